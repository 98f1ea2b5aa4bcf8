"""Load on `aiayn serve`: client and server on loopback, cross-request batching on versus off.

The server is `aiayn serve` started as a subprocess (one worker thread, `--threads 1`, so the load
generator has the other core of a 2-core machine), as a user gets it: the torch engine's measured once
the graphs it compiles in the background are in (its own store, runs/bench_serve/store, kept); the load is N concurrent clients, each sending one
sentence per request (real Multi30k validation sentences) and sending the next as soon as the answer
comes, for a fixed time and at most a fixed number of requests. A prober in its own process asks
`/health` every 100 ms meanwhile. Each cell reports sentences/s, latency p50/p95/p99, errors by
status, the mean batch size the server reported (X-Batch-Size) and the /health latency; each server
its RSS after a warm-up at the largest load and at the end. Then an overload run: a short queue (`--max-queue`) under 64 clients must answer only 200s and
503s with Retry-After, never anything else. Last a soak: 64 clients for --soak seconds, the server's
RSS every 10 s (a leak grows; a warm allocator plateaus).

Cells: engines (torch: aiayn's search; ctranslate2: the exported model) x batching (on; off =
`--max-batch-requests 1`) x clients (1, 8, 32, 64).

    python benchmarks/bench_serve.py [--model DIR] [--seconds 15] [--clients 1,8,32,64]
                                     [--engines torch,ctranslate2] [--max-requests 5000]

Without --model it serves `runs/bench_serve/model`, trained once (preset small, de->en, 10 minutes on
the Multi30k training set, the README's short-run recipe) when it is not there. The last line printed is JSON with every figure.

--cold-start measures instead what a user waits for at the start, from an empty store of compiled graphs
(and an empty inductor cache) and from the store that start filled: seconds from `aiayn serve` starting
to its first translation (a client retrying every 0.25 s) and to full speed (every graph of the default
search in), the compile seconds of each graph, the lines the console printed; and `aiayn translate
--compile` of one sentence, empty and warm. Models of bench_translate.py's shapes with random weights
(compiling does not look at the values) and a BPE vocabulary of Multi30k, under runs/bench_serve/.

    python benchmarks/bench_serve.py --cold-start [--configs small,base] [--dtypes fp32,int8]
                                     [--isa native|avx2] [--results FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import http.client
import json
import multiprocessing
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CONFIGS, cap_isa, have, machine, save_results, steal_ticks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"
DEFAULT_MODEL = ROOT / "runs" / "bench_serve" / "model"
STORE = ROOT / "runs" / "bench_serve" / "store"  # the servers' compiled graphs, kept between runs
HEALTH_EVERY_S = 0.1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def trained_model(minutes: float) -> Path:
    """runs/bench_serve/model, trained once with the CLI as a user would."""
    if (DEFAULT_MODEL / "model.safetensors").exists():
        return DEFAULT_MODEL
    if not (MULTI30K / "train.de.gz").exists():
        sys.exit(f"no model given and no Multi30k at {MULTI30K}: pass --model DIR")
    print(f"training the served model ({minutes} min, preset small, Multi30k de->en) ...", flush=True)
    subprocess.run(
        [sys.executable, "-m", "aiayn", "train", "--train", str(MULTI30K / "train"), "--valid",
         str(MULTI30K / "val"), "--src-lang", "de", "--tgt-lang", "en", "--preset", "small",
         "--max-minutes", str(minutes), "--vocab-size", "6000", "--max-tokens", "2048", "--set",
         "warmup_steps=400", "--set", "lr_scale=0.5", "--set", "valid_every=400",  # the README's short-run recipe
         "--out", str(DEFAULT_MODEL.parent / "run"), "--quiet"],
        check=True,
    )  # fmt: skip
    DEFAULT_MODEL.parent.mkdir(parents=True, exist_ok=True)
    (DEFAULT_MODEL.parent / "run").rename(DEFAULT_MODEL)
    return DEFAULT_MODEL


def sentences(lang: str, split: str = "val") -> list[str]:
    """The Multi30k sentences of a split (validation unless told) in one language."""
    path = MULTI30K / f"{split}.{lang}.gz"
    if not path.exists():
        sys.exit(f"no {path}: the load uses real validation sentences")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


class Server:
    """`aiayn serve MODEL` on a free loopback port, as a subprocess."""

    def __init__(self, model: Path | list[Path], engine: str, extra: list[str]):
        self.url = f"http://127.0.0.1:{free_port()}"
        models = [str(m) for m in (model if isinstance(model, list) else [model])]
        command = [sys.executable, "-m", "aiayn", "serve", *models, "--port", self.url.rsplit(":", 1)[1],
                   "--engine", engine, "--dtype", "fp32", "--threads", "1", *extra]  # fmt: skip
        # the server a user gets: it compiles its graphs in the background (into the benchmark's own store,
        # so a later server loads them), and is measured once they are all in
        env = {**os.environ, "AIAYN_COMPILE_STORE": str(STORE)}
        self.proc = subprocess.Popen(
            command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
        )
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(f"{self.url}/health", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.proc.kill()
                    sys.exit(f"the server did not start: {' '.join(command)}\n{self.proc.stderr.read()}")
                time.sleep(0.2)
        deadline = time.monotonic() + 1800
        while time.monotonic() < deadline:  # a torch server compiles in the background: until it is done
            compiled = httpx.get(f"{self.url}/info", timeout=5).json().get("compiled")
            if compiled is None or compiled.get("state") in ("done", "failed", "off"):
                return
            time.sleep(1)

    def rss_mb(self) -> float:
        return rss_mb(self.proc.pid)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def quantile(values: list[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def probe_health(url: str, seconds: float, out) -> None:
    """GET /health every HEALTH_EVERY_S on its own connection, in its own process (so that the load
    generator's work on its responses does not count as the server's latency); sends the latencies."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    latencies, errors = [], Counter()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        connection.request("GET", "/health")
        response = connection.getresponse()
        response.read()
        latencies.append(time.perf_counter() - t0)
        if response.status != 200:
            errors[f"health {response.status}"] += 1
        time.sleep(HEALTH_EVERY_S)
    out.send((latencies, errors))


