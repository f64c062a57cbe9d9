"""Draft sources, each in its own file behind one interface (base.py).

SOURCES is the one list of them, in the order a round asks them: a round takes the first
tree that drafts a token. Prompt lookup comes first because its drafts are free; the model's
own draft last, because it always has a guess. Adding a source: a new file with a Proposer
subclass, and its class here (a DraftConfig enables it by name in `sources`).
"""

from __future__ import annotations

from spirit.proposers.base import DraftContext, DraftResources, Proposer
from spirit.proposers.prompt_lookup import PromptLookup
from spirit.proposers.self_draft import SelfDraft

SOURCES: tuple[type[Proposer], ...] = (PromptLookup, SelfDraft)


def source_names() -> tuple[str, ...]:
    return tuple(source.name for source in SOURCES)


def for_request(resources: DraftResources, sources: tuple[type[Proposer], ...] = SOURCES) -> list[Proposer]:
    """One proposer per source for a new request, in the order rounds ask them."""
    return [source(resources) for source in sources]


__all__ = ["SOURCES", "DraftContext", "DraftResources", "Proposer", "for_request", "source_names"]
