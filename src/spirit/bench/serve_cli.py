"""`spirit bench-serve`: parse arguments, check them, load the model, hand over to
`run_serve_load`, write the report.

Registered by spirit.cli whatever is installed: this module imports nothing from the serve
or bench extras until the command runs (spirit.cli first checks that they are there).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from spirit.bench.serve_load import DEFAULT_CLIENTS

# the Spec-Bench dev questions of a checkout, next to it in ../shared (never copied into the
# repository); an installed package has none, and then --questions names a file
DEFAULT_QUESTIONS = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "specbench" / "dev.jsonl"
DEFAULT_MAX_BATCH = 8
DEFAULT_MAX_TOKENS = 64
# 2 of each of the dev file's 13 categories: 26 prompts, more than the largest client count,
# so 16 clients have 16 different prompts in flight
DEFAULT_PER_CATEGORY = 2


def register(subparsers) -> None:
    from spirit.cli_args import add_model_args

    p = subparsers.add_parser(
        "bench-serve", help="load-benchmark the HTTP server: 1..16 clients, one at a time against batched",
        description="Start the server in this process with --max-batch 1 and --max-batch N, drive each with 1, 2, 4, "
                    "8, 16 concurrent streaming clients on Spec-Bench prompts (greedy), check every answer against "
                    "its solo decoding, and write report.md, results.json and plots into --out.",
    )
    add_model_args(p)
    p.add_argument("--method", default="spirit", help="the server's decoding method (default spirit)")
    p.add_argument("--skip", default=None, help="skip set for --method static, e.g. 'attn:4,9;mlp:4,9,12'")
    p.add_argument("--questions", default=None,
                   help=f"question file in Spec-Bench's format (default {DEFAULT_QUESTIONS}, the checkout's dev set)")
    p.add_argument("--categories", default=None, help="comma-separated categories (default all)")
    p.add_argument("--per-category", type=int, default=DEFAULT_PER_CATEGORY,
                   help=f"first N questions of each category (default {DEFAULT_PER_CATEGORY})")
    p.add_argument("--clients", default=",".join(map(str, DEFAULT_CLIENTS)),
                   help="comma-separated concurrent client counts (default %(default)s)")
    p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                   help="the batched server setting, compared with max_batch 1 (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="per request (default %(default)s)")
    p.add_argument("--out", default=None, help="output folder (default results/bench-serve-<time>)")
    p.add_argument("--allow-mismatch", action="store_true",
                   help="exit 0 even when an answer differs from its solo greedy decoding (reported either way)")
    p.set_defaults(func=cmd_bench_serve)


def parse_clients(text: str) -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4): ascending, each once; every count must be >= 1."""
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--clients: expected comma-separated whole numbers such as 1,2,4, got {text!r}") from None
    if not counts:
        raise ValueError("--clients is empty; give counts such as 1,2,4,8,16")
    bad = [c for c in counts if c < 1]
    if bad:
        raise ValueError(f"--clients: every count must be >= 1, got {bad[0]}")
    return tuple(sorted(set(counts)))


def command_line(args: argparse.Namespace) -> str:
    """The run as a command with every option this command reads, defaults included: what
    reproduces it."""
    argv = ["spirit", "bench-serve", "--model", args.model, "--dtype", args.dtype, "--weights", args.weights,
            "--device", args.device, "--method", args.method, "--questions", str(args.questions or DEFAULT_QUESTIONS),
            "--per-category", str(args.per_category), "--clients", args.clients, "--max-batch", str(args.max_batch),
            "--max-tokens", str(args.max_tokens)]
    argv += ["--skip", args.skip] if args.skip else []
    argv += ["--categories", args.categories] if args.categories else []
    argv += ["--out", args.out] if args.out else []
    argv += ["--allow-mismatch"] if args.allow_mismatch else []
    return shlex.join(argv)


def plan(args: argparse.Namespace) -> dict:
    """Everything the run needs, from the arguments alone: bad input fails here, before a
    model loads."""
    from spirit.bench.questions import QuestionFileError, SPEC_BENCH_URL, load_questions, select
    from spirit.bench.serve_load import LoadSettings, prompts_of
    from spirit.request import Request
    from spirit.server.config import ServerConfig

    clients = parse_clients(args.clients)
    Request.build("", max_new_tokens=args.max_tokens)  # the same check as every request
    ServerConfig(method=args.method, skip=args.skip, max_batch=args.max_batch)  # the server's own checks
    if args.questions is None and not DEFAULT_QUESTIONS.is_file():
        raise QuestionFileError(f"no --questions given and the default {DEFAULT_QUESTIONS} does not exist: pass a "
                                f"question file in Spec-Bench's format, e.g. {SPEC_BENCH_URL}")
    questions = load_questions(args.questions or DEFAULT_QUESTIONS)
    categories = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None
    settings = LoadSettings(clients=clients, max_batches=tuple(dict.fromkeys((1, args.max_batch))),
                            max_tokens=args.max_tokens, method=args.method, skip=args.skip)
    out = Path(args.out) if args.out else Path("results") / f"bench-serve-{time.strftime('%Y%m%d-%H%M%S')}"
    return dict(settings=settings, prompts=prompts_of(select(questions, categories, args.per_category)), out=out)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from spirit.bench.serve_load import run_serve_load
    from spirit.bench.serve_report import summary, write_outputs
    from spirit.cli_args import load_for_cli

    p = plan(args)
    settings = p["settings"]
    print(f"spirit bench-serve: {args.model}, {len(p['prompts'])} prompts, method {settings.method}, clients "
          f"{','.join(map(str, settings.clients))}, max_batch {' vs '.join(map(str, settings.max_batches))}, "
          f"max {settings.max_tokens} tokens -> {p['out']}", file=sys.stderr)
    lm = load_for_cli(args)
    result = run_serve_load(lm, p["prompts"], settings)
    result.command = command_line(args)
    paths = write_outputs(result, p["out"])
    print(summary(result))
    print("wrote " + ", ".join(str(paths[k]) for k in ("report", "json", "throughput", "latency") if k in paths))
    if result.errors:
        print(f"spirit: error: {result.errors} request(s) failed under load (see above)", file=sys.stderr)
        return 1
    if result.mismatches and not args.allow_mismatch:
        reason = (result.exactness or {}).get("reason")
        print(f"spirit: error: {result.mismatches} answer(s) differ from their solo greedy decoding (see above"
              f"{'; exactness check: ' + reason if reason else ''}); --allow-mismatch reports without failing",
              file=sys.stderr)
        return 1
    return 0
