"""Gumbel mode (sampling.py) and its tree verification (verify.py), without a model.

The Gumbel-max pick over many seeds follows the processed p (temperature, top-k, top-p); so
does the first token a tree verification emits, whatever the tree and however its drafts were
made; and tree verification commits exactly the tokens plain Gumbel-max decoding picks, on a
hand-built "model" whose next-token logits are a function of the prefix. Engine-level tests:
test_gumbel_engine.py.
"""

import hashlib

import numpy as np
import pytest
import torch
from scipy.stats import kstest

import spirit.verify as verify_module
from spirit.tree import DraftTree
from spirit.sampling import (
    KEEP_POSITIONS,
    GumbelNoise,
    SamplingParams,
    gumbel_noise,
    gumbel_pick,
    perturbed_logprobs,
    pick,
    probabilities,
    randomness,
)
from spirit.verify import verify_tree_gumbel
from test_tree_sampling import chi_square_p

LOGITS = torch.tensor([1.2, -0.3, 0.9, -4.0, 0.2, 1.0])
P = torch.softmax(LOGITS, -1)
FREE = SamplingParams(temperature=1.0, mode="gumbel")
TRIALS = 20_000


def test_the_noise_is_a_function_of_seed_and_position():
    a = gumbel_noise(7, 12, 1000)
    assert a.dtype == torch.float32 and a.shape == (1000,)
    assert torch.equal(a, gumbel_noise(7, 12, 1000))
    assert not torch.equal(a, gumbel_noise(7, 13, 1000)) and not torch.equal(a, gumbel_noise(8, 12, 1000))
    # the server accepts seeds in [-2^63, 2^64)
    for seed in (-(1 << 63), (1 << 64) - 1):
        assert torch.isfinite(gumbel_noise(seed, 0, 10)).all()


def test_the_noise_is_standard_gumbel():
    sample = torch.cat([gumbel_noise(3, t, 5000) for t in range(4)]).double().numpy()
    assert kstest(sample, "gumbel_r").pvalue > 1e-3


def test_kept_noise_survives_eviction():
    noise = GumbelNoise(5, 50)
    first = noise.at(0).clone()
    for t in range(1, KEEP_POSITIONS + 10):  # position 0 is evicted on the way
        noise.at(t)
    assert torch.equal(noise.at(0), first)


TOP_K = SamplingParams(temperature=0.7, top_k=3, mode="gumbel")
TOP_P = SamplingParams(temperature=1.3, top_p=0.8, mode="gumbel")


@pytest.mark.parametrize("params", [FREE, TOP_K, TOP_P])
def test_the_gumbel_pick_follows_the_processed_distribution(params):
    expected = probabilities(LOGITS, params)
    counts = np.zeros(len(LOGITS))
    for seed in range(TRIALS):
        counts[gumbel_pick(LOGITS, params, gumbel_noise(seed, 0, len(LOGITS)))] += 1
    assert chi_square_p(counts, expected) > 1e-4


def test_modes():
    assert SamplingParams(temperature=0.7, seed=1).gumbel  # auto: seeded requests repeat
    assert not SamplingParams(temperature=0.7).gumbel  # auto: unseeded ones keep rejection sampling
    assert SamplingParams(temperature=0.7, mode="gumbel").gumbel
    assert not SamplingParams(temperature=0.7, seed=1, mode="rejection").gumbel
    assert not SamplingParams(seed=1, mode="gumbel").gumbel  # greedy has no randomness
    assert isinstance(randomness(SamplingParams(temperature=0.7, mode="gumbel"), 10), GumbelNoise)
    assert isinstance(randomness(SamplingParams(temperature=0.7, seed=1, mode="rejection"), 10), torch.Generator)
    assert randomness(SamplingParams(), 10) is None
    with pytest.raises(ValueError, match="sampling mode"):
        SamplingParams(mode="typical")


def test_an_unseeded_gumbel_request_varies():
    params = SamplingParams(temperature=1.0, mode="gumbel")
    logits = torch.zeros(1000)
    assert len({pick(logits, params, randomness(params, 1000), 0) for _ in range(5)}) > 1


# -- tree verification ----------------------------------------------------------------------------

Q = torch.softmax(torch.tensor([0.2, 0.9, -0.5, 1.5, 0.0, 0.4]), -1)  # a draft that is off


