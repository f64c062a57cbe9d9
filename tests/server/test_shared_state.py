"""What scaled-out replicas share, without Ray: the merge rules of the spirit policy's learned
state, the store, a replica's sync, and the fingerprint check (shared_state.py)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "policies"))  # the policy simulator, sim.py
from sim import Landscape, prompts_of, ratio_peak, run  # noqa: E402

from spirit.policies.base import ModelInfo  # noqa: E402
from spirit.policies.spirit import SpiritPolicy  # noqa: E402
from spirit.server.shared_state import (  # noqa: E402
    Fingerprint,
    FingerprintRegistry,
    PolicySync,
    StateStore,
    fingerprint,
    merge_spirit_state,
    summary,
)

L = 24


def learned(task: int, requests: int, peak: float = 0.3) -> SpiritPolicy:
    policy = SpiritPolicy(ModelInfo(L))
    run(policy, Landscape(ratio_peak(peak)), prompts_of(task, requests), noise=0.01)
    return policy


def test_merging_a_state_with_itself_changes_nothing():
    state = learned(0, 4).state_dict()
    assert merge_spirit_state(state, state) == merge_spirit_state(state, copy.deepcopy(state))
    assert summary(merge_spirit_state(state, state)) == summary(state)
    assert merge_spirit_state(None, state) == state and merge_spirit_state(state, None) == state


def test_a_task_learned_elsewhere_is_used_at_once():
    a, b = learned(0, 5, peak=0.3), learned(1, 5, peak=0.1)
    merged = merge_spirit_state(b.state_dict(), a.state_dict())
    assert summary(merged)["tasks"] == 2
    fresh = SpiritPolicy(ModelInfo(L))
    fresh.load_state_dict(merged)
    # task 0 was learned by `a` alone: a request of it runs a's ratio, with no new search
    log = run(fresh, Landscape(ratio_peak(0.3)), prompts_of(0, 1), noise=0.01)
    ratios = [c.skip.ratio(L) for c in log.configs_of(0) if c.skip is not None]
    assert ratios and all(abs(r - 0.3) <= 0.05 for r in ratios)
    assert len(fresh.profiles) == 2 and not any(h["trial"] == "ratio" for h in fresh.history)
    # the base's tasks keep their places (a live policy's current task stays valid)
    assert merged["profiles"][0] == b.state_dict()["profiles"][0]


def test_the_same_task_keeps_the_profile_with_more_requests():
    few, many = learned(0, 2), learned(0, 6)
    for base, incoming in ((few, many), (many, few)):
        merged = merge_spirit_state(base.state_dict(), incoming.state_dict())
        assert summary(merged) == {"tasks": 1, "task_requests": 6}


def test_another_machines_round_costs_are_not_taken():
    base, incoming = learned(0, 3).state_dict(), learned(0, 4).state_dict()
    base["costs"] = {"machine": "xeon", "costs": {}, "shared": {}}
    incoming["costs"] = {"machine": "epyc", "costs": {"arm": {"factor": 2.0, "windows": 9}}, "shared": {}}
    assert merge_spirit_state(base, incoming)["costs"]["costs"] == {}


def test_the_store_versions_merges_and_says_when_there_is_news():
    store = StateStore()
    state = learned(0, 3).state_dict()
    first = store.publish("spirit", state)
    assert first.version == 1 and first.state is None  # nothing the publisher lacks
    assert store.publish("spirit", state).version == 1  # no change, no new version
    assert store.pull("spirit", store.epoch, 1).state is None
    assert store.pull("spirit", store.epoch, 0).state is not None
    assert store.pull("spirit", "another epoch", 1).state is not None  # a replica of a lost store
    other = store.publish("spirit", learned(1, 3).state_dict())
    assert other.version == 2 and summary(other.state)["tasks"] == 2
    with pytest.raises(ValueError, match="no merge rule"):
        store.publish("swift", {})


class Flaky:
    """A store that can be lost and made again, as a killed actor is."""

    def __init__(self) -> None:
        self.store, self.up = StateStore(), True

    def connect(self) -> "Flaky":
        return self

    def _reach(self) -> StateStore:
        if not self.up:
            raise ConnectionError("store actor is gone")
        return self.store

    def publish(self, method, state):
        return self._reach().publish(method, state)

    def pull(self, method, epoch, version):
        return self._reach().pull(method, epoch, version)


def test_a_replica_publishes_pulls_and_survives_a_lost_store():
    remote = Flaky()
    remote.store.publish("spirit", learned(1, 4).state_dict())
    policy = learned(0, 3)
    sync = PolicySync("spirit", remote.connect)
    sync.first_pull(policy)
    assert summary(policy.state_dict())["tasks"] == 2  # started from what others learned
    sync.attach(policy)
    run(policy, Landscape(ratio_peak(0.3)), prompts_of(0, 1), noise=0.01)  # end_request snapshots
    sync.sync_once()
    assert summary(remote.store.states["spirit"])["tasks"] == 2 and sync.status.publishes == 1
    remote.up = False  # the actor is lost: serving goes on from local state
    sync.sync_once()
    assert not sync.status.connected and sync.status.errors == 1
    remote.store, remote.up = StateStore(), True  # made again, empty, with a new epoch
    sync.sync_once()
    sync.sync_once()
    assert sync.status.connected and summary(remote.store.states["spirit"])["tasks"] == 2


def test_the_first_fingerprint_of_a_deployment_is_the_one_every_replica_needs():
    registry = FingerprintRegistry()
    ours = Fingerprint("m", "sha256:aa", "int4", "bfloat16")
    theirs = Fingerprint("m", "sha256:bb", "int4", "bfloat16")
    assert registry.register("g1", ours) is None and registry.register("g1", ours) is None
    assert registry.register("g1", theirs) == ours
    assert registry.register("g2", theirs) is None  # another deployment
    assert theirs.differences(ours) == ["weights_digest: sha256:bb != sha256:aa"]


def test_fingerprints_follow_the_weights():
    from spirit.testing import tiny_spirit

    a, b, c = (fingerprint(tiny_spirit("llama", num_layers=2, seed=s)) for s in (0, 0, 1))
    assert a == b and a != c and a.weights_digest.startswith("tensors:")


def test_a_state_the_policy_cannot_take_leaves_it_as_it_was():
    remote = Flaky()
    policy = learned(0, 3)
    before = summary(policy.state_dict())
    sync = PolicySync("spirit", remote.connect)
    sync._inbox = {"profiles": [{"no such field": 1}], "index": {"centroids": [[1.0]], "counts": [1]}}
    sync.apply(policy)
    assert summary(policy.state_dict()) == before and sync.status.merges == 0
