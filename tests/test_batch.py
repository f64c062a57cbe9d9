"""Continuous batching (batch.py): each request's output equals its solo decoding (tiny float32
models of every architecture; plain steps, chain and tree drafts, prompt lookup; requests
joining and leaving mid-decode), and the per-round draft budget on simulated costs.

Where the load-time check finds the kernels row-invariant this equality is bit for bit by
construction (each row's linear outputs are a fixed per-row function and its attention reads
only its own cache); float32 tiny models are not row-invariant on every CPU (not on an AVX-512
EPYC), and there the check is the greedy tokens, as in the other lossless tests."""

import functools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spirit.batch import Batch, DraftDemand, PassCostModel, allot_drafts
from spirit.engine import DecodeSettings, Engine
from spirit.model.adapter import SkippableModel
from spirit.policies.base import LookupPolicy, ModelInfo, StaticPolicy, VanillaPolicy
from spirit.proposers.self_draft import ChainDraft, draft_layerskip, draft_together
from spirit.skipset import DraftConfig, SkipSet
from spirit.testing import ARCHITECTURES, decode_all, tiny_model

LAYERS = 4
INFO = ModelInfo(LAYERS)


@functools.cache
def engine(arch: str) -> Engine:
    return Engine(SkippableModel(tiny_model(arch, num_layers=LAYERS)))


POLICIES = {
    "vanilla": lambda: VanillaPolicy(INFO),
    "chain": lambda: StaticPolicy(INFO, DraftConfig(max_draft=4), skip=SkipSet(attn=frozenset({1}), mlp=frozenset({2}))),
    "tree": lambda: StaticPolicy(INFO, DraftConfig(max_draft=6, branches=2, branch_below=0.99),
                                 skip=SkipSet(mlp=frozenset({1, 2}))),
    "lookup": lambda: LookupPolicy(INFO),
}


def run_batched(eng: Engine, requests: list[tuple[list[int], int, str]], max_batch: int, join_every: int = 1):
    """Decode `requests` (prompt, max_new_tokens, policy name) through one Batch: a waiting
    request joins every `join_every` steps while there is room. Returns each one's tokens."""
    batch = Batch(eng, max_batch)
    outputs: list[list[int]] = [[] for _ in requests]
    finished: list[bool] = [False] * len(requests)
    waiting = list(range(len(requests)))
    steps = 0
    while waiting or len(batch):
        if waiting and not batch.full and steps % join_every == 0:
            i = waiting.pop(0)
            prompt, n, policy = requests[i]
            decoding = eng.start(prompt, DecodeSettings(max_new_tokens=n), POLICIES[policy]())
            batch.add(decoding, emit=lambda ids, i=i: outputs[i].extend(ids) or True,
                      done=lambda stats, i=i: finished.__setitem__(i, True))
        batch.step()
        steps += 1
        assert steps < 5000
    assert all(finished)
    return outputs, batch


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_batched_outputs_equal_solo_outputs(arch):
    eng = engine(arch)
    rng = random.Random(arch)
    unit = [rng.randrange(256) for _ in range(3)]
    requests = [
        ([rng.randrange(256) for _ in range(9)], 20, "vanilla"),
        (unit * 5, 24, "lookup"),
        ([rng.randrange(256) for _ in range(14)], 17, "chain"),
        ([rng.randrange(256) for _ in range(5)], 22, "tree"),
        ([rng.randrange(256) for _ in range(7)], 3, "chain"),  # leaves early
        (unit * 3 + [7], 19, "vanilla"),
    ]
    solo = [decode_all(eng, prompt, n, POLICIES[policy]())[0] for prompt, n, policy in requests]
    batched, batch = run_batched(eng, requests, max_batch=3, join_every=2)
    assert batched == solo
    assert batch.stats.most_requests > 1  # passes did pack several requests


