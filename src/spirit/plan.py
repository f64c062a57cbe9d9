"""The policy contract's one value: what the next window of decoding runs.

A policy returns a Plan; the engine decodes `window_tokens` new tokens with `config` and
reports a WindowStats that carries the same Plan back. The `trial` is the policy's own note of
why it chose this window (which candidate it measures), so that it learns from the window
without keeping "what I planned last" in an attribute the engine never sees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spirit.skipset import VANILLA, DraftConfig


@dataclass(frozen=True)
class Plan:
    config: DraftConfig = VANILLA
    window_tokens: int = 32  # new tokens decoded before the window is reported
    trial: tuple[str, Any] = ("", None)  # the policy's note: (kind, argument); the engine ignores it

    def __post_init__(self) -> None:
        if self.window_tokens < 1:
            raise ValueError(f"window_tokens must be >= 1, got {self.window_tokens}")
