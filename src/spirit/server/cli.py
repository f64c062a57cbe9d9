"""`spirit serve`: the OpenAI-compatible server.

Registered by spirit.cli whatever is installed: this module imports nothing from the serve
extra at import time, and spirit.cli checks that fastapi and uvicorn are there before
`cmd_serve` runs (naming the extra to install when they are not).
"""

from __future__ import annotations

import argparse
import os

from spirit.server.config import DEFAULT_MAX_BODY_BYTES
from spirit.server.ray_serve import add_ray_args, ray_options, serve_on_ray


def register(subparsers) -> None:
    from spirit.cli_args import add_model_args

    p = subparsers.add_parser("serve", help="serve an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)")
    add_model_args(p)
    p.add_argument("--method", default="spirit", help="default decoding method; a request may name another in 'method'")
    p.add_argument("--skip", default=None, help="skip set for --method static, e.g. 'attn:4,9;mlp:4,9,12'")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-queue", type=int, default=16, help="requests that may wait behind the running one; more get 429")
    p.add_argument("--max-batch", type=int, default=1,
                   help="requests decoded together in one engine (continuous batching); 1 = one at a time")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds a request may wait and generate; 0 = none")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: env SPIRIT_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default the model's name)")
    p.add_argument("--max-context", type=int, default=None, help="cap the context length (default the model's)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413 before they are parsed or tokenized (default 1 MiB)")
    p.add_argument("--allow-methods", default=None, metavar="M1,M2",
                   help="comma-separated methods a request may name (default: --method and every method that needs "
                        "no offline calibration and no quantized draft beyond --method's; see docs/server.md). "
                        "What the allowed methods need is built before the server answers any request")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_ray_args(p)  # --ray, --replicas, ...: Ray is imported only when --ray runs
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from spirit.server.config import ServerConfig
    from spirit.server.launcher import serve  # spirit.cli has checked that the serve extra is installed

    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.request_timeout < 0:
        raise ValueError(f"--request-timeout must be >= 0, got {args.request_timeout}")
    config = ServerConfig(
        method=args.method, max_queue=args.max_queue, max_batch=args.max_batch, request_timeout_s=args.request_timeout or None,
        api_key=args.api_key or os.environ.get("SPIRIT_API_KEY") or None, model_name=args.served_model_name,
        skip=args.skip, max_body_bytes=args.max_body_bytes, allow_methods=args.allow_methods,
    )
    scale_out = ray_options(args)  # None without --ray; a Ray option without it is an error
    if scale_out is not None:
        return serve_on_ray(args, config, scale_out)
    lm = _load(args)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not config.api_key:
        print(f"spirit: warning: listening on {args.host} without an API key", flush=True)
    # the app builds what the allowed methods need (quantized draft MLPs, calibrations) when
    # it is made, before it answers anything: no request starts a build
    print(f"spirit: serving {config.model_name or lm.name} ({config.method}; requests may name "
          f"{', '.join(config.allowed_methods)}) on http://{args.host}:{args.port}/v1", flush=True)
    serve(lm, config, args.host, args.port, args.log_level)
    return 0


def _load(args: argparse.Namespace):
    from spirit.cli_args import load_for_cli

    lm = load_for_cli(args)
    if args.max_context is not None:
        if args.max_context < 1:
            raise ValueError(f"--max-context must be >= 1, got {args.max_context}")
        lm.engine.max_context = min(args.max_context, lm.engine.max_context)
    return lm
