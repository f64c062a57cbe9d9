"""Prompt lookup: drafts that cost no model pass.

Summaries, RAG answers, extraction and code edits copy spans of their prompt, and long
answers repeat themselves. If the last n tokens of the text occurred before, the tokens that
followed them then are a free guess at what follows now (Saxena, 2023, "Prompt Lookup
Decoding"; transformers' `PromptLookupCandidateGenerator`). Several earlier occurrences
with different continuations become branches of one token tree.

The index maps every n-gram (MIN_N <= n <= MAX_N) to the positions right after its
occurrences and is extended incrementally, so a lookup costs the same at any context length
(no scan of the whole text per step, unlike transformers' generator).
"""

from __future__ import annotations

from collections import defaultdict

from spirit.drafts.tree import DraftTree

MAX_N = 4  # longest suffix matched; longer matches are rarer and add little
MIN_N = 2  # a single-token match is mostly a false lead
OCCURRENCES = 4  # most recent occurrences of an n-gram kept as candidates


class NgramIndex:
    """n-gram -> positions after its occurrences, over one growing token sequence."""

    def __init__(self, max_n: int = MAX_N, min_n: int = MIN_N) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self._after: dict[tuple[int, ...], list[int]] = defaultdict(list)
        self._indexed = 0  # n-grams ending before this position are in the index

    def extend(self, ids: list[int]) -> None:
        """Index the n-grams of `ids` (the whole sequence so far, which only grows) that end
        before its last token: those are the ones with a known continuation."""
        for end in range(max(self._indexed, self.min_n), len(ids)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                positions = self._after[tuple(ids[end - n : end])]
                positions.append(end)
                del positions[:-OCCURRENCES]
        self._indexed = max(self._indexed, len(ids))

    def propose(self, ids: list[int], max_tokens: int, branches: int = 1) -> DraftTree:
        """A tree rooted at ids[-1] from the longest suffix of `ids` seen before: up to
        `branches` continuations (most recent occurrence first), each up to `max_tokens`
        long, merged where they share a prefix. A root-only tree means no match."""
        self.extend(ids)
        tree = DraftTree(ids[-1])
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            starts = self._after.get(tuple(ids[len(ids) - n :]))
            if not starts:
                continue
            for start in reversed(starts[-branches:]):
                node = 0
                for token in ids[start : start + max_tokens]:
                    found = tree.child(node, token)
                    if found is None and tree.full:
                        break
                    node = found if found is not None else tree.add(node, token)
            return tree
        return tree
