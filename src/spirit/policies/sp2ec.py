"""SP²ec: per-query search of how many layers the draft keeps.

Throughput is single-peaked in the number of layers kept n (keep too few: drafts are
rejected; keep too many: drafts cost as much as the target), so each query runs a
golden-section search over n, one window per probe, which needs O(log L) windows. The search
is bracketed around the previous query's best n to keep wall-time regret low, and two probes
closer than a noise margin count as a tie (the bracket shrinks from both sides). n = L is
plain decoding, so the search can always fall back on it.

Which layers a count keeps comes from an importance order learned from past queries: each
window charges its skipped layers with the rejected share of its drafts, and layers are
skipped least-harmful first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from spirit.plan import Plan
from spirit.policies.base import REGISTRY, ModelInfo, Policy, RequestInfo
from spirit.policies.speed_model import SpeedModel
from spirit.skipset import DraftConfig, SkipSet
from spirit.stats import WindowStats

INV_PHI = (math.sqrt(5) - 1) / 2  # 0.618...
NOISE_MARGIN = 0.03  # relative difference below which two probes tie
BRACKET = 8  # half-width of the first bracket around the previous best
MIN_TOKENS = 8
WINDOW = 16  # tokens per probe window: short, so a query affords a full search


@dataclass
class GoldenSection:
    """Maximize an integer-argument, single-peaked, noisy function, one probe at a time."""

    lo: int
    hi: int
    values: dict[int, float] = field(default_factory=dict)

    def points(self) -> tuple[int, int]:
        span = self.hi - self.lo
        c = round(self.hi - INV_PHI * span)
        d = round(self.lo + INV_PHI * span)
        if d <= c:
            d = min(self.hi, c + 1)
        return c, d

    def next_probe(self) -> int | None:
        """The next n to measure, or None when the bracket is fully measured."""
        while True:
            if self.hi - self.lo <= 2:
                left = [n for n in range(self.lo, self.hi + 1) if n not in self.values]
                return left[0] if left else None
            c, d = self.points()
            for n in (c, d):
                if n not in self.values:
                    return n
            fc, fd = self.values[c], self.values[d]
            if fc > fd * (1 + NOISE_MARGIN):
                self.hi = d
            elif fd > fc * (1 + NOISE_MARGIN):
                self.lo = c
            else:  # a tie within noise: the peak lies between (or near) them
                self.lo, self.hi = c, d

    def best(self) -> int:
        return max(self.values, key=lambda n: (self.values[n], n))


class Sp2ecPolicy(Policy):
    interleaved = False  # one query's golden-section search runs over that query's windows
    name = "sp2ec"
    window_tokens = WINDOW

    def __init__(self, model: ModelInfo, base: DraftConfig = DraftConfig(), min_keep: int | None = None) -> None:
        super().__init__(model, base)
        L = model.num_layers
        self.min_keep = min_keep if min_keep is not None else max(2, L // 3)
        self.speed = SpeedModel()
        self.harm = {i: 0.0 for i in range(1, L - 1)}  # mean rejected share when skipped
        self.seen = {i: 0 for i in range(1, L - 1)}
        self.best_keep = L  # start from plain decoding: no regret before evidence
        self.search: GoldenSection | None = None
        self.probes_per_query: list[int] = []

    def order(self) -> list[int]:
        """Layers in skip order: least harmful first; unseen layers rank by depth prior."""
        L = self.model.num_layers
        center = 0.6 * (L - 1)
        return sorted(self.harm, key=lambda i: (self.harm[i] if self.seen[i] else 0.5, abs(i - center)))

    def skip_for(self, keep: int) -> SkipSet | None:
        count = self.model.num_layers - keep
        if count <= 0:
            return None
        return SkipSet.of_layers(self.order()[:count])

    def start_request(self, request: RequestInfo) -> Plan:
        L = self.model.num_layers
        lo = max(self.min_keep, self.best_keep - BRACKET)
        hi = min(L, self.best_keep + BRACKET)
        if hi - lo < 4:  # keep a bracket wide enough for the peak to move
            lo, hi = max(self.min_keep, hi - 2 * BRACKET), min(L, lo + 2 * BRACKET)
        self.search = GoldenSection(lo, hi)
        self.probes_per_query.append(0)
        return self.plan()

    def plan(self) -> Plan:
        """The next probe of the search (layers kept), or the best found once it is done;
        the plan carries the number kept back to learn()."""
        if not self.speed.calibrated:
            keep = self.model.num_layers
        else:
            n = self.search.next_probe() if self.search else None
            keep = n if n is not None else self.best_keep
        return self.window(self.config(self.skip_for(keep)), trial=("keep", keep))

    def learn(self, stats: WindowStats) -> None:
        if stats.counters.new_tokens < MIN_TOKENS:
            return
        if not stats.config.speculative:
            self.speed.observe_plain(stats)
        elif stats.config.skip is not None:
            rejected = 1.0 - stats.counters.acceptance_rate
            for i in stats.config.skip.attn | stats.config.skip.mlp:
                if i in self.harm:
                    self.seen[i] += 1
                    self.harm[i] += (rejected - self.harm[i]) / self.seen[i]
        score = self.speed.normalized(stats)
        if score is None or self.search is None:
            return
        _, keep = stats.plan.trial
        if keep not in self.search.values:
            self.search.values[keep] = score
            self.probes_per_query[-1] += 1
            self.best_keep = self.search.best()

    def state_dict(self) -> dict:
        return {"speed": self.speed.state_dict(), "harm": self.harm, "seen": self.seen, "best_keep": self.best_keep}

    def load_state_dict(self, state: dict) -> None:
        self.speed.load_state_dict(state.get("speed", {}))
        self.harm = {int(k): v for k, v in state.get("harm", {}).items()} or self.harm
        self.seen = {int(k): v for k, v in state.get("seen", {}).items()} or self.seen
        self.best_keep = state.get("best_keep", self.best_keep)


REGISTRY.register(Sp2ecPolicy)
