"""Read a GGUF file's linear-layer weights straight from their quantized blocks.

Why: the usual path converts a GGUF file to bf16 (transformers dequantizes every block) and
then re-quantizes to torch's int4 groups with a min/max fit. For files that are already 4-bit,
that round trip throws away the file's own codes and scales, which llama.cpp chose with a
better (error-minimising) search, and adds bf16 rounding and a second quantization error on
top. The 4-bit block types used here map exactly onto torch's CPU int4 format:

    torch, per group of 32 inputs:  w[o, i] = (q[o, i] - 8) * scale[o, g] + zero[o, g],  q in 0..15

    Q4_0  (32 weights: fp16 d, 16 bytes of nibbles)           w = d * (q - 8)
          -> scale = d, zero = 0
    Q4_1  (32 weights: fp16 d, fp16 m, 16 bytes of nibbles)   w = d * q + m
          -> scale = d, zero = m + 8 d
    Q4_K  (256 weights: fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins for 8 sub-blocks
          of 32, 128 bytes of nibbles)                        w = d sc_j * q - dmin m_j
          -> per sub-block j: scale = d sc_j, zero = 8 d sc_j - dmin m_j

so those come back as `Int4Groups` holding the file's exact 4-bit codes. Every other
supported block type comes back as float32 (via gguf's own dequantization) for the caller
to re-quantize.

Names are mapped to Hugging Face module paths, and llama-architecture attn_q / attn_k get the
inverse of the row permutation llama.cpp's converter applies (as transformers does when it
loads a GGUF), so the result lines up with the bf16 weights transformers would produce.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import gguf
import numpy as np
import torch

INT4_GROUP = 32  # torch's int4 group along inputs; every int4-direct block type has 32-wide groups

INT4_DIRECT = ("Q4_0", "Q4_1", "Q4_K")  # block types read as exact int4 groups
# Block types float32() decodes through gguf.quants (each checked in tests/model/test_gguf_blocks.py).
# The int4-direct types decode to float32 as well.
FLOAT_READ = ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q5_K", "Q6_K")
SUPPORTED_BLOCKS = INT4_DIRECT + FLOAT_READ

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma")

# GGUF per-layer tensor stem -> HF module path inside model.layers.N
_LAYER_LINEARS = MappingProxyType({
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
})
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.([a-z_]+)\.weight")

# Byte layouts (bytes per block) of the int4-direct types, from gguf/llama.cpp's block structs.
_Q4_0_BYTES = 2 + 16
_Q4_1_BYTES = 2 + 2 + 16
_Q4_K_BYTES = 2 + 2 + 12 + 128
_Q4_K_WEIGHTS = 256


class UnsupportedBlockError(ValueError):
    """A tensor's block type cannot be read the way the caller asked."""