def test_a_long_prompt_is_prefilled_in_chunks_and_matches_solo():
    from spirit.engine import PREFILL_CHUNK

    eng = engine("qwen2")
    rng = random.Random(5)
    long_prompt = [rng.randrange(256) for _ in range(PREFILL_CHUNK * 2 + 11)]
    requests = [([1, 2, 3], 30, "vanilla"), (long_prompt, 12, "chain")]
    solo = [decode_all(eng, prompt, n, POLICIES[policy]())[0] for prompt, n, policy in requests]
    batched, batch = run_batched(eng, requests, max_batch=2)
    assert batched == solo
    assert batch.stats.prefill_chunks >= 3 + 1  # three chunks of the long prompt, one of the short


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), max_batch=st.integers(1, 4), join_every=st.integers(1, 3))
def test_any_mix_of_requests_and_joins_equals_solo(seed, max_batch, join_every):
    eng = engine("llama")
    rng = random.Random(seed)
    requests = [([rng.randrange(256) for _ in range(rng.randint(1, 12))], rng.randint(1, 16), rng.choice(list(POLICIES)))
                for _ in range(rng.randint(1, 5))]
    solo = [decode_all(eng, prompt, n, POLICIES[policy]())[0] for prompt, n, policy in requests]
    batched, _ = run_batched(eng, requests, max_batch, join_every)
    assert batched == solo


def test_a_request_that_asks_to_stop_leaves_the_batch():
    eng = engine("llama")
    batch = Batch(eng, 2)
    got, ended = [], []
    batch.add(eng.start([5, 6, 7], DecodeSettings(max_new_tokens=50), VanillaPolicy(INFO)),
              emit=lambda ids: got.extend(ids) or len(got) < 4, done=ended.append)
    while len(batch):
        batch.step()
    assert 4 <= len(got) < 50 and len(ended) == 1 and ended[0].new_tokens == len(got)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_chains_drafted_together_are_the_chains_drafted_alone(arch):
    """Packed draft steps (draft_together) give each request the tree its chain gives alone:
    chains of different lengths, ending at different steps, with and without branches."""
    eng = engine(arch)
    rng = random.Random(arch + "chains")
    skip = SkipSet(attn=frozenset({2}), mlp=frozenset({1}))
    configs = [DraftConfig(skip=skip, max_draft=5, threshold=0.0), DraftConfig(skip=skip, max_draft=2),
               DraftConfig(skip=skip, max_draft=6, threshold=0.0, branches=2, branch_below=0.99)]
    starts = []
    for n in (9, 4, 13):
        decoding = eng.start([rng.randrange(256) for _ in range(n)], DecodeSettings(max_new_tokens=10), VanillaPolicy(INFO))
        while decoding.prefilling:
            decoding.prefill_chunk()
        starts.append(decoding)
    sampling = starts[0].settings.sampling
    alone = [draft_layerskip(eng.model, d.ids, d.cache, config, sampling, None, config.max_draft).tokens
             for d, config in zip(starts, configs)]
    chains = [ChainDraft(d.ids, d.cache, config, sampling, None, config.max_draft) for d, config in zip(starts, configs)]
    draft_together(eng.model, chains)
    assert [chain.tree().tokens for chain in chains] == alone
    assert len(chains[0].chain) == 5 and len(chains[1].chain) <= 2 and len(chains[2].chain) == 6
    with pytest.raises(ValueError, match="same sublayers"):
        draft_together(eng.model, [ChainDraft(starts[0].ids, starts[0].cache, DraftConfig(skip=SkipSet(mlp=frozenset({3}))),
                                              sampling, None, 2), *chains])


