"""Exact full-model passes of 1 and 8 rows at a short and a long context: what attention
over the KV cache adds to a decoding step, and to a batched one (model/kernels/layer_ops.cpp
`rowwise_attention`).

    python benchmarks/attention_context.py --contexts 200,1000

Each context is prefilled with random tokens, then 1- and 8-row passes (one request's rows at
the end of its cache, as a chain's verification) are timed in turn; the best of `--repeats`.
"""

from __future__ import annotations

import argparse
import time

import torch

import spirit
from spirit.skipset import SkipSet


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--contexts", default="200,1000")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    lm = spirit.load(args.model, dtype="auto", weights="auto")
    model = lm.engine.model
    for ctx in (int(c) for c in args.contexts.split(",")):
        cache = model.new_cache(ctx + 64)
        for start in range(0, ctx, 128):
            ids = torch.randint(100, 5000, (1, min(128, ctx - start)))
            model.forward(ids, start, cache, SkipSet(), prefill=True)
        times: dict[int, list[float]] = {1: [], 8: []}
        for _ in range(args.repeats):
            for rows in times:
                ids = torch.randint(100, 5000, (1, rows))
                t0 = time.perf_counter()
                model.forward(ids, ctx, cache, SkipSet(), exact=True)
                times[rows].append(time.perf_counter() - t0)
        print(f"context {ctx}: " + ", ".join(f"{rows} rows {1000 * min(t):.1f} ms" for rows, t in times.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
