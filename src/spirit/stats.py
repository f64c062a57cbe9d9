"""Metrics, defined once and used by the engine, the policies, the benchmark and the server.

Conventions (see also verify.py for accepted / recovered / bonus):
- *tokens/s* is new tokens divided by the whole wall time of the request, prefill included
  (Spec-Bench's definition). `decode_tokens_per_s` excludes the prefill.
- a *draft round* is one draft-then-verify cycle with at least one drafted token; a plain
  decoding step is a full-model pass with no draft and is not a round.
- *drafted tokens* count every node of a draft tree but its root (a chain of k has k); with
  branches, at most one branch per depth can be accepted.
- *acceptance rate* = accepted / drafted tokens.
- *mean accepted* = accepted draft tokens per draft round, the recovered/bonus token NOT
  included (add 1 for tokens committed per verification, vLLM's "mean acceptance length").
- *verify time* is all full-model time after the prefill: verifications and plain steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spirit.plan import Plan
from spirit.skipset import DraftConfig


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


@dataclass
class Counters:
    """Additive counts over a stretch of decoding (a window or a whole request)."""

    new_tokens: int = 0
    draft_rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    probe_time_s: float = 0.0  # teacher-forced agreement probes asked for by a policy
    lookup_rounds: int = 0  # draft rounds whose tree came from prompt lookup (proposers/prompt_lookup.py)

    def add(self, other: "Counters") -> None:
        for name in vars(self):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def acceptance_rate(self) -> float:
        return _ratio(self.accepted, self.drafted)

    def to_dict(self) -> dict:
        """The one serialization of counters (API results, benchmark files), with the
        derived rates."""
        return {
            "draft_rounds": self.draft_rounds,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_per_round": round(self.mean_accepted, 4),
            "draft_time_s": round(self.draft_time_s, 6),
            "verify_time_s": round(self.verify_time_s, 6),
            "probe_time_s": round(self.probe_time_s, 6),
            "lookup_rounds": self.lookup_rounds,
        }

    @property
    def mean_accepted(self) -> float:
        return _ratio(self.accepted, self.draft_rounds)


@dataclass(frozen=True)
class WindowStats:
    """What a policy hears at the end of each window of decoding."""

    request_id: int
    plan: Plan  # what the policy planned for the window, echoed back
    counters: Counters
    wall_time_s: float  # includes the policy's own deciding and probing time
    context_length: int  # tokens in context at the window's end
    probe_agreement: float | None = None  # share of top-1 matches of config.probe, if asked
    final: bool = False  # the request ended inside this window

    @property
    def config(self) -> DraftConfig:
        """The configuration that ran during the window."""
        return self.plan.config

    @property
    def tokens_per_s(self) -> float:
        return _ratio(self.counters.new_tokens, self.wall_time_s)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    wall_time_s: float = 0.0
    prefill_time_s: float = 0.0
    counters: Counters = field(default_factory=Counters)
    configs: list[str] = field(default_factory=list)  # each window's draft configuration, in order
    windows: list[dict] = field(default_factory=list)  # per-window figures, for plots and reports

    @property
    def tokens_per_s(self) -> float:
        return _ratio(self.new_tokens, self.wall_time_s)

    @property
    def decode_tokens_per_s(self) -> float:
        return _ratio(self.new_tokens, self.wall_time_s - self.prefill_time_s)

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "wall_time_s": round(self.wall_time_s, 6),
            "prefill_time_s": round(self.prefill_time_s, 6),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 3),
            **self.counters.to_dict(),
            "configs": list(self.configs),
            "windows": list(self.windows),
        }

