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
On x86-64 CPUs where spirit's own kernel builds (model/qgemm.py), it runs both formats
instead: int4 as above but with float16 scale and offset per group of 32 (w = q * scale +
offset), int8 symmetric per block of 32 inputs (not per channel), both with int8-quantized
activations and with blocks interleaved in groups of 16 (kernels/qgemm.cpp, "Formats"). It
streams packed weights about 1.3x faster than torch's int4 op and is row-invariant by
construction. `PackedWeight` is a packed weight with the kernel that runs it:
the one value every user of these formats (low-bit targets, quantized drafts, the probe) holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spirit.model import qgemm

INT4_GROUP = 32  # inputs per int4 scale: smaller groups are more accurate and cost the same here
GROUP_BLOCKS = 16  # blocks interleaved together in spirit's layouts (kernels/qgemm.cpp)
# names spirit's layouts in kept packings: one packed with another layout is packed again
SPIRIT_LAYOUT = {"int4": "groups-of-16", "int8": "groups-of-16"}
_INT4_INNER_K_TILES = 1  # packing parameter of the CPU kernel (any valid value works on CPU)
_INT4_INNER_K_TILES_CUDA = 8  # tinygemm's tiling: in_features must be a multiple of 16 x this




def bytes_per_weight(fmt: str) -> float:
    """Bytes a kernel reads per weight of a packed format: int8 one byte (plus, for spirit's
    kernel, a float16 scale per 32); int4 half a byte plus two 16-bit numbers per group of 32."""
    if fmt == "int8":
        return 1.0 + (2.0 / INT4_GROUP if qgemm.available() else 0.0)
    if fmt == "int4":
        return 0.5 + 4.0 / INT4_GROUP
    raise ValueError(f"unknown packed format {fmt!r}")


class UnsupportedKernelError(ValueError):
    """No low-bit kernel for this format on this device."""


def _spirit_kernel(device: str) -> bool:
    return device == "cpu" and qgemm.available()


def int4_fits(out_features: int, in_features: int, group: int = INT4_GROUP, device: str = "cpu") -> bool:
    if _spirit_kernel(device):
        return in_features % group == 0
    cuda_tiles = in_features % (16 * _INT4_INNER_K_TILES_CUDA) == 0 if device == "cuda" else True
    return out_features % 16 == 0 and in_features % group == 0 and cuda_tiles


