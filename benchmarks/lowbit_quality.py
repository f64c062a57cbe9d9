"""What a low-bit target costs in quality: perplexity of the dev questions' texts
(teacher-forced, the model's own tokenizer) and greedy agreement with the bf16 model over
the first N generated tokens, for bf16, int8 and int4 linear layers and `auto` (a GGUF
file's own precision: its 4-bit blocks with their own codes, other blocks int8), and for
llama.cpp on the same file when llama-cpp-python is installed (the `llamacpp` extra).

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
    p.add_argument("--weights", default="bf16,int8,int4,auto",
                   help="comma-separated: bf16 (first: the reference), int8, int4, auto, llamacpp (after a spirit one)")
    args = p.parse_args()
    questions = select(load_questions(args.questions), per_category=1)[: args.prompts]
    texts = [q.turns[0] for q in questions]
    reference = None
    print(f"{args.model}, {len(texts)} prompts, {args.tokens} greedy tokens")
    print("weights  perplexity  identical-to-bf16  mean common prefix")
    lm = None
    for weights in args.weights.split(","):
        if weights == "llamacpp":
            outs, ppl = llamacpp_figures(lm, texts, args.tokens)
        else:
            lm = spirit.load(args.model, weights=weights)
            outs = [lm.generate([{"role": "user", "content": t}], chat=True, max_new_tokens=args.tokens,
                                method="vanilla").token_ids for t in texts]
            ppl = perplexity(lm, texts)
            weights = f"{weights} ({lm.weights})" if weights == "auto" else weights
        if reference is None:
            reference = outs
        same = sum(a == b for a, b in zip(outs, reference))
        prefix = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                     for a, b in zip(outs, reference)) / len(outs)
        print(f"{weights:7s}  {ppl:10.4f}  {same:>8d}/{len(outs):<8d}  {prefix:8.1f}", flush=True)
    return 0


def llamacpp_figures(lm, texts: list[str], tokens: int) -> tuple[list[list[int]], float]:
    """llama.cpp on the GGUF file `lm` was loaded from: greedy tokens from the same prompt
    tokens (spirit's chat template), and perplexity of the same token ids, teacher-forced."""
    import numpy as np
    from llama_cpp import Llama

    from spirit.bench.llamacpp import gguf_file

    llama = Llama(model_path=str(gguf_file(lm)), n_ctx=1024, n_threads=torch.get_num_threads(),
                  logits_all=True, verbose=False)
    outs = []
    for t in texts:
        llama.reset()
        ids = lm.encode([{"role": "user", "content": t}], chat=True)
        out = []
        for token in llama.generate(ids, top_k=1, temp=0.0, reset=True):
            out.append(token)  # spirit's tokens end with the end-of-sequence token too
            if token in lm.eos_token_ids or len(out) == tokens:
                break
        outs.append(out)
    nll, count = 0.0, 0
    for text in texts:
        ids = lm.encode(text)[:512]
        llama.reset()
        llama.eval(ids)
        logits = np.asarray(llama.scores[: len(ids) - 1], dtype=np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        nll -= float(logp[np.arange(len(ids) - 1), ids[1:]].sum())
        count += len(ids) - 1
    return outs, math.exp(nll / count)


if __name__ == "__main__":
    raise SystemExit(main())
