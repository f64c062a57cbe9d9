"""The benchmark harness: Spec-Bench questions, methods interleaved, lossless check, reports.

    from spirit.bench import load_questions, sample, run_bench, write_outputs
    result = run_bench(lm, sample(load_questions(path), per_category=2, seed=0), ["vanilla", "fixed", "spirit"])
    write_outputs(result, "results/run1")
"""

from spirit.bench.metrics import (
    Figures, Lossless, QuestionRun, TurnResult, aggregate, compare_lossless, speedup, summarize,
)
from spirit.bench.questions import Block, Question, load_questions, sample, select, stream_blocks
from spirit.bench.report import write_outputs
from spirit.bench.runner import BenchResult, run_bench, schedule

__all__ = [
    "BenchResult", "Block", "Figures", "Lossless", "Question", "QuestionRun", "TurnResult", "aggregate",
    "compare_lossless", "load_questions", "run_bench", "sample", "schedule", "select", "speedup", "stream_blocks",
    "summarize", "write_outputs",
]