@dataclass(frozen=True)
class Int4Groups:
    """A weight in torch's int4 group format, w = (codes - 8) * scale + zero per group of 32.

    codes: uint8 [out, in], values 0..15 (torch's q); scale, zero: float32 [out, in // 32].
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def dequantized(self) -> torch.Tensor:
        """float32 [out, in] = (codes - 8) * scale + zero, group by group."""
        out_features, in_features = self.codes.shape
        q = self.codes.to(torch.float32).reshape(out_features, in_features // INT4_GROUP, INT4_GROUP)
        w = (q - 8.0) * self.scale[..., None] + self.zero[..., None]
        return w.reshape(out_features, in_features)


@dataclass(frozen=True)
class GGUFLinear:
    """One linear layer's weight in a GGUF file, decoded only when asked.

    `data` is the reader's (memory-mapped) view of the tensor: raw blocks as uint8
    [out, bytes per row] for quantized types, a float array [out, in] for F32/F16.
    `rotary_heads`, when set, is the head count of llama.cpp's rotary row permutation to undo.
    """

    hf_name: str
    block_type: str
    shape: tuple[int, int]  # (out_features, in_features)
    gguf_name: str = ""
    data: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint8), repr=False, compare=False)
    rotary_heads: int | None = None

    def int4(self) -> Int4Groups:
        """The file's own 4-bit codes and per-32 scales/zeros; only for INT4_DIRECT types."""
        if self.block_type not in INT4_DIRECT:
            raise UnsupportedBlockError(
                f"{self._label()} is {self.block_type}, which has no exact int4 form; "
                f"int4() reads {', '.join(INT4_DIRECT)} (use float32() for {', '.join(FLOAT_READ)})"
            )
        out_features, in_features = self.shape
        if in_features % INT4_GROUP:
            raise UnsupportedBlockError(
                f"{self._label()} has in_features={in_features}, not a multiple of the int4 group "
                f"({INT4_GROUP}); a well-formed {self.block_type} tensor cannot have that shape"
            )
        rows = np.ascontiguousarray(self.data, dtype=np.uint8).reshape(out_features, -1)
        codes, scale, zero = _INT4_DECODERS[self.block_type](rows)
        groups = Int4Groups(torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(zero))
        if self.rotary_heads is None:
            return groups
        heads = self.rotary_heads
        # The permutation moves whole output rows, so each row's groups along inputs stay intact.
        return Int4Groups(_unpermute_rows(groups.codes, heads), _unpermute_rows(groups.scale, heads),
                          _unpermute_rows(groups.zero, heads))

    def float32(self) -> torch.Tensor:
        """float32 [out, in], decoded by gguf's own dequantization; for every supported type."""
        if self.block_type not in SUPPORTED_BLOCKS:
            raise UnsupportedBlockError(
                f"{self._label()} is {self.block_type}; supported block types are "
                f"{', '.join(SUPPORTED_BLOCKS)}"
            )
        qtype = gguf.GGMLQuantizationType[self.block_type]
        values = gguf.quants.dequantize(self.data, qtype).reshape(self.shape)
        # F32 comes back as a view of the read-only memory map: copy it so torch owns writable memory.
        weight = torch.from_numpy(np.require(values, np.float32, ["C", "W"]))
        return weight if self.rotary_heads is None else _unpermute_rows(weight, self.rotary_heads)

    def _label(self) -> str:
        return f"tensor {self.gguf_name or self.hf_name!r} ({self.hf_name}, shape {self.shape})"


