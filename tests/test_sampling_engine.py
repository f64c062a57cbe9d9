"""End to end: sampled continuations under speculation follow the full model's distribution.

A tiny model with a 4-token vocabulary and flat-ish logits; three new tokens give 64 possible
continuations whose exact probabilities we compute from the model. The draft skips most
sublayers so that q differs clearly from p and the residual path is exercised often. Both
sampling modes: rejection (speculative sampling) and gumbel (per-position noise from the seed,
so the continuations over seeds 0..n-1 are n independent samples).
"""

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from spirit.engine import DecodeSettings, Engine
from spirit.model.adapter import SkippableModel
from spirit.policies.base import ModelInfo, StaticPolicy
from spirit.sampling import SamplingParams
from spirit.skipset import DraftConfig, SkipSet
from spirit.testing import tiny_model

VOCAB, NEW = 4, 3


def exact_distribution(model, prompt):
    probs = {}
    for cont in itertools.product(range(VOCAB), repeat=NEW):
        ids = torch.tensor([prompt + list(cont)])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].double(), -1)
        probs[cont] = float(sum(logp[len(prompt) - 1 + i, t] for i, t in enumerate(cont)).exp())
    return probs


@pytest.mark.parametrize("mode", ["rejection", "gumbel"])
def test_sampling_under_speculation_matches_the_model(mode):
    model = tiny_model("llama", num_layers=4, vocab_size=VOCAB, logit_scale=1.5, seed=3)
    prompt = [0, 1, 2, 3, 1]
    exact = exact_distribution(model, prompt)
    engine = Engine(SkippableModel(model))
    draft = SkipSet(frozenset({1, 2, 3}), frozenset({1, 2}))
    policy = StaticPolicy(ModelInfo(4), DraftConfig(max_draft=3, threshold=0.0), skip=draft)
    counts = {c: 0 for c in exact}
    trials = 1500
    accepted = drafted = 0
    for i in range(trials):
        settings = DecodeSettings(max_new_tokens=NEW, sampling=SamplingParams(temperature=1.0, seed=i, mode=mode))
        out = []
        decoding = engine.decode(prompt, settings, policy)
        while True:
            try:
                out.extend(next(decoding))
            except StopIteration as end:
                accepted += end.value.counters.accepted
                drafted += end.value.counters.drafted
                break
        counts[tuple(out)] += 1
    assert 0.1 < accepted / drafted < 0.95, "the test needs both accepted and rejected drafts"
    keys = sorted(exact)
    observed = np.array([counts[k] for k in keys], dtype=float)
    expected = np.array([exact[k] for k in keys]) * trials
    # merge rare outcomes so every bin expects at least 5
    order = np.argsort(expected)
    obs_sorted, exp_sorted = observed[order], expected[order]
    cut = np.searchsorted(np.cumsum(exp_sorted), 5.0) + 1
    obs = np.concatenate([[obs_sorted[:cut].sum()], obs_sorted[cut:]])
    exp = np.concatenate([[exp_sorted[:cut].sum()], exp_sorted[cut:]])
    assert chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-3