def own_body(i: int, text: str) -> dict:
    return {"text": text}


async def load(
    url: str, texts: list[str], clients: int, seconds: float, max_requests: int, body: Callable = own_body
) -> dict:
    """clients concurrent loops of one-sentence requests for `seconds` (or max_requests in all); body(i,
    text): the i-th request's JSON (aiayn's own by default)."""
    latencies: list[float] = []
    batches: list[int] = []
    statuses: Counter = Counter()
    retry_after_missing = 0
    issued = 0
    limits = httpx.Limits(max_connections=clients + 1, max_keepalive_connections=clients + 1)
    parent, child = multiprocessing.get_context("fork").Pipe()
    prober = multiprocessing.get_context("fork").Process(target=probe_health, args=(url, seconds, child))
    prober.start()
    steal = steal_ticks()
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:
        start = time.perf_counter()
        end = start + seconds

        async def one_client(k: int) -> None:
            nonlocal issued, retry_after_missing
            i = k * 97
            while time.perf_counter() < end and issued < max_requests:
                issued += 1
                text = texts[i % len(texts)]
                i += 1
                t0 = time.perf_counter()
                try:
                    r = await client.post("/translate", json=body(i, text))
                except httpx.HTTPError as e:
                    statuses[type(e).__name__] += 1
                    continue
                statuses[r.status_code] += 1
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - t0)
                    batches.append(int(r.headers["x-batch-size"]))
                elif r.status_code == 503:
                    retry_after_missing += "retry-after" not in r.headers
                    await asyncio.sleep(float(r.headers.get("retry-after", 1)))  # as a polite client does

        await asyncio.gather(*(one_client(k) for k in range(clients)))
        elapsed = time.perf_counter() - start
    health, health_errors = parent.recv()
    prober.join()
    statuses.update(health_errors)
    errors = {str(k): v for k, v in statuses.items() if k != 200 and v}
    return {
        "clients": clients,
        "seconds": round(elapsed, 2),
        "requests": sum(v for k, v in statuses.items() if not str(k).startswith("health")),
        "sentences_per_s": round(len(latencies) / elapsed, 2),
        "p50_ms": round(1000 * quantile(latencies, 0.50), 1),
        "p95_ms": round(1000 * quantile(latencies, 0.95), 1),
        "p99_ms": round(1000 * quantile(latencies, 0.99), 1),
        "mean_batch": round(statistics.fmean(batches), 2) if batches else 0.0,
        "errors": errors,
        "retry_after_missing": retry_after_missing,
        "steal_s": (steal_ticks() - steal) / os.sysconf("SC_CLK_TCK"),  # the VM's host taking our CPU
        "health_max_ms": round(1000 * max(health), 1) if health else float("nan"),
        "health_p99_ms": round(1000 * quantile(health, 0.99), 1) if health else float("nan"),
    }


