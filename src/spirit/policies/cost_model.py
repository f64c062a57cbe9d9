"""Predicted speed of a draft arm: the machine's cost of a round, the task's acceptance.

SPIRIT's decomposition: speculation's speed relative to plain decoding is what a draft round
commits (the task's: how much of the draft the target accepts) over what a round costs (the
machine's: a draft pass at some fraction of a plain step, and a verification pass over
several rows, which on an AVX2-only CPU costs several plain steps). A window of decoding
with R draft rounds and P plain steps (rounds whose draft found nothing) commits
R*tau + P tokens in R*rho + P plain-step times, so

    speed = (h*tau + 1 - h) / (h*rho + 1 - h),   h = R / (R + P)

with tau = accepted/R + 1 tokens per round and rho a round's cost in plain steps. tau, h and
the drafted tokens per round d are learned per task (`Acceptance`); rho is learned across
tasks per arm (`ArmCost`): this machine's pass costs from the hardware probe (machine.py)
predict it for any d, and windows correct that prediction by a measured factor. Without a
probe, rho is the measured figure alone.

Plain Python, no torch: a policy's state.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from spirit.machine import PassCosts
from spirit.skipset import DraftConfig
from spirit.stats import WindowStats

EMA = 0.3  # weight of a new window in the running figures
# Before any task measured an arm: what a first search assumes it accepts. Only the cost side
# differs between machines, so these decide nothing where verifying is cheap (AVX-512 BF16:
# every arm predicts a gain and is measured) and keep a machine where it is not (AVX2: a
# 4-row pass costs ~3 plain steps) from paying for trials that cannot win.
PRIOR_DRAFTED = 3.0  # tokens per round
PRIOR_MODEL_ACCEPTANCE = 0.8  # per drafted token, a draft that skips nothing (ratio 0) ...
PRIOR_ACCEPTANCE_DROP = 1.5  # ... less this much per unit of skip ratio
PRIOR_LOOKUP_SHARE = 0.4  # share of steps on which prompt lookup finds a match
PRIOR_LOOKUP_ACCEPTANCE = 0.4


@dataclass
class Acceptance:
    """What one arm's drafts achieve on one task (running means over its windows)."""

    tokens_per_round: float  # tau: accepted draft tokens + the target's own token
    drafted_per_round: float  # d
    round_share: float  # h: share of steps that were draft rounds
    lookup_share: float = 0.0  # share of rounds drafted by prompt lookup
    windows: int = 1

    def update(self, other: "Acceptance") -> None:
        for name in ("tokens_per_round", "drafted_per_round", "round_share", "lookup_share"):
            setattr(self, name, (1 - EMA) * getattr(self, name) + EMA * getattr(other, name))
        self.windows += 1


@dataclass
class ArmCost:
    """A round's cost on this machine, across tasks: measured over predicted (with a probe),
    or the measured cost in plain steps (without)."""

    factor: float
    windows: int = 1


def arm_key(config: DraftConfig, num_layers: int) -> str:
    """Arms that cost alike: skip ratio, lookup, quantized bits, vocabulary, branches."""
    ratio = config.skip.ratio(num_layers) if config.skip else 0.0
    model = "model" if config.skip is not None else "none"
    return f"{ratio:.2f}/{model}/lookup={int(config.ngram)}/bits={config.draft_bits}/vocab={config.draft_vocab}/b={config.branches}"


def window_figures(stats: WindowStats, plain_step_s: float) -> tuple[Acceptance, float] | None:
    """The acceptance a speculative window showed and its rounds' cost in plain steps; None
    for a window without draft rounds (nothing to say about a round)."""
    c = stats.counters
    rounds = c.draft_rounds
    if rounds == 0 or plain_step_s <= 0:
        return None
    plain_steps = max(0, c.new_tokens - c.accepted - rounds)
    round_cost = max(1e-3, (stats.wall_time_s / plain_step_s - plain_steps) / rounds)
    acceptance = Acceptance(
        tokens_per_round=c.accepted / rounds + 1,
        drafted_per_round=c.drafted / rounds,
        round_share=rounds / (rounds + plain_steps),
        lookup_share=c.lookup_rounds / rounds,
    )
    return acceptance, round_cost


def speed(acceptance: Acceptance, round_cost: float) -> float:
    """Relative to plain decoding (1.0)."""
    h = acceptance.round_share
    return (h * acceptance.tokens_per_round + 1 - h) / (h * round_cost + 1 - h)


