"""What does bit-exact verification cost plain decoding? The engine's plain decoding with the
row-wise attention of exact passes (model/attention.py, plus padding to the rows this CPU's
kernels need) against the same engine with SDPA one-token steps (before exactness), side by
side in one process, interleaved prompt by prompt (the order alternates), after a warm-up.

    python benchmarks/exact_attention.py --model qwen2.5-coder-1.5b --prompts 13 --tokens 64

Prints tokens/s of each, their ratio, and whether the two produced the same text (they need
not: SDPA rounds differently; it is the exact path that speculation reproduces). With
`--passes`, also the cost of one full pass of 1, 4, 8, 16 and 32 rows at a 300-token context,
exact against SDPA (what a verification pass pays for exactness).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import spirit
from spirit.engine import DecodeSettings

DEFAULT_QUESTIONS = Path(__file__).resolve().parents[2] / "shared/data/specbench/dev.jsonl"


def one_per_category(path: Path, count: int) -> list[str]:
    seen: dict[str, str] = {}
    for line in path.read_text().splitlines():
        q = json.loads(line)
        seen.setdefault(q["category"], q["turns"][0])
    return list(seen.values())[:count]


def decode(lm, prompt_ids: list[int], tokens: int, exact: bool) -> tuple[list[int], float]:
    """Plain decoding; returns the tokens and the decode time (prefill excluded)."""
    lm.engine.exact = exact
    gen = lm.engine.decode(prompt_ids, DecodeSettings(max_new_tokens=tokens))
    ids = list(next(gen))  # the prefill's token
    t0 = time.perf_counter()
    for chunk in gen:
        ids.extend(chunk)
    return ids, time.perf_counter() - t0


def pass_costs(lm, context: int = 300, repeats: int = 6) -> None:
    from spirit.skipset import SkipSet

    model, none = lm.model, SkipSet()
    cache = model.new_cache(context + 64)
    model.forward(torch.randint(0, 1000, (1, context)), 0, cache, none)

    def ms(fn) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t0) / repeats * 1e3

    for rows in (1, 4, 8, 16, 32):
        x = torch.randint(0, 1000, (1, rows))
        sdpa = ms(lambda: model.forward(x, context, cache, none, last_only=rows == 1))
        exact = ms(lambda: model.forward(x, context, cache, none, exact=True))
        print(f"  {rows:2d}-row pass at context {context}: SDPA {sdpa:6.1f} ms, exact {exact:6.1f} ms ({exact / sdpa:.2f}x)")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS)
    p.add_argument("--prompts", type=int, default=13)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--passes", action="store_true", help="also time single passes of 1..32 rows")
    args = p.parse_args()

    lm = spirit.load(args.model, dtype=args.dtype)
    print(f"{lm.name} {lm.dtype}, {torch.get_num_threads()} threads; {lm.exactness.reason} "
          f"(check took {lm.exactness.check_time_s:.2f} s)")
    if not lm.exactness.exact:
        print("exact passes are off on this machine: nothing to compare")
        return 1
    prompts = [lm.encode([{"role": "user", "content": q}], chat=True) for q in one_per_category(args.questions, args.prompts)]
    decode(lm, prompts[0], 16, exact=True)  # warm-up of both paths
    decode(lm, prompts[0], 16, exact=False)
    time_s = {True: 0.0, False: 0.0}
    tokens = {True: 0, False: 0}
    same = 0
    for i, ids in enumerate(prompts):
        outputs = {}
        for exact in ((True, False) if i % 2 == 0 else (False, True)):
            out, seconds = decode(lm, ids, args.tokens, exact)
            outputs[exact] = out
            time_s[exact] += seconds
            tokens[exact] += len(out) - 1
        same += outputs[True] == outputs[False]
    speed = {k: tokens[k] / time_s[k] for k in time_s}
    print(f"plain decoding, {len(prompts)} prompts x {args.tokens} tokens:")
    print(f"  SDPA one-token steps  {speed[False]:.2f} tok/s")
    print(f"  exact (row-wise)      {speed[True]:.2f} tok/s   ratio {speed[True] / speed[False]:.3f}")
    print(f"  same text: {same}/{len(prompts)}")
    if args.passes:
        pass_costs(lm)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
