"""Closed-form SOL of one decoding step of a decoder-only model, plain or as a draft.

Per token (memory side, the gpt-fast accounting: model bytes x tokens/s):
  weights read once (every kept sublayer's parameters, the final norm, the lm_head, and only
  the gathered row of the embedding unless it is tied to the lm_head)
  + KV read (2 x kv_heads x head_dim x visible positions per kept attention layer)
  + KV written (the new positions) + the token ids in and fp32 logits out.
Compute: 2 FLOPs per weight per token for every linear layer and the lm_head, plus
attention 4 x heads x head_dim x visible positions per kept attention layer.
SOL = max(compute / matmul peak, bytes / memory bandwidth).
A low-bit target (`weights` "int8" / "int4") reads its packed linear weights instead: the
bound is then the packed bytes per token (model/quantize.bytes_per_weight); compute is
still counted at the activation dtype's matmul peak (the kernels multiply in it).
A sliding-window layer reads only its window here (an ideal kernel); spirit's adapter reads the
whole cached slice under a mask, so its traced step costs more on those layers.

Parameter counts come from the model built on the meta device from its config, so any
architecture spirit drives (Llama, Qwen2/3, Mistral, Gemma) is counted from its own modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from spirit.model.kv_cache import KVCache
from spirit.skipset import SkipSet
from spirit.sol.hardware import HardwareSpec, load_hardware


@dataclass(frozen=True)
class SublayerParams:
    attn_linear: tuple[int, ...]  # per layer: elements in the attention's nn.Linear weights
    attn_other: tuple[int, ...]  # per layer: biases and norms that go with the attention sublayer
    mlp_linear: tuple[int, ...]
    mlp_other: tuple[int, ...]
    embed: int  # vocab x hidden
    lm_head: int  # vocab x hidden (0 extra bytes when tied)
    final_norm: int
    tied: bool
    hidden: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    windows: tuple[int | None, ...]  # per layer: sliding window or None


@dataclass(frozen=True)
class DecodeCost:
    matrix_flops: float
    vector_flops: float
    weight_bytes: float
    kv_read_bytes: float
    kv_write_bytes: float
    io_bytes: float  # token ids in, fp32 logits out
    dtype: torch.dtype

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes + self.io_bytes

    def compute_seconds(self, hw: HardwareSpec) -> float:
        return self.matrix_flops / hw.matmul_peak(self.dtype) + self.vector_flops / hw.vector_peak(self.dtype)

    def seconds(self, hw: HardwareSpec) -> float:
        return max(self.compute_seconds(hw), self.bytes / hw.memory_bandwidth)


def _params(module: nn.Module | None) -> tuple[int, int]:
    """(elements in nn.Linear weights, all other parameter elements) of a module."""
    if module is None:
        return 0, 0
    linear = sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))
    return linear, sum(p.numel() for p in module.parameters()) - linear


_PARAMS_CACHE: dict[str, SublayerParams] = {}  # config JSON -> counts (building a meta model takes ~0.1-1 s)


def sublayer_params(config) -> SublayerParams:
    key = config.to_json_string(use_diff=False)
    if key not in _PARAMS_CACHE:
        _PARAMS_CACHE[key] = _count_params(config)
    return _PARAMS_CACHE[key]


def _count_params(config) -> SublayerParams:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    from spirit.model.adapter import Layout, SkippableModel

    sm = SkippableModel(model)
    attn_l, attn_o, mlp_l, mlp_o = [], [], [], []
    for layer in sm.layers:
        a = _params(layer.self_attn)
        n1 = _params(layer.input_layernorm)[1]
        n2 = _params(layer.post_attention_layernorm)[1]
        m = _params(layer.mlp)
        if sm.layout is Layout.SANDWICH:
            attn_o.append(a[1] + n1 + n2)
            mlp_o.append(m[1] + _params(layer.pre_feedforward_layernorm)[1] + _params(layer.post_feedforward_layernorm)[1])
        else:
            attn_o.append(a[1] + n1)
            mlp_o.append(m[1] + n2)
        attn_l.append(a[0])
        mlp_l.append(m[0])
    embed = sm.embed_tokens.weight.numel()
    tied = sm.lm_head.weight is sm.embed_tokens.weight or bool(getattr(config, "tie_word_embeddings", False))
    return SublayerParams(
        tuple(attn_l), tuple(attn_o), tuple(mlp_l), tuple(mlp_o), embed, sm.lm_head.weight.numel(),
        _params(sm.norm)[1], tied, sm.shape.hidden_size, sm.shape.vocab_size,
        config.num_attention_heads, sm.shape.num_kv_heads, sm.shape.head_dim, tuple(sm._windows),
    )


def decode_cost(config, dtype: torch.dtype, context: int, skip: SkipSet | None = None, tokens: int = 1,
                weights: str | None = None) -> DecodeCost:
    """Cost of running `tokens` new tokens after `context` cached ones (1 = a decode step,
    k+1 = verifying k drafted tokens), with the sublayers of `skip` left out. `weights`: a
    packed format of the linear layers and lm_head ("int8", "int4"); None or a float dtype's
    name: they are in `dtype`."""
    from spirit.model.quantize import bytes_per_weight

    p = sublayer_params(config)
    skip = skip or SkipSet()
    skip.validate(len(p.attn_linear))
    b = torch.empty((), dtype=dtype).element_size()
    packed = weights in ("int8", "int4")
    linear_b = bytes_per_weight(weights) if packed else b
    kept_attn = [i for i in range(len(p.attn_linear)) if i not in skip.attn]
    kept_mlp = [i for i in range(len(p.mlp_linear)) if i not in skip.mlp]
    linear = sum(p.attn_linear[i] for i in kept_attn) + sum(p.mlp_linear[i] for i in kept_mlp) + p.lm_head
    other = sum(p.attn_other[i] for i in kept_attn) + sum(p.mlp_other[i] for i in kept_mlp) + p.final_norm
    # a packed head is a copy: the embedding's gathered rows are read apart from it even when tied
    embed_read = 0 if p.tied and not packed else tokens * p.hidden
    weight_bytes = linear * linear_b + (other + embed_read) * b
    kv_row = 2 * p.kv_heads * p.head_dim * b  # K and V of one position in one layer
    kv_read = kv_pairs = 0
    for i in kept_attn:
        window = p.windows[i]
        visible = context + tokens if window is None else min(context + tokens, window)
        kv_read += visible * kv_row
        # causal within the new tokens: token j sees context + j + 1 positions
        kv_pairs += sum(min(context + j + 1, window or 1 << 62) for j in range(tokens))
    matrix = 2.0 * tokens * linear + 2.0 * kv_pairs * p.heads * 2 * p.head_dim
    # norms (~6/elem), residual adds, rotary, activation: a few per hidden/intermediate element
    vector = tokens * (8.0 * p.hidden * (len(kept_attn) + len(kept_mlp)) + 3.0 * sum(p.mlp_linear[i] for i in kept_mlp) / max(p.hidden, 1)) + 5.0 * kv_pairs * p.heads
    io = tokens * (8 + 4 * p.vocab)
    return DecodeCost(matrix, vector, float(weight_bytes), float(kv_read), float(len(kept_attn) * tokens * kv_row), float(io), dtype)


def decode_step_seconds(config, dtype: torch.dtype, context: int, hardware: str | HardwareSpec = "this-cpu",
                        skip: SkipSet | None = None, weights: str | None = None) -> float:
    """Per-token SOL (seconds) of plain decoding, or of the draft pass when `skip` is given."""
    hw = load_hardware(hardware, calibrate_if_missing=True)
    return decode_cost(config, dtype, context, skip, weights=weights).seconds(hw)


@dataclass(frozen=True)
class Speculation:
    plain_s: float  # SOL of one plain decode step
    draft_s: float  # SOL of one draft step
    verify_s: float  # SOL of verifying draft_len tokens plus the bonus one
    expected_tokens: float  # per round, bonus included: (1 - a^(k+1)) / (1 - a)
    speedup: float  # upper bound on speculative over plain decoding


def speculative_speedup(config, dtype: torch.dtype, context: int, skip: SkipSet, acceptance: float,
                        draft_len: int, hardware: str | HardwareSpec = "this-cpu",
                        weights: str | None = None) -> Speculation:
    """Upper bound on the speedup of self-speculative decoding at the speed of light.

    Tokens per round follow Leviathan et al. 2023 (eq. 1, i.i.d. per-token acceptance a,
    k drafted tokens, bonus token included): E = (1 - a^(k+1)) / (1 - a). A round costs k
    draft steps plus one verification of k+1 tokens, each at its SOL.
    """
    hw = load_hardware(hardware, calibrate_if_missing=True)
    if not 0.0 <= acceptance <= 1.0 or draft_len < 1:
        raise ValueError("acceptance must be in [0, 1] and draft length >= 1")
    plain = decode_cost(config, dtype, context, weights=weights).seconds(hw)
    draft = decode_cost(config, dtype, context, skip, weights=weights).seconds(hw)
    verify = decode_cost(config, dtype, context, tokens=draft_len + 1, weights=weights).seconds(hw)
    k, a = draft_len, acceptance
    expected = k + 1.0 if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)
    return Speculation(plain, draft, verify, expected, expected * plain / (k * draft + verify))


class _StepCache(KVCache):
    """A KVCache over given buffers, so the buffers are graph inputs of a traced step."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], start: int) -> None:
        self.keys, self.values = keys, values
        self.capacity = keys[0].shape[2]
        self._start = start