@dataclass(frozen=True)
class PackedWeight:
    """A weight [out, in] in a packed format, with the kernel that multiplies by it.

    kernel "spirit" (model/qgemm.py): int4 codes nibble-packed in groups of 16 blocks, float16
    `scales` and `offsets` [out, in // 32]; int8 codes [out, in] in groups of 16 blocks, float16
    `scales` per block.
    kernel "torch": torch's packed layouts; `scales` in the activation dtype the op needs.
    """

    fmt: str  # "int8" | "int4"
    kernel: str  # "spirit" | "torch"
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    activation: torch.dtype  # what rows are cast to before the kernel
    out_features: int
    in_features: int

    def matmul(self, rows: torch.Tensor, panels: torch.Tensor | None = None) -> torch.Tensor:
        """[rows, in] -> [rows, out] in the activation dtype. `panels`: this weight in AMX tile
        order (tile_panels), for many-row products on CPUs with AMX (spirit's kernel only)."""
        rows = rows.to(self.activation)
        if self.kernel == "spirit":
            return qgemm.qgemm(rows, self.codes, self.scales, self.offsets, None, self.bits, panels)
        if self.fmt == "int8":
            return int8_matmul(rows, self.codes, self.scales)
        return int4_matmul(rows, self.codes, INT4_GROUP, self.scales)

    @property
    def bits(self) -> int:
        return 8 if self.fmt == "int8" else 4

    def tile_panels(self) -> torch.Tensor | None:
        """This weight again in AMX tile order, or None where many-row products do not run on
        AMX here (model/qgemm.tile_panels): the same bits, as many bytes again."""
        if self.kernel != "spirit":
            return None
        return qgemm.tile_panels(self.codes, self.scales, self.offsets, self.bits)

    @property
    def nbytes(self) -> int:
        tensors = (self.codes, self.scales) if self.offsets is None else (self.codes, self.scales, self.offsets)
        return sum(t.numel() * t.element_size() for t in tensors)

    def tensors(self) -> dict:
        """What to save; `from_tensors` rebuilds it."""
        return {"format": self.fmt, "kernel": self.kernel, "layout": self._layout(), "codes": self.codes, "scales": self.scales,
                "offsets": self.offsets, "activation": str(self.activation).removeprefix("torch."),
                "out_features": self.out_features, "in_features": self.in_features}

    def _layout(self) -> str:
        return SPIRIT_LAYOUT[self.fmt] if self.kernel == "spirit" else ""

    @classmethod
    def from_tensors(cls, state: dict) -> "PackedWeight":
        """Raises ValueError for a packing kept with another layout (the caller packs again)."""
        expected = SPIRIT_LAYOUT[state["format"]] if state["kernel"] == "spirit" else ""
        if state.get("layout", "") != expected:  # older packings: int4 in pairs, int8 blocks in order
            raise ValueError(f"a kept packing in layout {state.get('layout', '')!r}, not {expected!r}")
        return cls(state["format"], state["kernel"], state["codes"], state["scales"], state["offsets"],
                   getattr(torch, state["activation"]), state["out_features"], state["in_features"])

    def copy(self) -> "PackedWeight":
        """The same weight at another address (the probe cycles copies to read memory, not cache)."""
        offsets = None if self.offsets is None else self.offsets.clone()
        return PackedWeight(self.fmt, self.kernel, self.codes.clone(), self.scales.clone(), offsets,
                            self.activation, self.out_features, self.in_features)

    def usable_here(self) -> bool:
        """False for a kept spirit-kernel packing where that kernel does not run now."""
        return self.kernel != "spirit" or _spirit_kernel(self.codes.device.type)


