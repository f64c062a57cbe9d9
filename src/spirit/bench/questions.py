"""Spec-Bench questions: reading, selecting, and arranging them into a stream of blocks.

The format is Spec-Bench's `question.jsonl`, one JSON object a line:

    {"question_id": 282, "category": "summarization", "turns": ["first user turn", ...]}

Multi-turn questions (MT-Bench's) are asked turn by turn; see `runner.py`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# Spec-Bench's six reported tasks: MT-Bench's eight categories count as one ("mt_bench").
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
# The few questions `spirit bench --quick` runs, shipped in the package (data/SOURCE.md says
# where they come from and under which licenses); every other run names its question file.
QUICK_QUESTIONS = Path(__file__).resolve().parent / "data" / "quick.jsonl"
SPEC_BENCH_URL = "https://github.com/hemingkx/Spec-Bench/blob/main/data/spec_bench/question.jsonl"


class QuestionFileError(ValueError):
    """A question file that is missing or not in Spec-Bench's format."""


@dataclass(frozen=True)
class Question:
    question_id: int | str
    category: str
    turns: tuple[str, ...]  # user turns, asked in order


def load_questions(path: str | Path) -> list[Question]:
    """Read a Spec-Bench question file; every problem names the file and line."""
    path = Path(path)
    if not path.is_file():
        raise QuestionFileError(f"question file {path} does not exist")
    questions = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise QuestionFileError(f"{where}: not valid JSON ({exc.msg})") from None
            questions.append(_parse(record, where))
    if not questions:
        raise QuestionFileError(f"question file {path} holds no questions")
    return questions


def _parse(record: object, where: str) -> Question:
    if not isinstance(record, dict):
        raise QuestionFileError(f"{where}: expected a JSON object with question_id, category, turns")
    missing = [k for k in ("question_id", "category", "turns") if k not in record]
    if missing:
        raise QuestionFileError(f"{where}: missing field(s) {', '.join(missing)}")
    turns = record["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
        raise QuestionFileError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
    if not isinstance(record["category"], str) or not record["category"]:
        raise QuestionFileError(f"{where}: 'category' must be a non-empty string")
    qid = record["question_id"]
    if not isinstance(qid, (int, str)) or isinstance(qid, bool):
        raise QuestionFileError(f"{where}: 'question_id' must be an integer or a string")
    return Question(qid, record["category"], tuple(turns))


def categories_of(questions: list[Question]) -> list[str]:
    """Categories in order of first appearance."""
    return list(dict.fromkeys(q.category for q in questions))


def check_categories(wanted: list[str], questions: list[Question]) -> None:
    known = categories_of(questions)
    unknown = [c for c in wanted if c not in known]
    if unknown:
        raise QuestionFileError(f"unknown category {', '.join(map(repr, unknown))}; the questions have {', '.join(known)}")


def select(questions: list[Question], categories: list[str] | None = None, per_category: int | None = None) -> list[Question]:
    """The first `per_category` questions of each wanted category, in file order."""
    if categories:
        check_categories(categories, questions)
    if per_category is not None and per_category < 1:
        raise ValueError(f"--per-category must be >= 1, got {per_category}")
    wanted = set(categories) if categories else None
    taken: dict[str, int] = {}
    chosen = []
    for q in questions:
        if wanted is not None and q.category not in wanted:
            continue
        if per_category is not None and taken.get(q.category, 0) >= per_category:
            continue
        taken[q.category] = taken.get(q.category, 0) + 1
        chosen.append(q)
    return chosen


@dataclass(frozen=True)
class Block:
    index: int
    category: str
    questions: tuple[Question, ...]


def stream_blocks(questions: list[Question], categories: list[str], per_block: int) -> list[Block]:
    """Blocks of `per_block` questions, one category each, in the order given.

    A category that appears twice gets its next unused questions, so a repeated block
    measures the return to a task and not a replay; only when a category runs out do its
    questions start over.
    """
    if not categories:
        raise ValueError("--stream needs at least one category, e.g. 'qa,math_reasoning,qa'")
    if per_block < 1:
        raise ValueError(f"--per-block must be >= 1, got {per_block}")
    check_categories(categories, questions)
    pools = {c: [q for q in questions if q.category == c] for c in set(categories)}
    cursor = dict.fromkeys(pools, 0)
    blocks = []
    for index, category in enumerate(categories):
        pool = pools[category]
        picked = tuple(pool[(cursor[category] + i) % len(pool)] for i in range(per_block))
        cursor[category] += per_block
        blocks.append(Block(index, category, picked))
    return blocks


def sample(questions: list[Question], per_category: int, seed: int, categories: list[str] | None = None) -> list[Question]:
    """`per_category` questions drawn at random from each wanted category (all of a smaller
    one), in file order. Each category's draw depends only on the seed and that category's
    questions, so choosing more or fewer categories does not change the others' samples."""
    if categories:
        check_categories(categories, questions)
    if per_category < 1:
        raise ValueError(f"--sample must be >= 1, got {per_category}")
    chosen: set[int] = set()
    for category in categories or categories_of(questions):
        indices = [i for i, q in enumerate(questions) if q.category == category]
        rng = random.Random(f"{seed}:{category}")  # a str seed hashes the same in every process
        chosen.update(rng.sample(indices, min(per_category, len(indices))))
    return [q for i, q in enumerate(questions) if i in chosen]


def questions_path(given: str | None, quick: bool = False) -> Path:
    """The question file to read: `given`; with `quick`, the questions shipped in the package;
    otherwise a user error that says where Spec-Bench's question file is."""
    if given:
        return Path(given)
    if quick:
        return QUICK_QUESTIONS
    raise QuestionFileError(
        f"no --questions given: pass a question file in Spec-Bench's format, e.g. Spec-Bench's own "
        f"question.jsonl from {SPEC_BENCH_URL}, or run --quick on the few questions shipped with spirit"
    )
