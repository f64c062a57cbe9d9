"""Issue 7's ablation: each drafting lever on and off, side by side in one process.

    python benchmarks/ablation.py --model qwen2.5-coder-1.5b --per-category 1 --tokens 64

Variants (all greedy, checked token by token against plain decoding in the same engine):
  vanilla              plain decoding
  skip                 layer-skip chain drafts at --ratio (the prior "skip these first" order)
  skip+vocab           ... with the reduced-vocabulary draft head (--vocab tokens)
  skip+vocab+tree      ... with runner-up leaves where the draft is unsure (--branches)
  lookup               prompt-lookup drafts alone (no model pass to draft)
  lookup+skip+...      lookup first, layer-skip (all levers) when lookup finds nothing
  int8/int4+...        no sublayer skipped, the draft's MLPs quantized (--ratio's skip for
                       int4+skip); @t0.5: drafting stops below top-1 probability 0.5, not 0.8;
                       vocab/2: a draft head of half the --vocab tokens
  fixed                spirit's default levers at its ratio-0 arm, no online policy
  spirit               the spirit policy with every lever, adapting online across the run
Runs through `spirit.bench.run_bench`, like `spirit bench`: a warm-up of every variant (on a
throwaway policy and learned state), then question by question every variant in turn, the
order rotated per question; each variant drafts with its own learned state only. Speedup is
spirit.bench.metrics' one definition (mean tokens/s over questions, prefill included, over
vanilla's on the same questions); "identical" compares each variant's greedy tokens with
vanilla's, and every divergence is listed. Only each question's first turn is asked. Prints
a table and writes it as Markdown with --markdown.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import spirit
from spirit.bench.metrics import OVERALL
from spirit.bench.questions import load_questions, select
from spirit.bench.report import lossless_section
from spirit.bench.runner import SpiritMethod, run_bench
from spirit.policies.spirit import prior_order
from spirit.skipset import DraftConfig, SkipSet, skipset_from_sublayers


def variants(lm, ratio: float, vocab: int, branches: int) -> dict[str, dict]:
    skip = skipset_from_sublayers(prior_order(lm.num_layers)[: round(ratio * 2 * lm.num_layers)])
    static = dict(method="static", skip=skip)
    return {
        "vanilla": dict(method="vanilla"),
        "skip": dict(static, draft=DraftConfig()),
        "skip+vocab": dict(static, draft=DraftConfig(draft_vocab=vocab)),
        "skip+vocab+tree": dict(static, draft=DraftConfig(draft_vocab=vocab, branches=branches)),
        "lookup": dict(method="lookup"),
        "lookup+skip+vocab+tree": dict(static, draft=DraftConfig(ngram=True, draft_vocab=vocab, branches=branches)),
        # quantized drafts: every sublayer kept, MLPs at int8 / int4 (draft_model/quantized.py)
        "int8+vocab": dict(method="static", skip=SkipSet(), draft=DraftConfig(draft_bits=8, draft_vocab=vocab)),
        "int4+vocab": dict(method="static", skip=SkipSet(), draft=DraftConfig(draft_bits=4, draft_vocab=vocab)),
        "int4+vocab@t0.5": dict(method="static", skip=SkipSet(),
                                draft=DraftConfig(draft_bits=4, draft_vocab=vocab, threshold=0.5)),
        "int4+vocab+tree@t0.5": dict(method="static", skip=SkipSet(), draft=DraftConfig(
            draft_bits=4, draft_vocab=vocab, threshold=0.5, branches=branches)),
        "lookup+int4+vocab@t0.5": dict(method="static", skip=SkipSet(), draft=DraftConfig(
            ngram=True, draft_bits=4, draft_vocab=vocab, threshold=0.5)),
        "int4+skip+vocab@t0.5": dict(static, draft=DraftConfig(draft_bits=4, draft_vocab=vocab, threshold=0.5)),
        "int4+vocab@t0.3": dict(method="static", skip=SkipSet(),
                                draft=DraftConfig(draft_bits=4, draft_vocab=vocab, threshold=0.3)),
        "int4+vocab/2@t0.5": dict(method="static", skip=SkipSet(),
                                  draft=DraftConfig(draft_bits=4, draft_vocab=vocab // 2, threshold=0.5)),
        "fixed": dict(method="fixed"),
        "spirit": dict(method="spirit"),
    }


def runners(table: dict[str, dict]) -> dict[str, SpiritMethod]:
    """One bench runner per variant, each with its own learned draft state (named after it)."""
    return {name: SpiritMethod(spec["method"], spec.get("skip"), spec.get("draft"), learner=name)
            for name, spec in table.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--questions", default=str(Path(__file__).resolve().parents[2] / "shared/data/specbench/dev.jsonl"))
    p.add_argument("--categories", default=None, help="comma-separated (default: all)")
    p.add_argument("--per-category", type=int, default=1)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--ratio", type=float, default=0.2)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--branches", type=int, default=2)
    p.add_argument("--only", default=None, help="comma-separated variants to run (vanilla always runs)")
    p.add_argument("--markdown", default=None, help="also write the table here")
    args = p.parse_args()

    lm = spirit.load(args.model, dtype=args.dtype)
    cats = args.categories.split(",") if args.categories else None
    questions = [replace(q, turns=q.turns[:1]) for q in
                 select(load_questions(Path(args.questions)), categories=cats, per_category=args.per_category)]
    table = variants(lm, args.ratio, args.vocab, args.branches)
    if args.only:
        keep = {"vanilla", *args.only.split(",")}
        table = {k: v for k, v in table.items() if k in keep}
    result = run_bench(lm, questions, list(table), runners=runners(table), max_new_tokens=args.tokens)
    figures = result.by_category()
    lossless = result.lossless()
    categories = list(dict.fromkeys(q.category for q in questions))
    lines = [
        f"model {lm.name}, dtype {result.dtype}, {len(questions)} questions x {args.tokens} "
        f"tokens, skip ratio {args.ratio}, draft vocab {args.vocab}, branches {args.branches}",
        "",
        "| variant | tok/s | speedup | worst category | acceptance | accepted/round | lookup rounds | draft s | verify s | identical to vanilla |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in result.methods:
        row, ll = figures[name], lossless.get(name)
        f, c = row[OVERALL], row[OVERALL].counters
        worst = min(categories, key=lambda g: row[g].speedup or 0.0)
        identical = "reference" if ll is None else f"{ll.identical_questions}/{ll.questions}"
        lines.append(
            f"| {name} | {f.tokens_per_s:.2f} | {f.speedup or 0:.2f}x | {worst} {row[worst].speedup or 0:.2f}x | "
            f"{c.acceptance_rate:.2f} | {c.mean_accepted:.2f} | {c.lookup_rounds}/{c.draft_rounds} | "
            f"{c.draft_time_s:.1f} | {c.verify_time_s:.1f} | {identical} |"
        )
    lines += ["", "Per category (speedup over vanilla):", "",
              "| variant | " + " | ".join(categories) + " |", "|---|" + "---|" * len(categories)]
    for name in result.methods:
        lines.append(f"| {name} | " + " | ".join(f"{figures[name][g].speedup or 0:.2f}x" for g in categories) + " |")
    lines += ["", *lossless_section(lossless, result.exactness)]
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