def read_linears(gguf_file: Path) -> dict[str, GGUFLinear]:
    """HF module path (e.g. "model.layers.3.self_attn.q_proj", "lm_head") -> lazily decoded weight.

    Only the linear layers of the decoder (attention, MLP, output head) are listed; the file is
    memory-mapped, so nothing is decoded until int4() or float32() is called.
    """
    reader = gguf.GGUFReader(gguf_file, "r")
    architecture = _field(reader, "general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{gguf_file}: architecture {architecture!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    tensors = {t.name: t for t in reader.tensors}
    names = _hf_names(tensors.keys())
    linears = {}
    for gguf_name, hf_name in names.items():
        tensor = tensors[gguf_name]
        # GGUF lists dimensions innermost first ([in, out]); torch wants [out, in].
        in_features, out_features = (int(d) for d in tensor.shape)
        linears[hf_name] = GGUFLinear(
            hf_name=hf_name,
            block_type=tensor.tensor_type.name,
            shape=(out_features, in_features),
            gguf_name=gguf_name,
            data=tensor.data,
            rotary_heads=_rotary_heads(reader, architecture, gguf_name),
        )
    return linears


def _hf_names(gguf_names: Iterable[str]) -> dict[str, str]:
    """GGUF tensor name -> HF module path, for the linear layers among `gguf_names`."""
    names = set(gguf_names)
    mapped = {}
    for name in names:
        layer = _LAYER_TENSOR.fullmatch(name)
        if layer and layer.group(2) in _LAYER_LINEARS:
            mapped[name] = f"model.layers.{layer.group(1)}.{_LAYER_LINEARS[layer.group(2)]}"
    if "output.weight" in names:
        mapped["output.weight"] = "lm_head"
    elif "token_embd.weight" in names:
        # Tied embeddings: with no output.weight the output head reuses the embedding matrix
        # (transformers sets tie_word_embeddings the same way), so it is also the lm_head.
        mapped["token_embd.weight"] = "lm_head"
    return mapped


def _rotary_heads(reader: gguf.GGUFReader, architecture: str, gguf_name: str) -> int | None:
    """Head count of the row permutation to undo for this tensor, or None.

    llama.cpp's converter reorders the rows of attn_q / attn_k for llama files only
    (from HF's half-split rotary layout to interleaved pairs); transformers undoes it for
    general.architecture == "llama" only, and so do we. Mistral models are written as "llama"
    by llama.cpp, so they take this path too; qwen2/qwen3/gemma files are not permuted.
    """
    if architecture != "llama":
        return None
    layer = _LAYER_TENSOR.fullmatch(gguf_name)
    if not layer or layer.group(2) not in ("attn_q", "attn_k"):
        return None
    key = "head_count" if layer.group(2) == "attn_q" else "head_count_kv"
    counts = _field(reader, f"llama.attention.{key}")
    if isinstance(counts, list):  # some files give one head count per layer
        counts = counts[int(layer.group(1))]
    return int(counts)


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    found = reader.get_field(key)
    if found is None:
        raise ValueError(f"GGUF metadata has no {key!r}")
    return found.contents()


def _unpermute_rows(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp stores each head's rows as interleaved pairs (row 2j + t holds HF row t * half + j,
    half = head_dim / 2); reshaping rows to (heads, half, 2) and swapping the last two axes puts
    them back in HF's order (heads, 2, half).
    """
    rows = x.shape[0]
    if rows % (2 * heads):
        raise ValueError(f"{rows} rows do not split into {heads} heads of even size")
    half = rows // heads // 2
    return x.reshape(heads, half, 2, *x.shape[1:]).transpose(1, 2).reshape(x.shape).contiguous()


def _fp16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 fields ([..., 2] bytes) -> float32 [...]."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray, chunk: int) -> np.ndarray:
    """Unpack nibbles in ggml's order: within each run of `chunk` bytes, the low nibbles give
    `chunk` consecutive weights, then the high nibbles of the same bytes give the next `chunk`.
    qs: uint8 [out, blocks, bytes] -> uint8 [out, blocks * bytes * 2]."""
    out_features, blocks, nbytes = qs.shape
    runs = qs.reshape(out_features, blocks, nbytes // chunk, 1, chunk)
    codes = np.concatenate([runs & 0x0F, runs >> 4], axis=3)
    return codes.reshape(out_features, blocks * nbytes * 2)


def _decode_q4_0(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    blocks = rows.reshape(rows.shape[0], -1, _Q4_0_BYTES)
    d = _fp16(blocks[..., 0:2])
    codes = _nibbles(blocks[..., 2:], chunk=16)
    return codes, d, np.zeros_like(d)  # w = d (q - 8): the file's q is torch's q


def _decode_q4_1(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    blocks = rows.reshape(rows.shape[0], -1, _Q4_1_BYTES)
    d, m = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])
    codes = _nibbles(blocks[..., 4:], chunk=16)
    return codes, d, m + 8.0 * d  # w = d q + m = (q - 8) d + (m + 8 d)


def _q4_k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes of 6-bit scales and mins for 8 sub-blocks -> (sc, m), uint8 [..., 8] each.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3 likewise; the top 2 bits
    of those bytes are the high bits of scales / mins 4-7, whose low 4 bits sit in the low and
    high nibbles of bytes 8-11.
    """
    low, mid, high = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([low & 0x3F, (high & 0x0F) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([mid & 0x3F, (high >> 4) | ((mid >> 6) << 4)], axis=-1)
    return scales, mins


def _decode_q4_k(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    out_features = rows.shape[0]
    blocks = rows.reshape(out_features, -1, _Q4_K_BYTES)
    d, dmin = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])
    sc, m = _q4_k_scales_mins(blocks[..., 4:16])
    # 128 bytes = 4 runs of 32: sub-block 2r is run r's low nibbles, sub-block 2r+1 its high ones.
    codes = _nibbles(blocks[..., 16:], chunk=32)
    scale = d[..., None] * sc.astype(np.float32)  # [out, super-blocks, 8]
    shift = dmin[..., None] * m.astype(np.float32)
    zero = 8.0 * scale - shift  # w = d sc q - dmin m = (q - 8) d sc + (8 d sc - dmin m)
    return codes, scale.reshape(out_features, -1), zero.reshape(out_features, -1)


_INT4_DECODERS = MappingProxyType({"Q4_0": _decode_q4_0, "Q4_1": _decode_q4_1, "Q4_K": _decode_q4_k})
