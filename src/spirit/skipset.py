"""Draft configurations as values.

A `SkipSet` names the attention and MLP sublayers that the draft pass replaces by the
identity on the residual stream. A `DraftConfig` is what a policy hands the engine for one
window of decoding: a skip set (or none, meaning plain decoding) plus the drafting knobs.
Both are frozen, hashable values passed as arguments; nothing global is toggled.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


class SkipSetError(ValueError):
    """A skip set that is malformed or names a layer the model does not have."""


@dataclass(frozen=True)
class SkipSet:
    attn: frozenset[int] = field(default_factory=frozenset)  # layer indices whose attention is skipped
    mlp: frozenset[int] = field(default_factory=frozenset)  # layer indices whose MLP is skipped

    def __post_init__(self) -> None:
        object.__setattr__(self, "attn", frozenset(int(i) for i in self.attn))
        object.__setattr__(self, "mlp", frozenset(int(i) for i in self.mlp))

    @classmethod
    def parse(cls, text: str) -> "SkipSet":
        """Parse ``"attn:4,9;mlp:4,9,12"`` (either part may be absent; ``""`` is the empty set).

        ``"layers:3,5"`` skips both sublayers of the named layers.
        """
        attn: set[int] = set()
        mlp: set[int] = set()
        for part in filter(None, (p.strip() for p in text.split(";"))):
            kind, sep, numbers = part.partition(":")
            kind = kind.strip().lower()
            if not sep or kind not in ("attn", "mlp", "layers"):
                raise SkipSetError(
                    f"bad skip set part {part!r}: expected 'attn:1,2', 'mlp:3,4' or 'layers:5,6'"
                )
            try:
                indices = {int(n) for n in numbers.split(",") if n.strip()}
            except ValueError:
                raise SkipSetError(f"bad layer index in {part!r}: indices must be integers") from None
            if kind in ("attn", "layers"):
                attn |= indices
            if kind in ("mlp", "layers"):
                mlp |= indices
        return cls(frozenset(attn), frozenset(mlp))

    @classmethod
    def of_layers(cls, layers: set[int] | frozenset[int] | list[int]) -> "SkipSet":
        layers = frozenset(layers)
        return cls(layers, layers)

    def validate(self, num_layers: int) -> "SkipSet":
        bad = sorted(i for i in self.attn | self.mlp if not 0 <= i < num_layers)
        if bad:
            raise SkipSetError(
                f"skip set names layer(s) {bad} but the model has layers 0..{num_layers - 1}"
            )
        return self

    @property
    def size(self) -> int:
        """Number of skipped sublayers."""
        return len(self.attn) + len(self.mlp)

    def ratio(self, num_layers: int) -> float:
        """Fraction of the model's 2*num_layers sublayers that are skipped."""
        return self.size / (2 * num_layers)

    def is_empty(self) -> bool:
        return not self.attn and not self.mlp

    def __str__(self) -> str:
        return f"attn:{','.join(map(str, sorted(self.attn)))};mlp:{','.join(map(str, sorted(self.mlp)))}"

    def to_vector(self, num_layers: int) -> list[int]:
        """0/1 vector of length 2L: attention bits for layers 0..L-1, then MLP bits."""
        return [int(i in self.attn) for i in range(num_layers)] + [
            int(i in self.mlp) for i in range(num_layers)
        ]

    @classmethod
    def from_vector(cls, bits: list[int] | tuple[int, ...]) -> "SkipSet":
        n = len(bits) // 2
        return cls(
            frozenset(i for i in range(n) if bits[i]), frozenset(i for i in range(n) if bits[n + i])
        )


def sublayer_ids(num_layers: int, first_last_kept: bool = True) -> list[tuple[str, int]]:
    """All (kind, layer) sublayers that may be skipped; first and last layer kept by default
    because skipping them destroys the draft (every layer-skip paper keeps them)."""
    layers = range(1, num_layers - 1) if first_last_kept and num_layers > 2 else range(num_layers)
    return [(kind, i) for i in layers for kind in ("attn", "mlp")]


