"""Quantized drafts are lossless: the draft's MLPs at 8 or 4 bits change what it proposes,
never what is accepted (float32, tiny models of every architecture, greedy == plain)."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_lossless_levers import LAYERS, engine, run

from spirit.engine import Engine
from spirit.model.adapter import SkippableModel
from spirit.policies.base import ModelInfo, StaticPolicy
from spirit.policies.spirit import SpiritPolicy
from spirit.sampling import SamplingParams
from spirit.skipset import DraftConfig, SkipSet
from spirit.stats import WindowStats
from spirit.testing import ARCHITECTURES, tiny_model


layers = st.frozensets(st.integers(0, LAYERS - 1), max_size=3)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    bits=st.sampled_from([4, 8]),
    skip=st.one_of(st.just(SkipSet()), st.builds(SkipSet, layers, layers)),
    prompt=st.lists(st.integers(0, 255), min_size=1, max_size=24),
    n=st.integers(1, 40),
    ngram=st.booleans(),
    vocab=st.sampled_from([0, 64]),
    branches=st.integers(1, 3),
    threshold=st.sampled_from([0.0, 0.5, 0.8]),
)
def test_quantized_drafts_equal_vanilla(arch, bits, skip, prompt, n, ngram, vocab, branches, threshold):
    eng = engine(arch)
    config = DraftConfig(max_draft=8, threshold=threshold, ngram=ngram, draft_vocab=vocab, branches=branches,
                         draft_bits=bits)
    policy = StaticPolicy(ModelInfo(LAYERS), config, skip=skip)
    assert run(eng, prompt, n, policy) == run(eng, prompt, n, None)


class Recording(StaticPolicy):
    """A static policy that keeps the window stats the engine reports."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.windows: list[WindowStats] = []

    def learn(self, stats: WindowStats) -> None:
        self.windows.append(stats)


def test_a_quantized_draft_really_drafts_and_is_accepted():
    # the path is exercised, not bypassed: the engine builds int4 MLPs, drafts with them
    # (no sublayer skipped), and the full model accepts most of what they propose
    eng = Engine(SkippableModel(tiny_model("qwen2", num_layers=LAYERS)))
    prompt = list(range(40, 60))
    policy = Recording(ModelInfo(LAYERS), DraftConfig(max_draft=6, threshold=0.0, draft_bits=4), skip=SkipSet())
    out = run(eng, prompt, 48, policy)
    assert out == run(eng, prompt, 48, None)
    assert 4 in eng._quantized
    rounds = sum(w.counters.draft_rounds for w in policy.windows)
    drafted = sum(w.counters.drafted for w in policy.windows)
    accepted = sum(w.counters.accepted for w in policy.windows)
    assert rounds > 0 and accepted / drafted > 0.5


def test_sampling_with_a_quantized_draft_is_seeded():
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    sampling = SamplingParams(temperature=1.0, seed=3)
    config = DraftConfig(threshold=0.0, draft_bits=4, branches=2)

    def sample_once():
        eng = Engine(SkippableModel(tiny_model("llama", num_layers=LAYERS)))
        return run(eng, prompt, 30, StaticPolicy(ModelInfo(LAYERS), config, skip=SkipSet()), sampling)

    a, b = sample_once(), sample_once()
    assert a == b and len(a) == 30


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_spirit_policy_with_quantized_drafts_equals_vanilla(arch):
    eng = engine(arch)
    policy = SpiritPolicy(ModelInfo(LAYERS), SpiritPolicy.default_draft)
    for prompt in ([1, 2, 3, 1, 2, 3, 1, 2], list(range(100, 130)), [7] * 12):
        assert run(eng, prompt, 60, policy) == run(eng, prompt, 60, None)
