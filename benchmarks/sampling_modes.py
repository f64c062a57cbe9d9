"""Issue 15, part 4: Gumbel-mode sampling against rejection sampling, on the same prompts.

    python benchmarks/sampling_modes.py --model smollm2-135m --per-category 2 --tokens 64

For each question (first turn, chat template) and seed, every (method, mode) pair decodes the
same request, temperature 0.7, in an order rotated from question to question, so both modes
see the same machine load. Each pair has its own learned draft state (learner) and its own
policy, so no run drafts from another's output. Reports per pair: draft acceptance (accepted /
drafted), mean accepted per round, decode tokens/s and its ratio to vanilla of the same mode;
and for gumbel, on how many requests each method's tokens equal vanilla's (the guarantee).
"""

from __future__ import annotations

import argparse
import itertools
from collections import defaultdict
from pathlib import Path

import torch

import spirit
from spirit.request import default_draft
from spirit.bench.questions import load_questions, select
from spirit.policies import REGISTRY
from spirit.policies.base import ModelInfo

MODES = ("gumbel", "rejection")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default=None, help="bf16 or fp32 (default: spirit's choice for this CPU)")
    p.add_argument("--questions", default=str(Path(__file__).resolve().parents[2] / "shared/data/specbench/dev.jsonl"))
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--methods", default="fixed,spirit", help="speculative methods compared (vanilla always runs)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    lm = spirit.load(args.model, dtype=args.dtype)
    questions = select(load_questions(args.questions), per_category=args.per_category)
    methods = ["vanilla"] + args.methods.split(",")
    pairs = list(itertools.product(methods, MODES))
    info = ModelInfo(lm.num_layers, lm.name)
    # one policy per pair: adaptive policies learn across requests, and must not share that
    policies = {(m, mode): REGISTRY.create(m, info, default_draft(m)) for m, mode in pairs}
    assert all(policy.calibrated for policy in policies.values()), "a method that needs calibration"
    lm.generate("warm up", max_new_tokens=8, method="vanilla", learner="warm-up")
    lm.engine.learners.forget("warm-up")

    totals: dict[tuple, dict] = defaultdict(lambda: defaultdict(float))
    for i, question in enumerate(questions):
        outputs = {}
        for method, mode in pairs[i % len(pairs):] + pairs[: i % len(pairs)]:  # rotated order
            result = lm.generate(
                question.turns[0], chat=True, max_new_tokens=args.tokens, temperature=args.temperature, seed=i,
                sampling_mode=mode, policy=policies[method, mode], learner=f"{method}-{mode}",
            )
            stats, t = result.stats, totals[method, mode]
            t["tokens"] += stats.new_tokens - 1  # decoding only: the first token is the prefill's
            t["decode_s"] += stats.wall_time_s - stats.prefill_time_s
            t["drafted"] += stats.counters.drafted
            t["accepted"] += stats.counters.accepted
            t["rounds"] += stats.counters.draft_rounds
            outputs[method, mode] = result.token_ids
        for method, mode in pairs:
            totals[method, mode]["identical"] += outputs[method, mode] == outputs["vanilla", mode]
        print(f"{i + 1}/{len(questions)} {question.category}", flush=True)

    print(f"\n{lm.name}, {lm.model.dtype} {torch.get_num_threads()} threads, "
          f"{len(questions)} prompts x {args.tokens} tokens, temperature {args.temperature}")
    print(f"{'method':<10}{'mode':<11}{'accepted/drafted':>18}{'accept':>8}{'acc/round':>10}{'tok/s':>8}"
          f"{'vs vanilla':>11}{'= vanilla':>10}")
    for method, mode in pairs:
        t = totals[method, mode]
        speed = t["tokens"] / t["decode_s"]
        base = totals["vanilla", mode]
        ratio = speed / (base["tokens"] / base["decode_s"])
        accept = t["accepted"] / t["drafted"] if t["drafted"] else 0.0
        per_round = t["accepted"] / t["rounds"] if t["rounds"] else 0.0
        counts = f"{int(t['accepted'])}/{int(t['drafted'])}"
        print(f"{method:<10}{mode:<11}{counts:>18}{accept:>8.3f}{per_round:>10.2f}{speed:>8.1f}{ratio:>11.3f}"
              f"{int(t['identical']):>7}/{len(questions)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
