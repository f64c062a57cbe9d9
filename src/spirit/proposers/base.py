"""The one interface every draft source implements.

A proposer guesses what follows the text so far as a token tree (tree.py) that one full-model
pass then verifies. The engine keeps one proposer per source for the length of a request (a
source may index the text as it grows), asks the sources the window's DraftConfig enables,
in the order proposers/__init__.py lists them, and takes the first tree that drafts a token;
after verification every source hears what was accepted.

Anchors: transformers' `CandidateGenerator` (`get_candidates` plus
`update_candidate_strategy`) and vLLM v1's one-proposer-per-file `spec_decode/`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from spirit.model.adapter import SkippableModel
from spirit.model.kv_cache import KVCache
from spirit.sampling import GumbelNoise, SamplingParams
from spirit.skipset import DraftConfig
from spirit.tree import DraftTree


@dataclass(frozen=True)
class DraftResources:
    """What a request offers its draft sources: the model, and the learned or derived
    pieces a model draft may run instead of the model's own."""

    model: SkippableModel
    # per-layer MLP modules at `bits` (4 or 8) for drafts, None for 0 (the engine's, built once)
    mlps: Callable[[int], Sequence[nn.Module] | None]
    # the reduced draft head over the N most frequent tokens of this request's learner, or
    # None for the whole vocabulary (draft_model/vocab.py)
    head: Callable[[int], object | None]


@dataclass(frozen=True)
class DraftContext:
    """One round's question to a source: what follows `ids` (whose last token is pending,
    not yet in the KV cache)?"""

    ids: list[int]
    cache: KVCache  # slots >= len(ids) - 1 are scratch a model draft may write
    config: DraftConfig
    sampling: SamplingParams
    generator: torch.Generator | GumbelNoise | None
    stop_ids: frozenset[int]
    # a later source will be asked if this one drafts nothing: a weak guess may leave the
    # round to it
    fallback: bool = False


class Proposer(ABC):
    """A draft source. `name` identifies it in DraftConfig.sources and reports;
    `model_free` says that its drafts cost no model pass (the policy's cost model counts
    such rounds apart: stats.Counters.lookup_rounds)."""

    name: str = ""
    model_free: bool = False

    def __init__(self, resources: DraftResources) -> None:
        self.resources = resources

    def enabled(self, config: DraftConfig) -> bool:
        """Whether this window's configuration asks for this source (by default: by name
        in config.sources; the built-in sources read their own knobs)."""
        return self.name in config.sources

    @abstractmethod
    def propose(self, context: DraftContext, budget: int) -> DraftTree:
        """A tree rooted at context.ids[-1] with at most `budget` drafted tokens along any
        path; a root-only tree means no guess this round."""

    def accepted(self, tree: DraftTree, path: Sequence[int]) -> None:
        """Feedback after verification: the nodes of `tree` that were accepted (root
        excluded), in order. Default: nothing to learn."""
