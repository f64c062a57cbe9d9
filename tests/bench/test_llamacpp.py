"""llama.cpp as a bench method (bench/llamacpp.py).

The registration, the refusals and the draft counting need no llama-cpp-python and always
run; the runs on the real bundled smollm2-135m skip cleanly without it (the optional extra
`llamacpp`), so only those tests are skipped, not the module.
"""

import json
import sys
import types

import numpy as np
import pytest

from spirit.bench import llamacpp
from spirit.bench.llamacpp import ALLOW_AMX, DraftLog, LlamaCppMethod, _import_llama_cpp, context_size
from spirit.bench.metrics import OTHER_ENGINES
from spirit.bench.runner import available_methods, build_runners, default_methods, learned_from
from spirit.cli import main
from spirit.testing import tiny_spirit


def test_asking_for_llamacpp_without_the_extra_names_the_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(llamacpp, "available", lambda: False)
    assert "llamacpp" not in available_methods()
    with pytest.raises(ValueError, match=r"'llamacpp-lookup' need llama-cpp-python.*pip install -e '\.\[llamacpp\]'"):
        build_runners(["vanilla", "llamacpp-lookup"], None)
    # and from the command line: one line, exit 2, before any model loads
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["hi"]}) + "\n")
    assert main(["bench", "--questions", str(questions), "--methods", "vanilla,llamacpp", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("spirit: error:") and "pip install -e '.[llamacpp]'" in err and "\n" not in err


def test_with_the_extra_both_methods_are_known_but_run_only_when_named(monkeypatch):
    monkeypatch.setattr(llamacpp, "available", lambda: True)
    assert {"llamacpp", "llamacpp-lookup"} <= set(available_methods())
    assert not {"llamacpp", "llamacpp-lookup"} & set(default_methods())
    runners = build_runners(["vanilla", "llamacpp", "llamacpp-lookup"], None)
    assert isinstance(runners["llamacpp"], LlamaCppMethod) and runners["llamacpp-lookup"].lookup
    for m in ("llamacpp", "llamacpp-lookup"):
        assert m in OTHER_ENGINES  # their agreement with vanilla is llama.cpp's, not spirit's lossless check
        assert learned_from(runners[m]).startswith("nothing: llama.cpp's context is cleared")
    assert "prompt lookup" in learned_from(runners["llamacpp-lookup"])


def test_a_model_not_converted_from_gguf_is_refused(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the tiny model's folder is "."; make sure no spirit-source.json is there
    lm = tiny_spirit("llama")
    with pytest.raises(ValueError, match="llamacpp needs a GGUF model"):
        LlamaCppMethod("llamacpp")(lm, "hi", 4, None)


def test_a_build_with_amx_kernels_is_refused_with_the_rebuild(monkeypatch):
    """Such a build segfaults on our Xeon at its first matmul: refused before it can run."""
    fake = types.ModuleType("llama_cpp")
    fake.__version__, fake.Llama = "0.3.36", object
    fake.llama_print_system_info = lambda: b"CPU : AVX2 = 1 | AMX_INT8 = 1 | OPENMP = 1 |"
    speculative = types.ModuleType("llama_cpp.llama_speculative")
    speculative.LlamaPromptLookupDecoding = object
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", speculative)
    monkeypatch.delenv(ALLOW_AMX, raising=False)
    with pytest.raises(ValueError, match="AMX kernels.*-mno-amx-int8.*llama-cpp-python==0.3.36"):
        _import_llama_cpp()
    monkeypatch.setenv(ALLOW_AMX, "1")
    assert _import_llama_cpp() == (object, object)
    fake.llama_print_system_info = lambda: b"CPU : AVX2 = 1 | AVX512 = 1 | OPENMP = 1 |"
    monkeypatch.delenv(ALLOW_AMX)
    assert _import_llama_cpp() == (object, object)


def test_context_is_a_power_of_two_within_the_model():
    assert context_size(100, 8192) == llamacpp.MIN_CONTEXT
    assert context_size(3000, 8192) == 4096 and context_size(4096, 8192) == 4096
    assert context_size(5000, 6000) == 6000


def test_lookup_reserves_slots_for_its_drafts_past_the_last_token():
    plain, lookup = LlamaCppMethod(llamacpp.PLAIN), LlamaCppMethod(llamacpp.LOOKUP)
    assert plain.context_needed(1984, 64) == 2048
    assert lookup.context_needed(1984, 64) > 2048  # a 2048-slot context would overflow on the last drafts
    assert context_size(lookup.context_needed(1984, 64), 32768) == 4096


def test_draft_counts_are_the_accepted_prefixes():
    drafts = iter([np.array([7, 8, 9]), np.array([], dtype=np.intc), np.array([5, 6])])
    log = DraftLog(lambda ids: next(drafts))
    log.start(prompt_tokens=3)
    log(np.zeros(4, dtype=np.intc))  # 1 token out: drafts output positions 1.. = [7, 8, 9]
    log(np.zeros(6, dtype=np.intc))  # nothing found: not a round
    log(np.zeros(7, dtype=np.intc))  # 4 tokens out: drafts positions 4.. = [5, 6]
    c = log.counters([1, 7, 8, 4, 5])  # [7, 8] kept then 4 picked; 5 kept, 6 never verified
    assert (c.draft_rounds, c.drafted, c.accepted, c.new_tokens) == (2, 5, 3, 4)


# -- the real bundled model ------------------------------------------------------------------

PROMPT = [{"role": "user", "content": "Repeat this line twice: the cat sat on the mat, the dog sat on the log."}]
TOKENS = 16


@pytest.fixture(scope="module")
def lm():
    pytest.importorskip("llama_cpp", reason="the llamacpp extra is not installed")
    try:
        _import_llama_cpp()
    except ValueError as refusal:  # e.g. a build with llama.cpp's AMX kernels on a CPU with AMX
        pytest.skip(f"this llama-cpp-python build is refused here: {refusal}")
    import spirit

    return spirit.load("smollm2-135m")


@pytest.fixture(scope="module")
def runs(lm):
    """Each method twice on the same prompt, one runner (one Llama) per method as in a bench."""
    out = {}
    for name in ("llamacpp", "llamacpp-lookup"):
        runner = LlamaCppMethod(name)
        first = runner(lm, PROMPT, TOKENS, None, warmup=True)
        llama = runner._llama
        second = runner(lm, PROMPT, TOKENS, None)
        assert runner._llama is llama  # opened once, kept between requests
        out[name] = (first, second)
    return out


@pytest.mark.integration
def test_generates_the_requested_tokens_and_text(lm, runs):
    for first, _ in runs.values():
        assert 0 < len(first.token_ids) <= TOKENS
        assert first.finish_reason == ("stop" if first.token_ids[-1] in lm.eos_token_ids else "length")
        if first.finish_reason == "length":
            assert len(first.token_ids) == TOKENS
        assert first.text and first.text == lm.tokenizer.decode(first.token_ids, skip_special_tokens=True)
        s = first.stats
        assert s.new_tokens == len(first.token_ids) and s.prompt_tokens == len(lm.encode(PROMPT))
        assert 0 < s.prefill_time_s < s.wall_time_s


@pytest.mark.integration
def test_greedy_runs_repeat(runs):
    for first, second in runs.values():
        assert first.token_ids == second.token_ids  # and the second had no prefix cache from the first


@pytest.mark.integration
def test_lookup_gives_plain_llamacpp_tokens_on_this_prompt(runs):
    """Equal here, NOT in general. llama.cpp's logits depend on how many tokens one evaluation
    holds (one at a time vs a token and its drafts: up to 1.1 apart on this model, measured),
    so lookup's verification can flip a near-tie: "Write a Python function that reverses a
    string." diverges at token 27, where the top two logits are 0.0009 apart. On this prompt
    every pick wins by at least 0.8, so the two agree; a divergence elsewhere in a bench is
    llama.cpp's, reported as such (metrics.OTHER_ENGINES)."""
    plain, lookup = runs["llamacpp"][0], runs["llamacpp-lookup"][0]
    assert lookup.token_ids == plain.token_ids
    c = lookup.stats.counters
    assert c.draft_rounds > 0 and 0 <= c.accepted <= c.drafted  # the prompt repeats itself: lookup drafts


def test_the_report_names_the_llamacpp_build_that_ran(monkeypatch):
    """Its instruction sets are fixed when it is compiled, not by the variables that hold
    torch's kernels back, so a report must say which build ran (an AVX2-class comparison needs
    an AVX2 build of llama.cpp too); nothing when llama.cpp did not run."""
    from spirit.bench.machine import llamacpp_build

    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    assert llamacpp_build() is None
    fake = types.ModuleType("llama_cpp")
    fake.__file__ = "/opt/llama-avx2/llama_cpp/__init__.py"
    fake.llama_print_system_info = lambda: b"CPU : SSE3 = 1 | AVX2 = 1 | FMA = 1 | OPENMP = 1 | "
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    assert llamacpp_build() == "CPU : SSE3 = 1 | AVX2 = 1 | FMA = 1 | OPENMP = 1 (/opt/llama-avx2/llama_cpp)"
