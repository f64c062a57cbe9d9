"""Token trees: what every draft source proposes, and what one verification pass checks.

Node 0 is the *root*: the pending token (emitted, not yet in the KV cache). Every other node
is a drafted token whose parent comes before it, so node order is a topological order and a
chain d1..dk is simply nodes 1..k with parents 0..k-1. In the verification pass node i sits
in cache slot `committed + i` at position `committed + depth(i)` and attends to the committed
prefix plus its own ancestors (`visible`), so all branches are scored in one forward pass.

For sampling, each drafted node carries the distribution q it was drawn from (a [vocab]
tensor), or None when it was proposed deterministically (prompt lookup), which is the same
as q = one-hot on the token. Siblings are candidates tried in node order (verify.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_NODES = 64  # rows of one verification pass at most; the engine keeps this many spare slots


@dataclass
class DraftTree:
    root: int  # the pending token
    tokens: list[int] = field(default_factory=list)  # node i's token; tokens[0] == root
    parents: list[int] = field(default_factory=list)  # parents[0] == -1
    dists: list[torch.Tensor | None] = field(default_factory=list)  # q of node i (None: one-hot)
    depths: list[int] = field(default_factory=list)  # depth of node i; the root has depth 0

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens, self.parents, self.dists, self.depths = [self.root], [-1], [None], [0]

    @classmethod
    def chain(cls, root: int, drafted: list[int], dists: list[torch.Tensor] | None = None) -> "DraftTree":
        tree = cls(root)
        for j, token in enumerate(drafted):
            tree.add(j, token, dists[j] if dists else None)
        return tree

    def add(self, parent: int, token: int, dist: torch.Tensor | None = None) -> int:
        """Append a child of `parent`; returns its node index."""
        if not 0 <= parent < len(self.tokens):
            raise IndexError(f"parent {parent} is not a node of this {len(self.tokens)}-node tree")
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.dists.append(dist)
        self.depths.append(self.depths[parent] + 1)
        return len(self.tokens) - 1

    def child(self, parent: int, token: int) -> int | None:
        """The first child of `parent` with this token, if any."""
        for i in self.children(parent):
            if self.tokens[i] == token:
                return i
        return None

    def children(self, node: int) -> list[int]:
        return [i for i in range(node + 1, len(self.tokens)) if self.parents[i] == node]

    @property
    def size(self) -> int:
        """Number of nodes, root included: the rows of the verification pass."""
        return len(self.tokens)

    @property
    def full(self) -> bool:
        return len(self.tokens) >= MAX_NODES

    @property
    def drafted(self) -> int:
        return len(self.tokens) - 1

    def truncated(self, size: int) -> "DraftTree":
        """The first `size` nodes: still a tree, since every parent comes before its children."""
        return DraftTree(self.root, self.tokens[:size], self.parents[:size], self.dists[:size], self.depths[:size])

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node` (empty for the root)."""
        path = []
        while node > 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def positions(self, committed: int, device: torch.device | None = None) -> torch.Tensor:
        """[size] position of each node: the committed length plus its depth."""
        return torch.tensor(self.depths, device=device) + committed

    def visible(self, committed: int, device: torch.device | None = None) -> torch.Tensor:
        """[size, committed + size] bool: node i sees the committed slots, itself and its
        ancestors (slot committed + j for each ancestor j)."""
        n = self.size
        ancestors = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            ancestors[i, i] = True
            p = self.parents[i]
            if p >= 0:
                ancestors[i] |= ancestors[p]  # parents come first, so their row is complete
        return torch.cat([torch.ones(n, committed, dtype=torch.bool), ancestors], dim=1).to(device)
