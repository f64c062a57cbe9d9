"""Fused decoder layers (model/fused.py, kernels/layer_ops.cpp): each piece against a float64
reference, bit-for-bit row-invariance for any number of rows, the fused model against
transformers' modules on the same packed weights, and which models run fused."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spirit.engine import Engine
from spirit.model import qgemm
from spirit.model.adapter import SkippableModel, Segment
from spirit.model.attention import RowKeys
from spirit.model.lowbit import PackedLinear, pack_model
from spirit.policies.base import ModelInfo, StaticPolicy
from spirit.skipset import DraftConfig, SkipSet
from spirit.testing import ARCHITECTURES, decode_all, tiny_model

pytestmark = pytest.mark.skipif(not qgemm.available(), reason=qgemm.status().reason)
FUSABLE = tuple(arch for arch in ARCHITECTURES if not arch.startswith("gemma"))


def ops():
    return qgemm.extension()


def packed(arch: str, dtype: torch.dtype = torch.bfloat16, layers: int = 3):
    model = tiny_model(arch, num_layers=layers, dtype=dtype)
    pack_model(model, "int4", dtype)
    return model


# -- the pieces -------------------------------------------------------------------------------

def reference_attention(q, keys, values, rows, scaling):
    """float64: q [M, H, d]; keys/values per cache [1, KV, cap, d]; rows: (cache, slot list)."""
    M, H, d = q.shape
    out = torch.zeros(M, H * d, dtype=torch.float64)
    for m, (c, slots) in enumerate(rows):
        if not slots:
            continue
        kv = keys[c].shape[1]
        for h in range(H):
            k = keys[c][0, h // (H // kv), slots].double()
            v = values[c][0, h // (H // kv), slots].double()
            p = torch.softmax(k @ q[m, h].double() * scaling, dim=0)
            out[m, h * d:(h + 1) * d] = p @ v
    return out


def csr(rows):
    offsets = torch.tensor([0] + [len(s) for _, s in rows]).cumsum(0)
    slots = torch.tensor([x for _, s in rows for x in s], dtype=torch.int64)
    return torch.tensor([c for c, _ in rows], dtype=torch.int64), offsets, slots


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 9), groups=st.sampled_from([1, 2, 4, 6, 7]),
       head_dim=st.sampled_from([8, 16, 64, 136]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_rowwise_attention_matches_the_reference_and_each_row_is_its_own(seed, rows, groups, head_dim, dtype):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    kv_heads, capacity = 2, 40
    caches = 2
    keys = [torch.randn(1, kv_heads, capacity, head_dim, generator=g).to(dtype) for _ in range(caches)]
    values = [torch.randn(1, kv_heads, capacity, head_dim, generator=g).to(dtype) for _ in range(caches)]
    q = torch.randn(rows, kv_heads * groups, head_dim, generator=g).to(dtype)
    # chains, trees (any ascending slots) and padding rows (no slot)
    spec = [(rng.randrange(caches), sorted(rng.sample(range(capacity), rng.randrange(0, capacity))))
            for _ in range(rows)]
    scaling = head_dim ** -0.5
    out = ops().rowwise_attention(q, keys, values, *csr(spec), scaling, 0.0)
    want = reference_attention(q, keys, values, spec, scaling)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.double(), want, atol=tol, rtol=tol)
    # query heads that share a key head (read once for up to 4 of them) get the bits each
    # gets with a key head of its own
    own = [kv.repeat_interleave(groups, dim=1).contiguous() for kv in keys]
    own_values = [kv.repeat_interleave(groups, dim=1).contiguous() for kv in values]
    assert torch.equal(ops().rowwise_attention(q, own, own_values, *csr(spec), scaling, 0.0), out)
    for m in range(rows):  # one row alone: the same bits
        alone = ops().rowwise_attention(q[m:m + 1].contiguous(), keys, values, *csr(spec[m:m + 1]), scaling, 0.0)
        assert torch.equal(alone, out[m:m + 1])
        if not spec[m][1]:
            assert not out[m].any()  # padding: zeros


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 12), width=st.sampled_from([8, 24, 64, 200]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_rms_norm_and_silu_mul_match_the_reference_row_by_row(seed, rows, width, dtype):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, width, generator=g) * 3).to(dtype)
    w = torch.randn(width, generator=g).to(dtype)
    y = ops().rms_norm(x, w, 1e-6)
    xd = x.double()
    want = w.double() * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(y.double(), want, atol=tol, rtol=tol)
    gate_up = torch.randn(rows, 2 * width, generator=g).to(dtype)
    act = ops().silu_mul(gate_up)
    gd, ud = gate_up.double().chunk(2, dim=-1)
    assert torch.allclose(act.double(), torch.nn.functional.silu(gd) * ud, atol=tol, rtol=tol)
    for m in range(rows):
        assert torch.equal(ops().rms_norm(x[m:m + 1].contiguous(), w, 1e-6), y[m:m + 1])
        assert torch.equal(ops().silu_mul(gate_up[m:m + 1].contiguous()), act[m:m + 1])


@pytest.mark.parametrize("with_norm", [False, True])
def test_rope_write_rotates_as_transformers_does_and_writes_the_cache(with_norm):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    rows, heads, kv_heads, d = 3, 4, 2, 16
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d)
    angles = torch.randn(rows, d // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    norm = torch.rand(d) + 0.5 if with_norm else torch.empty(0)
    keys, values = torch.zeros(1, kv_heads, 10, d), torch.zeros(1, kv_heads, 10, d)
    slots = torch.tensor([7, 2, 5])
    q = ops().rope_write(qkv, cos, sin, heads, kv_heads, d, norm, norm, 1e-6, [keys], [values],
                         torch.zeros(rows, dtype=torch.int64), slots)
    q_in = qkv[:, : heads * d].view(rows, heads, d)
    k_in = qkv[:, heads * d:(heads + kv_heads) * d].view(rows, kv_heads, d)
    if with_norm:
        q_in = norm * q_in / torch.sqrt(q_in.pow(2).mean(-1, keepdim=True) + 1e-6)
        k_in = norm * k_in / torch.sqrt(k_in.pow(2).mean(-1, keepdim=True) + 1e-6)
    want_q, want_k = apply_rotary_pos_emb(q_in, k_in, cos, sin)  # [rows, heads, d]
    assert torch.allclose(q, want_q, atol=1e-5)
    assert torch.allclose(keys[0][:, slots], want_k.transpose(0, 1), atol=1e-5)
    assert torch.equal(values[0][:, slots], qkv[:, (heads + kv_heads) * d:].view(rows, kv_heads, d).transpose(0, 1))
    assert not keys[0][:, [0, 1, 3, 4, 6, 8, 9]].any()  # nothing else written


def test_bad_arguments_are_refused_with_a_message():
    keys, values = [torch.zeros(1, 2, 8, 16)], [torch.zeros(1, 2, 8, 16)]
    q = torch.zeros(1, 4, 16)
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops().rowwise_attention(q, keys, values, torch.zeros(1, dtype=torch.int64), torch.tensor([0, 1]),
                                torch.tensor([8]), 0.25, 0.0)
    with pytest.raises(RuntimeError, match="cache index out of range"):
        ops().rowwise_attention(q, keys, values, torch.ones(1, dtype=torch.int64), torch.tensor([0, 1]),
                                torch.tensor([3]), 0.25, 0.0)
    with pytest.raises(RuntimeError, match="qkv must be"):
        ops().rope_write(torch.zeros(1, 5 * 16), torch.zeros(1, 16), torch.zeros(1, 16), 4, 2, 16, torch.empty(0),
                         torch.empty(0), 1e-6, keys, values, torch.zeros(1, dtype=torch.int64), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops().rms_norm(torch.zeros(2, 8, dtype=torch.float16), torch.zeros(8, dtype=torch.float16), 1e-6)


# -- the model --------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", FUSABLE)
def test_fused_layers_compute_what_the_modules_compute(arch):
    """float32, the same packed weights: fused and transformers' modules agree to float32
    rounding (the kernels' int8 activation blocks may round one input differently), in
    prefill, in exact one-token steps and in a draft pass with skipped sublayers."""
    model = SkippableModel(packed(arch, torch.float32))
    assert model.fused is not None, model.fused_reason
    fused = model.fused
    ids = torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(1))

    def run(use_fused: bool):
        model.fused = fused if use_fused else None
        cache = model.new_cache(32)
        prefill = model.forward(ids, 0, cache, SkipSet())
        step = model.forward(ids[:, :1], 12, cache, SkipSet(), exact=True)
        draft = model.forward(ids[:, 1:3], 13, cache, SkipSet.parse("attn:1;mlp:0"))
        return torch.cat([prefill, step, draft])

    try:
        with_fused, with_modules = run(True), run(False)
    finally:
        model.fused = fused
    assert torch.allclose(with_fused, with_modules, rtol=5e-3, atol=5e-3 * with_modules.abs().max().item())


def test_only_standard_layers_on_spirit_kernels_run_fused(monkeypatch):
    assert SkippableModel(tiny_model("llama", num_layers=2)).fused is None  # float weights
    gemma = SkippableModel(packed("gemma3"))
    assert gemma.fused is None and "Gemma" in gemma.fused_reason
    from spirit.model import quantize

    monkeypatch.setattr(quantize, "_spirit_kernel", lambda device: False)  # torch's int4 op
    on_torch = SkippableModel(packed("llama"))
    assert on_torch.fused is None and "spirit's kernel" in on_torch.fused_reason


def test_fused_projections_store_each_weight_once():
    model = packed("qwen2")
    SkippableModel(model)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    q, k, v = (m.weight_packed.codes for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert mlp.gate_proj.weight_packed.codes.untyped_storage().data_ptr() == \
        mlp.up_proj.weight_packed.codes.untyped_storage().data_ptr()
    x = torch.randn(2, model.config.hidden_size, dtype=torch.bfloat16)
    assert isinstance(attn.k_proj, PackedLinear) and attn.k_proj(x).shape == (2, attn.k_proj.out_features)


def test_mixed_formats_run_apart_and_concatenate():
    model = tiny_model("llama", num_layers=2, dtype=torch.bfloat16)
    pack_model(model, "int4", torch.bfloat16)
    attn = model.model.layers[0].self_attn
    attn.v_proj = PackedLinear.from_linear(torch.nn.Linear(attn.v_proj.in_features, attn.v_proj.out_features,
                                                           bias=False).to(torch.bfloat16), "int8", torch.bfloat16)
    fused = SkippableModel(model).fused
    assert fused is not None and fused.layers[0].qkv.weight is None
    x = torch.randn(3, model.config.hidden_size, dtype=torch.bfloat16)
    want = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
    assert torch.equal(fused.layers[0].qkv(x), want)


@pytest.mark.parametrize("arch", FUSABLE)
def test_packed_passes_on_fused_layers_equal_solo_passes(arch):
    """Continuous batching on a fused low-bit target: two requests' rows in one pass get the
    bits each gets alone."""
    model = SkippableModel(packed(arch))
    assert model.fused is not None
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 200, (n,), generator=g) for n in (7, 11)]
    caches = [model.new_cache(24) for _ in prompts]
    for prompt, cache in zip(prompts, caches):
        model.forward(prompt[None], 0, cache, SkipSet())
    steps = [torch.tensor([5, 9]), torch.tensor([3])]
    alone = [model.forward(s[None], len(p), c, SkipSet(), exact=True)
             for s, p, c in zip(steps, prompts, caches)]
    together = model.forward_packed([Segment(s, len(p), c) for s, p, c in zip(steps, prompts, caches)], exact=True)
    for a, b in zip(alone, together):
        assert torch.equal(a, b)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 1000))
def test_speculation_on_fused_layers_gives_plain_decoding(seed):
    engine = Engine(SkippableModel(packed("qwen3", layers=4)))
    assert engine.model.fused is not None
    rng = random.Random(seed)
    prompt = [rng.randrange(256) for _ in range(rng.randrange(3, 30))]
    plain, _ = decode_all(engine, prompt, 20)
    policy = StaticPolicy(ModelInfo(4), DraftConfig(max_draft=5, branches=2, branch_below=0.99),
                          skip=SkipSet.parse("attn:2;mlp:1"))
    out, stats = decode_all(engine, prompt, 20, policy)
    assert out == plain and stats.counters.draft_rounds > 0


# -- prefill ------------------------------------------------------------------------------------

def test_the_unpacked_weight_is_the_one_the_kernel_multiplies_by():
    from spirit.model.quantize import quantize_int4, quantize_int8

    torch.manual_seed(0)
    for pack in (quantize_int4, quantize_int8):
        for in_features in (96, 128, 1568):  # 3 blocks: a lone last block; 4: pairs only; 49: a group, pairs, a lone block
            w = pack(torch.randn(24, in_features) * 0.05, torch.bfloat16)
            dense = torch.empty(24, in_features, dtype=torch.bfloat16)
            qgemm.dequantize(w.codes, w.scales, w.offsets, dense, w.bits)
            # the kernel's product with the identity is its weight (an identity row quantizes
            # exactly), up to float32 rounding before the one bf16 rounding
            through_kernel = w.matmul(torch.eye(in_features, dtype=torch.bfloat16)).T.float()
            assert torch.allclose(dense.float(), through_kernel, rtol=8e-3, atol=1e-7)


amx_only = pytest.mark.skipif(not qgemm.prefill_tiles(), reason="no AMX tile products on this CPU")


@amx_only
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_prefill_tiles_turn_the_weights_into_the_bits_dequantize_gives(fmt):
    """Against the identity each product is one weight (times 1, plus zeros): so the panels'
    bf16 weights (whole groups at once, then pairs and a lone block) are dequantize's, bit for bit."""
    from spirit.model.quantize import quantize_int4, quantize_int8

    torch.manual_seed(2)
    w = (quantize_int4 if fmt == "int4" else quantize_int8)(torch.randn(40, 1568) * 0.05, torch.bfloat16)
    dense = qgemm.dequantize(w.codes, w.scales, w.offsets, torch.empty(40, 1568, dtype=torch.bfloat16), w.bits)
    y = qgemm.prefill_qgemm(torch.eye(1568, dtype=torch.bfloat16), w.codes, w.scales, w.offsets, None, w.bits)
    assert torch.equal(y, dense.T)


@amx_only
@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("rows", [1, 17, 40, 128])
def test_prefill_tile_products_are_the_dequantized_weights_product(fmt, rows):
    """N = 40 (a panel of 8 rows past the last whole one), K = 1568 (a group, pairs, a lone
    block), rows past a tile of 16: bf16 tile products of the weights as dequantize gives them,
    summed in float32, with the bias, rounded once; the same bits on a second call."""
    from spirit.model.quantize import quantize_int4, quantize_int8

    torch.manual_seed(1)
    w = (quantize_int4 if fmt == "int4" else quantize_int8)(torch.randn(40, 1568) * 0.05, torch.bfloat16)
    dense = qgemm.dequantize(w.codes, w.scales, w.offsets, torch.empty(40, 1568, dtype=torch.bfloat16), w.bits)
    x, bias = torch.randn(rows, 1568).to(torch.bfloat16), torch.randn(40)
    y = qgemm.prefill_qgemm(x, w.codes, w.scales, w.offsets, bias, w.bits)
    expected = x.double() @ dense.double().T + bias.double()
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 40)
    assert torch.allclose(y.double(), expected, rtol=1e-2, atol=1e-3 * expected.abs().max().item())
    assert torch.equal(y, qgemm.prefill_qgemm(x, w.codes, w.scales, w.offsets, bias, w.bits))


