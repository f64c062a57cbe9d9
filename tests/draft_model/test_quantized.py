"""Weight-only quantized copies of the MLPs that quantized drafts run (draft_model/quantized.py)."""

import pytest
import torch
from torch import nn

from spirit.draft_model import quantized
from spirit.draft_model.quantized import QuantizationError, QuantizedLinear, QuantizedMLP, QuantizedMLPs
from spirit.model.adapter import SkippableModel
from spirit.skipset import DraftConfig, SkipSet
from spirit.testing import tiny_model


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    approx, exact = approx.detach().float(), exact.detach().float()
    return float((approx - exact).norm() / exact.norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits, bound", [(8, 0.02), (4, 0.15)])
def test_quantized_linear_is_close_to_the_linear(dtype, bits, bound):
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=True).to(dtype)
    x = torch.randn(3, 5, 256, dtype=dtype)
    q = QuantizedLinear.from_linear(linear, bits)
    assert q.bits == bits
    y = q(x)
    assert y.shape == (3, 5, 96) and y.dtype == dtype
    err = relative_error(y, linear(x))
    assert err < bound, err
    # and the error is that of quantization, not noise: int4 is clearly coarser than int8
    if bits == 4:
        assert err > relative_error(QuantizedLinear.from_linear(linear, 8)(x), linear(x))


def test_int4_falls_back_to_int8_where_the_kernel_cannot_take_the_shape():
    # 48 inputs: not whole int4 groups of 32 (torch's op also needs outputs % 16: 20 is not)
    linear = nn.Linear(48, 20, bias=False)
    q = QuantizedLinear.from_linear(linear, 4)
    assert q.bits == 8
    x = torch.randn(2, 48)
    assert relative_error(q(x), linear(x)) < 0.02


def test_bytes_shrink_with_the_bits():
    linear = nn.Linear(512, 256, bias=False).to(torch.bfloat16)
    full = linear.weight.numel() * 2
    assert QuantizedLinear.from_linear(linear, 8).nbytes < 0.55 * full
    assert QuantizedLinear.from_linear(linear, 4).nbytes < 0.4 * full


@pytest.mark.parametrize("bits", [0, 2, 16])
def test_unsupported_bits_are_refused(bits):
    with pytest.raises(QuantizationError, match="bits"):
        QuantizedLinear.from_linear(nn.Linear(64, 32), bits)
    with pytest.raises(QuantizationError, match="bits"):
        QuantizedMLPs.build([], bits)


@pytest.mark.parametrize("bits", [1, 3, 16, -4])
def test_draft_config_refuses_other_bits(bits):
    with pytest.raises(ValueError, match="draft_bits"):
        DraftConfig(draft_bits=bits)


def test_a_non_gated_mlp_is_refused_with_a_clear_message():
    class PlainMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(64, 128), nn.Linear(128, 64)

    with pytest.raises(QuantizationError, match="gate_proj/up_proj/down_proj"):
        QuantizedMLP.from_mlp(PlainMLP(), 4)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_pass_approximates_the_full_model(arch, bits):
    model = SkippableModel(tiny_model(arch, num_layers=4))
    mlps = QuantizedMLPs.build(model.layers, bits)
    assert len(mlps.mlps) == 4 and mlps.bits == bits
    ids = torch.tensor([list(range(10, 30))])
    with torch.inference_mode():
        exact = model.hidden_states(ids, 0, model.new_cache(32), SkipSet())
        approx = model.hidden_states(ids, 0, model.new_cache(32), SkipSet(), mlps=mlps)
    err = relative_error(approx, exact)
    assert 0 < err < (0.05 if bits == 8 else 0.3), err


def test_the_disk_cache_round_trips_and_rebuilds_what_does_not_fit(tmp_path, monkeypatch):
    monkeypatch.setattr(quantized, "KEEP_AFTER_S", 0.0)  # a tiny model builds in milliseconds
    model = SkippableModel(tiny_model("qwen2", num_layers=3))
    path = tmp_path / "q" / "tiny-int4.pt"
    built = QuantizedMLPs.cached(model.layers, 4, path)
    assert path.exists()
    loaded = QuantizedMLPs.cached(model.layers, 4, path)
    x = torch.randn(2, 64)
    for a, b in zip(built.mlps, loaded.mlps):
        assert torch.equal(a(x), b(x))
    # a file for other layers (a different model) is not used: rebuilt, and replaced
    other = SkippableModel(tiny_model("qwen2", num_layers=2))
    rebuilt = QuantizedMLPs.cached(other.layers, 4, path)
    assert len(rebuilt.mlps) == 2 and len(QuantizedMLPs.load(path, other.layers, 4).mlps) == 2
    path.write_bytes(b"not a checkpoint")
    assert len(QuantizedMLPs.cached(model.layers, 4, path).mlps) == 3


def test_an_engine_keeps_its_quantized_mlps_in_the_cache_it_is_given(tmp_path, monkeypatch):
    from spirit.engine import Engine

    monkeypatch.setattr(quantized, "KEEP_AFTER_S", 0.0)
    eng = Engine(SkippableModel(tiny_model("llama", num_layers=2)), quantized_cache=tmp_path / "tiny")
    assert eng.quantized_mlps(0) is None
    assert eng.quantized_mlps(8).bits == 8 and len(list(tmp_path.glob("tiny-int8*.pt"))) == 1
    assert eng.quantized_mlps(8) is eng.quantized_mlps(8)


def test_what_builds_fast_is_not_kept_on_disk(tmp_path):
    model = SkippableModel(tiny_model("llama", num_layers=2))
    QuantizedMLPs.cached(model.layers, 4, tmp_path / "tiny-int4.pt")
    assert not (tmp_path / "tiny-int4.pt").exists()
