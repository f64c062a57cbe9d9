"""Row-wise attention: every query row computed exactly as plain one-token decoding computes it.

Why: speculation is lossless only if the verification pass scores each drafted token with the
same bits that plain decoding would. The linear layers can give that (model/exactness.py checks
it per machine), but fused attention kernels (SDPA) do not: with 8 query rows over a cache, most
rows differ in the last bits from running each row alone over its own prefix, and in bf16 that
flips near-tie argmaxes. So after prefill the adapter asks for *row-wise* attention: each query
row attends alone to exactly the key slots it may see, in slot order, with one fixed sequence
of ops (scores by matmul in the model dtype, softmax in float32, cast, matmul with V, as
transformers' eager attention does). A verification row and the plain step that would have
produced the same token then run the same ops on the same values, so they agree bit for bit.

It is a function in transformers' attention registry (`AttentionInterface`), selected for the
model by name; the attention modules call it with the extra `rows` keyword that the adapter
passes through. Without `rows` (prefill, drafts, transformers' own `generate`) it is SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ROWWISE_ATTENTION = "spirit_rowwise"

KeySlots = slice | torch.Tensor | None  # a contiguous range, ascending slot indices, or nothing

if TYPE_CHECKING:
    from spirit.model.kv_cache import KVCache


@dataclass(frozen=True)
class RowKeys:
    """Which cache slots each query row of one pass attends to (one entry per row).

    A slice is used where the slots are contiguous (chains, plain steps) and reads the cache
    in place; an index tensor (token trees) gathers the row's ancestors in slot order, which
    is the order plain decoding would have written them. None: a padding row, whose output
    is never read; it gets zeros and costs nothing.

    `caches`, in a pass that packs several requests' rows (continuous batching), names the
    cache each row reads its keys from (its own request's); None: the pass's one cache.
    """

    slots: tuple[KeySlots, ...]
    caches: "tuple[KVCache, ...] | None" = None

    @classmethod
    def from_mask(cls, allowed: torch.Tensor) -> "RowKeys":
        """allowed: [q, kv] bool (True = attend)."""
        rows: list[KeySlots] = []
        for row in allowed:
            idx = row.nonzero().flatten()
            if idx.numel() == 0:
                rows.append(None)
                continue
            first, last = int(idx[0]), int(idx[-1])
            rows.append(slice(first, last + 1) if last - first + 1 == idx.numel() else idx)
        return cls(tuple(rows))

    def __add__(self, other: "RowKeys") -> "RowKeys":
        """The rows of two requests' segments, one after the other, each reading its own cache."""
        if self.caches is None or other.caches is None:
            raise ValueError("only rows that name their caches can be packed into one pass")
        return RowKeys(self.slots + other.slots, self.caches + other.caches)

    def reading(self, cache: "KVCache") -> "RowKeys":
        """These rows, each reading its keys from `cache`."""
        return RowKeys(self.slots, (cache,) * len(self.slots))


def rowwise_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, q, head_dim]
    key: torch.Tensor,  # [1, kv_heads, kv, head_dim]
    value: torch.Tensor,  # [1, kv_heads, kv, head_dim]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    rows: RowKeys | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Returns attn_output [1, q, heads, head_dim], as every registered attention function does."""
    if rows is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    _, heads, q, head_dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    if scaling is None:
        scaling = head_dim**-0.5
    softcap = kwargs.get("softcap")
    out = query.new_zeros(q, heads, head_dim)
    layer = getattr(module, "layer_idx", None)
    for i, slots in enumerate(rows.slots):
        if slots is None:
            continue
        if rows.caches is None:
            k, v = key[0][:, slots], value[0][:, slots]  # [kv_heads, L, head_dim]
        else:  # the row's own request's cache, which the pass has just written
            cache = rows.caches[i]
            k, v = cache.keys[layer][0][:, slots], cache.values[layer][0][:, slots]
        # .contiguous(): the row's query must have the same layout whatever q is
        qi = query[0, :, i].contiguous().view(kv_heads, groups, head_dim)
        scores = torch.matmul(qi, k.transpose(1, 2)).float() * scaling  # [kv_heads, groups, L]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out[i] = torch.matmul(probs, v).view(heads, head_dim)
    return out[None], None


def register() -> str:
    """Register the function under its name (idempotent); returns the name to select. The
    model's own forward (transformers' `generate`, the `hf` baseline) then builds SDPA's masks
    for it, sliding windows included, exactly as under "sdpa"."""
    AttentionInterface.register(ROWWISE_ATTENTION, rowwise_attention)
    AttentionMaskInterface.register(ROWWISE_ATTENTION, sdpa_mask)
    return ROWWISE_ATTENTION