@amx_only
@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("rows", [5, 16, 37])
def test_prefill_tile_outputs_round_as_torch_rounds_float32_to_bf16(fmt, rows):
    """The float32 sums leave the tiles as bfloat16 the way torch rounds (nearest, ties to
    even), with the bias added first, in every row and column of partial tiles and panels:
    x holds scaled identity rows, so each sum is one exact product c * w (16 significant bits
    at most) plus zeros, and only the bias addition and the final rounding are inexact. A NaN
    row stays NaN."""
    from spirit.model.quantize import quantize_int4, quantize_int8

    torch.manual_seed(3)
    w = (quantize_int4 if fmt == "int4" else quantize_int8)(torch.randn(40, 1568) * 0.05, torch.bfloat16)
    dense = qgemm.dequantize(w.codes, w.scales, w.offsets, torch.empty(40, 1568, dtype=torch.bfloat16), w.bits)
    scale = torch.tensor([1 + 2**-7, 1 + 3 * 2**-7, 1 - 2**-8, 1.5])[torch.arange(rows) % 4].to(torch.bfloat16)
    picked = torch.randperm(1568)[:rows]
    x = torch.zeros(rows, 1568, dtype=torch.bfloat16)
    x[torch.arange(rows), picked] = scale
    bias = torch.randn(40) * 1e-3
    y = qgemm.prefill_qgemm(x, w.codes, w.scales, w.offsets, bias, w.bits)
    expected = (scale.float()[:, None] * dense.float()[:, picked].T + bias).to(torch.bfloat16)
    assert torch.equal(y.view(torch.int16), expected.view(torch.int16))
    x[rows // 2, 0] = float("nan")
    y = qgemm.prefill_qgemm(x, w.codes, w.scales, w.offsets, bias, w.bits)
    assert torch.isnan(y[rows // 2]).all() and not torch.isnan(y[torch.arange(rows) != rows // 2]).any()


@amx_only
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_prefill_tile_products_over_block_ranges_keep_every_bit(fmt):
    """128 rows of K = 4640 (9 groups and a lone block) take the inputs in two ranges of blocks
    (their pairs, 1160 KB, pass the kernel's 1 MB), the sums carried over between them; 16 rows
    take them in one. Each row's sums are its own, so both give every row the same bits."""
    from spirit.model.quantize import quantize_int4, quantize_int8

    torch.manual_seed(4)
    w = (quantize_int4 if fmt == "int4" else quantize_int8)(torch.randn(24, 4640) * 0.05, torch.bfloat16)
    x, bias = torch.randn(128, 4640).to(torch.bfloat16), torch.randn(24)
    ranged = qgemm.prefill_qgemm(x, w.codes, w.scales, w.offsets, bias, w.bits)
    for start in range(0, 128, 16):
        whole = qgemm.prefill_qgemm(x[start : start + 16], w.codes, w.scales, w.offsets, bias, w.bits)
        assert torch.equal(ranged[start : start + 16].view(torch.int16), whole.view(torch.int16))


def test_prefill_products_follow_the_cpu_and_spirit_prefill(monkeypatch):
    from spirit.model.fused import prefill_products

    monkeypatch.delenv("SPIRIT_PREFILL", raising=False)
    for tiles, dense, expected in ((True, True, "tiles"), (False, True, "dense"), (False, False, "kernel")):
        monkeypatch.setattr(qgemm, "prefill_tiles", lambda tiles=tiles: tiles)
        monkeypatch.setattr(qgemm, "dense_bf16", lambda dense=dense: dense)
        assert prefill_products(torch.bfloat16)[0] == expected
        assert prefill_products(torch.float32)[0] == "kernel"
    monkeypatch.setenv("SPIRIT_PREFILL", "dense")
    assert prefill_products(torch.bfloat16) == ("dense", "dense bf16 products for prefill (SPIRIT_PREFILL)")
    monkeypatch.setenv("SPIRIT_PREFILL", "tiles")  # dense_bf16 and prefill_tiles are False here
    with pytest.raises(ValueError, match="AMX tile products do not run here"):
        prefill_products(torch.bfloat16)
    monkeypatch.setenv("SPIRIT_PREFILL", "fast")
    with pytest.raises(ValueError, match="kernel, dense or tiles"):
        prefill_products(torch.bfloat16)


def test_without_avx512_bf16_prefill_stays_on_the_integer_kernel(monkeypatch):
    monkeypatch.delenv("SPIRIT_PREFILL", raising=False)
    monkeypatch.setattr(qgemm, "prefill_tiles", lambda: False)
    monkeypatch.setattr(qgemm, "dense_bf16", lambda: False)
    model = SkippableModel(packed("llama", torch.bfloat16))
    assert model.fused.prefill_how(128) == "kernel"
    assert "integer kernel for prefill" in model.fused_reason
    if model.exactness.exact:  # what --stats and the bench reports print
        assert "integer kernel for prefill" in model.exactness.reason


@pytest.mark.parametrize("how", ["dense", pytest.param("tiles", marks=amx_only)])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_prefill_takes_its_products_and_speculation_stays_exact(arch, how, monkeypatch):
    """A 70-token prompt is prefilled in the faster way (dense runs on any CPU when asked for);
    no decoding pass (plain steps, drafts, verification) takes it, so speculation still gives
    plain decoding's tokens."""
    import spirit.model.fused as fused_module

    monkeypatch.setenv("SPIRIT_PREFILL", how)
    engine = Engine(SkippableModel(packed(arch, torch.bfloat16, layers=4)))
    assert engine.model.fused.prefill_products == how
    calls = []
    real = fused_module._prefill_product
    monkeypatch.setattr(fused_module, "_prefill_product",
                        lambda x, *rest: calls.append((x.shape[0], rest[2])) or real(x, *rest))
    rng = random.Random(7)
    prompt = [rng.randrange(256) for _ in range(70)]
    plain, _ = decode_all(engine, prompt, 20)
    assert calls and set(calls) == {(70, how)}  # the prefill chunk, and nothing else
    policy = StaticPolicy(ModelInfo(4), DraftConfig(max_draft=6), skip=SkipSet.parse("mlp:1,2"))
    out, stats = decode_all(engine, prompt, 20, policy)
    assert out == plain and stats.counters.draft_rounds > 0
    assert set(calls) == {(70, how)}


def test_dense_products_agree_with_the_kernel_to_bf16_rounding():
    model = SkippableModel(packed("llama", torch.bfloat16))
    fused = model.fused
    fused.prefill_products = "dense"
    assert fused.prefill_how(64) == "dense" and fused.prefill_how(63) == "kernel"
    fused.prefill_products = "tiles"
    assert fused.prefill_how(32) == "tiles" and fused.prefill_how(31) == "kernel"  # panels win below 32
    fused.prefill_products = "dense"
    x = torch.randn(16, model.config.hidden_size).to(torch.bfloat16)
    layer = fused.layers[0]
    kernel, dense = layer.gate_up(x), layer.gate_up(x, "dense", fused._scratch)
    assert torch.allclose(dense.float(), kernel.float(), rtol=0.05, atol=0.05 * kernel.abs().max().item())


def test_projections_and_the_lm_head_keep_tile_panels_where_amx_runs(monkeypatch):
    """Where AMX runs (said to here, so this runs on any CPU), a fused model's packed products
    of 512 inputs or more and its lm_head carry their weights in tile order, and many-row
    passes with them give each row the bits of its one-row pass."""
    monkeypatch.setattr(qgemm, "amx", lambda: True)
    model = tiny_model("qwen2", num_layers=2, dtype=torch.bfloat16, hidden=512)
    pack_model(model, "int4", torch.bfloat16)
    adapter = SkippableModel(model)
    assert adapter.fused is not None
    for layer in adapter.fused.layers:
        assert all(p.panels is not None for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert isinstance(adapter.lm_head, PackedLinear) and adapter.lm_head.panels is not None
    x = torch.randn(20, 512).bfloat16()
    gate_up = adapter.fused.layers[0].gate_up
    assert torch.equal(gate_up(x), torch.cat([gate_up(x[i : i + 1]) for i in range(20)]))
    assert torch.equal(adapter.lm_head(x), torch.cat([adapter.lm_head(x[i : i + 1]) for i in range(20)]))
