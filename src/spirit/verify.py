"""Verification of a draft against the full model: pure functions, no model, no cache.

Terms, used the same way everywhere in spirit (engine, stats, benchmark, server):
- *draft tokens* d_1..d_k: proposed by the draft pass.
- *accepted tokens*: the longest prefix d_1..d_n that verification keeps (0 <= n <= k).
- *recovered token*: when d_{n+1} is rejected, the token the full model emits in its place
  (greedy: its argmax; sampling: a draw from the residual distribution).
- *bonus token*: when all k are accepted, the full model's token after d_k, which the same
  verification pass produced for free.
Each verification therefore commits n + 1 tokens: n accepted plus one recovered-or-bonus.

Sampling follows speculative sampling (Leviathan et al., 2023, "Fast Inference from
Transformers via Speculative Decoding", Alg. 1; Chen et al., 2023): accept d_j with
probability min(1, p(d_j) / q(d_j)); on rejection draw from norm(max(0, p - q)). The
committed tokens are then distributed exactly as the full model's own samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spirit.sampling import sample


@dataclass(frozen=True)
class Verdict:
    accepted: int  # n: how many draft tokens were kept
    next_token: int  # the recovered token (n < k) or the bonus token (n == k)


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """draft_tokens: [k] ids; target_logits: [k+1, vocab], row j scores the token after
    the j-th input (row 0 follows the last committed token)."""
    target_tokens = target_logits.argmax(dim=-1)  # [k+1]
    k = draft_tokens.shape[0]
    mismatches = (draft_tokens != target_tokens[:k]).nonzero()
    accepted = int(mismatches[0]) if mismatches.numel() else k
    return Verdict(accepted, int(target_tokens[accepted]))


def verify_sampling(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> Verdict:
    """draft_tokens: [k]; draft_probs: [k, vocab] (q, the distributions d_j was drawn from);
    target_probs: [k+1, vocab] (p, processed exactly like q)."""
    k = draft_tokens.shape[0]
    rows = torch.arange(k)
    p_tok = target_probs[rows, draft_tokens]  # [k]
    q_tok = draft_probs[rows, draft_tokens]  # [k]
    uniforms = torch.rand(k, generator=generator)
    # accept when u < p/q, written without a division so that q == 0 (impossible for a
    # sampled token, but cheap to guard) never accepts
    accept = uniforms * q_tok < p_tok
    rejected = (~accept).nonzero()
    if not rejected.numel():
        return Verdict(k, sample(target_probs[k], generator))
    n = int(rejected[0])
    residual = (target_probs[n] - draft_probs[n]).clamp_min(0.0)
    total = residual.sum()
    # p == q exactly leaves no residual mass; then any draw from p is exact
    recovered = sample(residual / total if total > 0 else target_probs[n], generator)
    return Verdict(n, recovered)