def run_server(model: Path, engine: str, batching: bool, args, texts: list[str]) -> dict:
    extra = [] if batching else ["--max-batch-requests", "1"]
    server = Server(model, engine, extra + args.server_args)
    try:
        # warm-up at the largest load: the allocator has then seen the largest batches
        asyncio.run(load(server.url, texts, max(args.clients), 5.0, 10**9))
        rss_start = server.rss_mb()
        cells = []
        for clients in args.clients:
            cell = asyncio.run(load(server.url, texts, clients, args.seconds, args.max_requests))
            cell.update(engine=engine, batching=batching, rss_mb=round(server.rss_mb(), 1))
            cells.append(cell)
            print(json.dumps(cell), flush=True)
        return {"engine": engine, "batching": batching, "rss_start_mb": round(rss_start, 1),
                "rss_end_mb": round(server.rss_mb(), 1), "cells": cells}  # fmt: skip
    finally:
        server.stop()


def overload(model: Path, args, texts: list[str]) -> dict:
    """64 clients against a queue of 8 lines: only 200 and 503 (with Retry-After) may come back."""
    server = Server(model, "torch", ["--max-queue", "8", *args.server_args])
    try:
        cell = asyncio.run(load(server.url, texts, 64, args.seconds, args.max_requests))
        cell.update(engine="torch", batching=True, max_queue=8)
        print(json.dumps(cell), flush=True)
        return cell
    finally:
        server.stop()


def soak(model: Path, args, texts: list[str]) -> dict:
    """The torch engine, batching on, 64 clients for args.soak seconds: the server's RSS every 10 s."""
    server = Server(model, "torch", args.server_args)
    try:
        asyncio.run(load(server.url, texts, 64, 5.0, 10**9))
        rss, served = [round(server.rss_mb(), 1)], 0
        for _ in range(max(1, round(args.soak / 10))):
            cell = asyncio.run(load(server.url, texts, 64, 10.0, 10**9))
            served += cell["requests"]
            rss.append(round(server.rss_mb(), 1))
        result = {"seconds": args.soak, "requests": served, "rss_mb_every_10s": rss}
        print(json.dumps({"soak": result}), flush=True)
        return result
    finally:
        server.stop()


LANGUAGES = ("en", "de", "fr", "es")  # the many-models mode's three pairs: SRC into three of these


def targets_of(src_lang: str) -> list[str]:
    return [t for t in LANGUAGES if t != src_lang][:3]


def pair_dirs(model: Path, src_lang: str) -> list[Path]:
    """Three model directories of one trained model, each saying it translates another pair
    (languages.json): what routing costs is then measured with the model's own cost held equal."""
    import shutil

    from aiayn.checkpoint import LANGUAGES, Languages, save_languages

    root = ROOT / "runs" / "bench_serve" / "pairs"
    dirs = []
    for target in targets_of(src_lang):
        directory = root / f"{src_lang}-{target}"
        if directory.exists():
            shutil.rmtree(directory)
        shutil.copytree(
            model, directory, ignore=shutil.ignore_patterns("checkpoints", "data", "*.log", "runs")
        )
        save_languages(Languages((src_lang,), (target,)), directory / LANGUAGES)
        dirs.append(directory)
    return dirs


