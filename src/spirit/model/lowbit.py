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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from spirit.model.quantize import PackedWeight, int4_fits, pack_int4, quantize_int4, quantize_int8

if TYPE_CHECKING:
    from spirit.model.gguf_blocks import GGUFLinear, Int4Groups

WEIGHTS = ("auto", "bf16", "int8", "int4")
PACKED_FORMATS = ("int8", "int4")
# A GGUF file's own precision, as closely as the kernels allow: its 4-bit blocks become int4
# groups with the file's exact codes; 5-, 6- and 8-bit blocks become int8 (per output channel:
# re-quantizing them to int4 costs 6.6x the error of int8 on qwen2.5-coder-1.5b's Q6_K layers)
FILE_PRECISION = "file"
KEEP_AFTER_S = 1.0  # packings that took longer than this are kept on disk


class PackedLinear(nn.Module):
    """A weight-only int8 / int4 copy of an nn.Linear: [..., in] -> [..., out] in the input's
    dtype, computed by the packed weight's kernel (model/quantize.PackedWeight)."""

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight_packed = weight
        self.format, self.in_features, self.out_features = weight.fmt, weight.in_features, weight.out_features
        self.register_buffer("bias", bias)
        # The float weight this was packed from, kept for the lm_head only: the reduced draft
        # head gathers rows of it (torch's CPU int4 layout interleaves rows in blocks, so rows
        # of a packed weight cannot always be gathered). Not a buffer: never saved.
        self.row_source: torch.Tensor | None = None
        self.file_codes = False  # packed from a GGUF file's own 4-bit codes (not re-quantized)
        self.panels: torch.Tensor | None = None  # the weight in AMX tile order (keep_tile_panels)

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str, activation: torch.dtype) -> "PackedLinear":
        weight = linear.weight.detach()
        out_features, in_features = weight.shape
        if fmt == "int4" and not int4_fits(out_features, in_features, device=weight.device.type):
            fmt = "int8"  # the int4 kernel cannot take this shape
        if fmt == "int4":
            packed = quantize_int4(weight, activation)
        elif fmt == "int8":
            if weight.device.type != "cpu":
                raise ValueError(f"int8 weights run on the CPU only (torch has no {weight.device.type} kernel)")
            packed = quantize_int8(weight, activation)
        else:
            raise ValueError(f"unknown packed format {fmt!r}; choose one of {', '.join(PACKED_FORMATS)}")
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(packed, bias)

    @classmethod
    def from_groups(cls, groups: "Int4Groups", bias: torch.Tensor | None, activation: torch.dtype) -> "PackedLinear":
        """The exact int4 groups read from a GGUF file's 4-bit blocks (model/gguf_blocks.py)."""
        packed = pack_int4(groups.codes, groups.scale, groups.zero, activation)
        module = cls(packed, None if bias is None else bias.detach().clone())
        module.file_codes = True
        return module

    @property
    def activation(self) -> torch.dtype:
        return self.weight_packed.activation

    @property
    def kernel(self) -> str:
        return self.weight_packed.kernel

    @property
    def device(self) -> torch.device:
        return self.weight_packed.codes.device

    def keep_tile_panels(self) -> None:
        """Keep the weight in AMX tile order too, where many-row products run on AMX here:
        a target's lm_head in a batched or verifying pass (the same bits, more memory)."""
        self.panels = self.weight_packed.tile_panels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.weight_packed.matmul(x.reshape(-1, self.in_features), self.panels).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] this module multiplies by, in float32 (tests and quality
        checks): the product with the identity, so it is what the kernel computes (an identity
        row quantizes exactly to int8)."""
        eye = torch.eye(self.in_features, dtype=self.activation, device=self.device)
        return self.weight_packed.matmul(eye).float().T.contiguous()

    def extra_repr(self) -> str:
        return (f"{self.format} ({self.kernel} kernel), in_features={self.in_features}, "
                f"out_features={self.out_features}")


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


def _packed(name: str, linear: nn.Linear, fmt: str, activation: torch.dtype,
            blocks: Mapping[str, "GGUFLinear"]) -> PackedLinear:
    """`linear` packed to `fmt`; from the GGUF file's exact 4-bit codes where its block is
    one (`fmt` "int4" or FILE_PRECISION), else re-quantized from the loaded weight."""
    from spirit.model.gguf_blocks import INT4_DIRECT

    block = blocks.get(name)
    out_features, in_features = linear.weight.shape
    exact = (fmt in ("int4", FILE_PRECISION) and block is not None and block.block_type in INT4_DIRECT
             and int4_fits(out_features, in_features, device=linear.weight.device.type))
    if not exact:
        return PackedLinear.from_linear(linear, "int8" if fmt == FILE_PRECISION else fmt, activation)
    groups = block.int4()
    _check_same_weight(name, groups, linear.weight)
    return PackedLinear.from_groups(groups, linear.bias, activation)


def _check_same_weight(name: str, groups: "Int4Groups", weight: torch.Tensor, rows: int = 16) -> None:
    """The file's codes must be the weight transformers loaded (the name mapping and llama's
    row permutation are right): its first rows must round to the same bf16 values."""
    from spirit.model.gguf_blocks import Int4Groups

    head = Int4Groups(groups.codes[:rows], groups.scale[:rows], groups.zero[:rows]).dequantized()
    loaded = weight[:rows].detach().to(torch.bfloat16).float().cpu()
    if not torch.allclose(head.to(torch.bfloat16).float(), loaded, rtol=1e-2, atol=1e-3):
        raise ValueError(f"the GGUF file's blocks for {name} do not match the weights loaded from it; "
                         "this file's tensor layout is not one spirit can read directly (use --weights bf16)")


@torch.inference_mode()
def pack_model(causal_lm: nn.Module, fmt: str, activation: torch.dtype = torch.bfloat16,
               cache: Path | None = None,
               blocks: Callable[[], Mapping[str, "GGUFLinear"]] | None = None) -> dict:
    """Replace every decoder linear layer and the lm_head of `causal_lm` by packed copies, in
    place; loaded from `cache` when a packing of these layers is kept there (else built, and
    kept if slow). `fmt`: "int8", "int4" or FILE_PRECISION; `blocks`: reads the GGUF file's
    linear weights by module name (model/gguf_blocks.read_linears), only when a packing is
    built; their 4-bit blocks are packed with their own codes. Returns what was done: formats, bytes before and after, seconds."""
    started = time.perf_counter()
    targets = packable_linears(causal_lm)
    names = {id(module): name for name, module in causal_lm.named_modules()}
    before = sum(linear.weight.numel() * linear.weight.element_size() for _, _, linear in targets)
    kept = _load(cache, targets, activation) if cache is not None and cache.exists() else None
    if kept is None:
        by_name = blocks() if blocks is not None else {}
        packed = [_packed(names[id(linear)], linear, fmt, activation, by_name) for _, _, linear in targets]
    else:
        packed = kept
    for (parent, name, linear), module in zip(targets, packed):
        if name == "lm_head":
            module.row_source = linear.weight.detach()  # tied: the embedding's own table, no copy
        setattr(parent, name, module)
    seconds = time.perf_counter() - started
    if kept is None and cache is not None and seconds >= KEEP_AFTER_S:
        _save(cache, packed)
    after = sum(m.weight_packed.nbytes for m in packed)
    return {"format": fmt, "linears": len(packed), "formats": sorted({m.format for m in packed}),
            "kernels": sorted({m.kernel for m in packed}),
            "file_codes": sum(m.file_codes for m in packed),
            "bytes_before": before, "bytes_after": after, "seconds": round(seconds, 2), "from_cache": kept is not None}


def _save(path: Path, modules: list[PackedLinear]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # a reader never sees half a file
        torch.save([{**m.weight_packed.tensors(), "bias": m.bias, "file_codes": m.file_codes} for m in modules], tmp)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs packing again


def _load(path: Path, targets: list[tuple[nn.Module, str, nn.Linear]], activation: torch.dtype) -> list[PackedLinear] | None:
    """The kept packing if it matches these layers' shapes and activation dtype, else None
    (an old or damaged file: packing again is always correct)."""
    try:
        device = targets[0][2].weight.device if targets else torch.device("cpu")
        state = torch.load(path, weights_only=True, map_location=device)
        modules = [PackedLinear(PackedWeight.from_tensors(s), s["bias"]) for s in state]
        for module, s in zip(modules, state):
            module.file_codes = bool(s.get("file_codes", False))
    except Exception:
        return None
    shapes_match = len(modules) == len(targets) and all(
        (m.out_features, m.in_features) == tuple(linear.weight.shape) and m.activation == activation
        and m.weight_packed.usable_here() for m, (_, _, linear) in zip(modules, targets))
    return modules if shapes_match else None