@dataclass
class CostModel:
    """Round costs per arm (the machine's), and each arm's acceptance averaged over the tasks
    that measured it (a new task's prior)."""

    num_layers: int
    vocab: int = 0
    probe: PassCosts | None = None
    costs: dict[str, ArmCost] = field(default_factory=dict)
    shared: dict[str, Acceptance] = field(default_factory=dict)

    # -- prediction ------------------------------------------------------------------------

    def predicted_round_cost(self, config: DraftConfig, acceptance: Acceptance) -> float | None:
        """A round's cost in plain steps from the probe alone (None without one)."""
        if self.probe is None:
            return None
        verify = self.probe.verify(acceptance.drafted_per_round + 1)
        if config.skip is None:
            return verify  # prompt lookup: no draft pass
        skip, layers = config.skip, self.num_layers
        vocab_fraction = min(1.0, config.draft_vocab / self.vocab) if config.draft_vocab and self.vocab else 1.0
        step = self.probe.draft_step(1 - len(skip.attn) / layers, 1 - len(skip.mlp) / layers, config.draft_bits, vocab_fraction)
        # a tree drafts its runner-up leaves in the pass that drafts their parent
        passes = acceptance.drafted_per_round / (1 + 0.5 * (config.branches - 1))
        return acceptance.lookup_share * verify + (1 - acceptance.lookup_share) * (passes * step + verify)

    def round_cost(self, config: DraftConfig, acceptance: Acceptance) -> float | None:
        key = arm_key(config, self.num_layers)
        predicted = self.predicted_round_cost(config, acceptance)
        measured = self.costs.get(key)
        if predicted is None:
            return measured.factor if measured else None
        if measured is None and self.costs:  # an unmeasured arm: the mean correction so far
            return predicted * sum(c.factor for c in self.costs.values()) / len(self.costs)
        return predicted * (measured.factor if measured else 1.0)

    def prior(self, config: DraftConfig) -> Acceptance:
        """What an arm is assumed to accept before any task measured it."""
        d = min(PRIOR_DRAFTED, config.max_draft)
        if config.skip is None:  # prompt lookup alone
            return Acceptance(1 + PRIOR_LOOKUP_ACCEPTANCE * d, d, PRIOR_LOOKUP_SHARE, 1.0, windows=0)
        ratio = config.skip.ratio(self.num_layers)
        per_token = max(0.1, PRIOR_MODEL_ACCEPTANCE - PRIOR_ACCEPTANCE_DROP * ratio)
        return Acceptance(1 + per_token * d, d, 1.0, 0.0, windows=0)

    def candidates(self, config: DraftConfig, task: Acceptance | None) -> list[Acceptance]:
        """What the arm may accept on a task: this task's measured figures if any; else both
        the prior and the mean over the tasks that ran it (a new task may accept more or
        less than they did, so a prediction of what *could* pay takes the better)."""
        if task is not None:
            return [task]
        shared = self.shared.get(arm_key(config, self.num_layers))
        return [self.prior(config)] + ([shared] if shared is not None else [])

    def predict(self, config: DraftConfig, task: Acceptance | None = None) -> float | None:
        """Predicted speed relative to plain decoding, the best the arm could do on this task;
        None when nothing can predict it yet (no probe and no window of this arm)."""
        if not config.speculative:
            return 1.0
        speeds = []
        for acceptance in self.candidates(config, task):
            cost = self.round_cost(config, acceptance)
            if cost is None:
                return None
            speeds.append(speed(acceptance, cost))
        return max(speeds)

    # -- learning ----------------------------------------------------------------------------

    def observe(self, config: DraftConfig, acceptance: Acceptance, round_cost: float) -> None:
        key = arm_key(config, self.num_layers)
        predicted = self.predicted_round_cost(config, acceptance)
        factor = round_cost / predicted if predicted else round_cost
        if key in self.costs:
            cost = self.costs[key]
            cost.factor = (1 - EMA) * cost.factor + EMA * factor
            cost.windows += 1
        else:
            self.costs[key] = ArmCost(factor)

    def share(self, config: DraftConfig, acceptance: Acceptance) -> None:
        """Fold one task's figures for an arm into the mean that new tasks start from."""
        key = arm_key(config, self.num_layers)
        if key in self.shared:
            self.shared[key].update(acceptance)
        else:
            self.shared[key] = Acceptance(**asdict(acceptance))

    def state_dict(self) -> dict:
        return {"costs": {k: asdict(v) for k, v in self.costs.items()},
                "shared": {k: asdict(v) for k, v in self.shared.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.costs = {k: ArmCost(**v) for k, v in state.get("costs", {}).items()}
        self.shared = {k: Acceptance(**v) for k, v in state.get("shared", {}).items()}
