"""Interleaving, the lossless check with a deliberately broken method, and end-to-end runs on
a tiny random model (no checkpoint)."""

import json
from dataclasses import replace

import pytest

from spirit.api import GenerationResult
from spirit.bench.questions import Question, stream_blocks
from spirit.bench.report import write_outputs
from spirit.bench.runner import SpiritMethod, default_static_skip, run_bench, schedule, with_baseline
from spirit.stats import GenerationStats
from spirit.testing import tiny_spirit

QUESTIONS = [
    Question(1, "qa", ("Who wrote Hamlet?",)),
    Question(2, "writing", ("Write a line about rain.", "Now shorter.")),
    Question(3, "qa", ("Name a colour.",)),
]


@pytest.fixture(scope="module")
def lm():
    return tiny_spirit("llama")


def test_schedule_interleaves_question_by_question():
    order = [(slot, q.question_id, m) for slot, q, m in schedule(QUESTIONS, ["a", "b", "c"])]
    assert order == [
        (0, 1, "a"), (0, 1, "b"), (0, 1, "c"),
        (1, 2, "a"), (1, 2, "b"), (1, 2, "c"),
        (2, 3, "a"), (2, 3, "b"), (2, 3, "c"),
    ]


def test_vanilla_is_always_the_reference():
    assert with_baseline(["static", "spirit"]) == ["vanilla", "static", "spirit"]
    assert with_baseline(["static", "vanilla", "static"]) == ["vanilla", "static"]


def test_default_static_skip():
    skip = default_static_skip(30)
    assert not skip.attn and len(skip.mlp) == 12  # 20% of 60 sublayers
    assert 0 not in skip.mlp and 29 not in skip.mlp
    assert default_static_skip(4).mlp <= {1, 2}


class Recorder:
    """A fake method: records each call and answers with fixed tokens."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def __call__(self, lm, prompt, max_new_tokens, tag, *, warmup=False):
        user_turns = sum(m["role"] == "user" for m in prompt)
        self.calls.append((self.name, tag, user_turns, warmup))
        ids = [1, 2, 3][:max_new_tokens]
        return GenerationResult("abc", ids, GenerationStats(prompt_tokens=4, new_tokens=len(ids), wall_time_s=0.01), "length")


def test_run_order_warmup_then_interleaved_turn_by_turn(lm):
    calls = []
    runners = {m: Recorder(m, calls) for m in ("vanilla", "x", "y")}
    result = run_bench(lm, QUESTIONS, ["x", "y"], runners=runners, max_new_tokens=3, progress=False)
    assert result.methods == ["vanilla", "x", "y"]
    assert calls[:3] == [("vanilla", "qa", 1, True), ("x", "qa", 1, True), ("y", "qa", 1, True)]
    assert calls[3:] == [
        ("vanilla", "qa", 1, False), ("x", "qa", 1, False), ("y", "qa", 1, False),
        ("vanilla", "writing", 1, False), ("vanilla", "writing", 2, False),
        ("x", "writing", 1, False), ("x", "writing", 2, False),
        ("y", "writing", 1, False), ("y", "writing", 2, False),
        ("vanilla", "qa", 1, False), ("x", "qa", 1, False), ("y", "qa", 1, False),
    ]
    assert [r.order for r in result.runs] == list(range(9))


class Broken:
    """Vanilla, with one token changed from the fourth on: must be caught as not lossless."""

    def __call__(self, lm, prompt, max_new_tokens, tag, *, warmup=False):
        result = SpiritMethod("vanilla")(lm, prompt, max_new_tokens, tag, warmup=warmup)
        ids = list(result.token_ids)
        if len(ids) > 3:
            ids[3] = (ids[3] + 1) % 256
        return replace(result, token_ids=ids, text=lm.tokenizer.decode(ids, skip_special_tokens=True))


def test_broken_method_is_reported_not_lossless(lm):
    result = run_bench(lm, QUESTIONS[:1], ["static", "broken"], runners={"broken": Broken()},
                       max_new_tokens=8, progress=False, warmup=False)
    lossless = result.lossless()
    assert lossless["static"].lossless  # fp32: skipping sublayers in the draft changes nothing
    broken = lossless["broken"]
    assert not broken.lossless and broken.rate == 0.0
    (d,) = broken.divergences
    assert d.position == 3 and d.method_token == (d.baseline_token + 1) % 256
    assert d.baseline_context and d.method_context and d.baseline_context != d.method_context


def test_end_to_end_outputs(lm, tmp_path):
    result = run_bench(lm, QUESTIONS[:2], ["static", "hf"], max_new_tokens=8, progress=False)
    paths = write_outputs(result, tmp_path / "out")
    data = json.loads(paths["json"].read_text())
    assert data["methods"] == ["vanilla", "static", "hf"]
    assert set(data["by_category"]["static"]) == {"qa", "writing", "overall"}
    assert data["by_category"]["vanilla"]["overall"]["speedup"] == 1.0
    assert data["lossless"]["static"]["lossless"] and data["lossless"]["hf"]["lossless"]
    assert data["machine"]["cores"] >= 1 and data["machine"]["dtype"] == "float32"
    assert data["timeline"]["static"] and all(p["skip_ratio"] > 0 for p in data["timeline"]["static"])
    for name in ("speedup.png", "run.png"):
        assert (tmp_path / "out" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = paths["report"].read_text()
    assert "## Tokens/s per category" in report and "![speedup per category](speedup.png)" in report
    for method in ("vanilla", "static", "hf"):
        lines = [json.loads(x) for x in (tmp_path / "out" / "answers" / f"{method}.jsonl").read_text().splitlines()]
        assert [x["question_id"] for x in lines] == [1, 2]
        choice = lines[1]["choices"][0]
        assert len(choice["turns"]) == len(choice["new_tokens"]) == len(choice["wall_time"]) == 2
        assert sum(choice["accept_lengths"]) == sum(choice["new_tokens"])


def test_stream_mode(lm, tmp_path):
    questions = [Question(i, c, (f"{c} question {i}",)) for i, c in enumerate(["qa", "qa", "math", "math"])]
    blocks = stream_blocks(questions, ["qa", "math", "qa"], 1)
    result = run_bench(lm, methods=["static"], blocks=blocks, max_new_tokens=6, progress=False, warmup=False)
    assert [r.block for r in result.runs] == [0, 0, 1, 1, 2, 2]
    assert set(result.by_block()["static"]) == {0, 1, 2, "overall"}
    paths = write_outputs(result, tmp_path / "s")
    assert (tmp_path / "s" / "stream.png").exists()
    data = json.loads(paths["json"].read_text())
    assert [b["category"] for b in data["blocks"]] == ["qa", "math", "qa"]
    assert "## Stream: tokens/s per block" in paths["report"].read_text()
