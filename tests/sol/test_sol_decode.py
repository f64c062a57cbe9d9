"""Closed-form decoding SOL against the traced graph of one decode step of tiny models."""

import pytest
import torch

from spirit.skipset import SkipSet
from spirit.sol import decode_cost, decode_step_seconds, load_hardware, speculative_speedup, trace_decode_step
from spirit.testing import tiny_config, tiny_model


@pytest.mark.parametrize("skip", ["", "attn:1,2;mlp:2"])
def test_traced_llama_decode_step_matches_closed_form(skip):
    model = tiny_model("llama")
    skipset = SkipSet.parse(skip)
    graph = trace_decode_step(model, context=40, skip=skipset)
    closed = decode_cost(model.config, torch.float32, 40, skipset)
    assert not graph.unknown
    assert graph.io_bytes() == pytest.approx(closed.bytes, rel=0.03)
    assert graph.matrix_flops == pytest.approx(closed.matrix_flops, rel=0.03)
    kv_updates = [o for o in graph.ops if o.kind == "kv-update"]
    assert len(kv_updates) == 2 * (4 - len(skipset.attn))
    assert all(o.bytes == 2 * 2 * 16 * 4 for o in kv_updates)  # one position of [kv_heads=2, head_dim=16] fp32, read + written


def test_traced_qwen2_from_config_on_meta_device():
    config = tiny_config("qwen2")
    graph = trace_decode_step(config, context=16, dtype=torch.bfloat16)
    closed = decode_cost(config, torch.bfloat16, 16)
    assert graph.io_bytes() == pytest.approx(closed.bytes, rel=0.03)
    assert graph.matrix_flops == pytest.approx(closed.matrix_flops, rel=0.03)


def test_decode_cost_parts():
    config = tiny_config("llama")
    c = decode_cost(config, torch.bfloat16, 100)
    layers, kv_heads, head_dim, hidden, vocab = 4, 2, 16, 64, 264
    assert c.kv_read_bytes == layers * 2 * kv_heads * head_dim * 101 * 2
    assert c.kv_write_bytes == layers * 2 * kv_heads * head_dim * 2
    per_layer = hidden * hidden * 2 + 2 * hidden * kv_heads * head_dim + 3 * hidden * 2 * hidden + 2 * hidden
    assert c.weight_bytes == (layers * per_layer + hidden + vocab * hidden + hidden) * 2


def test_draft_is_cheaper_and_speedup_bound():
    config = tiny_config("llama", num_layers=8)
    hw = load_hardware("h200")
    skip = SkipSet.parse("attn:1,2,3;mlp:2,3,4,5")
    plain = decode_step_seconds(config, torch.bfloat16, 256, hw)
    draft = decode_step_seconds(config, torch.bfloat16, 256, hw, skip=skip)
    assert draft < plain
    best = speculative_speedup(config, torch.bfloat16, 256, skip, acceptance=1.0, draft_len=4, hardware=hw)
    assert best.expected_tokens == 5
    worst = speculative_speedup(config, torch.bfloat16, 256, skip, acceptance=0.0, draft_len=4, hardware=hw)
    assert worst.expected_tokens == 1 and worst.speedup < 1 < best.speedup
    assert best.speedup <= 5 * plain / (4 * draft + best.verify_s) + 1e-12


def test_bad_skip_is_rejected():
    with pytest.raises(ValueError):
        decode_cost(tiny_config("llama"), torch.float32, 10, SkipSet.parse("attn:9"))


def test_sliding_window_closed_form_reads_only_the_window():
    config = tiny_config("mistral")  # window 16
    short, long = decode_cost(config, torch.float32, 8), decode_cost(config, torch.float32, 200)
    assert long.kv_read_bytes == short.kv_read_bytes * 16 / 9
    graph = trace_decode_step(config, context=24)
    assert not graph.unknown  # the adapter's mask (bool &=) is costed as pointwise
    assert graph.io_bytes() >= decode_cost(config, torch.float32, 24).bytes  # masked reads of the whole slice
