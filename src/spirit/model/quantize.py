"""Weight-only int8 / int4 formats that torch's kernels read directly, chosen per device.

- int8: symmetric per output channel, w ~= q * scale, q in [-127, 127]
  (`aten._weight_int8pack_mm`, CPU only in torch: refused on CUDA).
- int4: asymmetric per group of `INT4_GROUP` inputs, w ~= (q - 8) * scale + zero, q in
  [0, 15]. On CPU packed by `aten._convert_weight_to_int4pack_for_cpu` and run by
  `aten._weight_int4pack_mm_for_cpu`; on CUDA packed by `aten._convert_weight_to_int4pack`
  (from two 4-bit values per byte) and run by `aten._weight_int4pack_mm` (tinygemm; bf16
  activations). Needs out_features % 16 == 0 and in_features % INT4_GROUP == 0 (and, on
  CUDA, in_features % 128 == 0). The CUDA path is written from torch's op contracts and is
  untested here: no GPU was at hand.
Scales are returned in float32; the caller stores them in the activation dtype it feeds the
kernel (the kernels require both to match).
"""

from __future__ import annotations

import torch

INT4_GROUP = 32  # inputs per int4 scale: smaller groups are more accurate and cost the same here
_INT4_INNER_K_TILES = 1  # packing parameter of the CPU kernel (any valid value works on CPU)
_INT4_INNER_K_TILES_CUDA = 8  # tinygemm's tiling: in_features must be a multiple of 16 x this




def bytes_per_weight(fmt: str) -> float:
    """Bytes a kernel reads per weight of a packed format: int8 one byte (its per-row scale is
    negligible); int4 half a byte plus a bf16 scale and zero per group of INT4_GROUP."""
    if fmt == "int8":
        return 1.0
    if fmt == "int4":
        return 0.5 + 4.0 / INT4_GROUP
    raise ValueError(f"unknown packed format {fmt!r}")


class UnsupportedKernelError(ValueError):
    """No low-bit kernel for this format on this device."""


def int4_fits(out_features: int, in_features: int, group: int = INT4_GROUP, device: str = "cpu") -> bool:
    cuda_tiles = in_features % (16 * _INT4_INNER_K_TILES_CUDA) == 0 if device == "cuda" else True
    return out_features % 16 == 0 and in_features % group == 0 and cuda_tiles


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    out_features, in_features = weight.shape
    w = weight.float().reshape(out_features, in_features // group, group)
    low, high = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    scale = ((high - low) / 15.0).clamp(min=1e-12)
    q = torch.round((w - low) / scale).clamp(0, 15).to(torch.int32).reshape(out_features, in_features)
    zero = low + 8.0 * scale  # the kernel computes (q - 8) * scale + zero
    return pack_int4(q, scale.squeeze(-1), zero.squeeze(-1))


def pack_int4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [out, in] in 0..15 and per-group scale, zero [out, in // group] (w = (q - 8) *
    scale + zero) -> the device kernel's packed weight and scales-and-zeros [groups, out, 2]
    (float32; the caller casts them to the activation dtype)."""
    q = codes.to(torch.int32)
    if q.device.type == "cuda":
        pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # [out, in // 2], high nibble first
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs, _INT4_INNER_K_TILES_CUDA)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, _INT4_INNER_K_TILES)
    scales_and_zeros = torch.stack([scale.float(), zero.float()], dim=-1)  # [out, groups, 2]
    return packed, scales_and_zeros.transpose(0, 1).contiguous()


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[rows, in] x int8 [out, in] -> [rows, out], in the activations' dtype."""
    if x.device.type != "cpu":
        raise UnsupportedKernelError(f"torch has no int8 weight-only kernel on {x.device.type}; use 4 bits or none")
    return torch.ops.aten._weight_int8pack_mm(x, q, scales)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, group: int, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """[rows, in] x packed int4 [out, in] -> [rows, out], in the activations' dtype."""
    if x.device.type == "cuda":
        return torch.ops.aten._weight_int4pack_mm(x, packed, group, scales_and_zeros)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)
