"""`aiayn serve`: the HTTP API (aiayn's and LibreTranslate's) and its page around model directories."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from aiayn.cli.common import compile_flag, config_flags, device_flag, dtype_flag, inference_options
from aiayn.config import ServeConfig, from_dict
from aiayn.extras import need


def add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="a REST API (LibreTranslate's too) and a page around models (FastAPI)")
    p.add_argument(
        "model", nargs="+",
        help="model directories (what `aiayn train --out` or `aiayn import` wrote), or folders of them: each "
        "serves its language pair, loaded on first use",
    )  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    device_flag(p)
    dtype_flag(p)
    p.add_argument("--threads", type=int, help="PyTorch (or CTranslate2) threads of the model worker")
    compile_flag(
        p,
        None,
        "with --engine torch, compiled (or loaded from the store) in the background, eagerly until then",
    )
    p.add_argument(
        "--engine",
        choices=["torch", "ctranslate2"],
        default="torch",
        help="who translates: aiayn's search, or the model exported to CTranslate2 (attention: torch)",
    )
    p.add_argument("--api-key", help="require Authorization: Bearer KEY on the API")
    p.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        help="allow only this origin (CORS; repeatable); every origin by default, as LibreTranslate",
    )
    config_flags(p, ServeConfig)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> None:
    # uvicorn's httptools and uvloop come with the extra too, but it runs without them
    need("aiayn serve", "serve", "fastapi", "uvicorn", "prometheus_client")  # (serve() checks --engine's)
    from aiayn.serving.server import serve

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    limits = {f.name: getattr(args, f.name) for f in fields(ServeConfig) if getattr(args, f.name) is not None}
    config = from_dict(ServeConfig, limits, where="serve options")
    if args.compile is None:  # a server compiles in the background from its start; CTranslate2 has no graphs
        args.compile = args.engine == "torch"
    options = inference_options(args)
    serve(args.model, config, options, host=args.host, port=args.port, api_key=args.api_key,
          cors_origins=tuple(args.cors_origin))  # fmt: skip
