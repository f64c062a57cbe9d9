"""spirit's own int4 / int8 kernel (model/qgemm.py, kernels/qgemm.cpp): products against a
float64 reference of what it defines (the packed weight times int8-quantized activations),
row-invariance for any number of rows, and the layouts' odd cases."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from spirit.model import qgemm
from spirit.model.quantize import INT4_GROUP, PackedWeight, int4_groups, pack_int4, quantize_int8

needs_kernel = pytest.mark.skipif(not qgemm.available(), reason=qgemm.status().reason)


def test_the_kernel_builds_wherever_it_can():
    """On an x86-64 CPU with AVX2, FMA and F16C and a C++ compiler, the kernel must build:
    otherwise every test below would skip and a broken kernel would pass unseen."""
    import platform
    import shutil

    capable = (platform.machine() == "x86_64" and shutil.which("c++") is not None
               and {"avx2", "fma", "f16c"} <= qgemm._cpu_flags() and os.environ.get("SPIRIT_KERNEL", "") != "torch")
    if not capable:
        pytest.skip("no AVX2/FMA/F16C x86-64 CPU with a C++ compiler here")
    assert qgemm.available(), qgemm.status().reason


def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next_load(tmp_path):
    """torch's lock file outlives a process killed mid-build; under spirit's flock it is stale
    and cleared, so the load goes on instead of waiting forever."""
    (tmp_path / "lock").write_text("")  # what a build killed by Ctrl-C leaves
    built = []
    assert qgemm._load_locked(tmp_path, lambda: built.append((tmp_path / "lock").exists()) or "module") == "module"
    assert built == [False]


def test_the_build_folder_is_per_checkout(monkeypatch, tmp_path):
    """Two checkouts of the same sources build apart (torch's build records source paths: a
    shared folder would be rebuilt by each in turn)."""
    here = qgemm._build_directory(["-O3"])
    copies = []
    for source in qgemm.SOURCES:
        copy = tmp_path / source.name
        copy.write_text(source.read_text())
        copies.append(copy)
    monkeypatch.setattr(qgemm, "KERNELS", tmp_path)
    monkeypatch.setattr(qgemm, "SOURCES", tuple(copies))
    elsewhere = qgemm._build_directory(["-O3"])
    assert elsewhere != here and elsewhere.parent == here.parent


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """What the kernel multiplies by: x rounded to int8 per block of 32 (in float32, as the
    kernel computes it: d = max|x| / 127, q = round-half-even(x * (1 / d))), as float64."""
    rows, inputs = x.shape
    blocks = x.float().reshape(rows, inputs // INT4_GROUP, INT4_GROUP)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inverse = torch.where(d > 0, 1.0 / torch.where(d > 0, d, 1.0), 0.0)
    q = torch.round(blocks * inverse)
    return (q.double() * d.double()).reshape(rows, inputs)


def int4_weight(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """float64 [out, in] of the packed int4 weight (scale and offset rounded to float16)."""
    out_features, in_features = codes.shape
    offset = (zero.float() - 8.0 * scale.float()).half().double()
    q = codes.double().reshape(out_features, in_features // INT4_GROUP, INT4_GROUP)
    return (q * scale.half().double()[..., None] + offset[..., None]).reshape(out_features, in_features)


def int8_weight(packed: PackedWeight) -> torch.Tensor:
    """float64 [out, in] of a packed int8 weight, its codes read back from the grouped layout
    (kernels/qgemm.cpp: byte 64k + 4l + j of a group of 16 blocks is input 4k + j of block l)."""
    out_features, in_features = packed.codes.shape
    blocks = in_features // INT4_GROUP
    grouped = blocks // 16 * 16
    groups = packed.codes[:, : grouped * INT4_GROUP].reshape(out_features, grouped // 16, 8, 16, 4)
    codes = torch.cat([groups.permute(0, 1, 3, 2, 4).reshape(out_features, -1), packed.codes[:, grouped * INT4_GROUP :]],
                      dim=1)
    return (codes.double().reshape(out_features, blocks, INT4_GROUP)
            * packed.scales.double()[..., None]).reshape(out_features, in_features)


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(blocks=st.integers(1, 40), out_features=st.integers(1, 40), rows=st.integers(1, 9), seed=st.integers(0, 2**16))
@example(blocks=16, out_features=3, rows=5, seed=0)  # one group exactly
@example(blocks=35, out_features=17, rows=9, seed=1)  # two groups, a pair and a lone block
def test_int4_product_matches_its_definition_and_is_row_invariant(blocks, out_features, rows, seed):
    torch.manual_seed(seed)
    # groups of 16 blocks, then pairs; odd block counts exercise the lone last block
    in_features = blocks * INT4_GROUP
    weight = torch.randn(out_features, in_features) * 0.05
    codes, scale, zero = int4_groups(weight)
    packed = pack_int4(codes, scale, zero, torch.float32)
    assert packed.kernel == "spirit"
    x = torch.randn(rows, in_features)
    y = packed.matmul(x)
    reference = quantized_activations(x) @ int4_weight(codes, scale, zero).T
    assert torch.allclose(y.double(), reference, rtol=1e-4, atol=1e-4)
    one_at_a_time = torch.cat([packed.matmul(x[i : i + 1]) for i in range(rows)])
    assert torch.equal(one_at_a_time, y)  # bit for bit, whatever the number of rows


@needs_kernel
@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize(("blocks", "out_features", "rows"), [(129, 45, 11), (280, 23, 6), (48, 130, 13)])
def test_many_rows_across_weight_tiles_are_row_invariant(fmt, blocks, out_features, rows):
    """Many-row products take the weights a tile of rows at a time (kTileBytes) against every
    chunk of activation rows: wide rows make tiles of a few weight rows, so each thread's share
    spans several tiles and a partial one; each output must still be its one-row product."""
    torch.manual_seed(blocks + out_features)
    in_features = blocks * INT4_GROUP
    weight = torch.randn(out_features, in_features) * 0.05
    if fmt == "int4":
        codes, scale, zero = int4_groups(weight)
        packed = pack_int4(codes, scale, zero, torch.bfloat16)
    else:
        packed = quantize_int8(weight)
    assert packed.kernel == "spirit"
    x = torch.randn(rows, in_features).bfloat16()
    y = packed.matmul(x)
    assert torch.equal(torch.cat([packed.matmul(x[i : i + 1]) for i in range(rows)]), y)
    dense = int4_weight(codes, scale, zero) if fmt == "int4" else int8_weight(packed)
    assert torch.allclose(y.double(), quantized_activations(x) @ dense.T, rtol=2e-2, atol=2e-2)  # bf16 outputs


def _extreme_products() -> None:
    """The largest integer sums the formats can produce. int4: every code 15 against every
    activation code +127 or -127 (a block of equal values), over K = 1536 (3 groups of 16
    blocks) and 1568 (a lone last block after them). Without VNNI the kernel adds 8 byte-pair
    products in int16 before widening (at most 8 * 2 * 15 * 127 = 30480): an overflow there
    would show here as a wrong sum. int8: codes +-127 against +-127, where VNNI adds 128 to
    each code (to 255) and takes 128 * sum(q) off again, and maddubs takes the weight's sign
    onto x. Checked against the definition and one row at a time."""
    for in_features in (1536, 1568):
        blocks = in_features // INT4_GROUP
        codes = torch.full((6, in_features), 15, dtype=torch.uint8)
        codes[1::2, ::3] = 0  # some rows mix in the smallest code
        scale = torch.full((6, blocks), 0.25)
        zero = torch.full((6, blocks), 0.5)
        packed = pack_int4(codes, scale, zero, torch.float32)
        assert packed.kernel == "spirit"
        sign = torch.where(torch.arange(blocks) % 3 == 0, -1.0, 1.0).repeat_interleave(INT4_GROUP)
        x = torch.stack([sign * 3.0, -sign * 0.5, torch.full((in_features,), 2.0), sign])
        y = packed.matmul(x)
        reference = quantized_activations(x) @ int4_weight(codes, scale, zero).T
        assert torch.allclose(y.double(), reference, rtol=1e-5, atol=1e-3), (in_features, (y.double() - reference).abs().max())
        assert torch.equal(torch.cat([packed.matmul(x[i : i + 1]) for i in range(len(x))]), y)
        # int8: a block's weights all +-1 (codes +-127), some blocks negative, some rows mixed
        weight = sign.repeat(6, 1)
        weight[1::2, ::3] = -weight[1::2, ::3]
        packed8 = quantize_int8(weight, torch.float32)
        assert packed8.kernel == "spirit" and int(packed8.codes.abs().min()) == 127
        y8 = packed8.matmul(x)
        reference8 = quantized_activations(x) @ int8_weight(packed8).T
        assert torch.allclose(y8.double(), reference8, rtol=1e-5, atol=1e-3), (in_features, (y8.double() - reference8).abs().max())
        assert torch.equal(torch.cat([packed8.matmul(x[i : i + 1]) for i in range(len(x))]), y8)


@needs_kernel
@pytest.mark.parametrize("held_to_avx2", [False, True], ids=["native", "avx2"])
def test_sums_at_their_largest_are_exact(held_to_avx2):
    """The extreme products under this CPU's kernel and under the AVX2 build (maddubs, the
    path AVX2-only CPUs such as AMD's Zen 2/3 EPYCs take), which runs in a fresh process:
    the build is chosen when the kernel first loads."""
    if not held_to_avx2:
        _extreme_products()
        return
    import subprocess
    import sys

    from spirit.model.probe import AVX2_HELD_ENV
    script = ("import sys; sys.path.insert(0, sys.argv[1]); import test_qgemm; from spirit.model import qgemm; "
              "assert qgemm.status().isa == 'avx2', qgemm.status(); test_qgemm._extreme_products()")
    done = subprocess.run([sys.executable, "-c", script, os.path.dirname(__file__)], env={**os.environ, **AVX2_HELD_ENV},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(blocks=st.integers(1, 40), out_features=st.integers(1, 24), rows=st.integers(1, 9), seed=st.integers(0, 2**16))
@example(blocks=16, out_features=3, rows=5, seed=0)  # one group exactly
@example(blocks=41, out_features=17, rows=9, seed=1)  # two groups and 9 blocks in order after them
def test_int8_product_matches_its_definition_and_is_row_invariant(blocks, out_features, rows, seed):
    torch.manual_seed(seed)
    in_features = blocks * INT4_GROUP
    weight = torch.randn(out_features, in_features) * 0.05
    packed = quantize_int8(weight, torch.float32)
    assert packed.kernel == "spirit" and packed.codes.dtype == torch.int8
    assert int(packed.codes.abs().max()) <= 127  # the sign trick needs |code| <= 127
    dequantized = int8_weight(packed)
    x = torch.randn(rows, in_features)
    y = packed.matmul(x)
    assert torch.allclose(y.double(), quantized_activations(x) @ dequantized.T, rtol=1e-4, atol=1e-4)
    assert torch.equal(torch.cat([packed.matmul(x[i : i + 1]) for i in range(rows)]), y)
    # within half a step of the block's scale (the float16-rounded scale can clip a hair more)
    assert (dequantized - weight.double()).abs().max() <= 0.6 * weight.abs().max() / 127


@needs_kernel
@pytest.mark.parametrize("blocks", [1, 2, 15, 16, 17, 33, 48])
def test_int4_dequantize_unpacks_every_layout_region(blocks):
    """Dense prefill reads the packed codes back through `dequantize`: groups of 16, pairs and a
    lone last block must all come back as code * scale + offset."""
    torch.manual_seed(blocks)
    codes, scale, zero = int4_groups(torch.randn(5, blocks * INT4_GROUP))
    packed = pack_int4(codes, scale, zero, torch.bfloat16)
    dense = qgemm.dequantize(packed.codes, packed.scales, packed.offsets,
                             torch.empty(5, blocks * INT4_GROUP, dtype=torch.bfloat16), 4)
    assert torch.equal(dense, int4_weight(codes, scale, zero).float().to(torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("blocks", [1, 15, 16, 17, 41])
def test_int8_dequantize_unpacks_every_layout_region(blocks):
    torch.manual_seed(blocks)
    packed = quantize_int8(torch.randn(5, blocks * INT4_GROUP))
    dense = qgemm.dequantize(packed.codes, packed.scales, packed.offsets,
                             torch.empty(5, blocks * INT4_GROUP, dtype=torch.bfloat16), 8)
    assert torch.equal(dense, int8_weight(packed).float().to(torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_a_packing_kept_in_an_older_layout_is_refused(fmt):
    weight = torch.randn(4, 64)
    state = (pack_int4(*int4_groups(weight)) if fmt == "int4" else quantize_int8(weight)).tensors()
    state.pop("layout")  # what a packing kept before the grouped layouts holds
    with pytest.raises(ValueError, match="layout"):
        PackedWeight.from_tensors(state)
    assert PackedWeight.from_tensors({**state, "layout": "groups-of-16"}).fmt == fmt


@needs_kernel
def test_bf16_activations_give_bf16_and_zero_rows_give_zero():
    codes, scale, zero = int4_groups(torch.randn(16, 64))
    packed = pack_int4(codes, scale, zero, torch.bfloat16)
    y = packed.matmul(torch.zeros(2, 64, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and torch.equal(y, torch.zeros(2, 16, dtype=torch.bfloat16))


@needs_kernel
def test_scales_that_float16_cannot_hold_fall_back_to_torchs_kernel():
    codes, scale, zero = int4_groups(torch.randn(16, 64) * 1e6)  # scales beyond float16's range
    assert pack_int4(codes, scale, zero).kernel == "torch"


@needs_kernel
def test_bad_shapes_are_refused_with_a_message():
    codes, scale, zero = int4_groups(torch.randn(16, 64))
    packed = pack_int4(codes, scale, zero, torch.float32)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        qgemm.qgemm(torch.randn(2, 40), packed.codes, packed.scales, packed.offsets, None, 4)
    with pytest.raises(RuntimeError, match="codes shape"):
        qgemm.qgemm(torch.randn(2, 96), packed.codes, packed.scales, packed.offsets, None, 4)


@needs_kernel
def test_the_status_names_the_instruction_set():
    status = qgemm.status()
    assert status.available and status.isa in ("avx512-vnni", "avx512-vnni-256", "avx-vnni", "avx2") and status.isa in status.reason


# AMX tile products (kernels/qgemm.cpp, "Many rows on CPUs with AMX"): the panels' layout is
# checked on any CPU; the products themselves where the CPU has AMX.

needs_amx = pytest.mark.skipif(not (qgemm.available() and qgemm.amx()),
                               reason="no AMX tile products here (CPU without AMX, or the OS withholds them)")


def _packed(fmt: str, out_features: int, in_features: int, dtype: torch.dtype = torch.bfloat16) -> PackedWeight:
    weight = torch.randn(out_features, in_features) * 0.05
    if fmt == "int4":
        codes, scale, zero = int4_groups(weight)
        return pack_int4(codes, scale, zero, dtype)
    return quantize_int8(weight, dtype)


@needs_kernel
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_tile_panels_hold_the_grouped_blocks_in_tile_order(monkeypatch, fmt):
    """Panel p, block b = 16g + l, weight row 16p + n: int8 a tile of 512 bytes whose byte
    64k + 4n + j is byte 64k + 4l + j of the row's group g (input 4k + j); int4 256 bytes whose
    byte 64c + 4n + j is byte 64c + 4l + j of the group (two inputs in nibbles). Then the
    block's 16 scales (and offsets) by weight row; rows past the weight are zero. Read back
    here from the packed tensors by that definition, so a wrong permutation fails on any CPU."""
    monkeypatch.setattr(qgemm, "amx", lambda: True)
    torch.manual_seed(3)
    out_features, blocks = 21, 40  # two panels (the second part padding), two groups and 8 blocks after
    packed = _packed(fmt, out_features, blocks * INT4_GROUP)
    panels = packed.tile_panels()
    grouped, steps = 32, (4 if fmt == "int4" else 8)
    code_bytes = grouped * steps * 64
    assert panels is not None and panels.dtype == torch.uint8
    assert panels.shape == (2, code_bytes + grouped * 32 * (2 if fmt == "int4" else 1))
    codes = packed.codes.view(torch.uint8)
    for p, n, b in [(0, 0, 0), (0, 5, 17), (1, 4, 31), (0, 15, 16), (1, 3, 9)]:
        row, g, lane = 16 * p + n, b // 16, b % 16
        for step in range(steps):
            at = b * steps * 64 + 64 * step + 4 * n
            group_at = g * steps * 64 + 64 * step + 4 * lane
            assert torch.equal(panels[p, at : at + 4], codes[row, group_at : group_at + 4]), (p, n, b, step)
        scales = panels[p, code_bytes + 32 * b : code_bytes + 32 * b + 32].view(torch.float16)
        assert scales[n] == packed.scales.reshape(out_features, -1)[row, b]
        if fmt == "int4":
            offsets = panels[p, code_bytes + 32 * grouped + 32 * b :][:32].view(torch.float16)
            assert offsets[n] == packed.offsets.reshape(out_features, -1)[row, b]
    assert not panels[1, :code_bytes].view(grouped, steps, 16, 4)[:, :, 5:].any()  # weight rows 21..31: padding


@needs_kernel
def test_spirit_amx_0_turns_the_tiles_and_their_panels_off(monkeypatch):
    monkeypatch.setenv("SPIRIT_AMX", "0")
    assert not qgemm.amx()
    assert _packed("int8", 16, 512).tile_panels() is None


@needs_kernel
def test_no_panels_where_there_is_no_whole_group_or_no_amx(monkeypatch):
    monkeypatch.setattr(qgemm, "amx", lambda: True)
    assert _packed("int4", 16, 480).tile_panels() is None  # 15 blocks: no group of 16
    monkeypatch.setattr(qgemm, "amx", lambda: False)
    assert _packed("int4", 16, 512).tile_panels() is None


@needs_amx
@settings(max_examples=30, deadline=None)
@given(fmt=st.sampled_from(["int4", "int8"]), blocks=st.integers(16, 60), out_features=st.integers(1, 40),
       rows=st.integers(1, 80), bf16=st.booleans(), seed=st.integers(0, 2**16))
@example(fmt="int4", blocks=48, out_features=32, rows=16, bf16=True, seed=0)  # only groups, whole panels and tiles
@example(fmt="int8", blocks=32, out_features=40, rows=9, bf16=False, seed=3)  # int8 from 8 rows, a partial tile of rows
@example(fmt="int8", blocks=280, out_features=17, rows=70, bf16=True, seed=1)  # 8 blocks after 17 groups; 5 tiles of rows
@example(fmt="int4", blocks=35, out_features=5, rows=64, bf16=False, seed=2)  # a pair and a lone block after the groups
def test_amx_tile_products_give_the_bits_of_one_row_products(fmt, blocks, out_features, rows, bf16, seed):
    """Row counts below the tile path's thresholds (kernels/qgemm.cpp SPIRIT_AMX_MIN_ROWS_*: 8 rows
    for int8, 12 for int4, 64 where blocks follow the groups) take the VNNI path: the examples
    and the range of rows reach past each."""
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    packed = _packed(fmt, out_features, blocks * INT4_GROUP, dtype)
    panels = packed.tile_panels()
    assert panels is not None
    x = torch.randn(rows, blocks * INT4_GROUP).to(dtype)
    bias = torch.randn(out_features)
    tiles = qgemm.qgemm(x, packed.codes, packed.scales, packed.offsets, bias, packed.bits, panels)
    one_row = torch.cat([qgemm.qgemm(x[i : i + 1], packed.codes, packed.scales, packed.offsets, bias, packed.bits)
                         for i in range(rows)])
    assert torch.equal(tiles, one_row)
    assert torch.equal(tiles, qgemm.qgemm(x, packed.codes, packed.scales, packed.offsets, bias, packed.bits))


@needs_amx
def test_amx_sums_at_their_largest_are_exact():
    """Codes 15 (int4) or +-127 (int8) against activation codes +-127 over three groups: the
    tile products' int32 sums against the one-row products' (VNNI)."""
    for fmt in ("int4", "int8"):
        sign = torch.where(torch.arange(48) % 3 == 0, -1.0, 1.0).repeat_interleave(INT4_GROUP)
        weight = sign.repeat(16, 1)
        weight[1::2, ::3] = -weight[1::2, ::3]
        if fmt == "int4":
            codes = torch.full((16, 1536), 15, dtype=torch.uint8)
            codes[1::2, ::3] = 0
            packed = pack_int4(codes, torch.full((16, 48), 0.25), torch.full((16, 48), 0.5), torch.float32)
        else:
            packed = quantize_int8(weight, torch.float32)
        x = torch.stack([sign * 3.0, -sign * 0.5, torch.full((1536,), 2.0), sign]).repeat(4, 1)  # 16 rows: tiles
        y = packed.matmul(x, packed.tile_panels())
        assert torch.equal(torch.cat([packed.matmul(x[i : i + 1]) for i in range(len(x))]), y), fmt
