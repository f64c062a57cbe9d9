"""SWIFT baseline (Xia et al., ICLR 2025, "SWIFT: On-the-Fly Self-Speculative Decoding"),
reimplemented faithfully in this engine for comparison.

- Skips a fixed ratio (0.45) of the attention and MLP sublayers of layers 1..L-2 (the first
  and last layers are kept), starting from every other layer.
- Optimizes on the fly: at every decoding step it scores one candidate set by *matchness*,
  the share of the draft's top-1 predictions on already generated tokens that equal them
  (a teacher-forced probe), and keeps it if it beats the best so far. Candidates are mostly
  uniformly random sets; every 25th step a Gaussian-process Bayesian-optimization suggestion.
- Stops optimizing when the best matchness reaches 0.95, after 300 steps without
  improvement, or after 1000 steps; the state is global across requests.
It is acceptance-driven: nothing here looks at speed, which is the point of the comparison.
"""

from __future__ import annotations

import random

from spirit.policies import gp
from spirit.plan import Plan
from spirit.policies.base import REGISTRY, ModelInfo, Policy
from spirit.skipset import DraftConfig, SkipSet
from spirit.stats import WindowStats

SKIP_RATIO = 0.45
BO_EVERY = 25
TARGET_MATCHNESS = 0.95
MAX_STALE = 300
MAX_STEPS = 1000
BO_POOL = 256  # random candidates the acquisition function chooses among
EXPLOIT_WINDOW = 64  # tokens per window once optimization has stopped


class SwiftPolicy(Policy):
    name = "swift"
    window_tokens = 1  # while optimizing, one window per draft round: one candidate per step

    def __init__(self, model: ModelInfo, base: DraftConfig = DraftConfig(), seed: int = 0) -> None:
        super().__init__(model, base)
        L = model.num_layers
        self.rng = random.Random(seed)
        # positions in the 2L vector (attention bits, then MLP bits) that may be skipped
        self.eligible = [i for i in range(1, L - 1)] + [L + i for i in range(1, L - 1)]
        self.count = round(SKIP_RATIO * len(self.eligible))
        self.best = self._every_other_layer()
        self.best_score = -1.0
        self.steps = 0
        self.stale = 0
        self.optimizing = True
        self.observed: list[tuple[list[int], float]] = []

    def _every_other_layer(self) -> list[int]:
        L = self.model.num_layers
        vec = [0] * (2 * L)
        chosen = [p for p in self.eligible if (p % L) % 2 == 1][: self.count]
        for p in chosen:
            vec[p] = 1
        for p in self.eligible:  # top up if every other layer is not enough
            if sum(vec) >= self.count:
                break
            vec[p] = 1
        return vec

    def _propose(self) -> list[int]:
        L = 2 * self.model.num_layers
        if self.steps % BO_EVERY == BO_EVERY - 1 and len(self.observed) >= 2:
            pool = gp.random_vectors(self.eligible, L, self.count, BO_POOL, self.rng)
            return gp.suggest(self.observed[-200:], pool)
        return gp.random_vectors(self.eligible, L, self.count, 1, self.rng)[0]

    def plan(self) -> Plan:
        """While optimizing: one-token windows, each probing a candidate skip set (carried in
        the plan back to learn()); then 64-token windows of the best."""
        best = SkipSet.from_vector(self.best)
        if not self.optimizing:
            return self.window(self.config(best), EXPLOIT_WINDOW)
        candidate = self.best if self.best_score < 0 else self._propose()
        return self.window(self.config(best, probe=SkipSet.from_vector(candidate)), 1, ("candidate", candidate))

    def learn(self, stats: WindowStats) -> None:
        _, candidate = stats.plan.trial
        if not self.optimizing or stats.probe_agreement is None or candidate is None:
            return
        score = stats.probe_agreement
        self.steps += 1
        self.observed.append((candidate, score))
        if score > self.best_score:
            self.best, self.best_score, self.stale = candidate, score, 0
        else:
            self.stale += 1
        if self.best_score >= TARGET_MATCHNESS or self.stale >= MAX_STALE or self.steps >= MAX_STEPS:
            self.optimizing = False

    def state_dict(self) -> dict:
        return {"best": self.best, "best_score": self.best_score, "steps": self.steps, "stale": self.stale,
                "optimizing": self.optimizing}

    def load_state_dict(self, state: dict) -> None:
        for key in ("best", "best_score", "steps", "stale", "optimizing"):
            if key in state:
                setattr(self, key, state[key])


REGISTRY.register(SwiftPolicy)
