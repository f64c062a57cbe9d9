"""Low-bit targets: the model that decodes and verifies, with its linear layers packed to
int8 or int4 and run by torch's weight-only kernels (model/quantize.py).

A decoding step on a CPU is bound by reading weights: int4 reads about a quarter of bf16's
bytes. Every linear layer of every decoder layer (q, k, v, o, gate, up, down) and the lm_head is
replaced by a `PackedLinear` holding the packed weight, its scales and the bias; the
embedding stays a lookup table in the model's dtype (a step reads one row of it). The
lm_head is 15-27% of a small model's bytes, so leaving it in bf16 would cost a low-bit
step about a third of its time.

The packed model is what the output is defined by: plain decoding and speculation both run
it, and the exactness check (model/exactness.py) measures its kernels' row-invariance, so
speculation gives exactly plain int4 decoding's tokens where the check passes.

Built once per model, format, activation dtype, device and torch version and kept on disk
(`~/.cache/spirit/lowbit/`), written atomically like the quantized draft MLPs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch import nn

from spirit.model.quantize import INT4_GROUP, int4_fits, int4_matmul, int8_matmul, quantize_int4, quantize_int8

WEIGHTS = ("auto", "bf16", "int8", "int4")
PACKED_FORMATS = ("int8", "int4")
KEEP_AFTER_S = 1.0  # packings that took longer than this are kept on disk


class PackedLinear(nn.Module):
    """A weight-only int8 / int4 copy of an nn.Linear: [..., in] -> [..., out] in the input's
    dtype, computed by the kernel in `activation` (the dtype the kernel is fast with)."""

    def __init__(self, fmt: str, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 in_features: int, out_features: int) -> None:
        super().__init__()
        self.format, self.in_features, self.out_features = fmt, in_features, out_features
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)
        # The float weight this was packed from, kept for the lm_head only: the reduced draft
        # head gathers rows of it, and torch's CPU int4 layout interleaves rows in blocks, so
        # rows of the packed weight cannot be gathered. Not a buffer: never saved.
        self.row_source: torch.Tensor | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str, activation: torch.dtype) -> "PackedLinear":
        weight = linear.weight.detach()
        out_features, in_features = weight.shape
        if fmt == "int4" and not int4_fits(out_features, in_features, device=weight.device.type):
            fmt = "int8"  # the int4 kernel cannot take this shape
        if fmt == "int4":
            packed, scales = quantize_int4(weight, INT4_GROUP)
        elif fmt == "int8":
            if weight.device.type != "cpu":
                raise ValueError(f"int8 weights run on the CPU only (torch has no {weight.device.type} kernel)")
            packed, scales = quantize_int8(weight)
        else:
            raise ValueError(f"unknown packed format {fmt!r}; choose one of {', '.join(PACKED_FORMATS)}")
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(fmt, packed, scales.to(activation), bias, in_features, out_features)

    @property
    def activation(self) -> torch.dtype:
        return self.scales.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(self.activation)
        if self.format == "int4":
            y = int4_matmul(rows, self.packed, INT4_GROUP, self.scales)
        else:
            y = int8_matmul(rows, self.packed, self.scales)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] this module multiplies by, in float32 (tests and quality checks)."""
        eye = torch.eye(self.in_features, dtype=self.activation, device=self.packed.device)
        bias, self.bias = self.bias, None
        try:
            return self.forward(eye).float().T.contiguous()
        finally:
            self.bias = bias

    def extra_repr(self) -> str:
        return f"{self.format}, in_features={self.in_features}, out_features={self.out_features}"


def packable_linears(causal_lm: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent module, attribute, linear) for every nn.Linear inside the decoder layers, then
    the lm_head (last)."""
    found = []
    for layer in causal_lm.model.layers:
        for parent in layer.modules():
            for name, child in parent.named_children():
                if isinstance(child, nn.Linear):
                    found.append((parent, name, child))
    if isinstance(causal_lm.lm_head, nn.Linear):
        found.append((causal_lm, "lm_head", causal_lm.lm_head))
    return found


@torch.inference_mode()
def pack_model(causal_lm: nn.Module, fmt: str, activation: torch.dtype = torch.bfloat16,
               cache: Path | None = None) -> dict:
    """Replace every decoder linear layer and the lm_head of `causal_lm` by packed copies, in
    place; loaded from `cache` when a packing of these layers is kept there (else built, and
    kept if slow). Returns what was done: formats, bytes before and after, seconds."""
    started = time.perf_counter()
    targets = packable_linears(causal_lm)
    before = sum(linear.weight.numel() * linear.weight.element_size() for _, _, linear in targets)
    kept = _load(cache, targets, activation) if cache is not None and cache.exists() else None
    packed = kept or [PackedLinear.from_linear(linear, fmt, activation) for _, _, linear in targets]
    for (parent, name, linear), module in zip(targets, packed):
        if name == "lm_head":
            module.row_source = linear.weight.detach()  # tied: the embedding's own table, no copy
        setattr(parent, name, module)
    seconds = time.perf_counter() - started
    if kept is None and cache is not None and seconds >= KEEP_AFTER_S:
        _save(cache, packed)
    after = sum(m.packed.numel() * m.packed.element_size() + m.scales.numel() * m.scales.element_size() for m in packed)
    return {"format": fmt, "linears": len(packed), "formats": sorted({m.format for m in packed}),
            "bytes_before": before, "bytes_after": after, "seconds": round(seconds, 2), "from_cache": kept is not None}


def _save(path: Path, modules: list[PackedLinear]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # a reader never sees half a file
        torch.save([{"format": m.format, "packed": m.packed, "scales": m.scales, "bias": m.bias,
                     "in_features": m.in_features, "out_features": m.out_features} for m in modules], tmp)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs packing again


def _load(path: Path, targets: list[tuple[nn.Module, str, nn.Linear]], activation: torch.dtype) -> list[PackedLinear] | None:
    """The kept packing if it matches these layers' shapes and activation dtype, else None
    (an old or damaged file: packing again is always correct)."""
    try:
        device = targets[0][2].weight.device if targets else torch.device("cpu")
        state = torch.load(path, weights_only=True, map_location=device)
        modules = [PackedLinear(s["format"], s["packed"], s["scales"], s["bias"], s["in_features"], s["out_features"])
                   for s in state]
    except Exception:
        return None
    shapes_match = len(modules) == len(targets) and all(
        (m.out_features, m.in_features) == tuple(linear.weight.shape) and m.activation == activation
        for m, (_, _, linear) in zip(modules, targets))
    return modules if shapes_match else None
