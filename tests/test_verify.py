"""Verification rules on hand-built logits, and a statistical test of speculative sampling."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from spirit.sampling import SamplingParams, probabilities
from spirit.verify import Verdict, verify_greedy, verify_sampling


def one_hot_logits(tokens, vocab=10):
    logits = torch.full((len(tokens), vocab), -5.0)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def test_greedy_accepts_all_and_adds_bonus():
    assert verify_greedy(torch.tensor([3, 4, 5]), one_hot_logits([3, 4, 5, 6])) == Verdict(3, 6)


def test_greedy_stops_at_first_mismatch_and_recovers():
    assert verify_greedy(torch.tensor([3, 9, 5]), one_hot_logits([3, 4, 5, 6])) == Verdict(1, 4)
    assert verify_greedy(torch.tensor([7]), one_hot_logits([3, 4])) == Verdict(0, 3)


def first_token_counts(p, q, trials, verify, seed=0):
    """Draw d ~ q, verify against p; count the first committed token."""
    gen = torch.Generator().manual_seed(seed)
    counts = np.zeros(p.shape[-1])
    drafts = torch.multinomial(q[0].expand(trials, -1), 1, replacement=True, generator=gen)[:, 0]
    for d in drafts.tolist():
        verdict = verify(torch.tensor([d]), q, p, gen)
        first = d if verdict.accepted >= 1 else verdict.next_token
        counts[first] += 1
    return counts


P = torch.tensor([[0.5, 0.3, 0.1, 0.1, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
Q = torch.tensor([[0.1, 0.1, 0.2, 0.3, 0.3]])


def chi_square_p(counts, probs):
    mask = probs > 0
    assert counts[~mask].sum() == 0, "a token with zero target probability was emitted"
    return chisquare(counts[mask], probs[mask] * counts.sum()).pvalue


def test_speculative_sampling_preserves_the_target_distribution():
    counts = first_token_counts(P, Q, 20_000, verify_sampling)
    assert chi_square_p(counts, P[0].numpy()) > 1e-3


def test_a_wrong_residual_is_caught():
    """Recovering from p instead of norm(max(0, p - q)) biases the output; the test sees it."""

    def broken(draft_tokens, draft_probs, target_probs, gen):
        verdict = verify_sampling(draft_tokens, draft_probs, target_probs, gen)
        if verdict.accepted == 0:
            return Verdict(0, int(torch.multinomial(target_probs[0], 1, generator=gen)))
        return verdict

    counts = first_token_counts(P, Q, 20_000, broken)
    assert chi_square_p(counts, P[0].numpy()) < 1e-6


def test_all_accepted_gives_a_bonus_draw_from_the_last_row():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    verdict = verify_sampling(torch.tensor([1]), p[:1], p, torch.Generator().manual_seed(0))
    assert verdict == Verdict(1, 2)


def test_probabilities_top_k_and_top_p():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    top1 = probabilities(logits, SamplingParams(temperature=1.0, top_k=1))
    assert top1.tolist() == [1.0, 0.0, 0.0, 0.0]
    nucleus = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.7))
    full = torch.softmax(logits, -1)
    assert nucleus[2:].sum() == 0 and nucleus[:2].sum() == pytest.approx(1.0)
    assert nucleus[0] / nucleus[1] == pytest.approx(float(full[0] / full[1]))


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0.0), dict(top_k=-2)])
def test_invalid_sampling_params(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)
