"""Token trees, prompt lookup and reduced draft heads are lossless: greedy output equals plain
decoding (float32, tiny models of every architecture), and the committed KV cache after tree
rounds equals a plain prefill of the committed tokens."""

import functools
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spirit.draft_model.vocab import DraftHead
from spirit.engine import Engine
from spirit.model.adapter import SkippableModel
from spirit.plan import Plan
from spirit.policies.base import LookupPolicy, ModelInfo, Policy, StaticPolicy
from spirit.skipset import DraftConfig, SkipSet, random_skipset
from spirit.testing import ARCHITECTURES, decode_all, tiny_model

LAYERS = 6
VOCAB = 264  # tiny_model's vocabulary
EXAMPLES = dict(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@functools.cache
def model(arch: str) -> SkippableModel:
    return SkippableModel(tiny_model(arch, num_layers=LAYERS))


@functools.cache
def engine(arch: str) -> Engine:
    return Engine(model(arch))


decode = decode_all


@functools.lru_cache(maxsize=None)
def vanilla(arch: str, prompt: tuple[int, ...], n: int) -> list[int]:
    return decode(engine(arch), list(prompt), n, None)[0]


def speculative(arch, prompt, n, policy):
    out, stats = decode(engine(arch), prompt, n, policy)
    assert len(out) == n
    return out, stats


skip_sets = st.builds(SkipSet, st.frozensets(st.integers(0, LAYERS - 1)), st.frozensets(st.integers(0, LAYERS - 1)))
prompts = st.lists(st.integers(0, 255), min_size=1, max_size=24)
# prompts that repeat a short unit, so prompt lookup finds matches from the start
repeating = st.builds(lambda unit, times, tail: unit * times + tail,
                      st.lists(st.integers(0, 255), min_size=2, max_size=5), st.integers(2, 5),
                      st.lists(st.integers(0, 255), max_size=3))
draft_vocabs = st.sampled_from([16, 33, 64, 100, 200])


@pytest.mark.parametrize("arch", ARCHITECTURES)
@settings(**EXAMPLES)
@given(skip=skip_sets, prompt=prompts, n=st.integers(1, 40), vocab=draft_vocabs,
       max_draft=st.integers(1, 8), threshold=st.sampled_from([0.0, 0.5, 0.8]))
def test_reduced_draft_head_equals_vanilla(arch, skip, prompt, n, vocab, max_draft, threshold):
    config = DraftConfig(max_draft=max_draft, threshold=threshold, draft_vocab=vocab)
    out, _ = speculative(arch, prompt, n, StaticPolicy(ModelInfo(LAYERS), config, skip=skip))
    assert out == vanilla(arch, tuple(prompt), n)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@settings(**EXAMPLES)
@given(skip=skip_sets, prompt=prompts, n=st.integers(1, 40), branches=st.integers(2, 4),
       branch_below=st.sampled_from([0.5, 0.9, 1.0]), vocab=st.sampled_from([0, 16, 100]),
       max_draft=st.integers(1, 8), threshold=st.sampled_from([0.0, 0.5, 0.8]))
def test_branching_trees_equal_vanilla(arch, skip, prompt, n, branches, branch_below, vocab, max_draft, threshold):
    config = DraftConfig(max_draft=max_draft, threshold=threshold, branches=branches,
                         branch_below=branch_below, draft_vocab=vocab)
    out, _ = speculative(arch, prompt, n, StaticPolicy(ModelInfo(LAYERS), config, skip=skip))
    assert out == vanilla(arch, tuple(prompt), n)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@settings(**EXAMPLES)
@given(prompt=repeating, n=st.integers(1, 40), ngram_tokens=st.integers(1, 12), branches=st.integers(1, 4),
       max_draft=st.integers(1, 25))
def test_lookup_policy_equals_vanilla(arch, prompt, n, ngram_tokens, branches, max_draft):
    config = DraftConfig(ngram=True, ngram_tokens=ngram_tokens, branches=branches, max_draft=max_draft)
    out, stats = speculative(arch, prompt, n, LookupPolicy(ModelInfo(LAYERS), config))
    assert out == vanilla(arch, tuple(prompt), n)
    assert stats.counters.lookup_rounds == stats.counters.draft_rounds  # no model draft at all


@pytest.mark.parametrize("arch", ARCHITECTURES)
@settings(**EXAMPLES)
@given(skip=skip_sets, prompt=st.one_of(repeating, prompts), n=st.integers(1, 40),
       ngram_tokens=st.integers(1, 10), vocab=st.sampled_from([0, 16, 64, 200]), branches=st.integers(1, 4),
       branch_below=st.sampled_from([0.5, 0.9, 1.0]), threshold=st.sampled_from([0.0, 0.5, 0.8]))
def test_mixed_levers_equal_vanilla(arch, skip, prompt, n, ngram_tokens, vocab, branches, branch_below, threshold):
    config = DraftConfig(max_draft=8, threshold=threshold, ngram=True, ngram_tokens=ngram_tokens,
                         draft_vocab=vocab, branches=branches, branch_below=branch_below)
    out, _ = speculative(arch, prompt, n, StaticPolicy(ModelInfo(LAYERS), config, skip=skip))
    assert out == vanilla(arch, tuple(prompt), n)


# -- the paths above are really taken ---------------------------------------------------------


def test_lookup_drafts_are_found_and_accepted():
    prompt = [5, 6, 7, 8] * 5
    config = DraftConfig(ngram=True, ngram_tokens=6, branches=2)
    out, stats = speculative("llama", prompt, 40, LookupPolicy(ModelInfo(LAYERS), config))
    assert out == vanilla("llama", tuple(prompt), 40)
    assert stats.counters.lookup_rounds > 0 and stats.counters.accepted > 0


def test_the_reduced_head_is_what_the_draft_scores(monkeypatch):
    sizes = []
    real = DraftHead.logits

    def logits(head, hidden, capped):
        sizes.append(head.token_ids.numel())
        out = real(head, hidden, capped)
        assert torch.isinf(out).sum() == VOCAB - head.token_ids.numel()
        return out

    monkeypatch.setattr(DraftHead, "logits", logits)
    prompt = list(range(40, 60))
    config = DraftConfig(max_draft=4, threshold=0.0, draft_vocab=33, branches=3, branch_below=1.0)
    out, _ = speculative("qwen2", prompt, 24, StaticPolicy(ModelInfo(LAYERS), config, skip=SkipSet.parse("attn:2;mlp:3")))
    monkeypatch.undo()
    assert sizes and set(sizes) == {33}  # every draft pass scored the reduced head
    assert out == vanilla("qwen2", tuple(prompt), 24)


# -- the KV cache after tree rounds ------------------------------------------------------------


class RandomTreePolicy(Policy):
    """A new random configuration every 3 tokens: skip set (or lookup alone, or vanilla),
    branches, draft vocabulary, lookup."""

    name = "random-tree-test"
    window_tokens = 3

    def __init__(self, seed: int) -> None:
        super().__init__(ModelInfo(LAYERS), DraftConfig(max_draft=6, threshold=0.0))
        self.rng = random.Random(seed)

    def plan(self) -> Plan:
        r = self.rng
        choice = r.random()
        skip = None if choice < 0.2 else random_skipset(LAYERS, r.uniform(0.1, 0.6), r)
        return self.window(self.config(
            skip, ngram=choice < 0.1 or r.random() < 0.3, ngram_tokens=r.randint(1, 8),
            branches=r.randint(1, 4), branch_below=r.choice([0.5, 0.9, 1.0]),
            draft_vocab=r.choice([0, 0, 16, 100]), threshold=r.choice([0.0, 0.5]),
        ))


def decode_capturing_cache(arch, prompt, n, policy):
    """Decode, keeping the engine's KV cache and every non-trivial keep_path call."""
    m = model(arch)
    captured, moves = {}, []
    original = m.new_cache

    def new_cache(capacity):
        cache = original(capacity)
        real_keep = cache.keep_path

        def keep_path(start, slots):
            if any(s != start + j for j, s in enumerate(slots)):
                moves.append((start, list(slots)))
            real_keep(start, slots)

        cache.keep_path = keep_path
        captured["cache"] = cache
        return cache

    m.new_cache = new_cache
    try:
        out, _ = decode(Engine(m), prompt, n, policy)
    finally:
        m.new_cache = original
    return out, captured["cache"], moves


def assert_cache_is_a_plain_prefill(arch, ids, cache):
    m = model(arch)
    committed = len(ids) - 1  # the last token is pending, never in the cache
    reference = m.new_cache(committed + 1)
    m.forward(torch.tensor([ids[:committed]]), 0, reference, SkipSet())
    for layer in range(LAYERS):
        k, v = cache.committed_view(layer, committed)
        k_ref, v_ref = reference.committed_view(layer, committed)
        torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, v_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_accepted_leaves_move_their_kv_into_place(arch):
    """Branching drafts whose leaves get accepted: keep_path really moves rows, and the
    committed cache is still exactly the plain prefill's."""
    prompt = list(range(30, 50))
    config = DraftConfig(max_draft=6, threshold=0.0, branches=4, branch_below=1.0)
    policy = StaticPolicy(ModelInfo(LAYERS), config, skip=SkipSet.parse("mlp:1,2,3,4"))
    out, cache, moves = decode_capturing_cache(arch, prompt, 48, policy)
    assert moves, "no accepted off-chain node: keep_path was never exercised"
    assert out == vanilla(arch, tuple(prompt), 48)
    assert_cache_is_a_plain_prefill(arch, prompt + out, cache)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3"])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), prompt_len=st.integers(2, 24), n=st.integers(2, 40))
def test_cache_after_random_tree_rounds_equals_plain_prefill(arch, seed, prompt_len, n):
    rng = random.Random(seed)
    unit = [rng.randrange(256) for _ in range(rng.randint(2, 5))]
    prompt = (unit * prompt_len)[:prompt_len] if rng.random() < 0.5 else [rng.randrange(256) for _ in range(prompt_len)]
    out, cache, _ = decode_capturing_cache(arch, prompt, n, RandomTreePolicy(seed))
    assert out == vanilla(arch, tuple(prompt), n)
    assert_cache_is_a_plain_prefill(arch, prompt + out, cache)
