"""A worker process of warmup.py: loads a model directory as the translator that started it did, and compiles
its share of the warm-up's graphs into the store, saying each on its events pipe."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import torch
import torch._inductor.config

from aiayn.config import InferenceOptions, SearchConfig
from aiayn.inference.translate import Translator
from aiayn.inference.warmup import NICE, compile_share, plan_from_json


def work(args: argparse.Namespace) -> None:
    """One worker: the plan, then its share of the graphs, each announced on the events pipe."""
    os.nice(args.nice)
    # One thread for the worker's own eager passes, which share the cores with the other worker; the
    # graphs' loops shared out among the threads of the process that decodes with them, as that process
    # would compile them: inductor lays a kernel's loops out for the thread count it compiles under, and
    # graphs compiled under the worker's one ran single-threaded (a file's greedy decoding steps 1.7 times
    # slower, benchmarks/bench_real.py, AMD EPYC Zen 3, 2 cores).
    torch.set_num_threads(1)
    torch._inductor.config.cpp.threads = args.threads
    events = os.fdopen(args.events, "w", encoding="utf-8", buffering=1)
    options = InferenceOptions(**{**json.loads(args.options), "compile": True})
    searches = [SearchConfig(**s) for s in json.loads(args.searches)]
    sizes = json.loads(args.sizes)
    translator = Translator.load(args.model, searches[0], options)
    decoder = translator.compiled
    assert decoder is not None and decoder.store is not None
    if decoder.model_fingerprint() != args.fingerprint:
        sys.exit("the worker's model is not the server's (another fingerprint): nothing compiled")
    compile_share(
        translator,
        searches,
        sizes,
        args.worker,
        args.workers,
        lambda event: events.write(json.dumps(event) + "\n"),
        None if args.plan is None else plan_from_json(json.loads(args.plan)),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="a worker compiling a model's graphs into the store (warmup.py)"
    )
    parser.add_argument("model")
    parser.add_argument("--options", required=True, help="InferenceOptions as JSON")
    parser.add_argument("--searches", required=True, help="SearchConfigs as a JSON list")
    parser.add_argument("--sizes", required=True, help="row class -> warm-up sentences, JSON")
    parser.add_argument("--worker", type=int, required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--events", type=int, required=True, help="the file descriptor of the events pipe")
    parser.add_argument("--fingerprint", required=True, help="the graphs' fingerprint in the parent")
    parser.add_argument("--nice", type=int, default=NICE, help="the niceness to run at")
    parser.add_argument("--plan", help="the plan the parent made (warmup.plan_as_json), if it made one")
    parser.add_argument("--threads", type=int, default=-1, help="the threads the graphs' decoding runs on")
    args = parser.parse_args(argv)
    # SIGTERM from stop(): unwind, so that a package being written is removed, not left half there
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    work(args)


if __name__ == "__main__":
    main()
