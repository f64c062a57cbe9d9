import pytest
import torch
from torch import nn

from spirit.model.adapter import Layout, SkippableModel, UnsupportedModelError
from spirit.skipset import SkipSet
from spirit.testing import ARCHITECTURES, tiny_model


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_full_forward_matches_transformers_in_chunks(arch):
    """Empty skip set == the model's own forward, for prefill + multi-token + single steps,
    over a context longer than the sliding window (16) of Mistral and Gemma3."""
    model = tiny_model(arch, num_layers=4)
    ids = torch.randint(0, 250, (1, 40), generator=torch.Generator().manual_seed(1))
    reference = model(ids).logits[0]
    sm = SkippableModel(model)
    cache = sm.new_cache(64)
    pieces, start = [], 0
    for length in (17, 5, 1, 1, 9, 7):
        pieces.append(sm.forward(ids[:, start : start + length], start, cache, SkipSet()))
        start += length
    torch.testing.assert_close(torch.cat(pieces), reference, atol=2e-4, rtol=1e-4)


def test_layouts_detected():
    assert SkippableModel(tiny_model("llama")).layout is Layout.PRE_NORM
    assert SkippableModel(tiny_model("gemma3")).layout is Layout.SANDWICH


def test_skipping_everything_is_embedding_then_head():
    model = tiny_model("llama", num_layers=3)
    sm = SkippableModel(model)
    ids = torch.tensor([[5, 6, 7]])
    out = sm.forward(ids, 0, sm.new_cache(8), SkipSet.of_layers({0, 1, 2}))
    expected = model.lm_head(model.model.norm(model.model.embed_tokens(ids)))[0]
    torch.testing.assert_close(out, expected)


def test_skipped_attention_writes_no_kv():
    sm = SkippableModel(tiny_model("llama", num_layers=3))
    cache = sm.new_cache(8)
    sm.forward(torch.tensor([[1, 2]]), 0, cache, SkipSet(frozenset({1}), frozenset()))
    assert cache.keys[1].abs().sum() == 0
    assert cache.keys[0][:, :, :2].abs().sum() > 0


def test_unknown_layout_is_a_clear_error():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(2, 2)
            self.model = nn.Module()

    with pytest.raises(UnsupportedModelError, match="standard decoder-only layout"):
        SkippableModel(Odd())
