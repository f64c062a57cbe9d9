"""What a low-bit target costs in quality: perplexity of the dev questions' texts
(teacher-forced, the model's own tokenizer) and greedy agreement with the bf16 model over
the first N generated tokens, for bf16, int8 and int4 linear layers.

    python benchmarks/lowbit_quality.py --model smollm2-135m --questions ../shared/data/specbench/dev.jsonl

Agreement: the share of prompts whose first N greedy tokens equal bf16's, and the mean
length of the common prefix.
"""

from __future__ import annotations

import argparse
import math

import torch

import spirit
from spirit.bench.questions import load_questions, select


@torch.inference_mode()
def perplexity(lm, texts: list[str]) -> float:
    nll, count = 0.0, 0
    for text in texts:
        ids = torch.tensor([lm.encode(text)[:512]])
        logits = lm.hf_model(ids).logits[0, :-1].float()
        nll += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        count += ids.shape[1] - 1
    return math.exp(nll / count)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--questions", required=True)
    p.add_argument("--prompts", type=int, default=13)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    questions = select(load_questions(args.questions), per_category=1)[: args.prompts]
    texts = [q.turns[0] for q in questions]
    reference = None
    print(f"{args.model}, {len(texts)} prompts, {args.tokens} greedy tokens")
    print("weights  perplexity  identical-to-bf16  mean common prefix")
    for weights in ("bf16", "int8", "int4"):
        lm = spirit.load(args.model, weights=weights)
        outs = [lm.generate([{"role": "user", "content": t}], chat=True, max_new_tokens=args.tokens,
                            method="vanilla").token_ids for t in texts]
        ppl = perplexity(lm, texts)
        if reference is None:
            reference = outs
        same = sum(a == b for a, b in zip(outs, reference))
        prefix = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                     for a, b in zip(outs, reference)) / len(outs)
        print(f"{weights:7s}  {ppl:10.4f}  {same:>8d}/{len(outs):<8d}  {prefix:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