def test_a_batch_drafts_the_requests_that_share_a_configuration_together():
    """Where the budget gives several requests drafts of one configuration, their chains run
    in packed passes (one group per round), and every output still equals solo decoding."""
    eng = engine("qwen2")
    rng = random.Random(11)
    requests = [([rng.randrange(256) for _ in range(rng.randint(3, 10))], 18, "chain") for _ in range(4)]
    requests.append(([rng.randrange(256) for _ in range(6)], 15, "tree"))  # another configuration: its own group
    solo = [decode_all(eng, prompt, n, POLICIES[policy]())[0] for prompt, n, policy in requests]
    batch = Batch(eng, len(requests))
    batch.pass_costs.predict = lambda rows: 1.0  # verifying rows is free: every request is given drafts
    outputs: list[list[int]] = [[] for _ in requests]
    for i, (prompt, n, policy) in enumerate(requests):
        batch.add(eng.start(prompt, DecodeSettings(max_new_tokens=n), POLICIES[policy]()),
                  emit=lambda ids, i=i: outputs[i].extend(ids) or True, done=lambda stats: None)
    while len(batch):
        batch.step()
    assert outputs == solo
    assert batch.stats.drafts_together > batch.stats.draft_groups > 0  # some groups held several requests


# -- the draft budget on simulated costs ---------------------------------------------------------


def test_rows_that_cost_nothing_go_to_the_drafts_that_pay():
    flat = lambda rows: 1.0  # noqa: E731 - verifying more rows is free (AVX-512 BF16 up to 16 rows)
    demands = [DraftDemand(4, 0.8), DraftDemand(4, 0.0), DraftDemand(0, 0.9)]
    assert allot_drafts(demands, flat, max_rows=64) == [4, 0, 0]


def test_rows_that_cost_a_full_step_each_get_no_drafts():
    linear = lambda rows: float(rows)  # noqa: E731 - every row costs a plain step (bf16 on AVX2)
    assert allot_drafts([DraftDemand(6, 0.7), DraftDemand(6, 0.9)], linear, max_rows=64) == [0, 0]


def test_the_budget_goes_to_the_best_acceptance_and_stops_at_the_cap():
    cheap = lambda rows: 1.0 + 0.05 * rows  # noqa: E731
    drafts = allot_drafts([DraftDemand(8, 0.3), DraftDemand(8, 0.9)], cheap, max_rows=8)
    assert drafts[1] > drafts[0] and sum(drafts) + 2 <= 8


def test_drafting_cost_counts_against_a_request():
    flat = lambda rows: 1.0  # noqa: E731
    assert allot_drafts([DraftDemand(4, 0.6, draft_cost_s=0.0)], flat, 64) == [4]
    assert allot_drafts([DraftDemand(4, 0.6, draft_cost_s=2.0)], flat, 64) == [0]


def test_expected_tokens_of_a_chain():
    assert DraftDemand(3, 0.0).expected_tokens(3) == pytest.approx(1.0)
    assert DraftDemand(3, 0.5).expected_tokens(2) == pytest.approx(1.75)


def test_pass_costs_learn_online_and_scale_by_the_seed_shape():
    model = PassCostModel(seed=lambda rows: 10.0 + rows)
    assert model.predict(4) == 14.0  # before any pass: the seed
    model.observe(2, 6.0)
    assert model.predict(2) == 6.0
    assert model.predict(10) == pytest.approx(6.0 * 20 / 12)  # the nearest measurement, scaled
    model.observe(2, 16.0)
    assert 6.0 < model.predict(2) < 16.0  # a moving average


def test_a_request_allotted_no_drafts_does_not_probe_its_draft():
    """A window whose configuration probes its draft (teacher-forced agreement) runs the probe
    only in a round that may draft: alone (no allotment), or allotted at least one token."""
    class ProbingPolicy(StaticPolicy):
        def plan(self):
            return self.window(self.config(self.skip, probe=self.skip))

    eng = engine("llama")
    prompt = [random.Random(3).randrange(200) for _ in range(12)]
    for limit, probes in ((0, False), (1, True), (None, True)):
        policy = ProbingPolicy(INFO, DraftConfig(max_draft=4), skip=SkipSet(mlp=frozenset({1})))
        decoding = eng.start(prompt, DecodeSettings(max_new_tokens=8), policy)
        while decoding.prefilling:
            decoding.prefill_chunk()
        decoding.propose(limit)
        assert (decoding.counters().probe_time_s > 0) is probes, limit


def test_a_bad_batch_size_is_refused():
    with pytest.raises(ValueError, match="max_batch"):
        Batch(engine("llama"), 0)
