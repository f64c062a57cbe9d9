"""Plain decoding of the same model with bf16 and with packed int8/int4 linear layers, and
spirit on the packed model, side by side in one process (round-robin per prompt, after a
warm-up), on the first turn of the first question of each Spec-Bench category.

    python benchmarks/lowbit_speed.py --model qwen2.5-coder-1.5b --weights int4 \\
        --questions ../shared/data/specbench/dev.jsonl --tokens 64

Prints tok/s per variant and the ratio to bf16 plain decoding, and whether spirit's tokens
equal plain decoding of the packed model (they must: it is the reference for that target).
With --torch-kernel, also plain decoding of the same weights packed for torch's own int4/int8
ops instead of spirit's kernel (model/qgemm.py), to compare the two kernels end to end.
"""

from __future__ import annotations

import argparse
import time
from contextlib import contextmanager

import spirit
from spirit.bench.questions import load_questions, select


@contextmanager
def torch_kernel():
    """Packings made inside use torch's ops (a comparison only: spirit uses its own kernel
    wherever it builds)."""
    from spirit.model import qgemm, quantize

    real = quantize._spirit_kernel, qgemm.available
    quantize._spirit_kernel, qgemm.available = (lambda device: False), (lambda: False)
    try:
        yield
    finally:
        quantize._spirit_kernel, qgemm.available = real


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--weights", default="int4", choices=("int8", "int4"))
    p.add_argument("--questions", required=True)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=13)
    p.add_argument("--torch-kernel", action="store_true", help="also plain decoding on torch's int4/int8 ops")
    args = p.parse_args()

    questions = select(load_questions(args.questions), per_category=1)[: args.prompts]
    prompts = [[{"role": "user", "content": q.turns[0]}] for q in questions]
    t0 = time.perf_counter()
    bf16 = spirit.load(args.model, dtype="bf16")
    low = spirit.load(args.model, weights=args.weights)
    print(f"loaded; packing {low.packing} ({time.perf_counter() - t0:.1f} s in all)")
    print(f"exactness, {args.weights} target: {low.exactness.reason}")
    runs = {"bf16 vanilla": (bf16, "vanilla"), f"{args.weights} vanilla": (low, "vanilla"),
            f"{args.weights} spirit": (low, "spirit")}
    if args.torch_kernel:
        with torch_kernel():
            on_torch = spirit.load(args.model, weights=args.weights)
        runs[f"{args.weights} vanilla, torch's op"] = (on_torch, "vanilla")
    for lm, method in runs.values():  # warm-up: kernels, quantized drafts, policies' calibration
        lm.generate(prompts[0], chat=True, max_new_tokens=8, method=method)
    tokens = {name: 0 for name in runs}
    seconds = {name: 0.0 for name in runs}
    same = 0
    for k, prompt in enumerate(prompts):
        names = list(runs)[k % len(runs):] + list(runs)[: k % len(runs)]  # rotate who goes first
        outputs = {}
        for name in names:
            lm, method = runs[name]
            out = lm.generate(prompt, chat=True, max_new_tokens=args.tokens, method=method)
            tokens[name] += out.stats.new_tokens
            seconds[name] += out.stats.wall_time_s
            outputs[name] = out.token_ids
        same += outputs[f"{args.weights} spirit"] == outputs[f"{args.weights} vanilla"]
    base = tokens["bf16 vanilla"] / seconds["bf16 vanilla"]
    for name in runs:
        tps = tokens[name] / seconds[name]
        print(f"{name:30s} {tps:6.2f} tok/s  {tps / base:5.2f}x bf16 plain")
    print(f"spirit on {args.weights} identical to {args.weights} vanilla on {same}/{len(prompts)} prompts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
