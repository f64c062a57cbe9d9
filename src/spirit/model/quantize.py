"""Weight-only int8 / int4 formats that torch's CPU kernels read directly.

- int8: symmetric per output channel, w ~= q * scale, q in [-127, 127]
  (`aten._weight_int8pack_mm`).
- int4: asymmetric per group of `INT4_GROUP` inputs, w ~= (q - 8) * scale + zero, q in
  [0, 15], packed by `aten._convert_weight_to_int4pack_for_cpu`
  (`aten._weight_int4pack_mm_for_cpu`); needs out_features % 16 == 0 and
  in_features % INT4_GROUP == 0.
Scales are returned in float32; the caller stores them in the activation dtype it feeds the
kernel (the kernels require both to match).
"""

from __future__ import annotations

import torch

INT4_GROUP = 32  # inputs per int4 scale: smaller groups are more accurate and cost the same here
_INT4_INNER_K_TILES = 1  # packing parameter of the CPU kernel (any valid value works on CPU)


def int4_fits(out_features: int, in_features: int, group: int = INT4_GROUP) -> bool:
    return out_features % 16 == 0 and in_features % group == 0


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
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, _INT4_INNER_K_TILES)
    zero = low + 8.0 * scale  # the kernel computes (q - 8) * scale + zero
    scales_and_zeros = torch.stack([scale.squeeze(-1), zero.squeeze(-1)], dim=-1)  # [out, groups, 2]
    return packed, scales_and_zeros.transpose(0, 1).contiguous()
