"""Prompt lookup: drafts that cost no model pass.

Summaries, RAG answers, extraction and code edits copy spans of their prompt, and long
answers repeat themselves. If the last n tokens of the text occurred before, the tokens that
followed them then are a free guess at what follows now (Saxena, 2023, "Prompt Lookup
Decoding"; transformers' `PromptLookupCandidateGenerator`). Several earlier occurrences
with different continuations become branches of one token tree.

The index maps every n-gram (MIN_N <= n <= MAX_N) to the positions right after its
occurrences and is extended incrementally, so a lookup costs the same at any context length
(no scan of the whole text per step, unlike transformers' generator).

How far to copy depends on how long the match is (DRAFT_LENGTH): a 4-token match predicts a
long copy, a 1-token match only a guess at the next token. The guess is worth verifying
because a pass over 2 tokens costs what a pass over 1 does on a CPU in bf16, while a long
wrong guess is not free (qwen2.5-coder-1.5b, 2 threads: 2 tokens 0.95x, 4 tokens 1.07x,
8 tokens 1.2x, 16 tokens 1.46x of a one-token pass).
"""

from __future__ import annotations

from collections import defaultdict

from spirit.proposers.base import DraftContext, DraftResources, Proposer
from spirit.skipset import DraftConfig
from spirit.tree import DraftTree

MAX_N = 4  # longest suffix matched; longer matches are rarer and add little
MIN_N = 1  # a single-token match is a weak guess, but a nearly free one (see above)
STRONG_MATCH = 2  # with a layer-skip draft on offer, weaker matches leave the round to it
OCCURRENCES = 4  # most recent occurrences of an n-gram kept as candidates
# Tokens drafted after a match of n tokens. Chosen by replaying vanilla's greedy outputs on
# the 13 Spec-Bench categories against the measured cost of a k-token pass
# (benchmarks/lookup_replay.py): 1.48x fewer pass-equivalents than plain decoding, against
# 1.38x for 8 tokens after any match of 2 or more (the earlier rule).
DRAFT_LENGTH = {1: 1, 2: 3, 3: 6, 4: 10}


class NgramIndex:
    """n-gram -> positions after its occurrences, over one growing token sequence."""

    def __init__(
        self, max_n: int = MAX_N, min_n: int = MIN_N, lengths: dict[int, int] | None = DRAFT_LENGTH
    ) -> None:
        """`lengths`: tokens drafted after a match of n tokens (at most `max_tokens` of a
        proposal); a length missing from it means no cap. None: always `max_tokens`."""
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.lengths = dict(lengths or {})
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

    def propose(
        self, ids: list[int], max_tokens: int, branches: int = 1, shortest: int | None = None
    ) -> DraftTree:
        """A tree rooted at ids[-1] from the longest suffix of `ids` seen before (at least
        `shortest` tokens long, default min_n): up to `branches` continuations (most recent
        occurrence first), each up to `max_tokens` and the match length's DRAFT_LENGTH
        long, merged where they share a prefix. A root-only tree means no match."""
        shortest = self.min_n if shortest is None else shortest
        if shortest < self.min_n:
            raise ValueError(f"shortest match {shortest} is below the index's min_n {self.min_n}")
        self.extend(ids)
        tree = DraftTree(ids[-1])
        for n in range(min(self.max_n, len(ids) - 1), shortest - 1, -1):
            starts = self._after.get(tuple(ids[len(ids) - n :]))
            if not starts:
                continue
            length = min(max_tokens, self.lengths.get(n, max_tokens))
            for start in reversed(starts[-branches:]):
                node = 0
                for token in ids[start : start + length]:
                    found = tree.child(node, token)
                    if found is None and tree.full:
                        break
                    node = found if found is not None else tree.add(node, token)
            return tree
        return tree


class PromptLookup(Proposer):
    """Drafts copied from earlier text, at no model cost (DraftConfig.ngram)."""

    name = "lookup"
    model_free = True

    def __init__(self, resources: DraftResources) -> None:
        super().__init__(resources)
        self.index = NgramIndex()  # over this request's prompt and output

    def enabled(self, config: DraftConfig) -> bool:
        return config.ngram

    def propose(self, context: DraftContext, budget: int) -> DraftTree:
        # with a model draft to fall back on, a match shorter than STRONG_MATCH tokens leaves
        # the round to it: the policy measures which of the two pays (lookup alone is an arm)
        shortest = STRONG_MATCH if context.fallback else None
        config = context.config
        return self.index.propose(context.ids, min(config.ngram_tokens, budget), config.branches, shortest=shortest)
