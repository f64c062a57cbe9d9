"""Batched decoding with a fixed layer-skip draft: the requests' model drafts run together
(one packed pass per draft step, batch.py `Batch._draft_together`) against each request's
chain run alone, and plain batched decoding; prefill excluded.

    python benchmarks/draft_together.py --batches 4,8
    python benchmarks/draft_together.py --batches 4,8 --every-round

For each batch size B the first B Spec-Bench prompts are prefilled one at a time, then decoded
together for `--tokens` tokens by method "static" with `--skip` (or "vanilla"); the three modes
run interleaved, their order reversed at each repeat, after a warm-up. `--every-round` prices
every pass the same (as if verifying rows were free), so the budget gives every request drafts
every round: what drafting together saves when drafts are bought. Every output is checked
against plain decoding's (vanilla, batched); a difference makes the command exit 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import spirit
from spirit.batch import Batch, Member
from spirit.bench.questions import load_questions, select
from spirit.engine import Round
from spirit.proposers.self_draft import draft_together

SKIP = "attn:3,5,7,9,11,13,15,17,19,21;mlp:4,6,8,10,12,14,16,18,20,22"  # 20 of qwen2.5-1.5b's 56 sublayers


class DraftsAlone(Batch):
    """A batch whose requests' model drafts each run on their own (the path before drafting together)."""

    def _draft_together(self, members: list[Member], rounds: list[Round]) -> list[Round]:
        rounds = list(rounds)
        for i, round_ in enumerate(rounds):
            if round_.chain is not None:
                t0 = time.perf_counter()
                draft_together(self.engine.model, [round_.chain], round_.source.mlps(round_.chain.config))
                rounds[i] = members[i].decoding.drafted(round_, time.perf_counter() - t0)
                self.stats.draft_groups += 1
                self.stats.drafts_together += 1
        return rounds


def decode(lm, prompts: list[str], mode: str, tokens: int, skip: str, every_round: bool) -> tuple[float, list[list[int]]]:
    """Decode tok/s of `prompts` batched in `mode` (vanilla, alone, together), and the outputs."""
    options = {"method": "vanilla"} if mode == "vanilla" else {"method": "static", "skip": skip}
    decodings = [lm.stream(p, chat=True, max_new_tokens=tokens, **options).start() for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    for decoding, out in zip(decodings, outputs):
        while decoding.prefilling:
            out.extend(decoding.prefill_chunk())
    batch = (DraftsAlone if mode == "alone" else Batch)(lm.engine, len(prompts))
    if every_round:
        batch.pass_costs.predict = lambda rows: 1.0  # noqa: E731 - every pass priced alike: drafts always pay
    for decoding, out in zip(decodings, outputs):
        if not decoding.done:
            batch.add(decoding, emit=lambda ids, out=out: out.extend(ids) or True, done=lambda stats: None)
    before = sum(map(len, outputs))
    t0 = time.perf_counter()
    while len(batch):
        batch.step()
    return (sum(map(len, outputs)) - before) / (time.perf_counter() - t0), outputs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--questions", default=str(Path(__file__).resolve().parents[2] / "shared/data/specbench/dev.jsonl"))
    p.add_argument("--batches", default="4,8")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip", default=SKIP)
    p.add_argument("--every-round", action="store_true")
    args = p.parse_args()
    lm = spirit.load(args.model, dtype="auto", weights="auto")
    prompts = [q.turns[0] for q in select(load_questions(args.questions), per_category=1)]
    modes = ["vanilla", "alone", "together"]
    differ = 0
    for size in (int(b) for b in args.batches.split(",")):
        group = prompts[:size]
        decode(lm, group[:2], "together", 8, args.skip, args.every_round)  # warm-up
        speeds: dict[str, list[float]] = {m: [] for m in modes}
        reference = None
        for repeat in range(args.repeats):
            for mode in modes if repeat % 2 == 0 else modes[::-1]:
                speed, outputs = decode(lm, group, mode, args.tokens, args.skip, args.every_round)
                speeds[mode].append(speed)
                if mode == "vanilla":
                    reference = reference or outputs
                elif reference is not None and outputs != reference:
                    differ += 1
        print(f"B={size}: " + ", ".join(f"{m} {statistics.mean(v):.2f} tok/s" for m, v in speeds.items()), flush=True)
    if differ:
        print(f"{differ} runs differed from plain decoding", file=sys.stderr)
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
