"""Reading GGUF linear weights from their blocks (model/gguf_blocks.py): exact int4 codes,
gguf-consistent float decoding, llama's q/k row permutation, name mapping and clear refusals.

Synthetic files are written with gguf.GGUFWriter; blocks gguf cannot quantize (Q4_K and the
other K-quants) are built as raw bytes."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from spirit.model.gguf_blocks import (
    FLOAT_READ,
    INT4_DIRECT,
    GGUFLinear,
    UnsupportedBlockError,
    read_linears,
)

Q = gguf.GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, FFN = 64, 4, 2, 96
HEAD_DIM = HIDDEN // HEADS
# K-quants are 256-weight super-blocks, so their synthetic rows are wider
WIDE = 512


def _write(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, Q | None]]) -> Path:
    """A GGUF file with `arch` metadata and tensors given in torch order ([out, in] floats, or
    [out, bytes] uint8 blocks when a raw block type is given)."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    for name, (array, raw_dtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _random_blocks(rng: np.random.Generator, qtype: Q, rows: int, cols: int) -> np.ndarray:
    """Random raw blocks of `qtype`; bytes below 0x3C keep every fp16 field finite (< 1)."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    return rng.integers(0, 0x3C, size=(rows, cols // block * type_size), dtype=np.uint8)


def _gguf_dequantize(blocks: np.ndarray, qtype: Q) -> np.ndarray:
    return gguf.quants.dequantize(blocks, qtype)


def _llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter, written index by index: within each head, GGUF row 2j + t holds
    HF row t * head_dim / 2 + j."""
    head_dim = w.shape[0] // heads
    order = [h * head_dim + t * head_dim // 2 + j
             for h in range(heads) for j in range(head_dim // 2) for t in range(2)]
    return w[order]


def _pack_q4_k(d: float, dmin: float, sc: np.ndarray, m: np.ndarray, q: np.ndarray) -> np.ndarray:
    """One Q4_K super-block from known parts (sc, m: 8 six-bit values; q: 256 codes)."""
    scales = np.zeros(12, np.uint8)
    for j in range(4):
        scales[j] = sc[j] | (sc[j + 4] >> 4) << 6
        scales[j + 4] = m[j] | (m[j + 4] >> 4) << 6
        scales[j + 8] = (sc[j + 4] & 0x0F) | (m[j + 4] & 0x0F) << 4
    qs = np.zeros(128, np.uint8)
    for r in range(4):  # 32 bytes per pair of sub-blocks: 2r in the low nibbles, 2r + 1 high
        qs[r * 32:(r + 1) * 32] = q[64 * r:64 * r + 32] | q[64 * r + 32:64 * r + 64] << 4
    header = np.array([d, dmin], np.float16).view(np.uint8)
    return np.concatenate([header, scales, qs])


def test_q4_k_known_block_gives_its_codes_scales_and_zeros(tmp_path):
    rng = np.random.default_rng(0)
    rows, supers = 2, 2
    parts = [[(0.01 * (r + 1), 0.003, rng.integers(0, 64, 8, dtype=np.uint8),
               rng.integers(0, 64, 8, dtype=np.uint8), rng.integers(0, 16, 256, dtype=np.uint8))
              for _ in range(supers)] for r in range(rows)]
    blocks = np.stack([np.concatenate([_pack_q4_k(*p) for p in row]) for row in parts])
    path = _write(tmp_path / "k.gguf", "qwen2", {"blk.0.ffn_down.weight": (blocks, Q.Q4_K)})
    linear = read_linears(path)["model.layers.0.mlp.down_proj"]
    assert linear.block_type == "Q4_K" and linear.shape == (rows, supers * 256)
    groups = linear.int4()
    for r, row in enumerate(parts):
        d = np.float32(np.float16(row[0][0]))
        dmin = np.float32(np.float16(row[0][1]))
        codes = np.concatenate([p[4] for p in row])
        scale = np.concatenate([d * p[2].astype(np.float32) for p in row])
        zero = np.concatenate([8 * d * p[2].astype(np.float32) - dmin * p[3].astype(np.float32) for p in row])
        np.testing.assert_array_equal(groups.codes[r].numpy(), codes)
        np.testing.assert_allclose(groups.scale[r].numpy(), scale, rtol=1e-6)
        np.testing.assert_allclose(groups.zero[r].numpy(), zero, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("block_type", INT4_DIRECT)
def test_int4_groups_reproduce_gguf_dequantization(tmp_path, block_type):
    rng = np.random.default_rng(1)
    qtype = Q[block_type]
    if block_type == "Q4_K":  # gguf cannot quantize Q4_K: any scale/nibble bytes make a valid block
        blocks = rng.integers(0, 256, size=(48, WIDE // 256, 144), dtype=np.uint8)
        blocks[..., 0:4] = np.array([0.02, 0.01], np.float16).view(np.uint8)  # d, dmin: finite
        blocks = blocks.reshape(48, -1)
    else:
        blocks = gguf.quants.quantize(rng.standard_normal((48, WIDE)).astype(np.float32), qtype)
    path = _write(tmp_path / "q.gguf", "qwen2", {"blk.2.ffn_up.weight": (blocks, qtype)})
    linear = read_linears(path)["model.layers.2.mlp.up_proj"]
    groups = linear.int4()
    expected = torch.from_numpy(_gguf_dequantize(blocks, qtype))
    assert groups.codes.dtype == torch.uint8 and groups.codes.shape == (48, WIDE)
    assert int(groups.codes.max()) <= 15
    assert groups.scale.shape == groups.zero.shape == (48, WIDE // 32)
    assert groups.scale.dtype == groups.zero.dtype == torch.float32
    scale_of_weights = expected.abs().max()
    torch.testing.assert_close(groups.dequantized(), expected, rtol=0, atol=float(scale_of_weights) * 1e-6)
    torch.testing.assert_close(linear.float32(), expected, rtol=0, atol=0)


QUANTIZABLE = ("BF16", "Q8_0", "Q5_0", "Q5_1")


@pytest.mark.parametrize("block_type", FLOAT_READ)
def test_float_read_matches_gguf_dequantization(tmp_path, block_type):
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((32, WIDE)).astype(np.float32)
    qtype = Q[block_type]
    if block_type == "F32":
        stored, raw = weight, None
    elif block_type == "F16":
        stored, raw = weight.astype(np.float16), None
    elif block_type in QUANTIZABLE:
        stored, raw = gguf.quants.quantize(weight, qtype), qtype
    else:  # K-quants: gguf only dequantizes them
        stored, raw = _random_blocks(rng, qtype, 32, WIDE), qtype
    path = _write(tmp_path / "f.gguf", "qwen2", {"blk.0.attn_output.weight": (stored, raw)})
    linear = read_linears(path)["model.layers.0.self_attn.o_proj"]
    assert linear.block_type == block_type and linear.shape == (32, WIDE)
    got = linear.float32()
    assert got.dtype == torch.float32 and got.shape == (32, WIDE)
    expected = np.asarray(_gguf_dequantize(stored, qtype), dtype=np.float32).reshape(32, WIDE)
    np.testing.assert_array_equal(got.numpy(), expected)
    if block_type in ("F32", "F16", "BF16", "Q8_0"):  # and it is the weight we wrote, to the format's precision
        np.testing.assert_allclose(got.numpy(), weight, atol=0.05)
    with pytest.raises(UnsupportedBlockError, match=block_type):
        linear.int4()


def test_llama_q_and_k_rows_are_unpermuted(tmp_path):
    rng = np.random.default_rng(3)
    hf_q = rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32)
    hf_k = rng.standard_normal((KV_HEADS * HEAD_DIM, HIDDEN)).astype(np.float32)
    tensors = {
        "blk.0.attn_q.weight": (_llama_permute(hf_q, HEADS), None),
        "blk.0.attn_k.weight": (_llama_permute(hf_k, KV_HEADS), None),
        "blk.1.attn_q.weight": (gguf.quants.quantize(_llama_permute(hf_q, HEADS), Q.Q4_0), Q.Q4_0),
        "blk.1.attn_k.weight": (gguf.quants.quantize(_llama_permute(hf_k, KV_HEADS), Q.Q4_1), Q.Q4_1),
    }
    linears = read_linears(_write(tmp_path / "llama.gguf", "llama", tensors))
    np.testing.assert_array_equal(linears["model.layers.0.self_attn.q_proj"].float32().numpy(), hf_q)
    np.testing.assert_array_equal(linears["model.layers.0.self_attn.k_proj"].float32().numpy(), hf_k)
    # Blocks run along inputs, so quantizing commutes with the row permutation: the int4 groups
    # must equal those of the HF-ordered weight quantized directly.
    for name, hf, qtype in (("q_proj", hf_q, Q.Q4_0), ("k_proj", hf_k, Q.Q4_1)):
        linear = linears[f"model.layers.1.self_attn.{name}"]
        direct = _gguf_dequantize(gguf.quants.quantize(hf, qtype), qtype)
        np.testing.assert_allclose(linear.int4().dequantized().numpy(), direct, rtol=0, atol=1e-6)
        np.testing.assert_array_equal(linear.float32().numpy(), direct)


def test_qwen2_q_and_k_are_not_permuted(tmp_path):
    rng = np.random.default_rng(4)
    stored = rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32)
    path = _write(tmp_path / "qwen2.gguf", "qwen2", {"blk.0.attn_q.weight": (stored, None)})
    np.testing.assert_array_equal(read_linears(path)["model.layers.0.self_attn.q_proj"].float32().numpy(), stored)


def _decoder(tied: bool) -> dict[str, tuple[np.ndarray, Q | None]]:
    rng = np.random.default_rng(5)
    f32 = lambda *shape: (rng.standard_normal(shape).astype(np.float32), None)  # noqa: E731
    tensors = {"token_embd.weight": f32(128, HIDDEN), "output_norm.weight": f32(HIDDEN)}
    for n in range(2):
        tensors |= {
            f"blk.{n}.attn_norm.weight": f32(HIDDEN),
            f"blk.{n}.attn_q.weight": f32(HIDDEN, HIDDEN),
            f"blk.{n}.attn_q.bias": f32(HIDDEN),
            f"blk.{n}.attn_k.weight": f32(KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{n}.attn_v.weight": f32(KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{n}.attn_output.weight": f32(HIDDEN, HIDDEN),
            f"blk.{n}.ffn_norm.weight": f32(HIDDEN),
            f"blk.{n}.ffn_gate.weight": f32(FFN, HIDDEN),
            f"blk.{n}.ffn_up.weight": f32(FFN, HIDDEN),
            f"blk.{n}.ffn_down.weight": f32(HIDDEN, FFN),
        }
    if not tied:
        tensors["output.weight"] = f32(128, HIDDEN)
    return tensors


@pytest.mark.parametrize("arch, tied", [("llama", True), ("qwen2", False), ("qwen3", True), ("gemma", True)])
def test_names_map_to_hf_modules(tmp_path, arch, tied):
    tensors = _decoder(tied)
    linears = read_linears(_write(tmp_path / "m.gguf", arch, tensors))
    layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    assert set(linears) == {f"model.layers.{n}.{p}" for n in range(2) for p in layer} | {"lm_head"}
    head = linears["lm_head"]
    assert head.gguf_name == ("token_embd.weight" if tied else "output.weight")
    np.testing.assert_array_equal(head.float32().numpy(), tensors[head.gguf_name][0])
    assert linears["model.layers.1.mlp.down_proj"].shape == (HIDDEN, FFN)
    assert linears["model.layers.0.self_attn.k_proj"].shape == (KV_HEADS * HEAD_DIM, HIDDEN)
    assert all(lin.rotary_heads is None for name, lin in linears.items() if "q_proj" not in name and "k_proj" not in name)


def test_unknown_architecture_is_refused(tmp_path):
    path = _write(tmp_path / "phi.gguf", "phi3", _decoder(tied=False))
    with pytest.raises(ValueError, match="phi3"):
        read_linears(path)


def test_unsupported_block_type_names_tensor_type_and_alternatives(tmp_path):
    blocks = _random_blocks(np.random.default_rng(6), Q.IQ4_NL, 32, 64)
    path = _write(tmp_path / "iq.gguf", "qwen2", {"blk.0.ffn_up.weight": (blocks, Q.IQ4_NL)})
    linear = read_linears(path)["model.layers.0.mlp.up_proj"]
    assert linear.block_type == "IQ4_NL"
    with pytest.raises(UnsupportedBlockError, match=r"blk\.0\.ffn_up\.weight.*IQ4_NL.*Q4_K.*Q6_K"):
        linear.float32()
    with pytest.raises(UnsupportedBlockError, match=r"IQ4_NL.*Q4_0, Q4_1, Q4_K"):
        linear.int4()


def test_int4_refuses_inputs_not_a_multiple_of_the_group():
    # A well-formed file cannot hold this (ggml rows are whole 32-wide blocks), so build it directly.
    linear = GGUFLinear("model.layers.0.mlp.up_proj", "Q4_0", (2, 48), gguf_name="blk.0.ffn_up.weight",
                        data=np.zeros((2, 27), np.uint8))
    with pytest.raises(UnsupportedBlockError, match=r"in_features=48.*multiple.*32"):
        linear.int4()


@pytest.mark.integration
def test_smollm2_matches_its_bf16_conversion():
    from safetensors import safe_open

    from spirit.model.bundled import cache_root

    gguf_file = cache_root() / "gguf" / "smollm2-135m.gguf"
    converted = cache_root() / "converted" / "smollm2-135m" / "model.safetensors"
    if not (gguf_file.exists() and converted.exists()):
        pytest.skip("smollm2-135m GGUF file or its bf16 conversion is not in the cache")
    linears = read_linears(gguf_file)
    with safe_open(str(converted), "pt") as weights:
        for name in ("model.layers.3.self_attn.q_proj", "model.layers.3.mlp.down_proj"):
            expected = weights.get_tensor(f"{name}.weight")
            linear = linears[name]
            assert linear.block_type in INT4_DIRECT and linear.shape == tuple(expected.shape)
            # transformers rounded gguf's float values to bf16; ours must round to the same bits
            assert torch.equal(linear.int4().dequantized().to(torch.bfloat16), expected)
            assert torch.equal(linear.float32().to(torch.bfloat16), expected)
