import json
import re
from pathlib import Path

import pytest

from spirit.bench.questions import (
    QUICK_QUESTIONS, SPEC_BENCH_URL, Question, QuestionFileError, load_questions, questions_path, sample, select,
    stream_blocks,
)


def write(tmp_path, lines, name="q.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


QUESTIONS = [
    {"question_id": 1, "category": "qa", "turns": ["q1"]},
    {"question_id": 2, "category": "writing", "turns": ["w1", "w2"]},
    {"question_id": 3, "category": "qa", "turns": ["q3"]},
    {"question_id": 4, "category": "math", "turns": ["m4"]},
    {"question_id": 5, "category": "qa", "turns": ["q5"]},
]


def test_load_and_select(tmp_path):
    qs = load_questions(write(tmp_path, QUESTIONS))
    assert qs[1] == Question(2, "writing", ("w1", "w2"))
    assert [q.question_id for q in select(qs, per_category=1)] == [1, 2, 4]
    assert [q.question_id for q in select(qs, ["qa"], 2)] == [1, 3]
    assert len(select(qs)) == 5


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not valid JSON"),
        ('{"question_id": 9, "turns": ["x"]}', "missing field(s) category"),
        ('{"question_id": 9, "category": "qa", "turns": []}', "non-empty list"),
        ('{"question_id": 9, "category": "qa", "turns": "x"}', "non-empty list"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, line, message):
    path = write(tmp_path, [QUESTIONS[0], line])
    with pytest.raises(QuestionFileError, match=re.escape(message)) as err:
        load_questions(path)
    assert f"{path}:2" in str(err.value)


def test_missing_file_and_unknown_category(tmp_path):
    with pytest.raises(QuestionFileError, match="does not exist"):
        load_questions(tmp_path / "nope.jsonl")
    qs = load_questions(write(tmp_path, QUESTIONS))
    with pytest.raises(QuestionFileError, match="unknown category 'poetry'"):
        select(qs, ["qa", "poetry"])
    with pytest.raises(QuestionFileError, match="unknown category"):
        stream_blocks(qs, ["qa", "poetry"], 1)
    assert issubclass(QuestionFileError, ValueError)  # the CLI turns it into one line, exit 2


def test_stream_blocks_take_fresh_questions_for_a_repeated_category(tmp_path):
    qs = load_questions(write(tmp_path, QUESTIONS))
    blocks = stream_blocks(qs, ["qa", "math", "qa"], 2)
    assert [(b.index, b.category) for b in blocks] == [(0, "qa"), (1, "math"), (2, "qa")]
    assert [q.question_id for q in blocks[0].questions] == [1, 3]
    assert [q.question_id for q in blocks[1].questions] == [4, 4]  # one math question: it repeats
    assert [q.question_id for q in blocks[2].questions] == [5, 1]  # continues, then wraps


def test_sample_draws_per_category_by_seed(tmp_path):
    many = [{"question_id": i, "category": "qa" if i % 3 else "math", "turns": [f"t{i}"]} for i in range(30)]
    qs = load_questions(write(tmp_path, many))
    picked = sample(qs, 3, seed=1)
    assert [q.category for q in picked].count("qa") == 3 and [q.category for q in picked].count("math") == 3
    ids = [q.question_id for q in picked]
    assert ids == sorted(ids)  # file order
    assert sample(qs, 3, seed=1) == picked  # the seed decides
    assert any(sample(qs, 3, seed=s) != picked for s in range(2, 6))
    assert ids != [q.question_id for q in select(qs, per_category=3)]  # not simply the first ones
    # a category's draw does not depend on which other categories run
    assert [q for q in picked if q.category == "qa"] == sample(qs, 3, seed=1, categories=["qa"])
    assert len(sample(qs, 100, seed=0)) == 30  # a small category runs whole
    with pytest.raises(ValueError, match="--sample must be >= 1"):
        sample(qs, 0, seed=0)
    with pytest.raises(QuestionFileError, match="unknown category"):
        sample(qs, 1, seed=0, categories=["poetry"])


def test_questions_path():
    assert str(questions_path("x.jsonl")) == "x.jsonl"
    assert questions_path("x.jsonl", quick=True) == Path("x.jsonl")
    assert questions_path(None, quick=True) == QUICK_QUESTIONS
    with pytest.raises(QuestionFileError, match=re.escape(SPEC_BENCH_URL)):
        questions_path(None)


def test_the_quick_questions_ship_in_the_package_with_their_source():
    qs = load_questions(QUICK_QUESTIONS)
    assert {q.category for q in qs} == {"writing", "coding", "qa", "math_reasoning"}
    assert len(qs) == 4
    source = (QUICK_QUESTIONS.parent / "SOURCE.md").read_text()
    assert "Spec-Bench" in source and "Apache-2.0" in source
    assert all(str(q.question_id) in source for q in qs)
