"""Every learner that changes drafts, named and owned in one place.

Today there is one kind: the token-frequency table behind the reduced draft head
(vocab.py), which learns from the prompts and outputs of the requests that use it. A request
drafts with, and teaches, one learner by name. Every request shares SHARED_LEARNER unless its
caller names another: the benchmark gives each method its own, so that no method drafts from
another's output, and throws a warm-up's away.

What a learner learned changes only which drafts are proposed, never the output: verification
always uses the full model.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from spirit.draft_model.vocab import DraftHeads

SHARED_LEARNER = "shared"


class DraftLearners:
    """Learned draft state by learner name, each fresh (the rank prior alone) on first use."""

    def __init__(self, lm_head_weight: torch.Tensor) -> None:
        self._weight = lm_head_weight
        self._by_name: dict[str, DraftHeads] = {SHARED_LEARNER: DraftHeads(lm_head_weight)}

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def names(self) -> list[str]:
        return list(self._by_name)

    def get(self, name: str = SHARED_LEARNER) -> DraftHeads:
        if name not in self._by_name:
            self._by_name[name] = DraftHeads(self._weight)
        return self._by_name[name]

    def forget(self, name: str) -> None:
        """Drop what `name` learned (e.g. a throwaway warm-up's); the shared one stays."""
        if name != SHARED_LEARNER:
            self._by_name.pop(name, None)

    def start(self, name: str, prompt_ids: Iterable[int], always: Iterable[int]) -> DraftHeads:
        """A request begins: its prompt's tokens are likely to be copied, and `always`
        (end-of-sequence tokens) must stay in every reduced head."""
        heads = self.get(name)
        heads.table.observe(prompt_ids)
        heads.table.pin(always)
        return heads

    def finish(self, name: str, output_ids: Iterable[int]) -> None:
        """A request ended: learn the tokens it produced."""
        self.get(name).table.observe(output_ids)
