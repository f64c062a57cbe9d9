"""Self-speculative drafts: the model itself with some sublayers skipped, optionally with
low-bit MLPs and a reduced-vocabulary head (draft_model/).

The draft runs as a chain from the pending token, one skipping pass per token, writing its KV
in slots `committed + j` of the layers it runs (model/kv_cache.py says why that is safe),
and stops once its top-1 probability falls below the threshold. Where it is unsure
(top-1 below `branch_below`) the runner-ups join the tree as leaves: they cost no draft
pass, only rows of the verification pass, which on a CPU are nearly free.

Chain nodes are numbered 1..k, so node j's draft KV is in slot committed + j - 1 exactly as a
chain's; the leaves come after them.

In Gumbel mode (sampling.py) the draft perturbs its processed log-probabilities with the
noise of the position it drafts for, the very noise the target's token there will be picked
with, and then drafts greedily on those scores (runner-ups as leaves, as in greedy mode):
where q is close to p the two picks coincide, whatever the noise made them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from spirit.draft_model.vocab import DraftHead
from spirit.model.adapter import Segment, SkippableModel
from spirit.model.kv_cache import KVCache
from spirit.proposers.base import DraftContext, Proposer
from spirit.sampling import GumbelNoise, SamplingParams, perturbed_logprobs, probabilities, sample
from spirit.skipset import DraftConfig
from spirit.tree import DraftTree


class ChainDraft:
    """One request's draft chain in progress, a token at a time: `draft_layerskip` runs it
    alone, `draft_together` runs several requests' chains in packed passes (a batch whose
    requests draft with the same configuration). Each step drafts the token after `token`, at
    cache slot `slot`; `take` reads that step's logits and decides whether the chain goes on.

    `generator`: the request's randomness (sampling.randomness); Gumbel noise makes the draft
    deterministic, so its nodes carry no q. The chain ends at a token of `stop_ids` (end of
    sequence): what follows it is never used, and short answers (one sentence) would
    otherwise pay for a full draft past it."""

    def __init__(self, ids: list[int], cache: KVCache, config: DraftConfig, sampling: SamplingParams,
                 generator: torch.Generator | GumbelNoise | None, limit: int, head: DraftHead | None = None,
                 stop_ids: frozenset[int] = frozenset()) -> None:
        assert config.skip is not None
        self.root = ids[-1]
        self.committed = len(ids) - 1
        self.cache, self.config, self.sampling, self.generator = cache, config, sampling, generator
        self.limit, self.head, self.stop_ids = limit, head, stop_ids
        self.token = ids[-1]
        self.chain: list[int] = []
        self.chain_dists: list[torch.Tensor] = []
        self.leaves: list[tuple[int, int, torch.Tensor | None]] = []  # (parent node, token, q)
        self.done = limit < 1

    @property
    def deterministic(self) -> bool:
        """Greedy, or Gumbel noise: the draft picks tokens without sampling, so nodes carry no q."""
        return self.sampling.greedy or isinstance(self.generator, GumbelNoise)

    @property
    def slot(self) -> int:
        """The cache slot (and position) of the token the next step runs."""
        return self.committed + len(self.chain)

    def logits(self, model: SkippableModel, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] logits of final-normed `hidden` [rows, hidden]: -inf outside a reduced head."""
        return model.logits(hidden) if self.head is None else self.head.logits(hidden, model.capped)

    def take(self, logits: torch.Tensor) -> None:
        """The step's logits [vocab]: draft the next token (and runner-ups as leaves where unsure)."""
        config, sampling, generator, deterministic = self.config, self.sampling, self.generator, self.deterministic
        if isinstance(generator, GumbelNoise):  # this token is at position slot + 1
            logits = perturbed_logprobs(logits, sampling, generator.at(self.slot + 1))
        probs = torch.softmax(logits, dim=-1) if deterministic else probabilities(logits, sampling)
        confidence = float(probs.max())
        branch = config.branches > 1 and confidence < config.branch_below
        j = len(self.chain)
        if deterministic:
            if branch:
                top = torch.topk(probs, config.branches).indices.tolist()
                token = top[0]
                self.leaves += [(j, t, None) for t in top[1:]]
            else:
                token = int(probs.argmax())
        else:
            # siblings are further independent draws from the same q (verify.py needs that)
            token = sample(probs, generator)
            self.chain_dists.append(probs)
            if branch:
                self.leaves += [(j, sample(probs, generator), probs) for _ in range(config.branches - 1)]
        self.chain.append(token)
        self.token = token
        self.done = confidence < config.threshold or token in self.stop_ids or len(self.chain) >= self.limit

    def tree(self) -> DraftTree:
        tree = DraftTree.chain(self.root, self.chain, self.chain_dists or None)
        for parent, leaf, dist in self.leaves:
            if tree.full:
                break
            if self.deterministic and tree.child(parent, leaf) is not None:
                continue
            tree.add(parent, leaf, dist)
        return tree


