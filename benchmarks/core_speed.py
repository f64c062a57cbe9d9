"""Issue 2's figures: plain decoding in spirit's engine vs transformers' generate, and static
skip sets at several ratios, side by side in one process, interleaved, after a warm-up.

    python benchmarks/core_speed.py --model qwen2.5-coder-0.5b --per-category 1 --tokens 64

Static skip sets come from spirit's prior "skip these first" order (policies/spirit.py), so
the ratios are comparable across models. Prints a table; --json writes the raw figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import spirit
from spirit.bench.questions import load_questions, select
from spirit.policies.spirit import prior_order
from spirit.skipset import skipset_from_sublayers


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--questions", default=str(Path(__file__).resolve().parents[2] / "shared/data/specbench/dev.jsonl"))
    p.add_argument("--categories", default="writing,coding,math_reasoning,translation,summarization,qa")
    p.add_argument("--per-category", type=int, default=1)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--ratios", default="0.1,0.2,0.3")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    lm = spirit.load(args.model, dtype=args.dtype)
    questions = select(load_questions(Path(args.questions)), categories=args.categories.split(","),
                                 per_category=args.per_category)
    order = prior_order(lm.num_layers)
    statics = {f"static-{r}": skipset_from_sublayers(order[: round(float(r) * 2 * lm.num_layers)])
               for r in args.ratios.split(",")}
    methods = ["vanilla", "hf", *statics]

    def run(method: str, prompt: str):
        if method in statics:
            return lm.generate(prompt, chat=True, max_new_tokens=args.tokens, method="static", skip=statics[method])
        return lm.generate(prompt, chat=True, max_new_tokens=args.tokens, method=method)

    for m in methods:  # warm-up
        run(m, "Say hello.")
    rows = {m: [] for m in methods}
    for q in questions:
        prompt = q.turns[0]
        reference = None
        for m in methods:
            r = run(m, prompt)
            reference = reference or r.token_ids
            rows[m].append({"tps": r.stats.tokens_per_s, "acc": r.stats.counters.acceptance_rate,
                            "exact": r.token_ids == reference, "category": q.category})
        print(f"  {q.category}: " + "  ".join(f"{m} {rows[m][-1]['tps']:.2f}" for m in methods), file=sys.stderr, flush=True)
    base = statistics.mean(x["tps"] for x in rows["vanilla"])
    print(f"model {lm.name}  dtype {str(lm.dtype).removeprefix('torch.')}  {len(questions)} prompts x {args.tokens} tokens")
    print(f"{'method':14s} {'tok/s':>7s} {'speedup':>8s} {'accept':>7s} {'identical':>9s}  skip")
    for m in methods:
        tps = statistics.mean(x["tps"] for x in rows[m])
        acc = statistics.mean(x["acc"] for x in rows[m])
        same = sum(x["exact"] for x in rows[m])
        skip = str(statics[m]) if m in statics else ""
        print(f"{m:14s} {tps:7.2f} {tps / base:7.2f}x {acc:7.2f} {same:4d}/{len(rows[m]):<4d}  {skip}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": lm.name, "rows": rows, "statics": {k: str(v) for k, v in statics.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