def first_token_counts(build, trials=TRIALS, verify=verify_tree_gumbel) -> np.ndarray:
    """Histogram of the first emitted token over seeds; the root is at position 4 and its row
    is LOGITS (deeper rows do not matter for the first token)."""
    counts = np.zeros(len(LOGITS))
    for seed in range(trials):
        noise = GumbelNoise(seed, len(LOGITS))
        tree = build(noise)
        target = torch.stack([LOGITS] + [torch.zeros(len(LOGITS))] * (tree.size - 1))
        verdict = verify(tree, target, FREE, noise, 4)
        counts[tree.tokens[verdict.path[0]] if verdict.path else verdict.next_token] += 1
    return counts


def coupled_draft(noise: GumbelNoise) -> DraftTree:
    """What the layer-skip draft does: the top-2 of q's scores under the same noise."""
    tree = DraftTree(0)
    for token in perturbed_logprobs(Q.log(), FREE, noise.at(5)).topk(2).indices.tolist():
        tree.add(tree.add(0, token), 1)
    return tree


def fixed_guesses(noise: GumbelNoise) -> DraftTree:
    tree = DraftTree(0)
    for token in (3, 0, 5):  # a guess with tiny p first, as prompt lookup might make
        tree.add(0, token)
    return tree


@pytest.mark.parametrize("build", [coupled_draft, fixed_guesses])
def test_the_first_emitted_token_follows_p_whatever_the_tree(build):
    assert chi_square_p(first_token_counts(build), P) > 1e-4


def test_a_rule_that_trusts_the_draft_is_caught():
    """Accepting a child whenever it is among the target's two best perturbed scores (a
    'close enough' rule) favours the draft's tokens: the test sees it."""

    def lenient(tree, target, params, noise, root):
        scores = perturbed_logprobs(target[0], params, noise.at(root + 1))
        best = scores.topk(2).indices.tolist()
        for c in tree.children(0):
            if tree.tokens[c] in best:
                return verify_module.TreeVerdict([c], 0)
        return verify_module.TreeVerdict([], best[0])

    assert chi_square_p(first_token_counts(coupled_draft, trials=10_000, verify=lenient), P) < 1e-6


VOCAB = 12


def toy_logits(prefix: list[int]) -> torch.Tensor:
    """A hand-built model: next-token logits [VOCAB], a pure function of the whole prefix."""
    key = int.from_bytes(hashlib.blake2b(repr(prefix).encode(), digest_size=8).digest(), "little")
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(key)) * 2.0


def plain_decode(prompt: list[int], params: SamplingParams, seed: int, n: int) -> list[int]:
    ids, noise = list(prompt), GumbelNoise(seed, VOCAB)
    while len(ids) < len(prompt) + n:
        ids.append(pick(toy_logits(ids), params, noise, len(ids)))
    return ids[len(prompt):]


def random_tree(root: int, gen: torch.Generator) -> DraftTree:
    tree = DraftTree(root)
    for _ in range(int(torch.randint(1, 12, (), generator=gen))):
        parent = int(torch.randint(0, tree.size, (), generator=gen))
        tree.add(parent, int(torch.randint(0, VOCAB, (), generator=gen)))
    return tree


@pytest.mark.parametrize("params", [FREE, SamplingParams(temperature=0.7, top_k=4, top_p=0.9, mode="gumbel")])
def test_tree_verification_commits_plain_decodings_tokens(params):
    """Speculative rounds with random trees give plain Gumbel-max decoding's tokens exactly.
    Random trees guess right rarely; the toy model is peaked enough at low temperature that
    some guesses are accepted, and both paths through the tree are exercised."""
    prompt = [1, 2, 3]
    gen = torch.Generator().manual_seed(0)
    accepted = 0
    for seed in range(20):
        expected = plain_decode(prompt, params, seed, 16)
        ids, noise = list(prompt), GumbelNoise(seed, VOCAB)
        while len(ids) < len(prompt) + 16:
            tree = random_tree(ids[-1], gen)
            if seed % 2:  # half the rounds also hold the right next token somewhere
                tree.add(0, expected[len(ids) - len(prompt)])
            rows = [toy_logits(ids + [tree.tokens[n] for n in tree.path_to(node)]) for node in range(tree.size)]
            verdict = verify_tree_gumbel(tree, torch.stack(rows), params, noise, len(ids) - 1)
            accepted += verdict.accepted
            ids += [tree.tokens[n] for n in verdict.path] + [verdict.next_token]
        assert ids[len(prompt): len(prompt) + 16] == expected, seed
    assert accepted > 20
