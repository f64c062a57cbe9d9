"""Prompt lookup (NgramIndex): longest suffix match, most recent first, a trie of branches."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spirit.proposers.prompt_lookup import DRAFT_LENGTH, MAX_N, MIN_N, OCCURRENCES, NgramIndex
from spirit.tree import MAX_NODES, DraftTree


def shape(tree: DraftTree) -> tuple[list[int], list[int]]:
    return tree.tokens, tree.parents


def reference(ids, max_tokens, branches, max_n=MAX_N, min_n=MIN_N, lengths=DRAFT_LENGTH):
    """Brute force: scan the whole sequence for the longest earlier occurrence of a suffix."""
    tree = DraftTree(ids[-1])
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        suffix = ids[len(ids) - n:]
        # an occurrence ending right before `end`, whose continuation ids[end] exists
        ends = [end for end in range(n, len(ids)) if ids[end - n:end] == suffix]
        if not ends:
            continue
        length = min(max_tokens, (lengths or {}).get(n, max_tokens))
        for start in reversed(ends[-OCCURRENCES:][-branches:]):
            node = 0
            for token in ids[start:start + length]:
                found = tree.child(node, token)
                if found is None and tree.full:
                    break
                node = found if found is not None else tree.add(node, token)
        return tree
    return tree


def test_longest_suffix_wins():
    # (1, 2, 3) occurred twice, but (9, 1, 2, 3) only before 5: the longer match decides
    ids = [1, 2, 3, 4, 9, 1, 2, 3, 5, 9, 1, 2, 3]
    tree = NgramIndex().propose(ids, max_tokens=4, branches=2)
    assert shape(tree) == ([3, 5, 9, 1, 2], [-1, 0, 1, 2, 3])
    # with a shorter maximum n the 3-gram match gives two branches, most recent first
    tree = NgramIndex(max_n=3).propose(ids, max_tokens=2, branches=2)
    assert shape(tree) == ([3, 5, 9, 4, 9], [-1, 0, 1, 0, 3])


def test_most_recent_occurrence_first():
    ids = [3, 1, 2, 7, 8, 4, 1, 2, 5, 6, 0, 1, 2]
    assert shape(NgramIndex().propose(ids, 3, branches=1)) == ([2, 5, 6, 0], [-1, 0, 1, 2])
    two = NgramIndex().propose(ids, 3, branches=2)
    assert shape(two) == ([2, 5, 6, 0, 7, 8, 4], [-1, 0, 1, 2, 0, 4, 5])
    assert all(d is None for d in two.dists)  # lookup drafts are deterministic


def test_branches_sharing_a_prefix_merge_into_a_trie():
    ids = [1, 2, 5, 6, 9, 1, 2, 5, 7, 8, 1, 2]
    tree = NgramIndex().propose(ids, 2, branches=2)
    assert shape(tree) == ([2, 5, 7, 6], [-1, 0, 1, 1])
    # identical continuations collapse into one chain
    same = [1, 2, 5, 6, 0, 1, 2, 5, 6, 0, 1, 2]
    assert shape(NgramIndex().propose(same, 3, branches=3)) == ([2, 5, 6, 0], [-1, 0, 1, 2])


@pytest.mark.parametrize("ids", [[4], [1, 2, 3, 4]])
def test_no_match_gives_a_root_only_tree(ids):
    tree = NgramIndex().propose(ids, 8, branches=3)
    assert tree.tokens == [ids[-1]] and tree.drafted == 0


def test_a_one_token_match_is_a_one_token_guess_unless_a_longer_match_is_required():
    ids = [5, 1, 2, 5]
    assert NgramIndex().propose(ids, 8).tokens == [5, 1]  # DRAFT_LENGTH[1] == 1
    assert NgramIndex().propose(ids, 8, shortest=2).drafted == 0
    assert NgramIndex(lengths=None).propose(ids, 8).tokens == [5, 1, 2, 5]
    with pytest.raises(ValueError):
        NgramIndex(min_n=2).propose(ids, 8, shortest=1)


def test_draft_length_grows_with_the_match_length():
    text = list(range(100, 120))
    for n in range(1, MAX_N + 1):
        ids = text + [0] + text[:n]  # the last n tokens occurred once before, then 19 more
        tree = NgramIndex().propose(ids, 16)
        assert tree.drafted == DRAFT_LENGTH[n] and tree.tokens[1:] == text[n : n + DRAFT_LENGTH[n]]


def test_the_current_suffix_is_not_its_own_match():
    # (1, 2) ends the sequence; only its earlier occurrence counts, continued up to the end
    assert NgramIndex().propose([1, 2, 3, 1, 2], 10).tokens == [2, 3, 1, 2]


def test_max_tokens_is_respected():
    ids = list(range(20)) + [0, 1]
    for k in (1, 3, 7):
        tree = NgramIndex(lengths=None).propose(ids, k)
        assert tree.tokens == [1] + list(range(2, 2 + k)) and tree.is_chain()


def test_only_the_most_recent_occurrences_are_kept():
    ids = []
    for c in range(OCCURRENCES + 2):
        ids += [1, 2, 10 + c]
    ids += [1, 2]
    tree = NgramIndex().propose(ids, 1, branches=10)
    newest = [10 + c for c in range(OCCURRENCES + 2)][-OCCURRENCES:][::-1]
    assert [tree.tokens[c] for c in tree.children(0)] == newest


def test_the_tree_stops_at_max_nodes():
    # four distinct 40-token continuations of (1, 2): 160 candidate nodes
    ids = []
    for b in range(4):
        ids += [1, 2] + [100 + 40 * b + i for i in range(40)]
    ids += [1, 2]
    tree = NgramIndex(lengths=None).propose(ids, 40, branches=4)
    assert tree.size == MAX_NODES and tree.full
    newest = [100 + 40 * 3 + i for i in range(40)]
    assert tree.tokens[1:41] == newest and tree.parents[1:41] == list(range(40))  # kept whole
    assert tree.tokens[41:] == [100 + 80 + i for i in range(MAX_NODES - 41)]  # the next, cut


def test_bad_n_range_raises():
    with pytest.raises(ValueError):
        NgramIndex(max_n=2, min_n=3)
    with pytest.raises(ValueError):
        NgramIndex(min_n=0)


sequences = st.lists(st.integers(0, 3), min_size=1, max_size=40)  # a small alphabet repeats a lot


@settings(max_examples=150, deadline=None)
@given(ids=sequences, max_tokens=st.integers(1, 8), branches=st.integers(1, 6),
       n_range=st.sampled_from([(MIN_N, MAX_N), (1, 3), (2, 2), (3, 5)]))
def test_incremental_index_equals_a_fresh_one_and_brute_force(ids, max_tokens, branches, n_range):
    min_n, max_n = n_range
    incremental = NgramIndex(max_n=max_n, min_n=min_n)
    for end in range(1, len(ids) + 1):  # the engine's pattern: one lookup per growing prefix
        prefix = ids[:end]
        grown = incremental.propose(prefix, max_tokens, branches)
        fresh = NgramIndex(max_n=max_n, min_n=min_n).propose(prefix, max_tokens, branches)
        assert shape(grown) == shape(fresh)
        assert shape(grown) == shape(reference(prefix, max_tokens, branches, max_n, min_n))
        assert grown.size <= MAX_NODES and max(grown.depths) <= max_tokens


@settings(max_examples=50, deadline=None)
@given(ids=sequences, step=st.integers(1, 7), max_tokens=st.integers(1, 8), branches=st.integers(1, 4))
def test_extending_in_jumps_equals_a_fresh_index(ids, step, max_tokens, branches):
    """The engine commits several tokens per round: extend() sees the sequence in jumps."""
    incremental = NgramIndex()
    for end in list(range(1, len(ids), step)) + [len(ids)]:
        incremental.extend(ids[:end])
    assert shape(incremental.propose(ids, max_tokens, branches)) == shape(NgramIndex().propose(ids, max_tokens, branches))