def many_models(model: Path, args, texts: list[str]) -> dict:
    """LibreTranslate's requests (q, source, target) from N clients: to one model served alone, then a
    mix over three models in one server (each request's target in turn), and the same mix under a memory
    cap that holds two of the three (every model's turn may load it again)."""
    dirs = pair_dirs(model, args.src_lang)
    targets = targets_of(args.src_lang)
    size_mb = (dirs[0] / "model.safetensors").stat().st_size / (1 << 20)
    setups = [
        ("one model", [dirs[0]], [], lambda i, text: {"q": text, "source": args.src_lang, "target": targets[0]}),
        ("three models", dirs, [], lambda i, text: {"q": text, "source": args.src_lang, "target": targets[i % 3]}),
        # two in memory: a model loading counts its weights twice (models.py), so two stay beside it
        ("three models, room for two", dirs, ["--max-memory-mb", str(int(3 * size_mb) + 1)],
         lambda i, text: {"q": text, "source": args.src_lang, "target": targets[i % 3]}),
    ]  # fmt: skip
    rows = []
    for name, served, extra, body in setups:
        server = Server(served, "torch", extra + args.server_args)
        try:
            asyncio.run(load(server.url, texts, max(args.clients), 5.0, 10**9, body))  # every model loaded
            for clients in args.clients:
                cell = asyncio.run(load(server.url, texts, clients, args.seconds, args.max_requests, body))
                cell.update(setup=name, rss_mb=round(server.rss_mb(), 1))
                rows.append(cell)
                print(json.dumps(cell), flush=True)
        finally:
            server.stop()
    return {"model_mb": round(size_mb, 1), "cells": rows}


def many_table(result: dict, clients: list[int]) -> str:
    lines = ["| setup | clients | sent/s | p50 / p99 ms | vs one model | mean batch | errors | RSS MB |",
             "|---|---:|---:|---:|---:|---:|---|---:|"]  # fmt: skip
    alone = {c["clients"]: c for c in result["cells"] if c["setup"] == "one model"}
    for c in result["cells"]:
        ratio = c["sentences_per_s"] / alone[c["clients"]]["sentences_per_s"]
        lines.append(f"| {c['setup']} | {c['clients']} | {c['sentences_per_s']:.1f} | {c['p50_ms']:.0f} / "
                     f"{c['p99_ms']:.0f} | {ratio:.2f}x | {c['mean_batch']:.1f} | {c['errors'] or '-'} | "
                     f"{c['rss_mb']:.0f} |")  # fmt: skip
    return "\n".join(lines)


def table(servers: list[dict], clients: list[int]) -> str:
    lines = [
        "| engine | clients | batching off: sent/s | p50 / p95 / p99 ms | batching on: sent/s | p50 / p95 / p99 ms "
        "| mean batch | on / off | errors | /health max ms |",
        "|---|---:|---:|---|---:|---|---:|---:|---|---:|",
    ]
    by = {(s["engine"], s["batching"]): {c["clients"]: c for c in s["cells"]} for s in servers}
    for engine in dict.fromkeys(s["engine"] for s in servers):
        for n in clients:
            off, on = by[(engine, False)][n], by[(engine, True)][n]
            errors = {
                **{f"off {k}": v for k, v in off["errors"].items()},
                **{f"on {k}": v for k, v in on["errors"].items()},
            }
            lines.append(
                f"| {engine} | {n} | {off['sentences_per_s']:.1f} | {off['p50_ms']:.0f} / {off['p95_ms']:.0f} / "
                f"{off['p99_ms']:.0f} | {on['sentences_per_s']:.1f} | {on['p50_ms']:.0f} / {on['p95_ms']:.0f} / "
                f"{on['p99_ms']:.0f} | {on['mean_batch']:.1f} | {on['sentences_per_s'] / off['sentences_per_s']:.2f}x "
                f"| {errors or 0} | {max(off['health_max_ms'], on['health_max_ms']):.0f} |"
            )
    return "\n".join(lines)


