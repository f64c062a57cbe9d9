"""A simulated decoding machine with a fake clock, for testing policies without a model.

A landscape says how fast plain decoding is at a context length and what speedup (and
acceptance) a draft configuration gets; the simulator feeds a policy the WindowStats the
engine would produce, with wall times computed from those speeds instead of measured.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from spirit.policies.base import Policy, RequestInfo
from spirit.skipset import DraftConfig, SkipSet
from spirit.stats import Counters, WindowStats


@dataclass
class Landscape:
    speedup: Callable[[SkipSet | None], float]  # relative to plain decoding at the same context
    plain_tps: Callable[[float], float] = lambda ctx: 20.0  # plain tokens/s at a context length
    acceptance: Callable[[SkipSet | None], float] = lambda skip: 0.8
    matchness: Callable[[SkipSet], float] = lambda skip: 0.5
    # when set, speedup of the whole configuration (e.g. with prompt lookup), instead of `speedup`
    config_speedup: Callable[[DraftConfig], float] | None = None
    # what a draft round costs on this machine, in plain steps: the speedup a window shows
    # comes from tokens per round (the task's) over this (the machine's)
    round_cost: Callable[[DraftConfig], float] = lambda config: 1.5

    def speedup_of(self, config: DraftConfig) -> float:
        return self.config_speedup(config) if self.config_speedup else self.speedup(config.skip)


@dataclass
class Log:
    windows: list[tuple[int, DraftConfig, float, int]] = field(default_factory=list)  # (request, config, tok/s, tokens)

    def configs_of(self, request: int) -> list[DraftConfig]:
        return [c for r, c, *_ in self.windows if r == request]


def run(policy: Policy, landscape: Landscape, prompts: list[tuple[int, ...]], tokens: int = 128,
        start_context: int = 100, noise: float = 0.0, seed: int = 0, log: Log | None = None) -> Log:
    rng = random.Random(seed)
    log = log or Log()
    first_id = len({r for r, *_ in log.windows})
    for n, prompt in enumerate(prompts):
        rid = first_id + n
        plan = policy.start_request(RequestInfo(rid, prompt, tokens))
        context, remaining = start_context + len(prompt), tokens
        while remaining > 0:
            w, config = min(plan.window_tokens, remaining), plan.config
            speed = landscape.plain_tps(context) * landscape.speedup_of(config) * (1 + noise * rng.gauss(0, 1))
            counters = window_counters(landscape, config, w, landscape.speedup_of(config))
            context += w
            remaining -= w
            stats = WindowStats(rid, plan, counters, w / max(speed, 1e-6), context,
                                probe_agreement=landscape.matchness(config.probe) if config.probe else None,
                                final=remaining == 0)
            log.windows.append((rid, config, speed, w))
            if remaining == 0:
                policy.end_request(stats)
            else:
                plan = policy.on_window(stats)
    return log


def window_counters(landscape: Landscape, config: DraftConfig, tokens: int, speedup: float) -> Counters:
    """Counts consistent with the speedup: rounds that each cost the machine's round cost
    (raised where even one token per round could not be that slow) and commit
    speedup x cost tokens, of which `acceptance` of the drafted ones were accepted."""
    if not config.speculative:
        return Counters(new_tokens=tokens)
    cost = max(landscape.round_cost(config), 1 / max(speedup, 1e-6))
    per_round = speedup * cost
    rounds = max(1, min(tokens, round(tokens / per_round)))
    accepted = tokens - rounds
    rate = max(landscape.acceptance(config.skip), 1e-3)
    drafted = max(accepted, round(accepted / rate), rounds)
    return Counters(new_tokens=tokens, drafted=drafted, accepted=accepted, draft_rounds=rounds)


def prompts_of(task: int, count: int, length: int = 40) -> list[tuple[int, ...]]:
    """Prompts of one task: a shared instruction template, then request-specific tokens."""
    rng = random.Random(task * 1000 + count)
    base = 1000 * (task + 1)
    template = tuple(base + i for i in range(length * 3 // 4))
    return [template + tuple(base + 100 + rng.randrange(500) for _ in range(length // 4)) for _ in range(count)]


def ratio_peak(peak: float, height: float = 1.6, num_layers: int = 24) -> Callable[[SkipSet | None], float]:
    """Speedup single-peaked in the skip ratio: 1 at ratio 0, `height` at `peak`."""
    def speedup(skip: SkipSet | None) -> float:
        r = skip.ratio(num_layers) if skip else 0.0
        return max(0.05, 1 + (height - 1) * (1 - ((r - peak) / peak) ** 2)) if r > 0 else 1.0
    return speedup
