"""How good and how cheap is a quantized draft? Teacher-forced top-1 agreement with the full
model and the cost of one draft pass, for MLP weights at 16 (the model's own), 8 and 4 bits,
alone and combined with skipping sublayers, measured side by side on Spec-Bench answers.

    python benchmarks/quantized_draft.py --model qwen2.5-coder-1.5b --per-category 1 --tokens 48

Agreement: the full model decodes an answer greedily; the draft then runs over the same
tokens in one pass, reading the full model's KV of the prompt, and we count the positions
where its argmax equals the full model's choice. Cost: one single-token draft pass at the
end of the answer, relative to one single-token full pass, interleaved, median of repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import spirit
from spirit.bench.questions import load_questions, select
from spirit.draft_model.quantized import QuantizedMLPs
from spirit.policies.spirit import prior_order
from spirit.skipset import SkipSet, skipset_from_sublayers


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--questions", default=str(Path(__file__).resolve().parents[2] / "shared/data/specbench/dev.jsonl"))
    p.add_argument("--per-category", type=int, default=1)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--ratios", default="0,0.1,0.2")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    lm = spirit.load(args.model)
    model = lm.model
    t0 = time.perf_counter()
    quantized = {bits: QuantizedMLPs.build(model.layers, bits) for bits in (8, 4)}
    print(f"quantized both in {time.perf_counter() - t0:.1f} s; MLP bytes: "
          + ", ".join(f"int{b} {q.nbytes / 2**20:.0f} MiB" for b, q in quantized.items()))
    order = prior_order(lm.num_layers)
    ratios = [float(r) for r in args.ratios.split(",")]
    variants = [(bits, r) for r in ratios for bits in (16, 8, 4) if not (bits == 16 and r == 0)]
    agree = {v: [] for v in variants}
    cost = {v: [] for v in variants}
    questions = select(load_questions(Path(args.questions)), per_category=args.per_category)
    for q in questions:
        prompt = lm.encode(q.turns[0], chat=True)
        answer = lm.generate(prompt, max_new_tokens=args.tokens, method="vanilla").token_ids
        ids = prompt + answer
        n = len(answer)
        cache = model.new_cache(len(ids) + 8)
        with torch.inference_mode():
            full = model.forward(torch.tensor([ids]), 0, cache, SkipSet())  # all rows
            targets = full[len(prompt) - 1 : -1].argmax(-1)
            for bits, r in variants:
                skip = skipset_from_sublayers(order[: round(r * 2 * lm.num_layers)])
                mlps = None if bits == 16 else quantized[bits]
                start = len(prompt) - 1
                hidden = model.hidden_states(torch.tensor([ids[start:-1]]), start, cache, skip, mlps=mlps)[0]
                # re-write the full model's KV over the rows the draft wrote
                model.hidden_states(torch.tensor([ids[start:-1]]), start, cache, SkipSet())
                agree[(bits, r)].append(float((model.logits(hidden).argmax(-1) == targets).float().mean()))
            last = torch.tensor([[ids[-1]]])
            for _ in range(args.repeats):
                t = time.perf_counter()
                model.hidden_states(last, len(ids) - 1, cache, SkipSet())
                base = time.perf_counter() - t
                for bits, r in variants:
                    skip = skipset_from_sublayers(order[: round(r * 2 * lm.num_layers)])
                    mlps = None if bits == 16 else quantized[bits]
                    t = time.perf_counter()
                    model.hidden_states(last, len(ids) - 1, cache, skip, mlps=mlps)
                    cost[(bits, r)].append((time.perf_counter() - t) / base)
        print(f"{q.category:16s} " + "  ".join(f"b{b}/r{r}: {agree[(b, r)][-1]:.2f}" for b, r in variants), flush=True)
    print("\n| MLP bits | skip ratio | top-1 agreement | draft pass / full pass (no lm_head) |")
    print("|---|---|---|---|")
    for v in variants:
        print(f"| {v[0]} | {v[1]:.1f} | {statistics.mean(agree[v]):.3f} | {statistics.median(cost[v]):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
