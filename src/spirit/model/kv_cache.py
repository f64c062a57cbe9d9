"""A preallocated KV cache written by position (the gpt-fast way).

Every attention layer owns two buffers of shape [1, kv_heads, capacity, head_dim]. A forward
pass over positions [start, start + q) writes those slots in the layers it computes and
attends over slots [0, start + q). Rolling back is free: the engine keeps the committed
length and simply starts the next pass there, so a rejected draft is never read again.

Why it stays consistent with skipped sublayers: slots below the committed length always hold
the *full* model's keys and values, because only a verification pass (which runs every
layer) ever commits. A draft pass writes slots >= committed only in the layers it runs, and
within one draft round the same layers run for every token, so each layer it computes sees
keys it wrote itself. The next verification rewrites those slots in every layer.

It implements the one method of transformers' `Cache` interface that attention modules call
(`update`); masks and positions come from the adapter, not from the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class CacheFullError(RuntimeError):
    pass


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (1, num_kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity = capacity
        self._start = 0  # first slot written by the current forward pass

    def begin(self, start: int, length: int) -> None:
        """Declare the slots the next forward pass writes: [start, start + length)."""
        if start + length > self.capacity:
            raise CacheFullError(
                f"KV cache holds {self.capacity} positions; this step needs {start + length}"
            )
        self._start = start

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [1, kv_heads, q, head_dim]
        end = self._start + key_states.shape[2]
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        k_buf[:, :, self._start : end] = key_states
        v_buf[:, :, self._start : end] = value_states
        return k_buf[:, :, :end], v_buf[:, :, :end]

    def row_writes(self, rows: int) -> "RowWrites":
        """Where the pass declared by `begin` writes its `rows` rows: slots start, start + 1, ..."""
        return RowWrites((self,), torch.zeros(rows, dtype=torch.int64),
                         torch.arange(self._start, self._start + rows), self._start + rows)

    def keep_path(self, start: int, slots: list[int]) -> None:
        """After a token tree's verification: move the KV of the accepted nodes, which sit in
        slots `slots` (ascending, each >= start), to slots start, start+1, ... in every
        layer. Only those few rows move; a chain's accepted prefix is already in place."""
        if all(s == start + j for j, s in enumerate(slots)):
            return
        src = torch.tensor(slots, device=self.keys[0].device)
        dst = slice(start, start + len(slots))
        for buf in (*self.keys, *self.values):
            buf[:, :, dst] = buf[:, :, src]  # reads all sources before writing

    def committed_view(self, layer_idx: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer_idx][:, :, :length], self.values[layer_idx][:, :, :length]


class PackedCaches:
    """Several requests' caches behind one `update`, for a pass that packs their rows.

    The pass's rows are the requests' rows one after the other; `parts` gives each request's
    cache, the first slot its rows write and how many rows it has. `update` writes each
    request's keys and values into its own cache; attention then reads every row's keys from
    its own request's cache (model/attention.py, `RowKeys.caches`), so nothing is copied.
    """

    def __init__(self, parts: list[tuple[KVCache, int, int]]) -> None:
        for cache, start, rows in parts:
            cache.begin(start, rows)
        self.parts = parts

    def row_writes(self, rows: int) -> "RowWrites":
        caches = tuple(cache for cache, _, _ in self.parts)
        cache_of_row = torch.cat([torch.full((n,), i, dtype=torch.int64) for i, (_, _, n) in enumerate(self.parts)])
        slot_of_row = torch.cat([torch.arange(start, start + n) for _, start, n in self.parts])
        if cache_of_row.numel() != rows:
            raise ValueError(f"the packed caches hold {cache_of_row.numel()} rows; the pass has {rows}")
        return RowWrites(caches, cache_of_row, slot_of_row, None)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        offset = 0
        for cache, start, rows in self.parts:
            cache.keys[layer_idx][:, :, start : start + rows] = key_states[:, :, offset : offset + rows]
            cache.values[layer_idx][:, :, start : start + rows] = value_states[:, :, offset : offset + rows]
            offset += rows
        return key_states, value_states  # unused: the rows name the caches they read


@dataclass(frozen=True)
class RowWrites:
    """Where each row of a pass writes its keys and values (model/fused.py's kernels write them
    directly instead of through `update`)."""

    caches: tuple[KVCache, ...]
    cache_of_row: torch.Tensor  # [q] int64, index into caches
    slot_of_row: torch.Tensor  # [q] int64
    end: int | None  # one cache: the pass attends over slots [0, end); packed caches: None
