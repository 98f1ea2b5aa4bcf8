"""`aiayn serve`: read the model directories, load the first (a server of one model) or wait for requests
(of many), and run the app (app.py) under uvicorn on a socket bound before any model loads.
"""

from __future__ import annotations

import gc
import os
import socket
from collections.abc import Sequence
from pathlib import Path

from aiayn.checkpoint import CONFIG, ModelDir
from aiayn.config import InferenceOptions, ServeConfig
from aiayn.extras import need
from aiayn.files import check_writable_dir
from aiayn.inference.graph_store import stored
from aiayn.inference.translate import Translator
from aiayn.serving.app import ANY_ORIGIN, create_app
from aiayn.serving.models import Models, ServedModel, charge_of, default_cap, loader
from aiayn.serving.worker import log


def serve(
    model_dirs: str | Path | ModelDir | Sequence[str | Path | ModelDir],
    config: ServeConfig,
    options: InferenceOptions,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    cors_origins: tuple[str, ...] = (),
) -> None:
    """Serve the models until Ctrl-C or SIGTERM (then what is queued is answered first). A folder of model
    directories stands for them all; a directory that is no model is refused with its reason and the others
    are served (a ValueError when none is left). cors_origins: the origins allowed (CORS), every one if
    none is named."""
    import uvicorn

    if options.engine == "ctranslate2":  # before the port and the models
        need("--engine ctranslate2", "ctranslate2", "ctranslate2")
    if options.engine == "ctranslate2" and options.compile:
        options = InferenceOptions(**{**vars(options), "compile": False})  # CTranslate2 has no graphs
    listener = listen(host, port)  # before the models load: a port in use is said at once
    try:
        models = read_models(model_dirs, config, options)
        if len(models.served) == 1:  # loaded now: its errors are the command's, its first answer fast
            models.preload()
            loaded = models.served[0].loaded
            if loaded is not None and options.engine == "torch":
                check_store(loaded.translator)
    except BaseException:
        listener.close()
        raise
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        log.warning("serving on %s without --api-key: anyone who can reach this port can use it", host)
    with listener:
        app = create_app(
            models, config, threads=options.threads, api_key=api_key, cors_origins=cors_origins or ANY_ORIGIN,
            engine_name=options.engine, options=options,
        )  # fmt: skip
        # Everything loaded so far (torch, the model, CTranslate2's converters: a quarter of a million
        # objects) lives as long as the server: out of the cyclic GC's sight, whose full collections over
        # it paused the event loop under load (/health's worst latency in benchmarks/bench_serve.py).
        gc.collect()
        gc.freeze()
        settings = uvicorn.Config(
            app, log_level="warning", timeout_graceful_shutdown=int(config.timeout_s) + 5
        )
        try:
            uvicorn.Server(settings).run(sockets=[listener])
        finally:
            models.stop()


def model_paths(given: Sequence[str | Path | ModelDir]) -> list[Path | ModelDir]:
    """The model directories given, a folder of model directories standing for the ones it holds."""
    paths: list[Path | ModelDir] = []
    for item in given:
        if isinstance(item, ModelDir):
            paths.append(item)
            continue
        path = Path(item)
        inner = sorted(d for d in path.iterdir() if (d / CONFIG).is_file()) if path.is_dir() else []
        paths.extend(inner if inner and not (path / CONFIG).is_file() else [path])
    return paths


def read_models(
    given: str | Path | ModelDir | Sequence[str | Path | ModelDir],
    config: ServeConfig,
    options: InferenceOptions,
) -> Models:
    """The server's Models: each directory read once (its languages with it), none loaded yet."""
    if isinstance(given, (str, Path, ModelDir)):
        given = [given]
    paths = model_paths(given)
    served, refused = [], []
    for path in paths:
        try:
            model_dir = ModelDir.read(path)
            served.append(ServedModel(model_dir.path.name, model_dir, charge_of(model_dir, options)))
        except (ValueError, OSError) as e:
            if len(paths) == 1:
                raise
            refused.append(f"{path}: {e}")
            log.warning("not served: %s", e if str(path) in str(e) else f"{path}: {e}")
    if not served:
        raise ValueError(f"no model to serve: {'; '.join(refused)}")
    unknown = [m.name for m in served if m.languages is None]
    if unknown and len(served) > 1:
        log.warning(
            "the languages of %s are unknown (a directory of an older version): requests name them by "
            "model; `aiayn import --src-lang/--tgt-lang` or training with them records them", ", ".join(unknown)
        )  # fmt: skip
    workers = max(1, min(2, os.cpu_count() or 1))  # the graphs compile in processes beside the answering one
    cap = config.max_memory_mb << 20 if config.max_memory_mb else default_cap()
    return Models(served, loader(options, config, workers), cap, wait_s=config.timeout_s)


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


__all__ = ["serve", "listen", "read_models"]
