"""Length-aware normalization of measured speed.

Plain decoding slows as the context grows (attention reads the whole KV cache), so a window
at 2,000 tokens of context is slower than one at 200 for reasons that have nothing to do with
the draft configuration. We model plain decoding's seconds per token as a + b * context,
fit online from the windows that ran plain decoding, and judge every window by

    normalized speed = tokens/s  x  (a + b * context)  =  speed relative to plain decoding
                                                           at the same context length

so 1.0 means "as fast as plain decoding would be here", whatever the context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spirit.stats import WindowStats

MAX_SAMPLES = 64  # recent plain-decoding windows kept for the fit


def window_context(stats: WindowStats) -> float:
    """Mean context length during the window."""
    return max(1.0, stats.context_length - stats.counters.new_tokens / 2)


@dataclass
class SpeedModel:
    samples: list[tuple[float, float]] = field(default_factory=list)  # (context, seconds per token)

    def observe_plain(self, stats: WindowStats) -> None:
        if stats.counters.new_tokens < 2 or stats.wall_time_s <= 0:
            return
        self.samples.append((window_context(stats), stats.wall_time_s / stats.counters.new_tokens))
        del self.samples[:-MAX_SAMPLES]

    @property
    def calibrated(self) -> bool:
        return bool(self.samples)

    def coefficients(self) -> tuple[float, float]:
        """(a, b) of seconds/token = a + b * context, least squares, b clamped to >= 0."""
        n = len(self.samples)
        xs = [x for x, _ in self.samples]
        ys = [y for _, y in self.samples]
        mean_x, mean_y = sum(xs) / n, sum(ys) / n
        var_x = sum((x - mean_x) ** 2 for x in xs)
        # too little spread in context to see a slope: treat as flat
        if n < 2 or var_x < (0.1 * mean_x) ** 2 * n:
            return mean_y, 0.0
        b = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var_x)
        return mean_y - b * mean_x, b

    def covers(self, context: float) -> bool:
        """Whether the fit has seen plain decoding at a context within 2x of this one: beyond
        that an extrapolated slope is a guess, and a policy should measure instead."""
        return any(0.5 * context <= x <= 2.0 * context for x, _ in self.samples)

    def plain_seconds_per_token(self, context: float) -> float | None:
        if not self.samples:
            return None
        a, b = self.coefficients()
        return max(1e-9, a + b * context)

    def normalized(self, stats: WindowStats) -> float | None:
        """Speed relative to plain decoding at this context; None until calibrated."""
        expected = self.plain_seconds_per_token(window_context(stats))
        if expected is None:
            return None
        return stats.tokens_per_s * expected

    def state_dict(self) -> dict:
        return {"samples": self.samples}

    def load_state_dict(self, state: dict) -> None:
        self.samples = [tuple(s) for s in state.get("samples", [])]
