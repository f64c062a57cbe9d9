"""Greedy speculative output is token-identical to plain decoding (float32, tiny models)."""

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spirit.engine import DecodeSettings, Engine
from spirit.model.adapter import SkippableModel
from spirit.policies.base import ModelInfo, Policy, StaticPolicy
from spirit.skipset import DraftConfig, SkipSet
from spirit.testing import ARCHITECTURES, tiny_model

LAYERS = 6


@functools.cache
def engine(arch: str) -> Engine:
    return Engine(SkippableModel(tiny_model(arch, num_layers=LAYERS)))


def run(eng: Engine, prompt: list[int], n: int, policy: Policy | None) -> list[int]:
    out: list[int] = []
    for chunk in eng.decode(prompt, DecodeSettings(max_new_tokens=n), policy):
        out.extend(chunk)
    return out


skip_sets = st.builds(
    SkipSet,
    st.frozensets(st.integers(0, LAYERS - 1)),
    st.frozensets(st.integers(0, LAYERS - 1)),
)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    skip=skip_sets,
    prompt=st.lists(st.integers(0, 255), min_size=1, max_size=24),
    n=st.integers(1, 40),
    max_draft=st.integers(1, 8),
    threshold=st.sampled_from([0.0, 0.5, 0.8]),
)
def test_speculative_equals_vanilla(arch, skip, prompt, n, max_draft, threshold):
    eng = engine(arch)
    policy = StaticPolicy(ModelInfo(LAYERS), DraftConfig(max_draft=max_draft, threshold=threshold), skip=skip)
    assert run(eng, prompt, n, policy) == run(eng, prompt, n, None)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_skipping_almost_everything_is_still_exact(arch):
    eng = engine(arch)
    almost_all = SkipSet(frozenset(range(LAYERS)), frozenset(range(LAYERS - 1)))
    policy = StaticPolicy(ModelInfo(LAYERS), DraftConfig(max_draft=6, threshold=0.0), skip=almost_all)
    prompt = list(range(40, 60))
    assert run(eng, prompt, 48, policy) == run(eng, prompt, 48, None)


def test_vanilla_engine_matches_transformers_generate():
    model = tiny_model("qwen2", num_layers=LAYERS)
    prompt = [3, 14, 15, 92, 65]
    ours = run(Engine(SkippableModel(model)), prompt, 30, None)
    theirs = model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == theirs


def test_eos_stops_and_is_included():
    eng = engine("llama")
    prompt = [1, 2, 3]
    plain = run(eng, prompt, 20, None)
    eos = plain[5]
    out = []
    for chunk in eng.decode(prompt, DecodeSettings(max_new_tokens=20, eos_token_ids=frozenset({eos})),
                            StaticPolicy(ModelInfo(LAYERS), DraftConfig(threshold=0.0), skip=SkipSet.parse("attn:2"))):
        out.extend(chunk)
    assert out == plain[: plain.index(eos) + 1]
