"""Low-bit targets (model/lowbit.py): packing, the kept packing, and losslessness relative
to the low-bit model itself."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spirit.engine import Engine
from spirit.model import lowbit
from spirit.model.adapter import SkippableModel
from spirit.model.gguf_blocks import Int4Groups
from spirit.model.loader import file_precision_format
from spirit.model.lowbit import PackedLinear, pack_model, packable_linears
from spirit.policies.base import LookupPolicy, ModelInfo, StaticPolicy
from spirit.skipset import DraftConfig, SkipSet
from spirit.testing import ARCHITECTURES, decode_all, tiny_model

LAYERS = 4


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx.detach().float() - exact.detach().float()).norm() / exact.detach().float().norm())


@pytest.fixture(params=["spirit", "torch"])
def kernel(request, monkeypatch) -> str:
    """Each packing test runs with spirit's own kernel (where it builds) and with torch's ops."""
    from spirit.model import qgemm, quantize

    if request.param == "spirit" and not qgemm.available():
        pytest.skip(qgemm.status().reason)
    if request.param == "torch":
        monkeypatch.setattr(quantize, "_spirit_kernel", lambda device: False)
    return request.param


@pytest.mark.parametrize("fmt, bound", [("int8", 0.02), ("int4", 0.15)])
@pytest.mark.parametrize("bias", [False, True])
def test_packing_round_trips_against_the_dequantized_weight(fmt, bound, bias, kernel):
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=bias).to(torch.bfloat16)
    packed = PackedLinear.from_linear(linear, fmt, torch.bfloat16)
    assert packed.format == fmt and packed.kernel == kernel
    x = torch.randn(3, 5, 256, dtype=torch.bfloat16)
    y = packed(x)
    assert y.shape == (3, 5, 96) and y.dtype == torch.bfloat16
    # the kernel computes exactly a product with the weight it holds (up to bf16 rounding) ...
    reference = F.linear(x.float(), packed.dequantized(), None if linear.bias is None else linear.bias.float())
    assert relative_error(y, reference) < 0.01
    # ... which is the original weight within the format's error
    assert relative_error(packed.dequantized(), linear.weight) < bound


def test_a_shape_int4_cannot_take_falls_back_to_int8(kernel):
    # 48 inputs: not whole groups of 32 (torch's op also needs outputs % 16: 20 is not)
    packed = PackedLinear.from_linear(nn.Linear(48, 20), "int4", torch.bfloat16)
    assert packed.format == "int8" and packed.kernel == "torch"
    if kernel == "torch":
        assert PackedLinear.from_linear(nn.Linear(256, 20), "int4", torch.bfloat16).format == "int8"


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
    # 264 outputs: torch's int4 op needs a multiple of 16 (spirit's kernel takes any)
    assert model.lm_head.format == ("int4" if model.lm_head.kernel == "spirit" else "int8")
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
def test_speculation_on_an_int4_target_gives_its_plain_decoding(arch, kernel):
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


# -- a GGUF file's own blocks (model/gguf_blocks.py) ------------------------------------------

@dataclass
class FakeBlock:
    """Stands in for a GGUFLinear: a block type and the int4 groups its 4-bit blocks hold."""

    block_type: str
    groups: Int4Groups | None = None

    def int4(self) -> Int4Groups:
        assert self.groups is not None, "int4() asked of a block that has no 4-bit codes"
        return self.groups


def file_groups(out_features: int, in_features: int, seed: int = 0) -> Int4Groups:
    """Random 4-bit codes with scales and zeros that are exact in bf16, as a Q4_1 file's."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_features, in_features), generator=g, dtype=torch.uint8)
    groups = in_features // 32
    scale = (torch.rand(out_features, groups, generator=g) * 0.01 + 0.001).to(torch.bfloat16).float()
    zero = (torch.randn(out_features, groups, generator=g) * 0.01).to(torch.bfloat16).float()
    return Int4Groups(codes, scale, zero)


def test_4_bit_blocks_are_packed_with_the_files_own_codes():
    linear = nn.Linear(128, 48, bias=False).to(torch.bfloat16)
    groups = file_groups(48, 128)
    linear.weight.data = groups.dequantized().to(torch.bfloat16)  # what transformers dequantized
    packed = lowbit._packed("m.q_proj", linear, "int4", torch.bfloat16, {"m.q_proj": FakeBlock("Q4_1", groups)})
    assert packed.format == "int4" and packed.file_codes
    # the packed weight is the file's: no second rounding onto a new grid (the kernel's bf16
    # output, which `dequantized` reads, rounds each value once; spirit's kernel also holds
    # each group's offset, zero - 8 * scale, in float16: 2**-11 of it at most)
    offsets = (groups.zero - 8 * groups.scale).abs().max()
    atol = 0 if packed.kernel == "torch" else float(offsets) * 2**-11
    assert torch.allclose(packed.dequantized(), groups.dequantized(), rtol=2**-8, atol=atol)
    requantized = PackedLinear.from_linear(linear, "int4", torch.bfloat16)
    assert not requantized.file_codes
    assert relative_error(packed.dequantized(), linear.weight) < relative_error(requantized.dequantized(), linear.weight)


def test_blocks_that_do_not_match_the_loaded_weight_are_refused():
    linear = nn.Linear(128, 48, bias=False).to(torch.bfloat16)
    linear.weight.data = file_groups(48, 128, seed=1).dequantized().to(torch.bfloat16)
    with pytest.raises(ValueError, match="do not match the weights loaded"):
        lowbit._packed("m.q_proj", linear, "int4", torch.bfloat16, {"m.q_proj": FakeBlock("Q4_K", file_groups(48, 128))})


@pytest.mark.parametrize("fmt, expected", [("int4", "int4"), (lowbit.FILE_PRECISION, "int8"), ("int8", "int8")])
def test_other_blocks_are_requantized_to_the_asked_format(fmt, expected):
    """A Q6_K block: int4 asked is int4 re-quantized; the file's precision is int8."""
    linear = nn.Linear(128, 48).to(torch.bfloat16)
    packed = lowbit._packed("m.down_proj", linear, fmt, torch.bfloat16, {"m.down_proj": FakeBlock("Q6_K")})
    assert packed.format == expected and not packed.file_codes


def test_blocks_are_read_only_when_a_packing_is_built(tmp_path, monkeypatch):
    monkeypatch.setattr(lowbit, "KEEP_AFTER_S", 0.0)
    reads = []

    def blocks():
        reads.append(1)
        return {}

    path = tmp_path / "tiny.pt"
    first = pack_model(tiny_model("qwen2", num_layers=2, dtype=torch.bfloat16), "int4", torch.bfloat16, path, blocks)
    second = pack_model(tiny_model("qwen2", num_layers=2, dtype=torch.bfloat16), "int4", torch.bfloat16, path, blocks)
    assert not first["from_cache"] and second["from_cache"] and len(reads) == 1


def test_the_file_precision_is_the_format_holding_most_weights():
    assert file_precision_format({"a": ("Q4_K", 100), "b": ("Q6_K", 40)}) == "int4"
    assert file_precision_format({"a": ("Q4_K", 10), "b": ("Q5_0", 40), "c": ("F32", 500)}) == "int8"
    assert file_precision_format({"a": ("F16", 10), "b": ("BF16", 40)}) is None
