"""`spirit serve`: the OpenAI-compatible server, registered by spirit.cli if fastapi is installed."""

from __future__ import annotations

import argparse
import os


def register(subparsers) -> None:
    from spirit.cli_args import add_model_args

    p = subparsers.add_parser("serve", help="serve an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)")
    add_model_args(p)
    p.add_argument("--method", default="spirit", help="default decoding method; a request may name another in 'method'")
    p.add_argument("--skip", default=None, help="skip set for --method static, e.g. 'attn:4,9;mlp:4,9,12'")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-queue", type=int, default=16, help="requests that may wait behind the running one; more get 429")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds a request may wait and generate; 0 = none")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: env SPIRIT_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default the model's name)")
    p.add_argument("--max-context", type=int, default=None, help="cap the context length (default the model's)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise ValueError("spirit serve needs fastapi and uvicorn: pip install 'spirit[serve]'") from None
    from spirit.server.app import ServerConfig
    from spirit.server.launcher import serve

    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.request_timeout < 0:
        raise ValueError(f"--request-timeout must be >= 0, got {args.request_timeout}")
    config = ServerConfig(
        method=args.method, max_queue=args.max_queue, request_timeout_s=args.request_timeout or None,
        api_key=args.api_key or os.environ.get("SPIRIT_API_KEY") or None, model_name=args.served_model_name,
        skip=args.skip,
    )
    lm = _load(args)
    from spirit.request import default_draft

    # quantized draft MLPs are built (or loaded from disk) now, not in the first request
    lm.engine.quantized_mlps(default_draft(config.method).draft_bits)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not config.api_key:
        print(f"spirit: warning: listening on {args.host} without an API key", flush=True)
    print(f"spirit: serving {config.model_name or lm.name} ({config.method}) on http://{args.host}:{args.port}/v1",
          flush=True)
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
