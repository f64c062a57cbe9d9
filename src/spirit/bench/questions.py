"""Spec-Bench questions: reading, selecting, and arranging them into a stream of blocks.

The format is Spec-Bench's `question.jsonl`, one JSON object a line:

    {"question_id": 282, "category": "summarization", "turns": ["first user turn", ...]}

Multi-turn questions (MT-Bench's) are asked turn by turn; see `runner.py`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Spec-Bench's six reported tasks: MT-Bench's eight categories count as one ("mt_bench").
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
DEFAULT_QUESTIONS = Path("..") / "shared" / "data" / "specbench" / "dev.jsonl"


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


def resolve_questions_path(given: str | None, cwd: Path | None = None) -> Path:
    """The question file to read: `given`, else Spec-Bench's dev half in ../shared, looked up
    relative to the working directory and then to the repository holding this package."""
    if given:
        return Path(given)
    cwd = cwd or Path.cwd()
    repo_root = Path(__file__).resolve().parents[3]  # src/spirit/bench/questions.py -> repo
    for base in (cwd, repo_root):
        candidate = (base / DEFAULT_QUESTIONS).resolve()
        if candidate.is_file():
            return candidate
    raise QuestionFileError(
        f"no --questions given and {DEFAULT_QUESTIONS} was found neither under {cwd} nor under {repo_root}; "
        "pass a Spec-Bench question file with --questions"
    )
