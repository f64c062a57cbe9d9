"""A reduced-vocabulary draft head: the draft scores only the most frequent tokens.

A draft pass reads the whole lm_head to score one token (15% of qwen2.5-1.5b's bytes, 27% of
the 0.5b's). Text mostly uses a small part of a 150k vocabulary, so the draft scores only the
N most frequent tokens (FR-Spec, Zhao et al., 2025): when the full model's choice is outside
them the draft is simply wrong and verification (always over the full vocabulary) rejects it,
so output is unchanged.

Frequencies are learned from the text the engine sees (prompts and generated tokens) on top
of a prior: byte-level BPE and SentencePiece vocabularies are built in merge order, so a
lower id is a more frequent token, roughly Zipf-distributed in its rank.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

PRIOR_MASS = 1000.0  # prior count of id 0; id i gets PRIOR_MASS / (i + 1): one observed
# occurrence outweighs the prior of every id above ~1000, so the text seen decides the tail
PINNED_COUNT = 1e9  # tokens always scored (EOS): far above any count


class FrequencyTable:
    """Token counts with a rank prior; `top(n)` is the draft vocabulary."""

    def __init__(self, vocab_size: int) -> None:
        ranks = torch.arange(1, vocab_size + 1, dtype=torch.float64)
        self.counts = PRIOR_MASS / ranks  # [vocab]
        self.version = 0  # bumped on every change, so heads know when to rebuild

    def observe(self, token_ids: Iterable[int]) -> None:
        ids = torch.as_tensor(list(token_ids), dtype=torch.long)
        ids = ids[(ids >= 0) & (ids < self.counts.numel())]
        if ids.numel():
            self.counts.index_add_(0, ids, torch.ones(ids.numel(), dtype=torch.float64))
            self.version += 1

    def pin(self, token_ids: Iterable[int]) -> None:
        for t in token_ids:
            if 0 <= t < self.counts.numel() and self.counts[t] < PINNED_COUNT:
                self.counts[t] = PINNED_COUNT
                self.version += 1

    def top(self, n: int) -> torch.Tensor:
        """The n most frequent token ids, ascending: [min(n, vocab)] long."""
        n = min(n, self.counts.numel())
        return torch.topk(self.counts, n).indices.sort().values


class DraftHead:
    """The lm_head rows of a token subset, kept contiguous so a draft reads only them."""

    def __init__(self, weight: torch.Tensor, token_ids: torch.Tensor) -> None:
        self.token_ids = token_ids.to(weight.device)  # [n] long: row r scores token token_ids[r]
        self.weight = weight.detach().index_select(0, self.token_ids).contiguous()  # [n, hidden]
        self.vocab_size = weight.shape[0]

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., n] raw scores over the subset (before soft-capping)."""
        return torch.nn.functional.linear(hidden, self.weight)

    def logits(self, hidden: torch.Tensor, capped) -> torch.Tensor:
        """[..., hidden] -> float32 logits [..., vocab]: the subset's scores through the model's
        final soft-capping (`capped`, SkippableModel.capped), -inf for every other token."""
        return self.to_full(capped(self.scores(hidden).float()))

    def to_full(self, sub_logits: torch.Tensor) -> torch.Tensor:
        """[..., n] subset logits -> [..., vocab] with -inf for every token outside the subset,
        so the same sampling code gives q = 0 there (exact for speculative sampling)."""
        full = torch.full((*sub_logits.shape[:-1], self.vocab_size), float("-inf"), dtype=sub_logits.dtype,
                          device=sub_logits.device)
        full[..., self.token_ids] = sub_logits
        return full


class DraftHeads:
    """The draft heads of one model, rebuilt from the frequency table when it has changed."""

    def __init__(self, weight: torch.Tensor) -> None:
        self._weight = weight.detach()
        self.table = FrequencyTable(weight.shape[0])
        self._heads: dict[int, tuple[int, DraftHead]] = {}  # size -> (table version, head)

    def head(self, size: int) -> DraftHead | None:
        """The head over the `size` most frequent tokens; None when that is the whole vocabulary."""
        if size <= 0 or size >= self._weight.shape[0]:
            return None
        version, head = self._heads.get(size, (-1, None))
        if head is None or version != self.table.version:
            ids = self.table.top(size)
            if head is None or not torch.equal(ids, head.token_ids.cpu()):
                head = DraftHead(self._weight, ids)
            self._heads[size] = (self.table.version, head)
        return head
