"""`aiayn serve`: load a model, export it for CTranslate2 when asked, and run the app (app.py) under
uvicorn on a socket bound before the model loads.
"""

from __future__ import annotations

import gc
import os
import socket
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

from aiayn.checkpoint import ModelDir
from aiayn.config import InferenceOptions, ServeConfig
from aiayn.extras import need
from aiayn.files import check_writable_dir
from aiayn.inference.compiled import stored
from aiayn.inference.translate import Translator
from aiayn.precision import translation_dtype
from aiayn.serving.app import create_app
from aiayn.serving.worker import log


def serve(
    model_dir: str | Path | ModelDir,
    config: ServeConfig,
    options: InferenceOptions,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    cors_origins: tuple[str, ...] = (),
) -> None:
    """Load the model and serve it until Ctrl-C or SIGTERM (then what is queued is answered first)."""
    import tempfile

    import uvicorn

    if options.engine == "ctranslate2":  # before the port and the model
        need("--engine ctranslate2", "ctranslate2", "ctranslate2")
    listener = listen(host, port)  # before the model loads: a port in use is said at once
    model_dir = ModelDir.read(model_dir)
    search = replace(model_dir.search, beam_size=config.beam_size)  # alpha, penalty: the model's
    engine = options.engine
    if engine == "ctranslate2" and search.length_penalty != "average":  # CTranslate2 has only that one
        search = replace(search, length_penalty="average")
        log.warning("--engine ctranslate2: beams use the average length penalty, score / |Y|^alpha")
    try:
        translator = Translator.load(model_dir, search, options)
        if engine == "torch":
            check_store(translator)
    except BaseException:
        listener.close()
        raise
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        log.warning("serving on %s without --api-key: anyone who can reach this port can use it", host)
    # the export's directory only for the engine that reads it: a server stopped by SIGKILL leaves its
    # temporary directory behind
    scratch_dir = (
        tempfile.TemporaryDirectory(prefix="aiayn-ct2-") if engine == "ctranslate2" else nullcontext()
    )
    with listener, scratch_dir as scratch:
        other = None
        if engine == "ctranslate2":  # the exported model translates; attention stays with PyTorch
            from aiayn.interop.ctranslate2 import CTranslate2Translator, export_ctranslate2

            compute = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "int8": "int8"}
            kind = translation_dtype(options.dtype, translator.device)
            export_ctranslate2(model_dir, Path(scratch) / "ct2")
            other = CTranslate2Translator(
                Path(scratch) / "ct2", search, device=translator.device.type, compute_type=compute[kind],
                threads=options.threads or 0,
            )  # fmt: skip
        # the graphs compile in worker processes (two on a CPU of two cores or more), beside the one that
        # answers (create_app)
        workers = max(1, min(2, os.cpu_count() or 1))
        app = create_app(
            translator, config, engine=other, threads=options.threads, api_key=api_key, cors_origins=cors_origins,
            engine_name=engine, compile_workers=workers,
        )  # fmt: skip
        # Everything loaded so far (torch, the model, CTranslate2's converters: a quarter of a million
        # objects) lives as long as the server: out of the cyclic GC's sight, whose full collections over
        # it paused the event loop under load (/health's worst latency in benchmarks/bench_serve.py).
        gc.collect()
        gc.freeze()
        settings = uvicorn.Config(
            app, log_level="warning", timeout_graceful_shutdown=int(config.timeout_s) + 5
        )
        uvicorn.Server(settings).run(sockets=[listener])


def check_store(translator: Translator) -> None:
    """A server that will compile its graphs at start needs a store it can write them into: a ValueError
    now, rather than workers that fail after the port is open (a read-only home directory, say). A
    store that already holds the model's graphs may be read-only."""
    compiled = translator.compiled
    if compiled is None or compiled.store is None:
        return
    try:
        check_writable_dir(compiled.store, "store of compiled graphs")
    except ValueError as error:
        if stored(translator.model, compiled.store):  # (after: it hashes the weights)
            return
        raise ValueError(
            f"{error}: the server compiles its graphs into it at start; set AIAYN_COMPILE_STORE to a writable "
            "directory (or to none: in memory), or serve with --no-compile"
        ) from None


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening, or a ValueError that names the address."""
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on connections of a socket that says so, and
    # without it Nagle's algorithm and delayed ACKs add about 40 ms to every response.
    listener = socket.socket(
        socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP
    )
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
    try:
        listener.bind((host, port))
        listener.listen(2048)
    except OSError as e:
        listener.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return listener


__all__ = ["serve", "listen"]