# --- Cold start: what a user waits for before the first translation and before full speed ---------------


def cold_model(config: str) -> Path:
    """runs/bench_serve/cold-CONFIG: bench_translate.py's shape with random weights, a joint BPE vocabulary
    of its size learnt on Multi30k de-en, and the paper's search (beam 4)."""
    out = ROOT / "runs" / "bench_serve" / f"cold-{config}"
    if (out / "config.json").is_file():
        return out
    import torch

    from aiayn.checkpoint import save_model
    from aiayn.config import ModelConfig, SearchConfig
    from aiayn.model import Transformer
    from aiayn.tokenizer import Tokenizer

    shape = CONFIGS[config]
    de, en = sentences("de", "train"), sentences("en", "train")
    tokenizer = Tokenizer.train(de, en, vocab_size=shape["vocab"])
    vocab = tokenizer.src_vocab_size
    torch.manual_seed(0)
    model = Transformer(ModelConfig(src_vocab_size=vocab, tgt_vocab_size=vocab, d_model=shape["d_model"],
                                    d_ff=shape["d_ff"], n_heads=shape["n_heads"],
                                    n_encoder_layers=shape["n_layers"], n_decoder_layers=shape["n_layers"]))  # fmt: skip
    save_model(out, model, tokenizer, SearchConfig())
    return out


class Console:
    """A process's stderr, each line with the seconds since `start` at which it came."""

    def __init__(self, stream, start: float):
        import threading

        self.lines: list[tuple[float, str]] = []
        self.thread = threading.Thread(target=self.read, args=(stream, start), daemon=True)
        self.thread.start()

    def read(self, stream, start: float) -> None:
        for line in stream:
            self.lines.append((time.monotonic() - start, line.rstrip("\n")))