def int4_groups(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max int4 per group: codes [out, in] in 0..15 and scale, zero [out, in //
    group] (float32) with w ~= (codes - 8) * scale + zero."""
    out_features, in_features = weight.shape
    w = weight.float().reshape(out_features, in_features // group, group)
    low, high = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    scale = ((high - low) / 15.0).clamp(min=1e-12)
    q = torch.round((w - low) / scale).clamp(0, 15).to(torch.uint8).reshape(out_features, in_features)
    zero = low + 8.0 * scale
    return q, scale.squeeze(-1), zero.squeeze(-1)


def quantize_int4(weight: torch.Tensor, activation: torch.dtype = torch.bfloat16) -> PackedWeight:
    return pack_int4(*int4_groups(weight), activation=activation)


def _fits_half(*tensors: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t.half()).all()) for t in tensors)


def pack_int4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              activation: torch.dtype = torch.bfloat16) -> PackedWeight:
    """Codes [out, in] in 0..15 and per-group scale, zero [out, in // group] (w = (q - 8) *
    scale + zero) -> the packed weight for the best kernel on their device."""
    out_features, in_features = codes.shape
    device = codes.device.type
    offset = zero.float() - 8.0 * scale.float()
    if _spirit_kernel(device) and in_features % INT4_GROUP == 0 and _fits_half(scale, offset):
        return PackedWeight("int4", "spirit", _nibble_pairs(codes), scale.half().contiguous(),
                            offset.half().contiguous(), activation, out_features, in_features)
    q = codes.to(torch.int32)
    if device == "cuda":
        pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # [out, in // 2], high nibble first
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs, _INT4_INNER_K_TILES_CUDA)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, _INT4_INNER_K_TILES)
    scales_and_zeros = torch.stack([scale.float(), zero.float()], dim=-1)  # [out, groups, 2]
    return PackedWeight("int4", "torch", packed, scales_and_zeros.transpose(0, 1).contiguous().to(activation), None,
                        activation, out_features, in_features)


def _nibble_pairs(codes: torch.Tensor) -> torch.Tensor:
    """spirit's int4 layout (kernels/qgemm.cpp, "Formats"): the first 16 * (blocks // 16) blocks
    of 32 in groups of 16, byte 64c + 4l + j of a group = input 4c + j of block l | input 16 + 4c
    + j << 4; the rest in pairs, byte j = code j of the first block | code j of the second << 4;
    a lone last block packs its inputs j and j + 16 in byte j."""
    out_features, in_features = codes.shape
    blocks = in_features // INT4_GROUP
    q = codes.to(torch.uint8).reshape(out_features, blocks, INT4_GROUP)
    grouped = blocks // GROUP_BLOCKS * GROUP_BLOCKS
    # [out, group, block l, half, c, j] -> [out, group, c, l, j] per half
    groups = q[:, :grouped].reshape(out_features, grouped // GROUP_BLOCKS, GROUP_BLOCKS, 2, 4, 4)
    low, high = groups[:, :, :, 0].permute(0, 1, 3, 2, 4), groups[:, :, :, 1].permute(0, 1, 3, 2, 4)
    parts = [(low | high << 4).reshape(out_features, -1)]
    rest = q[:, grouped:]
    paired = (blocks - grouped) - (blocks - grouped) % 2
    pairs = rest[:, :paired].reshape(out_features, paired // 2, 2, INT4_GROUP)
    parts.append((pairs[:, :, 0] | pairs[:, :, 1] << 4).reshape(out_features, -1))
    if blocks % 2:
        last = q[:, -1]
        parts.append(last[:, :16] | last[:, 16:] << 4)
    return torch.cat(parts, dim=1).contiguous()


def _byte_groups(codes: torch.Tensor) -> torch.Tensor:
    """spirit's int8 layout (kernels/qgemm.cpp, "Formats"): the first 16 * (blocks // 16) blocks
    of 32 in groups of 16, byte 64k + 4l + j of a group = input 4k + j of block l; the rest in order."""
    out_features, in_features = codes.shape
    blocks = in_features // INT4_GROUP
    grouped = blocks // GROUP_BLOCKS * GROUP_BLOCKS
    # [out, group, block l, k, j] -> [out, group, k, l, j]
    groups = codes[:, : grouped * INT4_GROUP].reshape(out_features, grouped // GROUP_BLOCKS, GROUP_BLOCKS, 8, 4)
    return torch.cat([groups.permute(0, 1, 3, 2, 4).reshape(out_features, -1), codes[:, grouped * INT4_GROUP :]],
                     dim=1).contiguous()


def quantize_int8(weight: torch.Tensor, activation: torch.dtype = torch.bfloat16) -> PackedWeight:
    """Symmetric int8, q in [-127, 127]: per block of 32 inputs for spirit's kernel, per output
    channel for torch's."""
    out_features, in_features = weight.shape
    w = weight.float()
    if _spirit_kernel(weight.device.type) and in_features % INT4_GROUP == 0:
        blocks = w.reshape(out_features, in_features // INT4_GROUP, INT4_GROUP)
        scale = (blocks.abs().amax(dim=-1) / 127.0).clamp(min=1e-12).half().float()
        if _fits_half(scale):
            q = torch.round(blocks / scale[..., None]).clamp(-127, 127).to(torch.int8).reshape(out_features, in_features)
            return PackedWeight("int8", "spirit", _byte_groups(q), scale.half().contiguous(), None, activation,
                                out_features, in_features)
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return PackedWeight("int8", "torch", q.contiguous(), scale.to(activation), None, activation,
                        out_features, in_features)


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """torch's op: [rows, in] x int8 [out, in] (per-channel scales) -> [rows, out]."""
    if x.device.type != "cpu":
        raise UnsupportedKernelError(f"torch has no int8 weight-only kernel on {x.device.type}; use 4 bits or none")
    return torch.ops.aten._weight_int8pack_mm(x, q, scales)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, group: int, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """torch's op: [rows, in] x packed int4 [out, in] -> [rows, out], in the activations' dtype."""
    if x.device.type == "cuda":
        return torch.ops.aten._weight_int4pack_mm(x, packed, group, scales_and_zeros)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)
