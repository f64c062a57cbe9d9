"""Interleaving with a rotating order, learned state kept apart per method, the lossless
check with a deliberately broken method, and end-to-end runs on a tiny random model (no
checkpoint)."""

import json
from dataclasses import replace

import pytest

from spirit.api import GenerationResult
from spirit.bench.questions import Question, stream_blocks
from spirit.bench.report import write_outputs
from spirit.bench.runner import (
    WARMUP_LEARNER, SpiritMethod, as_prompt, default_static_skip, rotated, run_bench, schedule, with_baseline,
)
from spirit.draft_model.vocab import FrequencyTable
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


def test_schedule_interleaves_question_by_question_rotating_the_order():
    order = [(slot, q.question_id, m) for slot, q, m in schedule(QUESTIONS + QUESTIONS[:1], ["a", "b", "c"])]
    assert order == [
        (0, 1, "a"), (0, 1, "b"), (0, 1, "c"),
        (1, 2, "b"), (1, 2, "c"), (1, 2, "a"),
        (2, 3, "c"), (2, 3, "a"), (2, 3, "b"),
        (3, 1, "a"), (3, 1, "b"), (3, 1, "c"),  # question k starts with method k mod M
    ]
    assert rotated(["a"], 5) == ["a"] and rotated([], 3) == []


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
        ("x", "writing", 1, False), ("x", "writing", 2, False),
        ("y", "writing", 1, False), ("y", "writing", 2, False),
        ("vanilla", "writing", 1, False), ("vanilla", "writing", 2, False),
        ("y", "qa", 1, False), ("vanilla", "qa", 1, False), ("x", "qa", 1, False),
    ]
    assert [r.order for r in result.runs] == list(range(9))
    assert [result.order_of(slot) for slot in range(3)] == [["vanilla", "x", "y"], ["x", "y", "vanilla"],
                                                            ["y", "vanilla", "x"]]
    assert "question k starts with method k mod 3" in result.settings["order"]
    assert result.settings["learned_from"]["x"].startswith("not stated")


def expected_table(lm, runs) -> FrequencyTable:
    """The token table a learner has after exactly these runs' requests (engine order:
    prompt, end-of-sequence pins, output)."""
    table = FrequencyTable(lm.model.lm_head.weight.shape[0])
    for run in sorted(runs, key=lambda r: r.order):
        messages = []
        for text, turn in zip(run.question.turns, run.turns):
            messages.append({"role": "user", "content": text})
            prompt = as_prompt(lm, messages)
            table.observe(lm.encode(prompt, chat=not isinstance(prompt, str)))
            table.pin(lm.eos_token_ids)
            table.observe(turn.token_ids)
            messages.append({"role": "assistant", "content": turn.text})
    return table


def test_each_method_learns_from_its_own_requests_only_and_warmup_teaches_nothing():
    lm = tiny_spirit("llama")
    result = run_bench(lm, QUESTIONS, ["fixed", "spirit"], max_new_tokens=8, progress=False)
    learners = lm.engine.learners
    assert {"vanilla", "fixed", "spirit"} <= set(learners.names()) and WARMUP_LEARNER not in learners
    for method in ("vanilla", "fixed", "spirit"):
        want = expected_table(lm, [r for r in result.runs if r.method == method])
        assert learners.get(method).table.counts.equal(want.counts), method
    # vanilla's requests taught nobody else: the shared table saw nothing but its prior and pins
    assert learners.get("shared").table.version == 0
    learned = result.settings["learned_from"]
    assert learned["spirit"].startswith("its own prompts and outputs only") and "learner 'spirit'" in learned["spirit"]
    assert "speeds of its own decoding windows" in learned["spirit"] and "keeps no state" in learned["fixed"]


def test_spirit_method_passes_its_learner():
    lm = tiny_spirit("llama")
    SpiritMethod("static", default_static_skip(lm.num_layers), learner="mine")(lm, "Hi there", 4, None)
    SpiritMethod("vanilla")(lm, "Hi there", 4, None, warmup=True)
    assert "mine" in lm.engine.learners and "static" not in lm.engine.learners
    assert WARMUP_LEARNER not in lm.engine.learners and "vanilla" not in lm.engine.learners


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


def test_end_to_end_outputs(lm, tmp_path, monkeypatch):
    from spirit.api import Spirit

    class Exactness:
        def to_dict(self):
            return {"exact": True, "reason": "row-invariant kernels (test)"}

    monkeypatch.setattr(Spirit, "exactness", property(lambda self: Exactness()), raising=False)
    result = run_bench(lm, QUESTIONS[:2], ["static", "fixed", "hf"], max_new_tokens=8, progress=False)
    paths = write_outputs(result, tmp_path / "out")
    data = json.loads(paths["json"].read_text())
    assert data["methods"] == ["vanilla", "static", "fixed", "hf"]
    assert set(data["by_category"]["static"]) == {"qa", "writing", "overall"}
    assert data["by_category"]["vanilla"]["overall"]["speedup"] == 1.0
    assert data["lossless"]["static"]["lossless"] and data["lossless"]["fixed"]["lossless"]
    assert set(data["lossless"]) == {"static", "fixed"}  # hf is transformers' agreement, reported apart
    assert data["other_engines_vs_vanilla"]["hf"]["engine"] == "transformers' generate"
    assert data["other_engines_vs_vanilla"]["hf"]["questions"] == 2
    assert data["exactness"] == {"exact": True, "reason": "row-invariant kernels (test)"}
    assert [o["methods"] for o in data["question_orders"]] == [["vanilla", "static", "fixed", "hf"],
                                                               ["static", "fixed", "hf", "vanilla"]]
    assert "its own prompts and outputs only" in data["settings"]["learned_from"]["fixed"]
    assert data["machine"]["cores"] >= 1 and data["machine"]["dtype"] == "float32"
    assert data["timeline"]["static"] and all(p["skip_ratio"] > 0 for p in data["timeline"]["static"])
    for name in ("speedup.png", "run.png"):
        assert (tmp_path / "out" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = paths["report"].read_text()
    assert "## Tokens/s per category" in report and "![speedup per category](speedup.png)" in report
    assert "bit-exact verification: claimed on this machine (row-invariant kernels (test))" in report
    assert "| fixed | 2/2 | 3/3 | 100.0% | 0 |" in report and "### Every divergence (0)" in report
    assert "### hf against vanilla: a property of transformers' generate, not of spirit" in report
    assert "| 1, 2 |" not in report and "| 2 | static fixed hf vanilla |" in report  # the rotation
    assert "- spirit" not in report and "- fixed: its own prompts and outputs only" in report
    assert "llama.cpp build" not in report  # it did not run, even where another test imported it
    assert "near-tie" not in report and "margin" not in report
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
