"""Verification of a draft against the full model: pure functions, no model, no cache.

Terms, used the same way everywhere in spirit (engine, stats, benchmark, server):
- *draft tokens* d_1..d_k: proposed by the draft pass.
- *accepted tokens*: the longest prefix d_1..d_n that verification keeps (0 <= n <= k).
- *recovered token*: when d_{n+1} is rejected, the token the full model emits in its place
  (greedy: its argmax; sampling: a draw from the residual distribution; Gumbel mode: the
  argmax of its perturbed scores).
- *bonus token*: when all k are accepted, the full model's token after d_k, which the same
  verification pass produced for free.
Each verification therefore commits n + 1 tokens: n accepted plus one recovered-or-bonus.

Sampling follows speculative sampling (Leviathan et al., 2023, "Fast Inference from
Transformers via Speculative Decoding", Alg. 1; Chen et al., 2023): accept d_j with
probability min(1, p(d_j) / q(d_j)); on rejection draw from norm(max(0, p - q)). The
committed tokens are then distributed exactly as the full model's own samples.

Gumbel mode (sampling.py) fixes the noise of every position in advance, so the full model's
token at each node is determined, as in greedy decoding: argmax(log p + g) instead of
argmax(logits). Verification is then greedy verification of those perturbed scores, and the
committed tokens are the ones plain Gumbel-max decoding with the same seed commits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from spirit.tree import DraftTree
from spirit.sampling import GumbelNoise, SamplingParams, gumbel_pick, sample


@dataclass(frozen=True)
class Verdict:
    accepted: int  # n: how many draft tokens were kept
    next_token: int  # the recovered token (n < k) or the bonus token (n == k)


@dataclass(frozen=True)
class TreeVerdict:
    path: list[int]  # accepted nodes, root's child first (see tree.py); len = accepted
    next_token: int  # recovered or bonus token after the last accepted node

    @property
    def accepted(self) -> int:
        return len(self.path)


def verify_tree_greedy(tree: DraftTree, target_logits: torch.Tensor) -> TreeVerdict:
    """target_logits: [size, vocab], row i scores the token after node i. From the root,
    follow the child whose token is the full model's argmax; stop where none is."""
    target_tokens = target_logits.argmax(dim=-1).tolist()  # [size]
    return _follow(tree, target_tokens.__getitem__)


def verify_tree_gumbel(
    tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams, noise: GumbelNoise, root_position: int
) -> TreeVerdict:
    """Gumbel-mode verification (exact sampling by the Gumbel-max trick; see sampling.py).

    target_logits: [size, vocab], row i scores the token after node i; the root (the pending
    token) sits at absolute position `root_position`, so the token after node i is at
    root_position + depth(i) + 1, and the full model's token there is argmax(log p_i + g)
    with that position's noise g. From the root, follow the child holding it; stop where none does.
    Drafts may come from anywhere (their q plays no part): the verdict depends only on the
    target and the noise. Only the rows on the followed path are processed.
    """

    def target_token(node: int) -> int:
        return gumbel_pick(target_logits[node], params, noise.at(root_position + tree.depths[node] + 1))

    return _follow(tree, target_token)


def _follow(tree: DraftTree, target_token: Callable[[int], int]) -> TreeVerdict:
    """The accepted path when the full model's token after each node is determined
    (`target_token(node)`): from the root, follow the child holding it; where no child
    does, that token is the recovered one (or the bonus one, past a leaf)."""
    node, path = 0, []
    while (nxt := tree.child(node, token := target_token(node))) is not None:
        path.append(nxt)
        node = nxt
    return TreeVerdict(path, token)


def verify_tree_sampling(tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator) -> TreeVerdict:
    """target_probs: [size, vocab] (p, processed exactly like the drafts' q).

    Multi-candidate speculative sampling (SpecInfer, Miao et al., 2024, Alg. 2; one
    candidate is Leviathan et al.'s rule): at a node, try its children in order. Child c,
    drawn from q_c independently of the others, is accepted with probability
    min(1, p(c) / q_c(c)); on rejection the target becomes the residual norm(max(0, p - q_c))
    and the next child is tried against it. Each try is an exact speculative step on the
    current target, so the emitted token is distributed as the node's p; if every child is
    rejected, the token is drawn from the last residual. A child proposed deterministically
    (q = None) has q = one-hot, so it is accepted with probability p(c).
    """
    node, path = 0, []
    while True:
        p = target_probs[node]
        moved = False
        for c in tree.children(node):
            token = tree.tokens[c]
            q = tree.dists[c]
            q_tok = 1.0 if q is None else float(q[token])
            # u < p/q, written without a division (q == 0 is impossible for a drawn token)
            if float(torch.rand((), generator=generator)) * q_tok < float(p[token]):
                path.append(c)
                node, moved = c, True
                break
            p = _residual(p, q, token)
        if not moved:
            return TreeVerdict(path, sample(p, generator))


def _residual(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    if q is None:
        residual = p.clone()
        residual[token] = 0.0
    else:
        residual = (p - q).clamp_min(0.0)
    total = residual.sum()
    # p == q leaves no residual mass; rejection then has probability 0, any draw from p is exact
    return residual / total if total > 0 else p


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """A chain: draft_tokens [k] ids; target_logits [k+1, vocab], row j scores the token
    after the j-th input (row 0 follows the last committed token)."""
    tree = DraftTree.chain(-1, draft_tokens.tolist())
    verdict = verify_tree_greedy(tree, target_logits)
    return Verdict(verdict.accepted, verdict.next_token)


def verify_sampling(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> Verdict:
    """A chain: draft_tokens [k]; draft_probs [k, vocab] (q, the distributions d_j was drawn
    from); target_probs [k+1, vocab]."""
    tree = DraftTree.chain(-1, draft_tokens.tolist(), list(draft_probs))
    verdict = verify_tree_sampling(tree, target_probs, generator)
    return Verdict(verdict.accepted, verdict.next_token)
