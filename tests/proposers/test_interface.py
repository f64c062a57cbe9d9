"""The draft-source interface: a new source is one file and one line in proposers.SOURCES.

The example source below lives only here. It guesses that the last token repeats (right on
repetitive text, wrong elsewhere: both paths of verification run) and counts the feedback it
hears. Output must equal plain decoding whatever it guesses.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spirit import proposers
from spirit.engine import Engine
from spirit.model.adapter import SkippableModel
from spirit.policies.base import ModelInfo, Policy
from spirit.proposers import DraftContext, Proposer
from spirit.skipset import DraftConfig
from spirit.testing import decode_all, tiny_model
from spirit.tree import DraftTree

LAYERS = 4


class RepeatLast(Proposer):
    name = "repeat"
    model_free = True

    def __init__(self, resources) -> None:
        super().__init__(resources)
        self.heard: list[int] = []  # accepted tokens per round

    def propose(self, context: DraftContext, budget: int) -> DraftTree:
        return DraftTree.chain(context.ids[-1], [context.ids[-1]] * min(3, budget))

    def accepted(self, tree: DraftTree, path: Sequence[int]) -> None:
        assert all(tree.tokens[node] == tree.root for node in path)
        self.heard.append(len(path))


class AlwaysRepeat(Policy):
    name = "always-repeat"

    def plan(self):
        return self.window(self.config(None, sources=("repeat",)))


decode = decode_all


@pytest.fixture(scope="module")
def engines():
    model = SkippableModel(tiny_model("llama", num_layers=LAYERS))
    plain = Engine(model)
    extended = Engine(model)
    extended.sources = proposers.SOURCES + (RepeatLast,)  # the one place that lists sources
    return plain, extended


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(0, 255), min_size=1, max_size=16), n=st.integers(1, 30))
def test_a_new_source_plugs_in_and_stays_lossless(engines, prompt, n):
    plain, extended = engines
    expected, _ = decode(plain, prompt, n, None)
    out, stats = decode(extended, prompt, n, AlwaysRepeat(ModelInfo(LAYERS)))
    assert out == expected
    if n > 2:  # a round needs room for a draft and the token after it
        assert stats.counters.draft_rounds > 0 and stats.counters.lookup_rounds == stats.counters.draft_rounds


def test_a_source_hears_what_was_accepted(engines):
    _, extended = engines
    heard = []

    class Listening(RepeatLast):
        def accepted(self, tree, path):
            super().accepted(tree, path)
            heard.append(list(path))

    extended.sources = proposers.SOURCES + (Listening,)
    try:
        _, stats = decode(extended, [7, 7, 7, 7], 12, AlwaysRepeat(ModelInfo(LAYERS)))
    finally:
        extended.sources = proposers.SOURCES + (RepeatLast,)
    assert len(heard) == stats.counters.draft_rounds
    assert sum(len(p) for p in heard) == stats.counters.accepted


def test_sources_are_asked_in_listed_order_and_the_first_guess_wins(engines):
    """With lookup and the example both on, a lookup match takes the round: the example is
    asked only in rounds where lookup found nothing."""
    _, extended = engines
    asked = []

    class Counting(RepeatLast):
        def propose(self, context, budget):
            asked.append(len(context.ids))
            return super().propose(context, budget)

    class LookupAndRepeat(Policy):
        name = "both"

        def plan(self):
            return self.window(self.config(None, ngram=True, sources=("repeat",)))

    extended.sources = proposers.SOURCES + (Counting,)
    try:
        _, stats = decode(extended, [1, 2, 3, 4] * 4, 12, LookupAndRepeat(ModelInfo(LAYERS)))
    finally:
        extended.sources = proposers.SOURCES + (RepeatLast,)
    # every round the example was asked in, it drafted; the others were lookup's
    assert stats.counters.draft_rounds - len(asked) > 0


def test_a_config_naming_an_unknown_source_is_refused(engines):
    plain, _ = engines
    with pytest.raises(ValueError, match="unknown draft source 'repeat'"):
        decode(plain, [1, 2, 3], 4, AlwaysRepeat(ModelInfo(LAYERS)))


def test_source_names_and_descriptions():
    assert proposers.source_names() == ("lookup", "self")
    assert DraftConfig(sources=("repeat",)).speculative
    assert "+repeat" in DraftConfig(sources=("repeat",)).describe(LAYERS)
