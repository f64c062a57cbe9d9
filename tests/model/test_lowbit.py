"""Low-bit targets (model/lowbit.py): packing, the kept packing, and losslessness relative
to the low-bit model itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spirit.engine import Engine
from spirit.model import lowbit
from spirit.model.adapter import SkippableModel
from spirit.model.lowbit import PackedLinear, pack_model, packable_linears
from spirit.policies.base import LookupPolicy, ModelInfo, StaticPolicy
from spirit.skipset import DraftConfig, SkipSet
from spirit.testing import ARCHITECTURES, decode_all, tiny_model

LAYERS = 4


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx.detach().float() - exact.detach().float()).norm() / exact.detach().float().norm())


@pytest.mark.parametrize("fmt, bound", [("int8", 0.02), ("int4", 0.15)])
@pytest.mark.parametrize("bias", [False, True])
def test_packing_round_trips_against_the_dequantized_weight(fmt, bound, bias):
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=bias).to(torch.bfloat16)
    packed = PackedLinear.from_linear(linear, fmt, torch.bfloat16)
    assert packed.format == fmt
    x = torch.randn(3, 5, 256, dtype=torch.bfloat16)
    y = packed(x)
    assert y.shape == (3, 5, 96) and y.dtype == torch.bfloat16
    # the kernel computes exactly a product with the weight it holds (up to bf16 rounding) ...
    reference = F.linear(x.float(), packed.dequantized(), None if linear.bias is None else linear.bias.float())
    assert relative_error(y, reference) < 0.01
    # ... which is the original weight within the format's error
    assert relative_error(packed.dequantized(), linear.weight) < bound


def test_a_shape_int4_cannot_take_falls_back_to_int8():
    packed = PackedLinear.from_linear(nn.Linear(256, 20), "int4", torch.bfloat16)  # 20 outputs: not % 16
    assert packed.format == "int8"


def test_unknown_formats_are_refused():
    with pytest.raises(ValueError, match="unknown packed format 'int3'"):
        PackedLinear.from_linear(nn.Linear(64, 64), "int3", torch.bfloat16)


@pytest.mark.parametrize("tied", [False, True])
def test_every_linear_and_the_head_are_packed_and_the_embedding_is_not(tied):
    model = tiny_model("qwen2", num_layers=2, dtype=torch.bfloat16)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    head = model.lm_head.weight.detach().clone()
    count = len(packable_linears(model))
    done = pack_model(model, "int4", torch.bfloat16)
    assert count == 2 * 7 + 1 and done["linears"] == count and done["bytes_after"] < done["bytes_before"] / 2
    assert model.lm_head.format == "int8"  # 264 outputs: the int4 kernel needs a multiple of 16
    assert not packable_linears(model)  # nothing left unpacked
    assert isinstance(model.lm_head, PackedLinear) and isinstance(model.model.embed_tokens, nn.Embedding)
    # the reduced draft head gathers rows of the unpacked head, which a tied model does not copy
    adapted = SkippableModel(model)
    assert torch.equal(adapted.head_rows, head) and adapted.dtype == torch.bfloat16
    assert (adapted.head_rows.data_ptr() == model.model.embed_tokens.weight.data_ptr()) == tied
    assert relative_error(model.lm_head.dequantized(), head) < 0.15


def test_a_packing_is_kept_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setattr(lowbit, "KEEP_AFTER_S", 0.0)
    path = tmp_path / "tiny-int4.pt"
    built = tiny_model("llama", num_layers=2, dtype=torch.bfloat16)
    first = pack_model(built, "int4", torch.bfloat16, path)
    assert path.exists() and not first["from_cache"] and not list(tmp_path.glob("*.tmp"))
    again = tiny_model("llama", num_layers=2, dtype=torch.bfloat16)
    second = pack_model(again, "int4", torch.bfloat16, path)
    assert second["from_cache"]
    x = torch.randn(1, 3, 64, dtype=torch.bfloat16)
    assert torch.equal(built.model.layers[1].mlp(x), again.model.layers[1].mlp(x))
    assert torch.equal(built.lm_head(x), again.lm_head(x)) and again.lm_head.row_source is not None
    # another model's shapes, or a damaged file: packed again, never used
    other = tiny_model("llama", num_layers=3, dtype=torch.bfloat16)
    assert not pack_model(other, "int4", torch.bfloat16, path)["from_cache"]
    path.write_bytes(b"not a checkpoint")
    fresh = tiny_model("llama", num_layers=2, dtype=torch.bfloat16)
    assert not pack_model(fresh, "int4", torch.bfloat16, path)["from_cache"]


def packed_engine(arch: str, fmt: str) -> Engine:
    model = tiny_model(arch, num_layers=LAYERS, dtype=torch.bfloat16)
    pack_model(model, fmt, torch.bfloat16)
    return Engine(SkippableModel(model))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_speculation_on_an_int4_target_gives_its_plain_decoding(arch):
    engine = packed_engine(arch, "int4")
    assert engine.quantized_mlps(4) is None  # the target's own MLPs are the int4 draft's
    for prompt in (list(range(40, 60)), [5, 6, 7, 8] * 5):
        plain, _ = decode_all(engine, prompt, 24)
        for policy in (StaticPolicy(ModelInfo(LAYERS), DraftConfig(threshold=0.0, branches=2, draft_vocab=64),
                                    skip=SkipSet.parse("attn:1;mlp:2")),
                       LookupPolicy(ModelInfo(LAYERS), DraftConfig(ngram_tokens=6))):
            out, stats = decode_all(engine, prompt, 24, policy)
            assert out == plain
            assert stats.counters.draft_rounds > 0


def test_the_exactness_check_measures_the_packed_kernels():
    engine = packed_engine("llama", "int4")
    exactness = engine.model.exactness
    assert exactness.reason  # measured, whatever the verdict on this CPU
    from spirit.model.exactness import _distinct_linears

    assert any(isinstance(m, PackedLinear) for m in _distinct_linears(engine.model))
