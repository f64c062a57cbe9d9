"""After any sequence of draft / verify / reject steps, the committed cache equals a plain
prefill of the committed tokens."""

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spirit.engine import DecodeSettings, Engine
from spirit.model.adapter import SkippableModel
from spirit.policies.base import ModelInfo, Policy
from spirit.skipset import DraftConfig, SkipSet, random_skipset
from spirit.testing import tiny_model

LAYERS = 5
MODEL = SkippableModel(tiny_model("llama", num_layers=LAYERS))


class RandomPolicy(Policy):
    """A new random skip set (or none) every window of 3 tokens."""

    name = "random-test"
    window_tokens = 3

    def __init__(self, seed):
        super().__init__(ModelInfo(LAYERS), DraftConfig(max_draft=5, threshold=0.0))
        self.rng = random.Random(seed)

    def _next(self):
        if self.rng.random() < 0.2:
            return self.config(None)
        return self.config(random_skipset(LAYERS, self.rng.uniform(0, 1), self.rng), probe=None)

    def plan(self):
        return self.window(self._next())


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), prompt_len=st.integers(2, 20), n=st.integers(2, 30))
def test_cache_equals_plain_prefill(seed, prompt_len, n):
    engine = Engine(MODEL)
    captured = {}
    original_new_cache = MODEL.new_cache

    prompt = [random.Random(seed).randrange(256) for _ in range(prompt_len)]
    out = []
    decoding = engine.decode(prompt, DecodeSettings(max_new_tokens=n), RandomPolicy(seed))
    # grab the cache the engine allocates by wrapping this one call (scoped, restored below)
    try:
        MODEL.new_cache = lambda cap: captured.setdefault("cache", original_new_cache(cap))
        for chunk in decoding:
            out.extend(chunk)
    finally:
        MODEL.new_cache = original_new_cache
    ids = prompt + out
    committed = len(ids) - 1  # the last token is pending, never in the cache
    reference = original_new_cache(committed + 1)
    MODEL.forward(torch.tensor([ids[:committed]]), 0, reference, SkipSet())
    cache = captured["cache"]
    for layer in range(LAYERS):
        k, v = cache.committed_view(layer, committed)
        k_ref, v_ref = reference.committed_view(layer, committed)
        torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, v_ref, atol=1e-5, rtol=1e-5)


def test_probe_does_not_touch_committed_cache():
    engine = Engine(MODEL)

    class ProbePolicy(RandomPolicy):
        def _next(self):
            return self.config(SkipSet.parse("attn:1"), probe=random_skipset(LAYERS, 0.5, self.rng))

    policy = ProbePolicy(0)
    plain = []
    for chunk in engine.decode(list(range(30)), DecodeSettings(max_new_tokens=25), None):
        plain.extend(chunk)
    probed = []
    for chunk in engine.decode(list(range(30)), DecodeSettings(max_new_tokens=25), policy):
        probed.extend(chunk)
    assert probed == plain
