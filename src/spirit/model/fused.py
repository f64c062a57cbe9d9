"""Decoder layers of a low-bit target run as a few calls into spirit's CPU kernels.

Why: with spirit's int4 kernel a decoding step of qwen2.5-coder-1.5b spent ~35 ms reading
weights and ~18 ms more running transformers' modules around them (about 60 small aten ops
per layer: norms in several steps, rotary halves and concatenations, cache writes, one-row
bf16 attention matmuls that take a slow generic path). Here each sublayer is a handful of calls:

    attention: rms_norm -> one packed q|k|v product -> rope_write (rotary, KV cache write)
               -> row-wise attention (or SDPA where exactness is not asked) -> o product
    MLP:       rms_norm -> one packed gate|up product -> silu_mul -> down product

The projections that read the same input are packed as one weight (rows of q, k and v one
after the other); the modules' own packed weights become views of it, so nothing is stored
twice and transformers' forward (the `hf` baseline, probes) still runs the same numbers.

Every piece is row-invariant by construction (kernels/layer_ops.cpp, kernels/qgemm.cpp), so
the exactness contract of model/attention.py holds: a verification row gets the bits of a
one-token step. The arithmetic differs from transformers' modules in the last bits (sums in
float32, one rounding per output), so a low-bit target's output is defined by this path:
plain decoding and speculation both run it.

Used for the standard pre-norm layout with RMSNorm, SwiGLU and full rotary embeddings
(Llama, Qwen2, Qwen3, Mistral) when every linear layer runs on spirit's kernel; anything else
(Gemma's sandwich norms and GELU, torch's kernels, bf16 weights) runs transformers' modules.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from spirit.model import qgemm
from spirit.model.attention import RowKeys
from spirit.model.kv_cache import RowWrites
from spirit.model.lowbit import PackedLinear
from spirit.model.quantize import PackedWeight

_EMPTY = torch.empty(0)
PREFILL_TILE_ROWS = 32  # prefill chunks of this many rows or more take bf16 tile products where they run
DENSE_ROWS = 64  # ... or dense bf16 products, where those run


def prefill_products(activation: torch.dtype) -> tuple[str, str]:
    """How prefill chunks multiply on this CPU, and why: "tiles" where AMX runs (bf16 tile
    products, 2.5-4x the integer kernel at 43-128 rows on a Xeon with AMX), "dense" on other
    CPUs with AVX-512 BF16 (dense bf16 products, measured 1.5-1.7x the integer kernel at 128
    rows on an EPYC), else "kernel". `SPIRIT_PREFILL=kernel|dense|tiles` picks one (to compare)."""
    if activation != torch.bfloat16:
        return "kernel", "integer kernel for prefill (the faster products need bf16 activations)"
    chosen = os.environ.get("SPIRIT_PREFILL", "").lower()
    if chosen not in ("", "kernel", "dense", "tiles"):
        raise ValueError(f"SPIRIT_PREFILL must be kernel, dense or tiles, not {chosen!r}")
    if chosen == "tiles" and not qgemm.prefill_tiles():
        raise ValueError("SPIRIT_PREFILL=tiles: AMX tile products do not run here (qgemm.status())")
    how = chosen or ("tiles" if qgemm.prefill_tiles() else "dense" if qgemm.dense_bf16() else "kernel")
    reason = {"tiles": "bfloat16 AMX tile products for prefill", "dense": "dense bf16 products for prefill",
              "kernel": "integer kernel for prefill"}[how]
    return how, reason + (" (SPIRIT_PREFILL)" if chosen else "")


class Projection:
    """Linear layers that read the same input, run as one packed product [rows, sum of outs].

    Where their formats differ (a GGUF file's Q6_K v next to Q4_K q and k), each runs alone
    and the outputs are concatenated."""

    def __init__(self, linears: Sequence[PackedLinear]) -> None:
        self.parts: tuple[PackedLinear, ...] = tuple(linears)
        self.weight: PackedWeight | None = None
        self.bias: torch.Tensor | None = None
        self.panels: torch.Tensor | None = None  # the weight in AMX tile order, where that runs here
        if len(linears) == 1:
            self.weight = linears[0].weight_packed
            self.bias = None if linears[0].bias is None else linears[0].bias.float()
        elif len({linear.format for linear in linears}) == 1:
            self.weight = _concatenated([linear.weight_packed for linear in linears])
            if any(linear.bias is not None for linear in linears):
                self.bias = torch.cat([
                    linear.bias.float() if linear.bias is not None else torch.zeros(linear.out_features)
                    for linear in linears])
            # the modules read views of the one weight: stored once
            start = 0
            for linear in linears:
                end = start + linear.out_features
                linear.weight_packed = _rows(self.weight, start, end)
                start = end
        if self.weight is not None:
            self.panels = self.weight.tile_panels()

    def __call__(self, x: torch.Tensor, how: str = "kernel", scratch: torch.Tensor | None = None) -> torch.Tensor:
        """x: [rows, in] -> [rows, sum of outs]. `how`: "kernel", spirit's row-invariant integer
        products; for bf16 rows of a pass that need not be exact (prefill, FusedDecoder.prefill_how),
        "tiles", bfloat16 AMX tile products, or "dense", the weight unpacked into `scratch` (bf16, at
        least out x in elements) and multiplied as a dense matrix."""
        w = self.weight
        if w is None:
            if how == "kernel":
                return torch.cat([linear(x) for linear in self.parts], dim=-1)
            return torch.cat([_prefill_product(x, linear.weight_packed, linear.bias, how, scratch)
                              for linear in self.parts], dim=-1)
        if how == "kernel":
            return qgemm.qgemm(x, w.codes, w.scales, w.offsets, self.bias, w.bits, self.panels)
        return _prefill_product(x, w, self.bias, how, scratch)

    @property
    def size(self) -> int:
        """Weights in its largest packed product (the one weight, or its largest part)."""
        return max(linear.weight_packed.out_features * linear.weight_packed.in_features for linear in self.parts) \
            if self.weight is None else self.weight.out_features * self.weight.in_features


def _prefill_product(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None, how: str,
                     scratch: torch.Tensor | None) -> torch.Tensor:
    bias = None if bias is None else bias.float()
    if how == "tiles":
        return qgemm.prefill_qgemm(x, weight.codes, weight.scales, weight.offsets, bias, weight.bits)
    dense = scratch[: weight.out_features * weight.in_features].view(weight.out_features, weight.in_features)
    y = F.linear(x, qgemm.dequantize(weight.codes, weight.scales, weight.offsets, dense, weight.bits))
    return y if bias is None else y + bias.to(y.dtype)


def _concatenated(weights: Sequence[PackedWeight]) -> PackedWeight:
    first = weights[0]
    offsets = None if first.offsets is None else torch.cat([w.offsets for w in weights])
    return dataclasses.replace(first, codes=torch.cat([w.codes for w in weights]),
                               scales=torch.cat([w.scales for w in weights]), offsets=offsets,
                               out_features=sum(w.out_features for w in weights))


def _rows(weight: PackedWeight, start: int, end: int) -> PackedWeight:
    """Output rows [start, end) of a spirit-kernel weight (its tensors are row-major per output)."""
    offsets = None if weight.offsets is None else weight.offsets[start:end]
    return dataclasses.replace(weight, codes=weight.codes[start:end], scales=weight.scales[start:end],
                               offsets=offsets, out_features=end - start)


@dataclass(frozen=True)
class FusedLayer:
    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    qkv: Projection  # [rows, hidden] -> [rows, (heads + 2 kv_heads) head_dim]
    o: Projection
    gate_up: Projection  # -> [rows, 2 intermediate]
    down: Projection
    q_norm: torch.Tensor  # [head_dim] (Qwen3) or empty
    k_norm: torch.Tensor


@dataclass(frozen=True)
class PassKeys:
    """Which keys a pass's rows attend to, in the form the kernels take, for one window size.

    Row-wise (exact passes): CSR over cache slots, `slots[offsets[m]:offsets[m+1]]` for row m
    of cache `cache_of_row[m]`. Otherwise SDPA over slots [0, end) of the pass's one cache
    with `mask` ([1, 1, q, end] bool, True = attend; None = all)."""

    cache_of_row: torch.Tensor | None = None  # [q] int64
    offsets: torch.Tensor | None = None  # [q + 1] int64
    slots: torch.Tensor | None = None  # [total] int64
    mask: torch.Tensor | None = None
    end: int = 0

    @classmethod
    def rowwise(cls, rows: RowKeys, writes: RowWrites) -> "PassKeys":
        counts, parts = [], []
        for keys in rows.slots:
            if keys is None:
                counts.append(0)
            elif isinstance(keys, slice):
                counts.append(keys.stop - keys.start)
                parts.append(torch.arange(keys.start, keys.stop))
            else:
                counts.append(keys.numel())
                parts.append(keys.to(torch.int64))
        offsets = torch.zeros(len(counts) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(counts, dtype=torch.int64).cumsum(0)
        slots = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
        if rows.caches is None:
            cache_of_row = torch.zeros(len(counts), dtype=torch.int64)
        else:
            index = {id(cache): i for i, cache in enumerate(writes.caches)}
            cache_of_row = torch.tensor([index[id(cache)] for cache in rows.caches], dtype=torch.int64)
        return cls(cache_of_row, offsets, slots.contiguous())


class FusedDecoder:
    """The layers of one model as fused pieces; the adapter (model/adapter.py) runs them."""

    def __init__(self, layers: Sequence[FusedLayer], heads: int, kv_heads: int, head_dim: int,
                 scaling: float, eps: float, head_eps: float, activation: torch.dtype) -> None:
        self.layers = list(layers)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.scaling, self.eps, self.head_eps = scaling, eps, head_eps
        self._ops = qgemm.extension()
        # How prefill chunks (many rows, need not be exact) multiply: chosen by what the CPU has,
        # not by a timing at load (that once flipped between runs near its threshold, and with it
        # the text), so a machine always prefills the same way and gives the same text.
        self.prefill_products, self.prefill_reason = prefill_products(activation)
        self._scratch: torch.Tensor | None = None  # "dense": the largest product's weights in bf16

    def prefill_how(self, rows: int) -> str:
        """How a prefill chunk of `rows` rows multiplies (Projection.__call__'s `how`). Both
        faster ways turn each weight to bf16 once per product whatever the rows, which costs
        more than the integer kernel below PREFILL_TILE_ROWS (tiles: 17920x1536 int4 from
        memory, 3.5 ms at 16 rows against 2.0 for the kernel with its AMX panels, 3.9 against
        3.1 at 32, 5.0 against 6.3 at 64; a whole qwen2.5-coder-1.5b chunk, 184 ms against 138
        at 16 rows, 212 against 224 at 32) or DENSE_ROWS rows (dense)."""
        if self.prefill_products == "tiles" and rows >= PREFILL_TILE_ROWS:
            return "tiles"
        if self.prefill_products == "dense" and rows >= DENSE_ROWS:
            if self._scratch is None:
                self._scratch = torch.empty(max(p.size for p in self._projections()), dtype=torch.bfloat16)
            return "dense"
        return "kernel"

    def _projections(self) -> list[Projection]:
        return [p for layer in self.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]

    def input_norm(self, i: int, hidden: torch.Tensor) -> torch.Tensor:
        return self._ops.rms_norm(hidden, self.layers[i].input_norm, self.eps)

    def post_norm(self, i: int, hidden: torch.Tensor) -> torch.Tensor:
        return self._ops.rms_norm(hidden, self.layers[i].post_norm, self.eps)

    def attention(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, writes: RowWrites,
                  keys: PassKeys, how: str = "kernel") -> torch.Tensor:
        """x: normed [q, hidden]; cos, sin: [q, head_dim]. Writes the rows' keys and values into
        layer i of their caches; returns the attention sublayer's output [q, hidden]."""
        layer = self.layers[i]
        scratch = self._scratch
        key_buffers = [cache.keys[i] for cache in writes.caches]
        value_buffers = [cache.values[i] for cache in writes.caches]
        q = self._ops.rope_write(layer.qkv(x, how, scratch), cos, sin, self.heads, self.kv_heads, self.head_dim,
                                 layer.q_norm, layer.k_norm, self.head_eps, key_buffers, value_buffers,
                                 writes.cache_of_row, writes.slot_of_row)  # [q, heads, head_dim]
        if keys.offsets is not None:
            out = self._ops.rowwise_attention(q, key_buffers, value_buffers, keys.cache_of_row, keys.offsets,
                                              keys.slots, self.scaling, 0.0)
        else:
            k = key_buffers[0][:, :, : keys.end]
            v = value_buffers[0][:, :, : keys.end]
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=keys.mask,
                                                 scale=self.scaling, enable_gqa=True)  # [1, heads, q, head_dim]
            out = out[0].transpose(0, 1).reshape(q.shape[0], self.heads * self.head_dim)
        return layer.o(out, how, scratch)

    def mlp(self, i: int, x: torch.Tensor, how: str = "kernel") -> torch.Tensor:
        layer, scratch = self.layers[i], self._scratch
        return layer.down(self._ops.silu_mul(layer.gate_up(x, how, scratch)), how, scratch)


def fused_decoder(causal_lm: nn.Module, dtype: torch.dtype) -> tuple[FusedDecoder | None, str]:
    """The model's layers as a FusedDecoder, or None and why it runs transformers' modules."""
    reason = _unsupported(causal_lm, dtype)
    if reason is not None:
        return None, reason
    config = causal_lm.config
    layers = []
    for layer in causal_lm.model.layers[: config.num_hidden_layers]:
        attn, mlp = layer.self_attn, layer.mlp
        layers.append(FusedLayer(
            input_norm=layer.input_layernorm.weight.detach().contiguous(),
            post_norm=layer.post_attention_layernorm.weight.detach().contiguous(),
            qkv=Projection([attn.q_proj, attn.k_proj, attn.v_proj]),
            o=Projection([attn.o_proj]),
            gate_up=Projection([mlp.gate_proj, mlp.up_proj]),
            down=Projection([mlp.down_proj]),
            q_norm=attn.q_norm.weight.detach().contiguous() if hasattr(attn, "q_norm") else _EMPTY,
            k_norm=attn.k_norm.weight.detach().contiguous() if hasattr(attn, "k_norm") else _EMPTY,
        ))
    first = causal_lm.model.layers[0]
    head_norm = getattr(first.self_attn, "q_norm", None)
    head_eps = _eps(head_norm) if head_norm is not None else 0.0
    attn = first.self_attn
    decoder = FusedDecoder(layers, config.num_attention_heads, config.num_key_value_heads, attn.head_dim,
                           float(attn.scaling), _eps(first.input_layernorm), head_eps, dtype)
    return decoder, f"fused layers (spirit's kernels); {decoder.prefill_reason}"


def _eps(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def _is_rms_norm(norm: nn.Module | None, dtype: torch.dtype) -> bool:
    """transformers' Llama-style RMSNorm: x / rms(x) * weight (not Gemma's 1 + weight)."""
    return (norm is not None and type(norm).__name__.endswith("RMSNorm") and "Gemma" not in type(norm).__name__
            and getattr(norm, "weight", None) is not None and norm.weight.dtype == dtype
            and (hasattr(norm, "variance_epsilon") or hasattr(norm, "eps")))


def _unsupported(causal_lm: nn.Module, dtype: torch.dtype) -> str | None:
    """Why this model cannot run fused here (None: it can)."""
    config = causal_lm.config
    if not qgemm.available():
        return qgemm.status().reason
    if dtype not in (torch.bfloat16, torch.float32):
        return f"activations in {dtype}"
    if str(getattr(config, "model_type", "")).startswith("gemma"):
        return "Gemma's layers (sandwich norms, 1 + weight, GELU) run transformers' modules"
    if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        return f"activation {config.hidden_act}"
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0 or getattr(config, "attn_logit_softcapping", None):
        return "partial rotary embeddings or attention soft-capping"
    for layer in causal_lm.model.layers[: config.num_hidden_layers]:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(isinstance(m, PackedLinear) and m.kernel == "spirit" and m.activation == dtype for m in linears):
            return "linear layers not all packed for spirit's kernel"
        norms = [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
        norms += [getattr(attn, n) for n in ("q_norm", "k_norm") if hasattr(attn, n)]
        if not all(_is_rms_norm(norm, dtype) for norm in norms) or hasattr(layer, "pre_feedforward_layernorm"):
            return "norms other than RMSNorm before each sublayer"
        head_dim = getattr(attn, "head_dim", 0)
        if head_dim % 8 or head_dim > 512 or not hasattr(attn, "scaling"):
            return f"head_dim {head_dim}"
    return None
