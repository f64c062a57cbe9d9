"""The policy contract: a policy's Plan is the only thing the engine reads from it, and the
window's WindowStats carries that same plan back (policies/base.py, plan.py)."""

from __future__ import annotations

import pytest

from spirit.engine import DecodeSettings, Engine
from spirit.model.adapter import SkippableModel
from spirit.plan import Plan
from spirit.policies.base import ModelInfo, Policy
from spirit.skipset import DraftConfig, SkipSet
from spirit.testing import tiny_model

LAYERS = 4


class Numbered(Policy):
    """Windows of 2, 3, 4, ... tokens, alternating plain and a skip draft, each numbered."""

    name = "numbered-test"

    def __init__(self) -> None:
        super().__init__(ModelInfo(LAYERS), DraftConfig(max_draft=3, threshold=0.0))
        self.planned: list[Plan] = []
        self.heard: list = []

    def plan(self) -> Plan:
        n = len(self.planned)
        config = self.config(SkipSet.parse("attn:1") if n % 2 else None)
        self.planned.append(self.window(config, 2 + n, ("window", n)))
        return self.planned[-1]

    def learn(self, stats) -> None:
        self.heard.append(stats)


def test_every_window_reports_the_plan_it_ran():
    engine = Engine(SkippableModel(tiny_model("qwen2", num_layers=LAYERS)))
    policy = Numbered()
    for _ in engine.decode(list(range(10, 30)), DecodeSettings(max_new_tokens=40), policy):
        pass
    assert [s.plan for s in policy.heard] == policy.planned  # one report per plan, in order
    for stats in policy.heard[:-1]:
        # a window closes at the first round that reaches its length (a round may overshoot)
        assert stats.counters.new_tokens >= stats.plan.window_tokens
        assert stats.config is stats.plan.config
    assert policy.heard[-1].final


def test_a_plan_needs_a_positive_window():
    with pytest.raises(ValueError, match="window_tokens must be >= 1"):
        Plan(DraftConfig(), 0)
