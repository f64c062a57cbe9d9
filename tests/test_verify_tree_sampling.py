"""Multi-candidate speculative sampling over a token tree preserves the target distribution."""

import torch
from scipy.stats import chisquare

from spirit.tree import DraftTree
from spirit.verify import verify_tree_greedy, verify_tree_sampling

P = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])  # target at the root
Q = torch.tensor([0.40, 0.05, 0.25, 0.05, 0.15, 0.10])  # a poor draft, on purpose
TRIALS = 20000


def first_tokens(build, trials: int = TRIALS, seed: int = 0) -> torch.Tensor:
    """Histogram of the first emitted token over many trees built by build(generator)."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(len(P))
    for _ in range(trials):
        tree, target = build(gen)
        verdict = verify_tree_sampling(tree, target, gen)
        token = tree.tokens[verdict.path[0]] if verdict.path else verdict.next_token
        counts[token] += 1
    return counts


def p_value(counts: torch.Tensor, p: torch.Tensor = P) -> float:
    return chisquare(counts.numpy(), (p * counts.sum()).numpy()).pvalue


def targets(size: int) -> torch.Tensor:
    return torch.stack([P] + [torch.full((len(P),), 1 / len(P))] * (size - 1))


def iid_children(n: int):
    def build(gen):
        tree = DraftTree(0)
        for _ in range(n):  # independent draws from q, duplicates kept
            tree.add(0, int(torch.multinomial(Q, 1, generator=gen)), Q)
        return tree, targets(tree.size)
    return build


def test_iid_candidates_preserve_p():
    for n in (1, 2, 4):
        assert p_value(first_tokens(iid_children(n))) > 1e-4


def test_deterministic_candidates_preserve_p():
    def build(gen):
        tree = DraftTree(0)
        for token in (2, 4, 0):  # prompt-lookup style: fixed guesses, q = one-hot
            tree.add(0, token)
        return tree, targets(tree.size)
    assert p_value(first_tokens(build)) > 1e-4


def test_mixed_candidates_and_depth_preserve_p():
    def build(gen):
        tree = DraftTree(0)
        first = tree.add(0, int(torch.multinomial(Q, 1, generator=gen)), Q)
        tree.add(first, 3, None)  # a deeper node does not change the root's distribution
        tree.add(0, 1)  # a deterministic sibling after a sampled one
        tree.add(0, int(torch.multinomial(Q, 1, generator=gen)), Q)
        return tree, targets(tree.size)
    assert p_value(first_tokens(build)) > 1e-4


def test_a_wrong_rule_is_caught():
    """Accepting every candidate blindly gives q, not p: the test can tell them apart."""
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(len(P))
    for _ in range(TRIALS):
        counts[int(torch.multinomial(Q, 1, generator=gen))] += 1
    assert p_value(counts) < 1e-6


def test_second_level_is_distributed_as_p_given_the_first():
    """The token after an accepted node follows that node's target row."""
    p1 = torch.tensor([0.1, 0.1, 0.5, 0.1, 0.1, 0.1])

    def build(gen):
        tree = DraftTree(0)
        a = tree.add(0, 1)  # deterministic, accepted with probability P[1]
        tree.add(a, int(torch.multinomial(Q, 1, generator=gen)), Q)
        return tree, torch.stack([P, p1, P])

    gen = torch.Generator().manual_seed(2)
    counts = torch.zeros(len(P))
    build_tree = build
    for _ in range(TRIALS):
        tree, target = build_tree(gen)
        verdict = verify_tree_sampling(tree, target, gen)
        if verdict.path and verdict.path[0] == 1:
            second = tree.tokens[verdict.path[1]] if len(verdict.path) > 1 else verdict.next_token
            counts[second] += 1
    assert counts.sum() > 0.2 * TRIALS
    assert p_value(counts, p1) > 1e-4


def test_greedy_follows_the_argmax_through_branches():
    tree = DraftTree(9)
    a = tree.add(0, 1)
    b = tree.add(0, 2)
    tree.add(a, 3)
    c = tree.add(b, 4)
    logits = torch.full((tree.size, 6), -5.0)
    logits[0, 2] = 1  # root -> 2 (the second branch)
    logits[b, 4] = 1  # 2 -> 4
    logits[c, 5] = 1  # after 4 the model says 5: bonus token
    verdict = verify_tree_greedy(tree, logits)
    assert verdict.path == [b, c] and verdict.next_token == 5
