"""Decode throughput of B requests batched together (spirit/batch.py), prefill excluded:
how much of the machine continuous batching recovers once the prompts are in the cache.

    python benchmarks/batch_decode.py --model qwen2.5-coder-1.5b --batches 1,2,4,8 --tokens 64
    python benchmarks/batch_decode.py --prompts 8 --batches 1,8 --methods vanilla --tokens 32 --repeats 1

For each batch size B and method (interleaved: every B for every method in one repeat, the
order reversed at each next repeat, after a warm-up), the selected Spec-Bench prompts (the
first turn, as a chat message) are taken B at a time: each group is prefilled one prompt at a
time, then decoded together by `Batch.step` until every request in it ends. So every B decodes
the same prompts and tokens. Figures: committed tokens over the decode wall time (drafting,
packed passes and verification included; prefill not), the mean number of requests decoding
per round (requests that end early lower it), and that tok/s over B=1's of the
same method.

This isolates the decode side that bench-serve (spirit/bench/serve_load.py) mixes with
prefill: a load run's batching gain is bounded by its prompts' prefill share, this one is not.
Every request's tokens are checked against plain decoding alone (vanilla at B=1); a
difference is printed and makes the command exit 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import spirit
from spirit.batch import Batch
from spirit.bench.questions import load_questions, select


def decode_together(lm, prompts: list[str], method: str, tokens: int) -> dict:
    """Prefill each prompt alone, then decode all of them in one batch; the decode's figures."""
    streams = [lm.stream(p, chat=True, max_new_tokens=tokens, method=method) for p in prompts]
    decodings = [s.start() for s in streams]
    outputs: list[list[int]] = [[] for _ in prompts]
    for decoding, out in zip(decodings, outputs):
        while decoding.prefilling:
            out.extend(decoding.prefill_chunk())
    batch = Batch(lm.engine, len(prompts))
    for decoding, out in zip(decodings, outputs):
        if decoding.done:
            continue
        batch.add(decoding, emit=lambda ids, out=out: out.extend(ids) or True, done=lambda stats: None)
    committed_before = sum(len(o) for o in outputs)
    rounds, occupancy = 0, 0
    started = time.perf_counter()
    while len(batch):
        occupancy += len(batch)
        rounds += 1
        batch.step()
    seconds = time.perf_counter() - started
    decoded = sum(len(o) for o in outputs) - committed_before
    return {"tokens": decoded, "seconds": seconds, "request_rounds": occupancy, "rounds": rounds,
            "rows": batch.stats.rows, "passes": batch.stats.passes, "outputs": outputs}


COUNTED = ("tokens", "seconds", "request_rounds", "rounds", "rows", "passes")  # summed over a run's groups


def summary(runs: list[dict]) -> dict[str, float]:
    """Decode tok/s, requests decoding per round and rows per pass over the given runs."""
    total = {key: sum(r[key] for r in runs) for key in COUNTED}
    return {"tok_s": total["tokens"] / total["seconds"] if total["seconds"] else 0.0,
            "mean_batch": total["request_rounds"] / max(1, total["rounds"]),
            "rows_per_pass": total["rows"] / max(1, total["passes"])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--weights", default="auto")
    p.add_argument("--questions", default=str(Path(__file__).resolve().parents[2] / "shared/data/specbench/dev.jsonl"))
    p.add_argument("--per-category", type=int, default=1)
    p.add_argument("--prompts", type=int, default=None,
                   help="only the first N selected prompts (N = the largest batch: every request of it decodes together)")
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--methods", default="vanilla,spirit")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None, help="write every run's figures here")
    args = p.parse_args()

    lm = spirit.load(args.model, dtype=args.dtype, weights=args.weights)
    questions = select(load_questions(args.questions), per_category=args.per_category)
    prompts = [q.turns[0] for q in questions][: args.prompts]
    batches = [int(b) for b in args.batches.split(",")]
    methods = args.methods.split(",")
    for method in methods:  # warm-up (and any calibration) outside the timed runs
        decode_together(lm, prompts[:2], method, 8)

    # every batch size decodes the same prompts (in groups of B), so the figures compare the
    # same tokens; every answer must equal plain decoding's alone (B=1, vanilla: the reference)
    runs: list[dict] = []
    answers: dict[tuple[str, int, int], list[list[int]]] = {}
    order = [(m, b) for m in methods for b in batches]
    for repeat in range(args.repeats):
        for method, size in order if repeat % 2 == 0 else order[::-1]:
            run = {"method": method, "batch": size, "repeat": repeat, **dict.fromkeys(COUNTED, 0)}
            outputs: list[list[int]] = []
            for start in range(0, len(prompts), size):
                result = decode_together(lm, prompts[start : start + size], method, args.tokens)
                outputs.extend(result["outputs"])
                for key in COUNTED:
                    run[key] += result[key]
            answers[(method, size, repeat)] = outputs
            runs.append(run)
            figures = summary([run])
            print(f"  {method} B={size}: {figures['tok_s']:.2f} tok/s over {run['tokens']} tokens, "
                  f"mean batch {figures['mean_batch']:.2f}", file=sys.stderr, flush=True)
    reference = answers.get(("vanilla", 1, 0)) or answers[(methods[0], batches[0], 0)]
    mismatches = 0
    for (method, size, repeat), outputs in answers.items():
        for i, (got, want) in enumerate(zip(outputs, reference)):
            if got != want:
                mismatches += 1
                print(f"MISMATCH: {method} B={size} repeat {repeat} prompt {i}", file=sys.stderr)

    print(f"model {lm.name}  weights {args.weights}  {len(prompts)} prompts, {args.tokens} tokens, "
          f"{args.repeats} repeats; decode only (prefill excluded)")
    table = {(m, b): summary([r for r in runs if r["method"] == m and r["batch"] == b]) for m, b in order}
    first = methods[0]
    print(f"{'method':8s} {'B':>3s} {'tok/s':>7s} {'vs B=1':>7s} {'vs ' + first + ' B=1':>14s} {'mean batch':>10s} {'rows/pass':>9s}")
    for method, size in order:
        figures = table[(method, size)]
        speed = figures["tok_s"]
        print(f"{method:8s} {size:3d} {speed:7.2f} {speed / table[(method, batches[0])]['tok_s']:6.2f}x "
              f"{speed / table[(first, batches[0])]['tok_s']:13.2f}x {figures['mean_batch']:10.2f} {figures['rows_per_pass']:9.2f}")
    print(f"identical to solo decoding: {'yes' if not mismatches else f'NO, {mismatches} differ'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": lm.name, "args": vars(args), "runs": runs}, indent=1))
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