def skipset_from_sublayers(sublayers: list[tuple[str, int]] | set[tuple[str, int]]) -> SkipSet:
    return SkipSet(
        frozenset(i for kind, i in sublayers if kind == "attn"),
        frozenset(i for kind, i in sublayers if kind == "mlp"),
    )


def random_skipset(num_layers: int, ratio: float, rng: random.Random) -> SkipSet:
    """A uniformly random skip set with round(ratio * 2L) sublayers, first/last layer kept."""
    candidates = sublayer_ids(num_layers)
    count = min(len(candidates), round(ratio * 2 * num_layers))
    return skipset_from_sublayers(rng.sample(candidates, count))


@dataclass(frozen=True)
class DraftConfig:
    """What the engine runs for one window: which draft sources, and their knobs.

    `skip=None` and `ngram=False` mean plain decoding (no drafts). With `ngram`, a round
    first looks the recent text up in the prompt and the text generated so far (free to
    draft); with `skip` too, a round whose lookup finds no match of at least two tokens
    drafts with the skipping model instead.
    """

    skip: SkipSet | None = None
    # SWIFT's defaults: stop drafting when the draft's top-1 probability drops below 0.8,
    # at most 25 tokens.
    max_draft: int = 25
    threshold: float = 0.8
    # A candidate skip set whose teacher-forced top-1 agreement with the committed text the
    # engine should measure during the window (SWIFT's "matchness"); costs one draft pass.
    probe: SkipSet | None = None
    # Prompt-lookup drafts (proposers/prompt_lookup.py); at most `ngram_tokens` per round (and fewer
    # after a short match), because on a CPU verifying k tokens costs about 1 + 0.03k plain
    # steps (measured on qwen2.5-1.5b in bf16), so a long wrong guess is not free.
    ngram: bool = False
    ngram_tokens: int = 10
    # 0: the draft scores the whole vocabulary; N: only the N most frequent tokens
    # (draft_model/vocab.py), so drafting reads N/V of the lm_head. Verification always uses all.
    draft_vocab: int = 0
    # 1: drafts are chains. b > 1: where the draft's top-1 probability is below
    # `branch_below`, up to b - 1 runner-up tokens join the tree as leaves, verified in the
    # same pass (tree.py).
    branches: int = 1
    branch_below: float = 0.9
    # 0: the draft runs the model's own MLP weights. 8 or 4: weight-only quantized copies of
    # them (draft_model/quantized.py), so a draft pass reads a half or a quarter of the MLP bytes.
    # With no sublayer to skip, `skip=SkipSet()` and draft_bits > 0 is the quantized draft.
    draft_bits: int = 0
    # further draft sources by name (proposers/__init__.py lists them), asked in that list's
    # order; the built-in ones are enabled by their own knobs above (`ngram`, `skip`)
    sources: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.draft_bits not in (0, 4, 8):
            raise ValueError(f"draft_bits must be 0 (full precision), 8 or 4, got {self.draft_bits}")
        if self.max_draft < 1:
            raise ValueError(f"max_draft must be >= 1, got {self.max_draft}")
        if self.ngram_tokens < 1:
            raise ValueError(f"ngram_tokens must be >= 1, got {self.ngram_tokens}")
        if self.draft_vocab < 0:
            raise ValueError(f"draft_vocab must be >= 0 (0 = the full vocabulary), got {self.draft_vocab}")
        if self.branches < 1:
            raise ValueError(f"branches must be >= 1, got {self.branches}")

    @property
    def speculative(self) -> bool:
        return self.skip is not None or self.ngram or bool(self.sources)

    def describe(self, num_layers: int) -> str:
        if not self.speculative:
            return "vanilla"
        parts = [f"ratio={self.skip.ratio(num_layers):.2f} {self.skip}"] if self.skip is not None else []
        if self.ngram:
            parts.append(f"ngram={self.ngram_tokens}")
        if self.skip is not None and self.draft_bits:
            parts.append(f"int{self.draft_bits}")
        if self.skip is not None and self.draft_vocab:
            parts.append(f"vocab={self.draft_vocab}")
        if self.skip is not None and self.branches > 1:
            parts.append(f"branches={self.branches}")
        parts += [f"+{name}" for name in self.sources]
        return " ".join(parts)


VANILLA = DraftConfig(skip=None)
