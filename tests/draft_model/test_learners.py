"""The learned draft state, named and owned in one place (draft_model/learners.py)."""

import torch

from spirit.draft_model.learners import SHARED_LEARNER, DraftLearners

VOCAB, HIDDEN = 5000, 8
HEAD = 1000  # prior counts 1000 / (id + 1): one occurrence lifts any id into the top 1000


def learners() -> DraftLearners:
    return DraftLearners(torch.randn(VOCAB, HIDDEN))


def test_a_request_teaches_only_its_own_learner():
    state = learners()
    heads = state.start("mine", [4000, 4001, 4002], always=[4999])
    assert "mine" in state and state.names() == [SHARED_LEARNER, "mine"]
    state.finish("mine", [4003, 4003])
    top = set(heads.table.top(HEAD).tolist())
    assert {4000, 4001, 4002, 4003, 4999} <= top  # its prompt, its output and the pinned end token
    assert 4004 not in top
    assert state.get(SHARED_LEARNER).table.version == 0  # nobody else learned anything


def test_the_reduced_head_follows_what_was_learned():
    state = learners()
    before = state.get("a").head(HEAD).token_ids.tolist()
    state.finish("a", [3000] * 3)
    after = state.get("a").head(HEAD).token_ids.tolist()
    assert 3000 not in before and 3000 in after


def test_forgetting_drops_a_learner_but_never_the_shared_one():
    state = learners()
    state.start("warm-up", [1, 2], always=[])
    state.forget("warm-up")
    state.forget(SHARED_LEARNER)
    assert "warm-up" not in state and SHARED_LEARNER in state
    assert state.get("warm-up").table.version == 0  # fresh again on next use
