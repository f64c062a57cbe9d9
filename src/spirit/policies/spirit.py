"""SPIRIT: choose the draft configuration by measured, length-normalized throughput.

Per recognized task (a profile), the policy searches in two stages and then exploits:

1. *Ratio.* The fraction of sublayers skipped is the first-order knob. It measures a coarse
   grid of ratios, one window each, outwards from a prior, then refines around the best by
   half a grid step. Without a draft that skips nothing, ratio 0 is plain decoding and the
   prior is the middle of the grid. With one (prompt lookup, or a draft whose MLPs are
   quantized, `draft_bits`), ratio 0 is that draft, an arm to measure like any other, and
   the prior; plain decoding (1.0 by definition) is what every arm must beat, so the policy
   never settles on something slower than vanilla.
2. *Source.* With prompt lookup on offer and a model draft that can run without it (a skip
   ratio above 0, or a quantized draft), one window tries the chosen ratio with lookup
   switched the other way, kept if faster by a noise margin: lookup drafts pre-empt the
   model's, which pays where answers copy the prompt and costs where they don't.
3. *Pattern.* At the chosen ratio it tries a few swaps of which sublayers are skipped (one
   skipped sublayer out, a highly ranked kept one in), keeping a swap only if it is faster by
   a noise margin. The ranking of sublayers ("skip these first") is shared by all tasks and
   learns from every accepted swap.
   Searching costs only every other window: between two trials it runs the best configuration
   measured so far (plain decoding if nothing beat it yet), which also re-measures it. Most
   requests are short (a 64-token answer is three windows), so a search spread this way over
   several requests costs far less than one that spends whole requests on trials.
4. *Exploit.* It runs the incumbent, refreshes the plain-decoding speed model now and then,
   and re-searches (around the incumbent) if normalized speed leaves its recent range.

Every trial must first be predicted to beat plain decoding by the noise margin
(`cost_model.py`): costs are the machine's (seeded by the hardware probe, corrected by every
window, shared by all tasks), acceptance is the task's (this task's windows, else the mean
over tasks, else a prior). On a machine where verifying several tokens costs several plain
steps, nothing is predicted to pay, and a new task runs plain decoding from its first token;
a short trial of the best-predicted arm now and then (`REPROBE_GATED`) keeps the
prediction honest.

Speeds are compared after normalizing by plain decoding's speed at the same context length
(`speed_model.py`). Tasks are recognized from the prompt (`features.py`), so a stream that
returns to a known task restores its profile at once, and a new task starts a new search.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from enum import Enum

from spirit.plan import Plan
from spirit.policies.base import REGISTRY, ModelInfo, Policy, RequestInfo
from spirit.policies.cost_model import Acceptance, CostModel, arm_key, window_figures
from spirit.policies.features import ProfileIndex, prompt_vector
from spirit.policies.speed_model import SpeedModel, window_context
from spirit.skipset import DraftConfig, skipset_from_sublayers, sublayer_ids
from spirit.stats import WindowStats

RATIO_GRID = (0.0, 0.1, 0.2, 0.3, 0.4)
# The first task measures the grid outwards from a prior ratio: its middle when ratio 0 is
# plain decoding; otherwise ratio 0 (lookup alone, or the quantized draft that skips
# nothing), which measured fastest on this project's CPU (docs/benchmarks/), and upwards.
PRIOR_RATIO = 0.2
PRIOR_RATIO_DRAFT = 0.0
REFINE_STEP = 0.05
MAX_RATIO = 0.6
PATTERN_TRIALS = 4  # swaps tried per search
MARGIN = 0.03  # a challenger must be 3% faster (normalized) than the incumbent: window noise
SHIFT_DROP = 0.8  # exploit windows below 80% of the expected speed are suspicious ...
SHIFT_PATIENCE = 2  # ... and this many in a row trigger a re-search
PLAIN_REFRESH = 24  # exploit windows between plain-decoding windows that recalibrate
REPROBE_EVERY = 48  # plain-decoding exploit windows before the smallest ratio is tried again
YOUNG_REPROBE = 8  # ... but a new profile that inherited plain decoding checks after this many
HISTORY_WINDOWS = 4096
MIN_TOKENS = 8  # shorter windows (end of a request) are too noisy to judge
SEARCH_WINDOW = 24  # tokens per window while searching
EXPLOIT_WINDOW = 48  # tokens per window while exploiting
# a plain window that refreshes the speed model: short, since many requests are one or two
# windows long and this one runs at plain speed, yet long enough (>= MIN_TOKENS) to count
PLAIN_WINDOW = 16
# Plain windows that the cost prediction chose (it ruled every trial out) before one short
# trial of the best-predicted arm checks the prediction: rare and cheap, because where
# nothing pays each such trial is pure loss (16 tokens per ~3,000 at 48-token windows).
REPROBE_GATED = 64
GATED_TRIAL_WINDOW = 16


def prior_order(num_layers: int) -> list[tuple[str, int]]:
    """Initial "skip these first" ranking: attention before MLP, from the upper-middle of the
    stack outwards (layer-skipping studies find deep-middle layers the most redundant and
    the first and last layers essential; those two are never skipped)."""
    center = 0.6 * (num_layers - 1)
    return sorted(sublayer_ids(num_layers), key=lambda s: (abs(s[1] - center) + (0.5 if s[0] == "mlp" else 0.0), s))


class Stage(str, Enum):
    """Where a task's search stands: ratio -> source -> pattern -> exploit, and back to
    ratio when speed shifts or a re-probe is due. A str, so saved profiles stay plain JSON."""

    RATIO = "ratio"  # measuring skip ratios on the grid
    SOURCE = "source"  # one trial of the incumbent with prompt lookup switched the other way
    PATTERN = "pattern"  # swapping single sublayers of the incumbent's skip set
    EXPLOIT = "exploit"  # running the incumbent, with plain windows that recalibrate


MAX_TRANSITIONS = 8  # stage changes one plan() may make before it must decide (a bug guard)


@dataclass
class TaskProfile:
    pending: list[float] = field(default_factory=lambda: first_grid(PRIOR_RATIO))  # ratios left to measure
    ratio_scores: dict[str, list[float]] = field(default_factory=dict)  # "0.20" -> normalized speeds
    stage: Stage = Stage.RATIO
    refined: bool = False
    ratio: float = 0.0
    skip: list[list] | None = None  # the incumbent pattern, as [kind, layer] pairs
    score: float = 0.0  # the incumbent's expected normalized speed
    trials_left: int = PATTERN_TRIALS
    suspicious: int = 0
    searches: int = 1
    requests: int = 0
    inherited: list[list] | None = None  # the neighbour's pattern this profile started from
    drafting: bool = False  # whether the incumbent drafts at all (ratio 0: plain decoding if not)
    ngram: bool = True  # whether the incumbent drafts by prompt lookup first (when on offer)
    source_tried: bool = False  # the source stage's one trial of this search is done
    exploited: int = 0  # exploit windows since the last search
    owe_best: bool = False  # the last window was a trial: the next runs the best so far
    # per arm (cost_model.arm_key): what its drafts achieved on this task
    acceptance: dict[str, Acceptance] = field(default_factory=dict)
    gated: list[str] = field(default_factory=list)  # ratio keys this search ruled out by prediction


def first_grid(prior: float) -> list[float]:
    """The grid in the order a first search measures it: nearest the prior ratio first, so
    the early windows (which also serve the first requests) run likely-good ratios."""
    return sorted(RATIO_GRID, key=lambda r: (abs(r - prior), r))


def _key(ratio: float) -> str:
    return f"{ratio:.2f}"


def _means(p: TaskProfile) -> dict[float, float]:
    return {float(k): sum(v) / len(v) for k, v in p.ratio_scores.items() if v}


def _best_ratio(means: dict[float, float]) -> float:
    """The fastest ratio, where skipping more must pay by MARGIN over every smaller ratio:
    one window is noisy, and a near-tie is worth less than the cheaper, safer draft."""
    best = min(means)
    for ratio in sorted(means):
        if means[ratio] > means[best] * (1 + MARGIN):
            best = ratio
    return best


class SpiritPolicy(Policy):
    name = "spirit"
    # every lever that measured faster on qwen2.5-coder-1.5b in bf16 (docs/benchmarks/)
    default_draft = DraftConfig(ngram=True, draft_vocab=32768, branches=2, draft_bits=4, threshold=0.5)
    window_tokens = SEARCH_WINDOW

    def __init__(self, model: ModelInfo, base: DraftConfig = DraftConfig(), seed: int = 0) -> None:
        # Prompt lookup is a source the policy switches on per window: with it, every arm
        # drafts by lookup first. With it or with quantized drafts, ratio 0 is a draft arm
        # (lookup alone and/or the quantized model skipping nothing), and plain decoding
        # (1.0 by definition) is the arm every other one must beat.
        self.lookup = base.ngram
        self.zero_arm = base.ngram or base.draft_bits > 0
        super().__init__(model, replace(base, ngram=False))
        self.rng = random.Random(seed)
        self.speed = SpeedModel()
        self.costs = CostModel(model.num_layers, model.vocab, model.costs)
        self.plain_since_trial = 0  # plain windows since a trial ran (for REPROBE_GATED)
        self.index = ProfileIndex()
        self.profiles: list[TaskProfile] = []
        self.order: list[tuple[str, int]] = prior_order(model.num_layers)
        self.current = 0
        # request id -> its task profile, for requests decoding at once (a batch): each
        # window's feedback goes to its own request's task
        self.request_profiles: dict[int, int] = {}
        self.windows_since_plain = 0
        self.context = 0.0  # context length at the last feedback
        # recent windows' (profile, trial kind, ratio, score), for reports; bounded because a
        # server keeps one policy for its whole life
        self.history: deque[dict] = deque(maxlen=HISTORY_WINDOWS)

    # -- configurations ----------------------------------------------------------------------

    @property
    def profile(self) -> TaskProfile:
        return self.profiles[self.current]

    def pattern_for(self, ratio: float) -> list[tuple[str, int]]:
        count = round(ratio * 2 * self.model.num_layers)
        return list(self.order[:count])

    def _arm(self, sublayers, ngram: bool | None = None) -> DraftConfig:
        """The draft that skips `sublayers` (as [kind, layer] pairs), lookup first if on
        (`ngram`, default the profile's choice). Skipping nothing is the quantized draft
        with draft_bits, lookup alone without, and plain decoding with neither."""
        skip = skipset_from_sublayers(sublayers)
        ngram = self.lookup and (self.profile.ngram if ngram is None else ngram)
        return self.config(skip if sublayers or self.base.draft_bits else None, ngram=ngram)

    def _incumbent(self, p: TaskProfile) -> DraftConfig:
        if not p.skip and not p.drafting:
            return self.config(None)
        return self._arm(p.skip or [])

    def plan(self) -> Plan:
        """What the next window runs, and why (the plan's trial, which learn() reads back).
        Each stage's step either decides or moves the profile to another stage."""
        p = self.profile
        if not self.speed.calibrated:
            return self._plain(SEARCH_WINDOW)
        steps = {Stage.RATIO: self._ratio_step, Stage.SOURCE: self._source_step,
                 Stage.PATTERN: self._pattern_step, Stage.EXPLOIT: self._exploit_step}
        for _ in range(MAX_TRANSITIONS):
            decided = steps[p.stage](p)
            if decided is not None:
                return decided
        raise RuntimeError(f"spirit policy: no decision after {MAX_TRANSITIONS} stage changes ({p.stage})")

    def _plain(self, tokens: int) -> Plan:
        return self.window(self.config(None), tokens, ("plain", None))

    def _ratio_step(self, p: TaskProfile) -> Plan | None:
        if not p.pending:
            self._finish_ratio_stage(p)  # more ratios to measure, or the next stage
            return None
        means = _means(p)
        if p.owe_best and means:
            return self._run_best(means)
        ratio = p.pending[0]
        arm = self._arm(self.pattern_for(ratio))
        tokens = self._trial_window(arm)
        if tokens is None:  # predicted not to pay: ruled out without a window
            p.pending.pop(0)
            p.gated.append(_key(ratio))
            return None
        return self.window(arm, tokens, ("ratio", ratio))

    def _source_step(self, p: TaskProfile) -> Plan | None:
        if p.owe_best:  # after a trial, the incumbent
            return self.window(self._incumbent(p), SEARCH_WINDOW, ("exploit", None))
        arm = self._arm(p.skip or [], ngram=not p.ngram)
        tokens = None if p.source_tried else self._trial_window(arm)
        if tokens is None:
            p.source_tried = True
            p.stage = Stage.PATTERN if p.skip else Stage.EXPLOIT
            return None
        return self.window(arm, tokens, ("source", not p.ngram))

    def _pattern_step(self, p: TaskProfile) -> Plan | None:
        if p.trials_left <= 0 or not p.skip:
            p.stage = Stage.EXPLOIT
            return None
        candidate = self._swap([tuple(s) for s in p.skip]) if not p.owe_best else None
        if candidate is None:
            if p.owe_best:  # between two swaps, the incumbent
                return self.window(self._incumbent(p), SEARCH_WINDOW, ("exploit", None))
            p.stage = Stage.EXPLOIT
            return None
        return self.window(self._arm(candidate), SEARCH_WINDOW, ("pattern", candidate))

    def _exploit_step(self, p: TaskProfile) -> Plan | None:
        if not p.skip and p.exploited >= REPROBE_EVERY:
            # settled on plain decoding or the ratio-0 draft: now and then check whether
            # skipping pays now (longer contexts, another machine state); one window of
            # regret per REPROBE_EVERY (two when the ratio-0 draft may now beat plain decoding)
            p.exploited, p.stage, p.refined, p.gated = 0, Stage.RATIO, False, []
            if p.drafting:
                p.ratio_scores, p.pending = {_key(0.0): [p.score]}, [RATIO_GRID[1]]
            else:
                p.ratio_scores = self._plain_scores()
                p.pending = [RATIO_GRID[1]] if not self.zero_arm else [0.0, RATIO_GRID[1]]
            return None
        stale = self.windows_since_plain >= PLAIN_REFRESH or not self.speed.covers(self.context)
        if (p.skip or p.drafting) and stale:
            return self._plain(PLAIN_WINDOW)
        return self.window(self._incumbent(p), EXPLOIT_WINDOW, ("exploit", None))

    def _run_best(self, means: dict[float, float]) -> Plan:
        """The best ratio measured so far in this search; plain decoding (1.0 by definition)
        when nothing measured beats it."""
        best = _best_ratio(means)
        if means[best] < 1.0 or (best == 0.0 and not self.zero_arm):
            return self._plain(SEARCH_WINDOW)
        return self.window(self._arm(self.pattern_for(best)), SEARCH_WINDOW, ("best", best))

    def _trial_window(self, arm: DraftConfig) -> int | None:
        """Tokens for a trial of `arm`: SEARCH_WINDOW when it is predicted to beat plain
        decoding by the noise margin (or nothing can predict it yet); None when predicted
        not to pay, except that once REPROBE_GATED plain windows have passed, one short
        trial (GATED_TRIAL_WINDOW) is let through to check the prediction."""
        if not arm.speculative:
            return SEARCH_WINDOW
        predicted = self.costs.predict(arm, self.profile.acceptance.get(arm_key(arm, self.model.num_layers)))
        if predicted is None or predicted >= 1 + MARGIN:
            return SEARCH_WINDOW
        if self.plain_since_trial >= REPROBE_GATED:
            self.plain_since_trial = 0
            return GATED_TRIAL_WINDOW
        return None

    def _plain_scores(self) -> dict[str, list[float]]:
        """Grid scores known without measuring: ratio 0 is plain decoding, 1.0 by definition
        once calibrated, unless it is a draft arm (lookup, quantized), which is unknown."""
        return {} if self.zero_arm else {_key(0.0): [1.0]}

    def _finish_ratio_stage(self, p: TaskProfile) -> None:
        means = _means(p)
        best = _best_ratio(means) if means else 0.0
        tried = [r for r in means if r > 0]
        step = RATIO_GRID[1]
        lower = round(max(step, min(tried) - step), 4) if tried else 0.0
        if best == 0 and tried and min(tried) > step + 1e-9 and _key(lower) not in p.gated:
            # a local search found nothing faster than plain decoding above: look lower
            p.pending = [lower]
            return
        higher = round(best + step, 4)
        if best > 0 and best >= max(tried) and higher <= MAX_RATIO + 1e-9 and _key(higher) not in p.gated:
            # the best is the largest ratio tried: the peak may lie higher, climb a step
            p.pending = [higher]
            return
        if not p.refined and best > 0:
            p.refined = True
            p.pending = [
                r for r in (round(best - REFINE_STEP, 4), round(best + REFINE_STEP, 4))
                if 0 < r <= MAX_RATIO and _key(r) not in p.ratio_scores and _key(r) not in p.gated
            ]
            if p.pending:
                return
        p.drafting = means.get(best, 0.0) >= 1.0 and (best > 0 or self.zero_arm)
        if self.zero_arm and not p.drafting:
            best = 0.0  # nothing beat plain decoding
        p.ratio, p.score = best, means.get(best, 1.0) if p.drafting or not self.zero_arm else 1.0
        p.skip = [list(s) for s in self.pattern_for(best)]
        p.stage = Stage.PATTERN if p.skip else Stage.EXPLOIT
        if self.lookup and p.drafting and (p.skip or self.base.draft_bits):
            p.stage, p.source_tried = Stage.SOURCE, False
        # a profile that kept its neighbour's ratio keeps its refined pattern: one check only
        same = p.inherited is not None and len(p.inherited) == len(p.skip)
        if same:
            p.skip = p.inherited
        p.trials_left = 1 if same else PATTERN_TRIALS

    def _swap(self, incumbent: list[tuple[str, int]]) -> list[tuple[str, int]] | None:
        """Take one skipped sublayer out, put one of the best-ranked kept ones in."""
        kept = [s for s in self.order if s not in incumbent]
        if not kept or not incumbent:
            return None
        out = self.rng.choice(incumbent)
        into = self.rng.choice(kept[:3])
        return [into if s == out else s for s in incumbent]

    # -- feedback ------------------------------------------------------------------------------

    def start_request(self, request: RequestInfo) -> Plan:
        index, new, nearest = self.index.assign(prompt_vector(request.prompt_tokens))
        if new:
            self.profiles.append(self._new_profile(nearest))
        self.current = index
        self.request_profiles[request.request_id] = index
        self.profile.requests += 1
        return self.plan()

    def on_window(self, stats: WindowStats) -> Plan:
        self.current = self.request_profiles.get(stats.request_id, self.current)
        return super().on_window(stats)

    def end_request(self, stats: WindowStats) -> None:
        self.current = self.request_profiles.pop(stats.request_id, self.current)
        super().end_request(stats)

    def _new_profile(self, nearest: int | None) -> TaskProfile:
        """A new task starts from its nearest known task's configuration and searches
        locally around it (tasks often agree, and prompt features are only a hint); the
        very first task searches the whole grid."""
        profile = TaskProfile(pending=first_grid(PRIOR_RATIO_DRAFT if self.zero_arm else PRIOR_RATIO))
        if nearest is None or not self.speed.calibrated:
            return profile
        base = self.profiles[nearest]
        if base.stage == Stage.RATIO and not base.ratio_scores:
            return profile
        profile.ngram = base.ngram
        r = base.ratio
        if base.stage == Stage.RATIO:  # the neighbour is still searching: its best so far
            means = _means(base)
            r = _best_ratio(means)
        profile.ratio_scores = self._plain_scores()
        if r == 0.0 and base.stage == Stage.EXPLOIT:
            # the nearest task found nothing faster than plain decoding, or than the ratio-0
            # draft: start there, and check the smallest ratio after a few windows rather
            # than at once (a trial costs a window, and most requests are a few windows long)
            profile.stage, profile.pending = Stage.EXPLOIT, []
            profile.drafting, profile.score = base.drafting, base.score if base.drafting else 1.0
            profile.exploited = REPROBE_EVERY - YOUNG_REPROBE
            return profile
        around = [r, round(r - 2 * REFINE_STEP, 4), round(r + 2 * REFINE_STEP, 4)]
        if self.zero_arm:
            # the ratio-0 draft first: on every task the first search measures it, it was the
            # fastest arm on most (docs/benchmarks/), and a neighbour's skip ratio often does
            # not carry over; a ratio less than a step above 0 is that arm too
            around = [0.0] + [x for x in around if x >= REFINE_STEP - 1e-9]
        lowest = 0 if self.zero_arm else 1e-9  # ratio 0 is an arm to measure, or plain decoding
        profile.pending = [x for x in dict.fromkeys(around) if lowest <= x <= MAX_RATIO]
        profile.inherited = [list(s) for s in base.skip] if base.skip else None
        return profile

    def learn(self, stats: WindowStats) -> None:
        if stats.counters.new_tokens < MIN_TOKENS:
            return
        kind, arg = stats.plan.trial
        self.context = stats.context_length
        if not stats.config.speculative:
            self.speed.observe_plain(stats)
            self.windows_since_plain = 0
            self.plain_since_trial += 1
        else:
            self.windows_since_plain += 1
            self.plain_since_trial = 0
        score = self.speed.normalized(stats)
        if score is None:
            return
        p = self.profile
        if stats.config.speculative:
            self._learn_costs(p, stats)
        ratio = stats.config.skip.ratio(self.model.num_layers) if stats.config.skip else 0.0
        self.history.append({"profile": self.current, "trial": kind, "ratio": round(ratio, 3), "score": round(score, 4)})
        if kind == "plain" and p.stage == Stage.RATIO and 0.0 in p.pending and not self.zero_arm:
            kind, arg = "ratio", 0.0  # the calibration window is the grid's ratio-0 point
        # a speculative trial is followed by a window of the best so far; a plain window that
        # stands for ratio 0 (no lookup) is itself the best-known speed
        p.owe_best = kind in ("ratio", "pattern", "source") and stats.config.speculative
        if kind in ("ratio", "best"):
            p.ratio_scores.setdefault(_key(arg), []).append(score)
            if arg in p.pending:
                p.pending.remove(arg)
            self._prune_grid(p, arg, score)
        elif kind == "source":
            p.source_tried = True
            if score > p.score * (1 + MARGIN):
                p.ngram, p.score = arg, score
        elif kind == "pattern":
            p.trials_left -= 1
            if score > p.score * (1 + MARGIN):
                self._learn_order([tuple(s) for s in p.skip], arg)
                p.skip, p.score = [list(s) for s in arg], score
        elif kind == "exploit":
            p.exploited += 1
            if self.speed.covers(window_context(stats)):
                self._watch(p, score)

    def _learn_costs(self, p: TaskProfile, stats: WindowStats) -> None:
        """A speculative window's round cost (the machine's, shared) and acceptance (this
        task's, and folded into the mean that new tasks start from)."""
        figures = window_figures(stats, self.speed.plain_seconds_per_token(window_context(stats)) or 0.0)
        if figures is None:
            return
        acceptance, round_cost = figures
        key = arm_key(stats.config, self.model.num_layers)
        self.costs.observe(stats.config, acceptance, round_cost)
        if key in p.acceptance:
            p.acceptance[key].update(acceptance)
        else:
            p.acceptance[key] = acceptance
        self.costs.share(stats.config, acceptance)

    def _prune_grid(self, p: TaskProfile, ratio: float, score: float) -> None:
        """Speed is single-peaked in the ratio: once a ratio is clearly slower than the best
        smaller one, larger ratios only cost windows, so they are dropped."""
        smaller = [sum(v) / len(v) for k, v in p.ratio_scores.items() if float(k) < ratio and v]
        if smaller and score < max(smaller) * (1 - 2 * MARGIN):
            p.pending = [r for r in p.pending if r < ratio]

    def _learn_order(self, old: list[tuple[str, int]], new: list[tuple[str, int]]) -> None:
        """A winning swap: the sublayer brought in moves ahead of the one taken out."""
        (gone,) = [s for s in old if s not in new] or [None]
        (came,) = [s for s in new if s not in old] or [None]
        if gone is None or came is None:
            return
        i, j = self.order.index(gone), self.order.index(came)
        if j > i:
            self.order[i], self.order[j] = came, gone

    def _watch(self, p: TaskProfile, score: float) -> None:
        """Track the incumbent's speed; re-search around it when speed leaves its range."""
        if score < SHIFT_DROP * p.score:
            p.suspicious += 1
        else:
            p.suspicious = 0
            p.score = 0.8 * p.score + 0.2 * score
        if p.suspicious >= SHIFT_PATIENCE:
            p.suspicious = 0
            p.searches += 1
            p.stage, p.refined, p.gated = Stage.RATIO, False, []
            around = {0.0, p.ratio, round(max(0.0, p.ratio - 0.1), 4), round(min(MAX_RATIO, p.ratio + 0.1), 4)}
            p.pending = sorted(around)
            p.ratio_scores = {}

    # -- persistence -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "speed": self.speed.state_dict(),
            "index": self.index.state_dict(),
            "profiles": [asdict(p) for p in self.profiles],
            "order": [list(s) for s in self.order],
            # round costs are this machine's: kept with its name, and dropped on another
            "costs": {"machine": self._machine(), **self.costs.state_dict()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.speed.load_state_dict(state.get("speed", {}))
        self.index.load_state_dict(state.get("index", {}))
        # "lookup" is what profiles saved before quantized drafts called "drafting"
        self.profiles = [
            TaskProfile(**{("drafting" if k == "lookup" else k): v for k, v in p.items()})
            for p in state.get("profiles", [])
        ]
        for p in self.profiles:
            p.stage = Stage(p.stage)
            p.acceptance = {k: Acceptance(**v) if isinstance(v, dict) else v for k, v in p.acceptance.items()}
        costs = state.get("costs", {})
        if costs.get("machine") == self._machine():
            self.costs.load_state_dict(costs)
        else:  # another machine's costs mislead; what tasks accept still holds
            self.costs.load_state_dict({"shared": costs.get("shared", {})})
        self.order = [tuple(s) for s in state.get("order", [])] or self.order

    def _machine(self) -> str:
        return self.costs.probe.machine if self.costs.probe is not None else ""

    def describe(self) -> str:
        parts = [f"task {i}: {p.stage.value} ratio={p.ratio:.2f} score={p.score:.2f}" for i, p in enumerate(self.profiles)]
        return "spirit: " + "; ".join(parts)


REGISTRY.register(SpiritPolicy)
