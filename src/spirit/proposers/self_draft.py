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
from spirit.model.adapter import SkippableModel
from spirit.model.kv_cache import KVCache
from spirit.proposers.base import DraftContext, Proposer
from spirit.sampling import GumbelNoise, SamplingParams, perturbed_logprobs, probabilities, sample
from spirit.skipset import DraftConfig
from spirit.tree import DraftTree


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
    """A tree of up to `limit` chain tokens plus leaves, rooted at the pending token ids[-1].
    `mlps`: per-layer MLPs the draft runs instead of the model's own (quantized copies at
    config.draft_bits); `head`: a reduced-vocabulary head (config.draft_vocab).
    The chain ends at a token of `stop_ids` (end of sequence): what follows it is never
    used, and short answers (one sentence) would otherwise pay for a full draft past it.
    `generator`: the request's randomness (sampling.randomness); Gumbel noise makes the
    draft deterministic, so its nodes carry no q."""
    assert config.skip is not None
    committed = len(ids) - 1
    token = ids[-1]
    chain: list[int] = []
    chain_dists: list[torch.Tensor] = []
    leaves: list[tuple[int, int, torch.Tensor | None]] = []  # (parent node, token, q)
    deterministic = sampling.greedy or isinstance(generator, GumbelNoise)
    for j in range(limit):
        step = torch.tensor([[token]], device=model.device)
        hidden = model.hidden_states(step, committed + j, cache, config.skip, mlps=mlps)[0, -1]  # [hidden]
        # [vocab], -inf outside a reduced head
        logits = model.logits(hidden) if head is None else head.logits(hidden, model.capped)
        if isinstance(generator, GumbelNoise):  # this token is at position committed + j + 1
            logits = perturbed_logprobs(logits, sampling, generator.at(committed + j + 1))
        probs = torch.softmax(logits, dim=-1) if deterministic else probabilities(logits, sampling)
        confidence = float(probs.max())
        branch = config.branches > 1 and confidence < config.branch_below
        if deterministic:
            if branch:
                top = torch.topk(probs, config.branches).indices.tolist()
                token = top[0]
                leaves += [(j, t, None) for t in top[1:]]
            else:
                token = int(probs.argmax())
        else:
            # siblings are further independent draws from the same q (verify.py needs that)
            token = sample(probs, generator)
            chain_dists.append(probs)
            if branch:
                leaves += [(j, sample(probs, generator), probs) for _ in range(config.branches - 1)]
        chain.append(token)
        if confidence < config.threshold or token in stop_ids:
            break
    tree = DraftTree.chain(ids[-1], chain, chain_dists or None)
    for parent, leaf, dist in leaves:
        if tree.full:
            break
        if deterministic and tree.child(parent, leaf) is not None:
            continue
        tree.add(parent, leaf, dist)
    return tree


class SelfDraft(Proposer):
    """The model drafting for itself (DraftConfig.skip: the sublayers it skips)."""

    name = "self"

    def enabled(self, config: DraftConfig) -> bool:
        return config.skip is not None

    def propose(self, context: DraftContext, budget: int) -> DraftTree:
        config, r = context.config, self.resources
        return draft_layerskip(r.model, context.ids, context.cache, config, context.sampling, context.generator,
                               budget, r.head(config.draft_vocab), r.mlps(config.draft_bits), context.stop_ids)
