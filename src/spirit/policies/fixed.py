"""`fixed`: spirit's draft levers at one configuration, with no online policy.

It runs exactly `SpiritPolicy.default_draft` (int4 draft MLPs, the reduced draft head,
token trees, the 0.5 threshold, prompt lookup first) for every window of every request and
never adapts, so a benchmark that runs both shows what spirit's policy itself adds on top of
its draft sources (and what it costs, since searching runs slower arms now and then).
"""

from __future__ import annotations

from spirit.plan import Plan
from spirit.policies.base import REGISTRY, Policy
from spirit.policies.spirit import SpiritPolicy
from spirit.skipset import DraftConfig, SkipSet


class FixedPolicy(Policy):
    name = "fixed"
    default_draft = SpiritPolicy.default_draft
    window_tokens = 64  # windows only report here: nothing is decided between them

    def plan(self) -> Plan:
        # The configuration is spirit's ratio-0 arm: the quantized draft skipping no sublayer,
        # prompt lookup first. It is the arm spirit's first search starts from and the one that
        # measured fastest on most tasks (docs/benchmarks/), and it needs no choice of sublayers
        # to skip: any skip set would be a per-model, per-task tuning, which is the policy's
        # work this method leaves out. As in SpiritPolicy._arm, skipping nothing without a
        # quantized draft is no model draft (lookup alone, or plain decoding without lookup).
        return self.window(self.config(SkipSet() if self.base.draft_bits else None))


REGISTRY.register(FixedPolicy)