class _DecodeStep(nn.Module):
    def __init__(self, causal_lm: nn.Module, context: int, skip: SkipSet) -> None:
        super().__init__()
        from spirit.model.adapter import SkippableModel

        self.lm = causal_lm
        self.context, self.skip = context, skip
        self._sm = SkippableModel(causal_lm)

    def forward(self, input_ids: torch.Tensor, *kv: torch.Tensor) -> torch.Tensor:
        n = len(kv) // 2
        cache = _StepCache(list(kv[:n]), list(kv[n:]), self.context)
        return self._sm.forward(input_ids, self.context, cache, self.skip)


def build_meta_model(config, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return model.to(dtype).eval()


def trace_decode_step(model_or_config, context: int, skip: SkipSet | None = None, tokens: int = 1,
                      dtype: torch.dtype | None = None):
    """Capture `tokens` decode-step tokens after `context` cached ones through spirit's adapter
    and cost the graph. Accepts a *ForCausalLM or a config (then built on the meta device)."""
    from spirit.sol.capture import capture
    from spirit.sol.costs import graph_cost

    if isinstance(model_or_config, nn.Module):
        model = model_or_config
        dtype = dtype or next(model.parameters()).dtype
    else:
        model = build_meta_model(model_or_config, dtype or torch.float32)
        dtype = dtype or torch.float32
    step = _DecodeStep(model, context, skip or SkipSet())
    shape = step._sm.shape
    device = next(model.parameters()).device
    buffers = [torch.zeros(1, shape.num_kv_heads, context + tokens, shape.head_dim, dtype=dtype, device=device)
               for _ in range(2 * shape.num_layers)]
    ids = torch.zeros(1, tokens, dtype=torch.long, device=device)
    return graph_cost(capture(step, (ids, *buffers)))
