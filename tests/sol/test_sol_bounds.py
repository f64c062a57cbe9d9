"""The three bounds, their ordering, hardware specs and the SOL score."""

import math

import pytest
import torch
import torch.nn.functional as F

from spirit.sol import bounds, load_hardware, sol_score
from spirit.sol.hardware import HardwareNotFoundError, HardwareSpec

GPUS = ("h100-sxm", "h200", "b200", "a100")


def _tiny_cpu(llc: int = 1 << 16) -> HardwareSpec:
    return HardwareSpec("test-cpu", "", 10e9, {"float32": 50e9}, {"float32": 5e9}, llc, 40e9)


def _graphs():
    x = torch.randn(64, 128)
    w1, w2 = torch.randn(128, 256), torch.randn(256, 128)
    yield lambda x, a, b: torch.softmax(F.silu(x @ a) @ b, -1) + x, (x, w1, w2)
    q = torch.randn(1, 4, 32, 16)
    yield lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(1, 32, 64), (q, q + 1, q + 2)
    yield lambda x: x.t().contiguous(), (x,)
    yield lambda x: x.view(-1)[:10], (x,)


def test_fused_le_cache_aware_le_unfused(cost_of):
    specs = [load_hardware(name) for name in GPUS] + [_tiny_cpu(), _tiny_cpu(llc=1 << 30)]
    for fn, args in _graphs():
        cost = cost_of(fn, *args)
        for hw in specs:
            b = bounds(cost, hw)
            assert b.fused <= b.cache_aware * (1 + 1e-12) <= b.unfused * (1 + 1e-12), (hw.name, b)
            assert b.sol == b.fused >= 0


def test_cache_aware_discounts_resident_intermediates(cost_of):
    x, a, b_ = torch.randn(64, 128), torch.randn(128, 256), torch.randn(256, 128)
    cost = cost_of(lambda x, a, b: F.silu(F.silu(x @ a)) @ b, x, a, b_)
    small, big = bounds(cost, _tiny_cpu(llc=1)), bounds(cost, _tiny_cpu(llc=1 << 30))
    assert math.isclose(small.cache_aware, small.unfused)  # nothing fits: unfused
    assert big.cache_aware < big.unfused


def test_view_only_graph_has_zero_bounds(cost_of):
    b = bounds(cost_of(lambda x: x.t()[1:], torch.randn(8, 8)), _tiny_cpu())
    assert b.fused == b.cache_aware == b.unfused == 0


@pytest.mark.parametrize("name", GPUS)
def test_datasheet_specs_are_dense(name):
    hw = load_hardware(name)
    assert hw.memory_bandwidth > 1e12 and hw.llc_bytes > 0
    assert hw.matmul_peak(torch.bfloat16) < 3e15  # dense, not the 'with sparsity' figure
    assert hw.matmul_peak(torch.float8_e4m3fn) == pytest.approx(2 * hw.matmul_peak(torch.bfloat16), rel=1e-3)
    assert hw.matmul_peak(torch.float16) == hw.matmul_peak(torch.bfloat16) > hw.matmul_peak(torch.float32)


def test_h200_vs_h100_bandwidth():
    assert load_hardware("h200").memory_bandwidth == 4.8e12
    assert load_hardware("h100-sxm").memory_bandwidth == 3.35e12


def test_unknown_and_uncalibrated_hardware(cache_dir):
    with pytest.raises(HardwareNotFoundError, match="sol calibrate"):
        load_hardware("this-cpu")
    with pytest.raises(HardwareNotFoundError, match="h200"):
        load_hardware("tpu-v9")


def test_sol_score():
    assert sol_score(2.0, 2.0, 1.0) == 0.5
    assert sol_score(1.0, 2.0, 1.0) == 1.0
    assert sol_score(3.0, 2.0, 1.0) == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        sol_score(1.0, 1.0, 1.0)
