"""Greedy and seeded-sampled token ids of bundled models under every method, to compare two
versions of spirit: a refactor must leave them unchanged.

    python benchmarks/token_snapshot.py --out before.json      # on the old version
    python benchmarks/token_snapshot.py --out after.json --compare before.json

Each method gets a fresh `Spirit` per model and dtype, and runs the prompts in order, so
adaptive methods see the same request stream in both versions.
"""

from __future__ import annotations

import argparse
import json
import sys

import spirit

PROMPTS = [
    "Write a haiku about rain.",
    "Explain what a hash map is in two sentences.",
    "def fibonacci(n):",
    "Translate to French: The cat sleeps on the warm windowsill.",
    "List three prime numbers greater than 50 and say why each is prime.",
    "Summarize: The committee met on Tuesday to discuss the budget. After a long debate, "
    "they agreed to cut travel costs by ten percent and to raise the research budget.",
]
RUNS = [  # (model, dtype, methods)
    ("smollm2-135m", "bf16", ("vanilla", "spirit", "fixed", "lookup", "sp2ec", "swift", "dv")),
    ("smollm2-135m", "fp32", ("vanilla", "spirit", "lookup")),
    ("qwen2.5-coder-0.5b", "bf16", ("vanilla", "spirit", "fixed")),
]


def snapshot(tokens: int) -> dict:
    out = {}
    for model, dtype, methods in RUNS:
        for method in methods:
            lm = spirit.load(model, dtype=dtype)
            ids = []
            for prompt in PROMPTS:
                ids.append(lm.generate(prompt, chat=True, max_new_tokens=tokens, method=method).token_ids)
            ids.append(lm.generate(PROMPTS[0], chat=True, max_new_tokens=tokens, method=method,
                                   temperature=0.8, seed=7).token_ids)
            out[f"{model}/{dtype}/{method}"] = ids
            print(f"{model} {dtype} {method}: done", file=sys.stderr)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--compare", default=None, help="a snapshot to compare with")
    p.add_argument("--tokens", type=int, default=48)
    args = p.parse_args()
    now = snapshot(args.tokens)
    with open(args.out, "w") as f:
        json.dump(now, f)
    if not args.compare:
        return 0
    with open(args.compare) as f:
        before = json.load(f)
    differ = [k for k in before if before[k] != now.get(k)]
    same = len(before) - len(differ)
    print(f"{same}/{len(before)} method runs identical ({len(PROMPTS) + 1} requests each)")
    for k in differ:
        print(f"  differs: {k}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
