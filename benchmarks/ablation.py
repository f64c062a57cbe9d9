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
  spirit               the spirit policy with every lever, adapting online across the run
Order: a warm-up of every variant, then question by question every variant in turn, so drift
hits all alike. Prints a table (speed is tokens/s over the whole request, prefill included,
Spec-Bench's definition) and writes it as Markdown with --markdown.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import spirit
from spirit.bench.metrics import NEAR_TIE, first_divergence
from spirit.bench.questions import load_questions, select
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
        # quantized drafts: every sublayer kept, MLPs at int8 / int4 (drafts/quantized.py)
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
        "spirit": dict(method="spirit"),
    }


def run(lm, spec: dict, prompt: str, tokens: int):
    return lm.generate(prompt, chat=True, max_new_tokens=tokens, **spec)


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
    questions = select(load_questions(Path(args.questions)), categories=cats, per_category=args.per_category)
    table = variants(lm, args.ratio, args.vocab, args.branches)
    if args.only:
        keep = {"vanilla", *args.only.split(",")}
        table = {k: v for k, v in table.items() if k in keep}
    for name, spec in table.items():  # warm-up; spirit's kept policy starts the run fresh
        if name != "spirit":
            run(lm, spec, "Say hello.", 16)
    rows: dict[str, list[dict]] = defaultdict(list)
    margins: dict[str, list[float]] = defaultdict(list)  # logit gap at each divergence from vanilla
    for q in questions:
        reference = None
        for name, spec in table.items():
            r = run(lm, spec, q.turns[0], args.tokens)
            reference = reference if reference is not None else r.token_ids
            c = r.stats.counters
            found = first_divergence(reference, r.token_ids)
            if found is not None and None not in found[1:]:
                pos, want, got = found
                margin = lm.logit_margin(lm.encode(q.turns[0], chat=True), reference[:pos], want, got)
                margins[name].append(margin)
                print(f"    {name} diverges from vanilla at token {pos}: logit margin {margin:+.3f}"
                      f" ({'near-tie' if abs(margin) < NEAR_TIE else 'CLEAR'})", file=sys.stderr, flush=True)
            rows[name].append(dict(category=q.category, tps=r.stats.tokens_per_s, exact=r.token_ids == reference,
                                   acc=c.acceptance_rate, per_round=c.mean_accepted, rounds=c.draft_rounds,
                                   lookup=c.lookup_rounds, draft_s=c.draft_time_s, verify_s=c.verify_time_s,
                                   wall=r.stats.wall_time_s, tokens=r.stats.new_tokens))
        print(f"  {q.category}: " + "  ".join(f"{n} {rows[n][-1]['tps']:.2f}" for n in table), file=sys.stderr, flush=True)

    def total_tps(name: str, category: str | None = None) -> float:
        rs = [x for x in rows[name] if category is None or x["category"] == category]
        return sum(x["tokens"] for x in rs) / sum(x["wall"] for x in rs)

    base = total_tps("vanilla")
    categories = list(dict.fromkeys(x["category"] for x in rows["vanilla"]))
    lines = [
        f"model {lm.name}, dtype {str(lm.dtype).removeprefix('torch.')}, {len(questions)} questions x {args.tokens} "
        f"tokens, skip ratio {args.ratio}, draft vocab {args.vocab}, branches {args.branches}",
        "",
        "| variant | tok/s | speedup | worst category | acceptance | accepted/round | lookup rounds | draft s | verify s | identical to vanilla |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in table:
        rs = rows[name]
        per_cat = {c: total_tps(name, c) / total_tps("vanilla", c) for c in categories}
        worst = min(per_cat, key=per_cat.get)
        lines.append(
            f"| {name} | {total_tps(name):.2f} | {total_tps(name) / base:.2f}x | {worst} {per_cat[worst]:.2f}x | "
            f"{statistics.mean(x['acc'] for x in rs):.2f} | {statistics.mean(x['per_round'] for x in rs):.2f} | "
            f"{sum(x['lookup'] for x in rs)}/{sum(x['rounds'] for x in rs)} | {sum(x['draft_s'] for x in rs):.1f} | "
            f"{sum(x['verify_s'] for x in rs):.1f} | {sum(x['exact'] for x in rs)}/{len(rs)} |"
        )
    lines += ["", "Per category (speedup over vanilla):", "",
              "| variant | " + " | ".join(categories) + " |", "|---|" + "---|" * len(categories)]
    for name in table:
        lines.append(f"| {name} | " + " | ".join(f"{total_tps(name, c) / total_tps('vanilla', c):.2f}x" for c in categories) + " |")
    lines += ["", f"Divergences from vanilla (bf16): logit margin at the first differing token; below {NEAR_TIE} "
              "is a near-tie that a batched pass's rounding can flip.", ""]
    for name in table:
        if margins[name]:
            lines.append(f"- {name}: " + ", ".join(f"{m:+.3f}" for m in margins[name]))
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