@torch.inference_mode()
def draft_layerskip(
    model: SkippableModel,
    ids: list[int],
    cache: KVCache,
    config: DraftConfig,
    sampling: SamplingParams,
    generator: torch.Generator | GumbelNoise | None,
    limit: int,
    head: DraftHead | None = None,
    mlps: Sequence[nn.Module] | None = None,
    stop_ids: frozenset[int] = frozenset(),
) -> DraftTree:
    """A tree of up to `limit` chain tokens plus leaves, rooted at the pending token ids[-1],
    drafted alone (ChainDraft says how). `mlps`: per-layer MLPs the draft runs instead of the
    model's own (quantized copies at config.draft_bits); `head`: a reduced-vocabulary head
    (config.draft_vocab)."""
    draft = ChainDraft(ids, cache, config, sampling, generator, limit, head, stop_ids)
    while not draft.done:
        step = torch.tensor([[draft.token]], device=model.device)
        hidden = model.hidden_states(step, draft.slot, cache, config.skip, mlps=mlps)[0, -1:]  # [1, hidden]
        draft.take(draft.logits(model, hidden)[0])
    return draft.tree()


@torch.inference_mode()
def draft_together(model: SkippableModel, drafts: Sequence[ChainDraft], mlps: Sequence[nn.Module] | None = None) -> None:
    """Run several requests' chains, which skip the same sublayers (and run the same `mlps`),
    to their ends: each step is one packed pass over the token of every chain still going
    (model/adapter.py `hidden_packed`), so the chains share each step's reading of the weights;
    the logits of the rows that share a head are one product too. A chain that ends leaves
    the later steps."""
    skips = {draft.config.skip for draft in drafts}
    if len(skips) > 1:
        raise ValueError(f"chains drafted together must skip the same sublayers, got {len(skips)} skip sets")
    device = model.device
    while going := [draft for draft in drafts if not draft.done]:
        segments = [Segment(torch.tensor([draft.token], device=device), draft.slot, draft.cache) for draft in going]
        hidden = model.hidden_packed(segments, going[0].config.skip, mlps)  # [len(going), hidden]
        rows_by_head: dict[int, list[int]] = {}
        for row, draft in enumerate(going):
            rows_by_head.setdefault(id(draft.head), []).append(row)
        for rows in rows_by_head.values():
            logits = going[rows[0]].logits(model, hidden[rows])
            for row, row_logits in zip(rows, logits):
                going[row].take(row_logits)


class SelfDraft(Proposer):
    """The model drafting for itself (DraftConfig.skip: the sublayers it skips)."""

    name = "self"

    def enabled(self, config: DraftConfig) -> bool:
        return config.skip is not None

    def propose(self, context: DraftContext, budget: int) -> DraftTree:
        config, r = context.config, self.resources
        return draft_layerskip(r.model, context.ids, context.cache, config, context.sampling, context.generator,
                               budget, r.head(config.draft_vocab), r.mlps(config.draft_bits), context.stop_ids)

    def start(self, context: DraftContext, budget: int) -> ChainDraft:
        """The chain `propose` would run, not run yet: a batch runs it with other requests'
        chains that share its configuration (draft_together)."""
        return ChainDraft(context.ids, context.cache, context.config, context.sampling, context.generator, budget,
                          self.resources.head(context.config.draft_vocab), context.stop_ids)

    def mlps(self, config: DraftConfig) -> Sequence[nn.Module] | None:
        """The MLPs a chain of `config` runs instead of the model's own."""
        return self.resources.mlps(config.draft_bits)
