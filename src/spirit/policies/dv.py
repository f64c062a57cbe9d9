"""Draft & Verify baseline (Zhang et al., ACL 2024, "Draft & Verify: Lossless Large Language
Model Acceleration via Self-Speculative Decoding"), reimplemented in this engine.

Offline: Bayesian optimization (a Gaussian process over skip masks) of *measured* tokens/s
on a few calibration prompts picks which attention / MLP sublayers to skip. Online: that one
static configuration for every request. It measures speed, like SPIRIT, but once and
offline, so it cannot follow the task, the context length or the machine's state.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from spirit.policies import gp
from spirit.plan import Plan
from spirit.policies.base import REGISTRY, ModelInfo, Policy
from spirit.skipset import DraftConfig, SkipSet

CALIBRATION_TRIALS = 12  # measured configurations, after the initial random designs
INITIAL_DESIGNS = 4
POOL = 256

# Generic calibration prompts, deliberately not taken from any benchmark set.
CALIBRATION_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "A train travels 120 km in 1.5 hours. What is its average speed? Explain step by step.",
    "Summarize the main causes of the French Revolution in a few sentences.",
)


class DraftVerifyPolicy(Policy):
    name = "dv"
    window_tokens = 64
    calibration_prompts = CALIBRATION_PROMPTS

    def __init__(self, model: ModelInfo, base: DraftConfig = DraftConfig(), seed: int = 0,
                 trials: int = CALIBRATION_TRIALS) -> None:
        super().__init__(model, base)
        self.rng = random.Random(seed)
        self.calibration_trials = trials
        self.skip: SkipSet | None = None
        self.trials: list[tuple[list[int], float]] = []

    calibrated = False  # until calibrate() has run (or a profile says it has)

    def calibrate(self, measure: Callable[[SkipSet | None], float], trials: int | None = None) -> None:
        """Bayesian optimization of measure(skip) -> tokens/s; plain decoding is a candidate."""
        trials = self.calibration_trials if trials is None else trials
        L = self.model.num_layers
        eligible = list(range(1, L - 1)) + [L + i for i in range(1, L - 1)]
        baseline = measure(None)
        best_vec, best_speed = None, baseline
        for step in range(trials):
            if step < INITIAL_DESIGNS or len(self.trials) < 2:
                count = self.rng.randint(len(eligible) // 8, len(eligible) // 2)
                vec = gp.random_vectors(eligible, 2 * L, count, 1, self.rng)[0]
            else:
                pool = [v for c in range(len(eligible) // 10, len(eligible) // 2 + 1, 2)
                        for v in gp.random_vectors(eligible, 2 * L, c, POOL // 10, self.rng)]
                vec = gp.suggest(self.trials, pool)
            speed = measure(SkipSet.from_vector(vec))
            self.trials.append((vec, speed / baseline))
            if speed > best_speed:
                best_vec, best_speed = vec, speed
        self.skip = SkipSet.from_vector(best_vec) if best_vec is not None else None
        self.calibrated = True

    def plan(self) -> Plan:
        return self.window(self.config(self.skip))

    def state_dict(self) -> dict:
        return {"skip": str(self.skip) if self.skip else None, "calibrated": self.calibrated, "trials": self.trials}

    def load_state_dict(self, state: dict) -> None:
        self.skip = SkipSet.parse(state["skip"]) if state.get("skip") else None
        self.calibrated = bool(state.get("calibrated"))
        self.trials = [(list(v), s) for v, s in state.get("trials", [])]


REGISTRY.register(DraftVerifyPolicy)
