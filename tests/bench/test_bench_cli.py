"""`spirit bench` argument handling: bad input fails with one line before any model loads."""

import json

import pytest

from spirit.bench.cli import QUICK_CATEGORIES, QUICK_METHODS, plan
from spirit.bench.questions import SPEC_BENCH_URL
from spirit.cli import build_parser, main


pytestmark = pytest.mark.usefixtures("no_model")  # tests/bench/conftest.py


@pytest.fixture
def questions(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": ["hi"]})
                              for i, c in enumerate(["qa", "qa", "math"])) + "\n")
    return path


def args(*argv):
    return build_parser().parse_args(["bench", *argv])


def test_plan(questions, tmp_path):
    p = plan(args("--questions", str(questions), "--methods", "static", "--per-category", "1", "--out", str(tmp_path / "o")))
    assert p["methods"] == ["vanilla", "static"]
    assert [q.question_id for q in p["questions"]] == [0, 2]
    assert p["max_new_tokens"] == 128 and p["model"] == "smollm2-135m"
    s = plan(args("--questions", str(questions), "--stream", "qa,math", "--per-block", "2"))
    assert [b.category for b in s["blocks"]] == ["qa", "math"] and s["questions"] is None


def test_quick_plan(questions):
    p = plan(args("--quick", "--questions", str(questions)))
    assert p["model"] == "smollm2-135m" and p["max_new_tokens"] == 32
    assert set(p["methods"]) <= set(QUICK_METHODS) and p["methods"][0] == "vanilla"
    assert [q.category for q in p["questions"]] == ["qa"]  # the quick categories present in the file, one each


def test_quick_runs_the_questions_shipped_in_the_package(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # any folder: nothing is looked up relative to a checkout
    p = plan(args("--quick"))
    assert [q.category for q in p["questions"]] == list(QUICK_CATEGORIES)
    assert p["methods"] == ["vanilla", "static", "fixed", "spirit"]


def test_sample_per_category_with_a_seed(tmp_path):
    path = tmp_path / "many.jsonl"
    path.write_text("\n".join(json.dumps({"question_id": i, "category": "qa" if i % 2 else "math", "turns": ["hi"]})
                              for i in range(40)) + "\n")
    picked = [q.question_id for q in plan(args("--questions", str(path), "--sample", "2", "--seed", "7"))["questions"]]
    assert len(picked) == 4 and picked == [q.question_id for q in plan(args("--questions", str(path), "--sample", "2",
                                                                               "--seed", "7"))["questions"]]
    first = [q.question_id for q in plan(args("--questions", str(path), "--per-category", "2"))["questions"]]
    assert first == [0, 1, 2, 3]
    default_seed = plan(args("--questions", str(path), "--sample", "2"))["questions"]
    assert default_seed == plan(args("--questions", str(path), "--sample", "2", "--seed", "0"))["questions"]


def test_without_questions_the_error_says_where_to_get_spec_bench(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("spirit: error: no --questions given") and SPEC_BENCH_URL in err and "\n" not in err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--methods", "vanilla,nope"], "unknown method(s) 'nope'"),
        (["--categories", "poetry"], "unknown category 'poetry'"),
        (["--stream", "qa,poetry"], "unknown category 'poetry'"),
        (["--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
        (["--skip", "bogus:1"], "bad skip set part"),
        (["--per-block", "2"], "--per-block needs --stream"),
        (["--sample", "0"], "--sample must be >= 1"),
        (["--sample", "1", "--per-category", "1"], "give one"),
        (["--seed", "3"], "--seed needs --sample"),
        (["--stream", "qa", "--sample", "1"], "--stream chooses its own questions"),
        (["--methods", "vanilla,fixed,nope"], "unknown method(s) 'nope'"),
    ],
)
def test_bad_input_is_one_line_exit_2(questions, capsys, extra, message):
    assert main(["bench", "--questions", str(questions), "--no-progress", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and err.startswith("spirit: error:")


def test_missing_and_malformed_question_files(tmp_path, capsys):
    assert main(["bench", "--questions", str(tmp_path / "none.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "category": "qa", "turns": ["x"]}\n{oops\n')
    assert main(["bench", "--questions", str(bad)]) == 2
    assert f"{bad}:2: not valid JSON" in capsys.readouterr().err
