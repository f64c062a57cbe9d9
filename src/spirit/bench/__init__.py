"""The benchmark harness: Spec-Bench questions, methods interleaved, lossless check, reports.

    from spirit.bench import load_questions, select, run_bench, write_outputs
    result = run_bench(lm, select(load_questions(path), per_category=2), ["vanilla", "static"])
    write_outputs(result, "results/run1")
"""

from spirit.bench.metrics import Figures, Lossless, QuestionRun, TurnResult, aggregate, compare_lossless, summarize
from spirit.bench.questions import Block, Question, load_questions, select, stream_blocks
from spirit.bench.report import write_outputs
from spirit.bench.runner import BenchResult, run_bench, schedule

__all__ = [
    "BenchResult", "Block", "Figures", "Lossless", "Question", "QuestionRun", "TurnResult", "aggregate",
    "compare_lossless", "load_questions", "run_bench", "schedule", "select", "stream_blocks", "summarize",
    "write_outputs",
]
