"""Devices: `load(..., device=...)`, `--device`, and every tensor on the model's device.

The CUDA tests skip where torch sees no GPU (every machine this project has run on so far):
the CUDA path is written from torch's op contracts and is untested until they run.
"""

from __future__ import annotations

import pytest
import torch

from spirit.cli import main
from spirit.engine import Engine
from spirit.model.adapter import SkippableModel
from spirit.model.loader import choose_dtype, resolve_device
from spirit.policies.base import ModelInfo, StaticPolicy
from spirit.skipset import DraftConfig, SkipSet
from spirit.testing import ARCHITECTURES, decode_all, tiny_model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA GPU here")


def test_auto_is_the_gpu_where_there_is_one_else_the_cpu():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected and resolve_device(None).type == expected
    assert resolve_device("cpu") == torch.device("cpu")


def test_unknown_devices_are_refused_clearly():
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        resolve_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_asking_for_cuda_without_a_gpu_is_a_clear_error(capsys):
    with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
        resolve_device("cuda")
    assert main(["generate", "--model", "smollm2-135m", "--device", "cuda", "--prompt", "hi"]) == 2
    assert "torch sees no CUDA GPU" in capsys.readouterr().err


def test_bf16_is_the_gpu_default():
    assert choose_dtype(object(), torch.device("cuda")) == (torch.bfloat16, "the GPU default")


def decode(engine: Engine, prompt: list[int], n: int, policy=None) -> list[int]:
    return decode_all(engine, prompt, n, policy)[0]


@needs_cuda
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_on_cuda_speculation_equals_plain_decoding(arch):
    model = SkippableModel(tiny_model(arch, num_layers=4, dtype=torch.bfloat16).to("cuda"))
    engine = Engine(model)
    prompt = list(range(30, 50))
    plain = decode(engine, prompt, 24)
    for config in (DraftConfig(threshold=0.0, ngram=True, branches=2, draft_vocab=64),
                   DraftConfig(threshold=0.0, draft_bits=4)):
        policy = StaticPolicy(ModelInfo(4), config, skip=SkipSet.parse("attn:1;mlp:2"))
        assert decode(engine, prompt, 24, policy) == plain


@needs_cuda
def test_on_cuda_int8_drafts_are_refused_clearly():
    from spirit.draft_model.quantized import QuantizationError, QuantizedLinear

    linear = torch.nn.Linear(64, 48).to("cuda", torch.bfloat16)
    with pytest.raises(QuantizationError, match="no 8-bit draft kernel on cuda"):
        QuantizedLinear.from_linear(linear, 8)
