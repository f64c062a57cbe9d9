"""DraftTree: node numbering, parent links, depths/positions and the verification mask."""

import pytest
import torch

from spirit.tree import MAX_NODES, DraftTree


def test_root_only_tree():
    tree = DraftTree(7)
    assert tree.tokens == [7] and tree.parents == [-1] and tree.depths == [0] and tree.dists == [None]
    assert tree.size == 1 and tree.drafted == 0 and tree.is_chain() and not tree.full
    assert tree.children(0) == [] and tree.path_to(0) == []


def test_chain_construction():
    q = [torch.full((5,), 0.2) for _ in range(3)]
    tree = DraftTree.chain(9, [4, 1, 3], q)
    assert tree.tokens == [9, 4, 1, 3]
    assert tree.parents == [-1, 0, 1, 2]
    assert tree.depths == [0, 1, 2, 3]
    assert tree.dists[0] is None and all(tree.dists[i] is q[i - 1] for i in range(1, 4))
    assert tree.is_chain() and tree.size == 4 and tree.drafted == 3
    assert tree.path_to(3) == [1, 2, 3]
    assert [tree.children(i) for i in range(4)] == [[1], [2], [3], []]
    # without dists every node is deterministic
    assert DraftTree.chain(0, [1, 2]).dists == [None, None, None]


def branching():
    """      0(r=10)
           /    |    \\
        1(a=1) 2(b=2) 5(d=1, a duplicate token under the root)
        /  \\      \\
     3(3)  4(4)    6(6)
                    |
                   7(7)
    """
    tree = DraftTree(10)
    assert tree.add(0, 1) == 1
    assert tree.add(0, 2) == 2
    assert tree.add(1, 3) == 3
    assert tree.add(1, 4) == 4
    assert tree.add(0, 1) == 5
    assert tree.add(2, 6) == 6
    assert tree.add(6, 7) == 7
    return tree


ANCESTORS = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 4], 5: [0, 5], 6: [0, 2, 6], 7: [0, 2, 6, 7]}


def test_add_child_children_and_paths():
    tree = branching()
    assert not tree.is_chain()
    assert tree.parents == [-1, 0, 0, 1, 1, 0, 2, 6]
    assert tree.children(0) == [1, 2, 5] and tree.children(1) == [3, 4] and tree.children(2) == [6]
    assert tree.children(3) == [] and tree.children(7) == []
    assert tree.child(0, 1) == 1  # the first child with that token, not the duplicate 5
    assert tree.child(0, 2) == 2 and tree.child(1, 4) == 4 and tree.child(6, 7) == 7
    assert tree.child(0, 3) is None and tree.child(2, 7) is None
    for node, ancestors in ANCESTORS.items():
        assert tree.path_to(node) == ancestors[1:]
    assert tree.depths == [0, 1, 1, 2, 2, 1, 2, 3]


def test_positions_are_committed_plus_depth():
    tree = branching()
    assert tree.positions(0).tolist() == [0, 1, 1, 2, 2, 1, 2, 3]
    assert tree.positions(17).tolist() == [17, 18, 18, 19, 19, 18, 19, 20]


@pytest.mark.parametrize("committed", [0, 1, 5])
def test_visible_is_committed_prefix_plus_ancestors(committed):
    tree = branching()
    mask = tree.visible(committed)
    assert mask.dtype == torch.bool and mask.shape == (tree.size, committed + tree.size)
    assert mask[:, :committed].all()
    expected = torch.zeros(tree.size, tree.size, dtype=torch.bool)
    for node, ancestors in ANCESTORS.items():
        expected[node, ancestors] = True
    assert torch.equal(mask[:, committed:], expected)


def test_visible_of_a_chain_is_causal():
    tree = DraftTree.chain(0, [5, 6, 7, 8])
    mask = tree.visible(3)
    assert torch.equal(mask[:, 3:], torch.ones(5, 5, dtype=torch.bool).tril())


def test_full_at_max_nodes():
    tree = DraftTree(0)
    for i in range(MAX_NODES - 2):
        tree.add(i % 3, i)  # a bushy tree
        assert not tree.full
    tree.add(0, 99)
    assert tree.size == MAX_NODES and tree.full and tree.drafted == MAX_NODES - 1
    assert DraftTree.chain(0, list(range(MAX_NODES - 1))).full
    assert not DraftTree.chain(0, list(range(MAX_NODES - 2))).full


@pytest.mark.parametrize("parent", [-1, 3, 100])
def test_add_with_a_bad_parent_raises(parent):
    tree = DraftTree.chain(0, [1, 2])  # nodes 0..2
    with pytest.raises(IndexError):
        tree.add(parent, 5)
    assert tree.size == 3  # nothing was appended


def test_add_stores_dist_and_int_token():
    q = torch.tensor([0.5, 0.5])
    tree = DraftTree(0)
    node = tree.add(0, torch.tensor(1), q)
    assert tree.tokens[node] == 1 and type(tree.tokens[node]) is int and tree.dists[node] is q
