"""Answer files in Spec-Bench's format, one JSONL per method, readable by its `speed.py`.

One line per question:

    {"question_id", "category", "answer_id", "model_id",
     "choices": [{"index": 0, "turns": [text per turn], "decoding_steps": [...],
                  "new_tokens": [...], "wall_time": [...], "accept_lengths": [...]}],
     "tstamp"}

`decoding_steps` and the tokens committed per step follow spirit.bench.metrics. speed.py
averages `accept_lengths` (tokens committed per step, bonus included); the engine counts
rounds but does not log each round's length, so every draft round of a turn gets that turn's
mean: the list has one entry per decoding step and sums to the turn's new tokens, so its
mean is exact while its spread is not.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

from spirit.bench.metrics import QuestionRun, decoding_steps
from spirit.stats import GenerationStats


def accept_lengths(stats: GenerationStats) -> list[float]:
    """Tokens committed per decoding step: 1 for the prefill and each plain step, the turn's
    mean for each draft round (see the module docstring)."""
    steps = decoding_steps(stats)
    if steps == 0:
        return []
    rounds = stats.counters.draft_rounds
    plain = steps - 1 - rounds
    lengths = [1.0] * (1 + plain)
    if rounds:
        per_round = (stats.new_tokens - 1 - plain) / rounds
        lengths += [round(per_round, 4)] * rounds
    return lengths


def model_id(model: str, method: str, dtype: str) -> str:
    return f"{model}-{method}-{dtype}"


def answer_record(run: QuestionRun, model_id: str, answer_id: str | None = None, tstamp: float | None = None) -> dict:
    stats = [t.stats for t in run.turns]
    return {
        "question_id": run.question.question_id,
        "category": run.question.category,
        "answer_id": answer_id or uuid.uuid4().hex[:22],
        "model_id": model_id,
        "choices": [
            {
                "index": 0,
                "turns": [t.text for t in run.turns],
                "decoding_steps": [decoding_steps(s) for s in stats],
                "new_tokens": [s.new_tokens for s in stats],
                "wall_time": [s.wall_time_s for s in stats],
                "accept_lengths": [x for s in stats for x in accept_lengths(s)],
            }
        ],
        "tstamp": time.time() if tstamp is None else tstamp,
    }


def write_answers(runs: list[QuestionRun], folder: Path, model: str, dtype: str) -> dict[str, Path]:
    """One `<method>.jsonl` per method, questions in the order they ran."""
    folder.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for method in dict.fromkeys(r.method for r in runs):
        path = folder / f"{method}.jsonl"
        mid = model_id(model, method, dtype)
        with path.open("w", encoding="utf-8") as f:
            for run in sorted((r for r in runs if r.method == method), key=lambda r: r.slot):
                f.write(json.dumps(answer_record(run, mid), ensure_ascii=False) + "\n")
        paths[method] = path
    return paths