def cold_env(store: Path, cache: Path, headers_kept: bool = False) -> dict:
    """A first use on the machine: an empty store and inductor cache, and an empty temporary directory,
    where inductor keeps its precompiled headers whatever its cache directory (headers_kept: the
    machine's, as an earlier run left them)."""
    env = {**os.environ, "AIAYN_COMPILE_STORE": str(store), "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    if not headers_kept:
        env["TMPDIR"] = str(cache.with_name(f"{cache.name}-tmp"))
        Path(env["TMPDIR"]).mkdir(parents=True, exist_ok=True)
    return env


def serve_cold(model: Path, dtype: str, env: dict, text: str, log: Path) -> dict:
    """`aiayn serve MODEL --dtype DTYPE` as a user starts it: seconds to the first translation, to full
    speed, the compile seconds of each graph (the server's /info where it says them, else the console's
    lines a batch size), and what the console printed."""
    url = f"http://127.0.0.1:{free_port()}"
    command = [
        sys.executable,
        "-m",
        "aiayn",
        "serve",
        str(model),
        "--port",
        url.rsplit(":", 1)[1],
        "--dtype",
        dtype,
    ]
    start = time.monotonic()
    proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    console = Console(proc.stderr, start)
    first = full = None
    info: dict = {}
    try:
        while first is None:
            if proc.poll() is not None:
                sys.exit(
                    f"the server ended ({proc.returncode}):\n"
                    + "\n".join(line for _, line in console.lines[-30:])
                )
            try:
                r = httpx.post(f"{url}/translate", json={"text": text}, timeout=600)
                if r.status_code == 200:
                    first = time.monotonic() - start
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        while full is None:  # a server that compiles in the background says how far it is in /info
            info = httpx.get(f"{url}/info", timeout=60).json()
            compiled = info.get("compiled")
            if compiled is None or compiled.get("state") in ("done", "failed", "off"):
                full = first if compiled is None else time.monotonic() - start
                break
            if proc.poll() is not None:
                sys.exit("the server ended while compiling")
            time.sleep(1.0)
    finally:
        proc.terminate()
        proc.wait(120)
    console.thread.join(5)
    log.write_text("\n".join(f"{t:8.1f} {line}" for t, line in console.lines) + "\n", encoding="utf-8")
    compiled = info.get("compiled") or {}
    graphs = compiled.get("graphs")
    if graphs is None:  # a server that compiles before it answers: its console's line per batch size
        marks = [
            (t, line)
            for t, line in console.lines
            if "compiled decoding: the graphs of" in line or "ready after" in line
        ]
        graphs = [{"graph": f"batch size {m[1].split('the graphs of ')[1].split(' ')[0]}", "seconds": round(n[0] - m[0], 1)}
                  for m, n in zip(marks, marks[1:])]  # fmt: skip
    autotune = sum("AUTOTUNE" in line for _, line in console.lines)
    return {"first_s": round(first, 1), "full_s": round(full, 1), "graphs": graphs,
            "compile_s": round(sum(g["seconds"] for g in graphs), 1), "console_lines": len(console.lines),
            "autotune_lines": autotune, "state": compiled.get("state")}  # fmt: skip


def translate_cold(model: Path, dtype: str, env: dict, text: str) -> float:
    """Seconds of `aiayn translate MODEL --compile` of one sentence, as a new process."""
    command = [
        sys.executable,
        "-m",
        "aiayn",
        "translate",
        str(model),
        "--compile",
        "--dtype",
        dtype,
        "--quiet",
    ]
    start = time.monotonic()
    subprocess.run(command, env=env, input=text + "\n", text=True, check=True, capture_output=True)
    return round(time.monotonic() - start, 1)


def cold_start(args) -> None:
    import tempfile

    cap_isa(args.isa)
    text = sentences("de")[0]
    load_before = os.getloadavg()[0]
    print(f"{machine()}; load average before: {load_before:.2f}", flush=True)
    logs = ROOT / "runs" / "bench_serve" / "cold-logs"
    logs.mkdir(parents=True, exist_ok=True)
    rows = []
    for config in args.configs.split(","):
        model = cold_model(config)
        for dtype in args.dtypes.split(","):
            with tempfile.TemporaryDirectory(prefix="aiayn-cold-") as scratch:
                kept = args.headers_kept
                empty = cold_env(Path(scratch) / "store-1", Path(scratch) / "inductor-1", kept)
                filled = cold_env(Path(scratch) / "store-2", Path(scratch) / "inductor-2", kept)
                row = {
                    "config": config,
                    "dtype": dtype,
                    "translate_empty_s": translate_cold(model, dtype, empty, text),
                }
                print(json.dumps(row), flush=True)
                name = f"{config}-{dtype}-{args.isa}"
                row["serve_empty"] = serve_cold(model, dtype, filled, text, logs / f"{name}-empty.log")
                print(json.dumps(row), flush=True)
                row["serve_warm"] = serve_cold(model, dtype, filled, text, logs / f"{name}-warm.log")
                row["translate_warm_s"] = translate_cold(model, dtype, filled, text)
            print(json.dumps(row), flush=True)
            rows.append(row)
    print()
    print("| config | dtype | serve, empty store: first translation s | full speed s | graphs | compile s | "
          "warm store: first s | full s | translate --compile, empty s | warm s |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        e, w = r["serve_empty"], r["serve_warm"]
        print(f"| {r['config']} | {r['dtype']} | {e['first_s']:.1f} | {e['full_s']:.1f} | {len(e['graphs'])} | "
              f"{e['compile_s']:.0f} | {w['first_s']:.1f} | {w['full_s']:.1f} | {r['translate_empty_s']:.1f} | "
              f"{r['translate_warm_s']:.1f} |")  # fmt: skip
    summary = {
        "benchmark": "cold_start",
        "machine": machine(),
        "isa": args.isa,
        "headers_kept": args.headers_kept,
        "command": shlex.join(["python", *sys.argv]),
        "load_before": load_before,
        "results": rows,
    }
    save_results(args.results, summary)
    print(json.dumps(summary))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model", type=Path, help="model directory to serve (default: train runs/bench_serve/model)"
    )
    p.add_argument(
        "--src-lang", default="de", help="the language of the model's source (Multi30k de, en or fr)"
    )
    p.add_argument("--train-minutes", type=float, default=10.0)
    p.add_argument("--seconds", type=float, default=15.0, help="load time per cell")
    p.add_argument("--max-requests", type=int, default=5000, help="requests per cell, at most")
    p.add_argument("--clients", default="1,8,32,64")
    p.add_argument("--engines", default="torch,ctranslate2")
    p.add_argument("--soak", type=float, default=120.0, help="seconds of 64 clients watching RSS (0: none)")
    p.add_argument("--server-args", default="", help="more `aiayn serve` flags, space-separated")
    p.add_argument("--cold-start", action="store_true", help="measure the start instead of the load (above)")
    p.add_argument("--configs", default="small,base", help="--cold-start: the models' shapes")
    p.add_argument("--dtypes", default="fp32,int8", help="--cold-start: the servers' --dtype")
    p.add_argument(
        "--isa", default="native", choices=["native", "avx2"], help="--cold-start: cap every process"
    )
    p.add_argument(
        "--many-models", action="store_true",
        help="measure instead LibreTranslate's requests over three models in one server against one alone",
    )  # fmt: skip
    p.add_argument("--results", help="--cold-start, --many-models: write the summary here (docs/ renders it)")
    p.add_argument(
        "--headers-kept",
        action="store_true",
        help="--cold-start: keep the machine's precompiled headers of inductor (as figures before they "
        "were built ahead were measured)",
    )
    args = p.parse_args()
    if args.cold_start:
        return cold_start(args)
    args.clients = [int(c) for c in args.clients.split(",")]
    args.server_args = args.server_args.split()
    engines = [e for e in args.engines.split(",") if e != "ctranslate2" or have("ctranslate2")]
    model = args.model or trained_model(args.train_minutes)
    texts = sentences(args.src_lang)
    load_before = os.getloadavg()[0]
    print(f"{machine()}; load average before: {load_before:.2f}; serving {model}", flush=True)
    if args.many_models:
        result = {"benchmark": "serve many models", "machine": machine(), "load_before": load_before,
                  "command": shlex.join(["python", *sys.argv]), "model": model.name, **many_models(model, args, texts)}  # fmt: skip
        print()
        print(many_table(result, args.clients))
        if args.results:
            save_results(args.results, result)
        print(json.dumps(result))
        return
    servers = [run_server(model, e, b, args, texts) for e in engines for b in (False, True)]
    over = overload(model, args, texts)
    soaked = soak(model, args, texts) if args.soak else None
    print()
    print(table(servers, args.clients))
    print()
    for s in servers:
        print(f"{s['engine']:12s} batching {'on ' if s['batching'] else 'off'}: RSS {s['rss_start_mb']:.0f} MB after "
              f"warm-up, {s['rss_end_mb']:.0f} MB at the end")  # fmt: skip
    print(f"overload (64 clients, --max-queue 8): {over['sentences_per_s']:.1f} sent/s, statuses other than 200: "
          f"{over['errors']}, 503s without Retry-After: {over['retry_after_missing']}")  # fmt: skip
    if soaked:
        print(f"soak (torch, batching on, 64 clients, {soaked['seconds']:.0f} s, {soaked['requests']} requests): "
              f"RSS every 10 s {soaked['rss_mb_every_10s']} MB")  # fmt: skip
    figures = {"machine": machine(), "load_before": load_before, "servers": servers, "overload": over}
    print(json.dumps({**figures, "soak": soaked}))


if __name__ == "__main__":
    main()
