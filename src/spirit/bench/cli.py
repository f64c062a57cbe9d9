"""`spirit bench`: parse arguments, load the model, hand over to `run_bench`, write outputs."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# --quick: the bundled small model on the one question of each of four categories shipped in
# the package (bench/data/: short prompts whose licenses allow shipping them; MT-Bench's
# two-turn "writing" and "coding" included), 32 tokens a turn: 24 answers, a few minutes on
# 2 idle cores (9.5 minutes measured on 2 cores shared with other jobs). `fixed` runs too,
# so even a quick run shows what spirit's policy adds over its draft levers.
QUICK_MODEL = "smollm2-135m"
QUICK_METHODS = ("vanilla", "static", "fixed", "spirit")
QUICK_CATEGORIES = ("writing", "coding", "qa", "math_reasoning")
QUICK_PER_CATEGORY = 1
QUICK_MAX_NEW_TOKENS = 32
DEFAULT_MAX_NEW_TOKENS = 128  # Spec-Bench's MT-Bench setting is 1024; 128 keeps CPU runs short
DEFAULT_PER_BLOCK = 4


def _split(text: str | None) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()] if text else []


def _given(value, default):
    return default if value is None else value


def register(subparsers) -> None:
    from spirit.cli_args import add_model_args

    p = subparsers.add_parser(
        "bench", help="benchmark methods on Spec-Bench questions",
        description="Run methods interleaved on Spec-Bench questions; write results.json, report.md, "
                    "Spec-Bench answer files and plots into --out.",
    )
    add_model_args(p)
    p.set_defaults(model=None)  # None: the bundled default, or the small model with --quick
    p.add_argument("--questions", default=None,
                   help="question file in Spec-Bench's format (JSONL), e.g. Spec-Bench's own question.jsonl; "
                        "required except with --quick, which runs the few questions shipped with spirit")
    p.add_argument("--methods", default=None,
                   help="comma-separated methods (default: every registered one plus hf; vanilla is always added); "
                        "llamacpp, llamacpp-lookup (llama.cpp on the model's GGUF file) only when named, and only "
                        "with the llamacpp extra installed")
    p.add_argument("--categories", default=None, help="comma-separated categories to run (default all)")
    p.add_argument("--per-category", type=int, default=None, help="first N questions of each category (default all)")
    p.add_argument("--sample", type=int, default=None, metavar="N",
                   help="N questions drawn at random from each category (instead of the first N); see --seed")
    p.add_argument("--seed", type=int, default=None, help="seed of --sample's draw (default 0)")
    p.add_argument("--max-new-tokens", type=int, default=None, help=f"per turn (default {DEFAULT_MAX_NEW_TOKENS})")
    p.add_argument("--skip", default=None,
                   help="skip set for 'static', e.g. 'attn:4,9;mlp:4,9,12' (default: MLPs of every other middle layer, ~20%%)")
    p.add_argument("--stream", default=None,
                   help="stream mode: comma-separated categories, one block each, e.g. 'qa,summarization,qa'")
    p.add_argument("--per-block", type=int, default=None, help=f"questions per stream block (default {DEFAULT_PER_BLOCK})")
    p.add_argument("--out", default=None, help="output folder (default results/bench-<time>)")
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK_MODEL}, one question of each of {len(QUICK_CATEGORIES)} categories, "
                        f"{QUICK_MAX_NEW_TOKENS} tokens, methods {','.join(QUICK_METHODS)} (those registered)")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up generation of each method")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_bench)


def plan(args: argparse.Namespace) -> dict:
    """Everything the run needs, from the arguments alone (no model loaded): checked here so
    that bad input fails before a model is loaded."""
    from spirit.bench.questions import load_questions, questions_path, sample, select, stream_blocks
    from spirit.bench.runner import available_methods, check_methods, default_methods, with_baseline
    from spirit.model.bundled import DEFAULT_MODEL
    from spirit.request import Request
    from spirit.skipset import SkipSet

    known = available_methods()
    if args.methods is not None:
        methods = _split(args.methods)
        if not methods:
            raise ValueError("--methods is empty; name at least one, e.g. vanilla,static")
        check_methods(methods)
    elif args.quick:
        methods = [m for m in QUICK_METHODS if m in known]
    else:
        methods = default_methods()
    methods = with_baseline(methods)

    max_new = _given(args.max_new_tokens, QUICK_MAX_NEW_TOKENS if args.quick else DEFAULT_MAX_NEW_TOKENS)
    Request.build("", max_new_tokens=max_new)  # the same check as every request, before loading
    skip = SkipSet.parse(args.skip) if args.skip else None

    if args.sample is not None and args.per_category is not None:
        raise ValueError("--sample and --per-category both choose how many questions a category runs; give one")
    if args.seed is not None and args.sample is None:
        raise ValueError("--seed needs --sample")
    questions = load_questions(questions_path(args.questions, quick=args.quick))
    blocks = None
    if args.stream is not None:
        if args.categories or args.per_category is not None or args.sample is not None:
            raise ValueError("--stream chooses its own questions; drop --categories / --per-category / --sample")
        blocks = stream_blocks(questions, _split(args.stream), _given(args.per_block, DEFAULT_PER_BLOCK))
        chosen = None
    else:
        if args.per_block is not None:
            raise ValueError("--per-block needs --stream")
        categories = _split(args.categories) or (list(QUICK_CATEGORIES) if args.quick else None)
        if args.quick and not args.categories:
            present = {q.category for q in questions}
            categories = [c for c in categories if c in present] or None
        if args.sample is not None:
            chosen = sample(questions, args.sample, _given(args.seed, 0), categories)
        else:
            chosen = select(questions, categories, _given(args.per_category, QUICK_PER_CATEGORY if args.quick else None))
    model = args.model or (QUICK_MODEL if args.quick else DEFAULT_MODEL)
    out = Path(args.out) if args.out else Path("results") / f"{'quick' if args.quick else 'bench'}-{time.strftime('%Y%m%d-%H%M%S')}"
    return dict(model=model, methods=methods, max_new_tokens=max_new, skip=skip, questions=chosen, blocks=blocks, out=out)


def cmd_bench(args: argparse.Namespace) -> int:
    import spirit
    from spirit.bench.report import write_outputs
    from spirit.bench.runner import run_bench

    p = plan(args)
    n = len(p["questions"]) if p["questions"] is not None else sum(len(b.questions) for b in p["blocks"])
    print(f"spirit bench: {p['model']}, {n} questions, methods {','.join(p['methods'])}, "
          f"max {p['max_new_tokens']} new tokens -> {p['out']}", file=sys.stderr)
    lm = spirit.load(p["model"], dtype=args.dtype, device=args.device, weights=args.weights)
    if p["skip"] is not None:
        p["skip"].validate(lm.num_layers)
    result = run_bench(
        lm, p["questions"], p["methods"], blocks=p["blocks"], max_new_tokens=p["max_new_tokens"], skip=p["skip"],
        warmup=not args.no_warmup, progress=not args.no_progress,
    )
    paths = write_outputs(result, p["out"])
    print(summary(result))
    print(f"wrote {paths['report']}, {paths['json']}, {p['out'] / 'answers'}/*.jsonl, "
          + ", ".join(str(paths[k]) for k in ("speedup", "timeline") if k in paths))
    return 0


def summary(result) -> str:
    """A few lines for the terminal: overall figures per method."""
    from spirit.bench.metrics import OVERALL
    from spirit.bench.report import exactness_line, lossless_cell

    table = result.by_category()
    lossless = result.lossless()
    w = max([10, *map(len, table)])  # llamacpp-lookup is longer than spirit's names
    lines = [f"{'method':{w}s} {'tok/s':>8s} {'speedup':>8s} {'accept':>7s} {'tok/step':>8s}  identical to vanilla"]
    for method, row in table.items():
        f = row[OVERALL]
        lines.append(f"{method:{w}s} {f.tokens_per_s:8.2f} {(f.speedup or 0):7.2f}x {f.counters.acceptance_rate:7.2f} "
                     f"{f.committed_per_step:8.2f}  {lossless_cell(method, lossless.get(method))}")
    lines.append(exactness_line(result.exactness))
    if result.blocks:
        blocks = result.by_block()
        lines.append("stream tokens/s per block: " + "; ".join(
            f"{b.index}:{b.category} " + " ".join(f"{m}={blocks[m][b.index].tokens_per_s:.1f}" for m in blocks if b.index in blocks[m])
            for b in result.blocks))
    if result.sol and result.sol.get("available") and result.sol.get("percent_of_sol") is not None:
        lines.append(f"vanilla decoding at {result.sol['percent_of_sol']:.1f}% of the speed-of-light bound")
    lines.append(f"total {result.elapsed_s:.1f} s")
    return "\n".join(lines)
