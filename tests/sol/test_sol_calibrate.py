"""`this-cpu` calibration: versioned kept results, quiet-run timing, quick vs full.

Timings are injected (a fake runner returns wall and CPU seconds without running the kernel),
so these tests check the logic, not this machine's speed, and take milliseconds."""

import json
import random

import pytest
import torch

from spirit.sol import load_hardware, save_hardware
from spirit.sol import hardware as hwmod
from spirit.sol.hardware import (CALIBRATION_VERSION, FULL, QUICK, Effort, HardwareNotFoundError, HardwareSpec,
                                 buffer_bytes, calibrate, this_cpu_path, time_quiet)

SMALL = 4 * 4 * 4096 * 64  # a 4 MiB buffer: the fake runner never reads it

# what `spirit sol calibrate --quick` kept before calibrations were versioned (no "calibration" field)
OLD_FORMAT = {
    "name": "this-cpu", "description": "this machine's CPU (best of 1 and 2 threads), calibrated 2026-12-04 16:33",
    "memory_bandwidth": 10319471392.96612,
    "matmul_flops": {"float32": 158243152917.13507, "bfloat16": 597670761548.7877, "float16": 142969765138.84714},
    "vector_flops": {k: 2045189103.2822695 for k in ("float32", "bfloat16", "float16", "float64")},
    "llc_bytes": 503316480, "cache_bandwidth": 10319471392.96612, "source": "spirit sol calibrate (quick)",
    "measured": {"read_2xLLC_GBps": 10.319, "gemv_2xLLC_GBps": 10.032},
}


def _spec(bandwidth: float = 30e9, calibration: int = CALIBRATION_VERSION) -> HardwareSpec:
    return HardwareSpec("this-cpu", "test", bandwidth, {"float32": 1e11}, {"float32": 1e9}, 1 << 20, bandwidth,
                        calibration=calibration)


@pytest.fixture
def fake_calibrate(monkeypatch):
    calls = []

    def fake(quick=False, **_):
        calls.append(quick)
        return _spec()

    monkeypatch.setattr(hwmod, "calibrate", fake)
    return calls


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.setattr(hwmod, "_cores", lambda: 2)


def test_old_format_calibration_is_refused_or_redone(cache_dir, fake_calibrate, capsys):
    path = this_cpu_path()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(OLD_FORMAT))
    with pytest.raises(HardwareNotFoundError, match="older calibration method.*sol calibrate"):
        load_hardware("this-cpu")
    assert fake_calibrate == []

    spec = load_hardware("this-cpu", calibrate_if_missing=True)
    assert fake_calibrate == [True] and spec.memory_bandwidth == 30e9
    assert "older calibration method" in capsys.readouterr().err
    kept = json.loads(path.read_text())
    assert kept["calibration"] == CALIBRATION_VERSION and kept["memory_bandwidth"] == 30e9
    assert load_hardware("this-cpu") == spec and fake_calibrate == [True]  # current now: not redone


def test_older_version_and_unreadable_calibrations_are_redone(cache_dir, fake_calibrate):
    save_hardware(_spec(bandwidth=10e9, calibration=CALIBRATION_VERSION - 1))
    assert load_hardware("this-cpu", calibrate_if_missing=True).memory_bandwidth == 30e9
    this_cpu_path().write_text("{not json")
    with pytest.raises(HardwareNotFoundError, match="unreadable"):
        load_hardware("this-cpu")
    assert load_hardware("this-cpu", calibrate_if_missing=True).memory_bandwidth == 30e9
    assert fake_calibrate == [True, True]


def test_current_calibration_is_kept(cache_dir, fake_calibrate):
    save_hardware(_spec(bandwidth=12e9))
    assert load_hardware("this-cpu", calibrate_if_missing=True).memory_bandwidth == 12e9
    assert fake_calibrate == []


def test_datasheet_specs_need_no_calibration_version():
    assert load_hardware("h200").calibration == 0


class Runner:
    """Fake timings: (wall, CPU) pairs in turn; the first call per kernel is its warm-up."""

    def __init__(self, runs):
        self.runs = iter(runs)
        self.calls = 0

    def __call__(self, fn):
        self.calls += 1
        return next(self.runs)


def test_time_quiet_skips_warmup_and_disturbed_runs(two_cores):
    # warm-up 9 s (first touch); a run that waited for a core: 0.5 s wall, 0.5 s CPU on 2 threads
    runs = [(9.0, 18.0), (1.2, 2.4), (0.5, 0.5), (1.0, 2.0), (1.1, 2.2), (0.4, 0.1), (3.0, 6.0)]
    t = time_quiet(lambda: None, 2, Effort(quiet_runs=3, max_runs=10, budget_s=60), Runner(runs))
    assert (t.best_quiet_s, t.quiet, t.runs) == (1.0, 3, 4)  # stops at 3 quiet runs
    assert t.seconds == 1.0 and not t.loaded


def test_time_quiet_under_load_and_run_limit(two_cores):
    runner = Runner([(2.0, 2.0)] * 100)  # every run had half the CPU time of 2 threads
    t = time_quiet(lambda: None, 2, Effort(quiet_runs=3, max_runs=7, budget_s=60), runner)
    assert t.loaded and t.best_quiet_s is None and t.seconds == 2.0 and t.runs == 7 and runner.calls == 8
    # one thread needs only one core's worth of CPU time
    t = time_quiet(lambda: None, 1, Effort(quiet_runs=3, max_runs=7, budget_s=60), Runner([(2.0, 2.0)] * 100))
    assert t.quiet == 3 and not t.loaded


def test_time_quiet_gives_up_on_a_slow_kernel(two_cores):
    runner = Runner([(5.0, 10.0)] * 10)
    t = time_quiet(lambda: None, 2, QUICK, runner, give_up_s=1.0)
    assert t.runs == 0 and runner.calls == 1 and not t.loaded


def test_quick_and_full_measure_the_same_buffer():
    for llc in (8 << 20, 32 << 20, 480 << 20):
        size = buffer_bytes(llc)
        assert size >= min(2 * llc, hwmod._available_memory() // 3) and size % (4 * 4096) == 0
    assert QUICK.quiet_runs < FULL.quiet_runs and QUICK.budget_s <= FULL.budget_s


class NoisyMachine:
    """Each kernel's runs: `base` x (1 + up to 8% noise) when quiet; one run in four waited
    for a core (twice as long, 40% CPU share); each kernel's first (warm-up) call 10x."""

    def __init__(self, base: float = 0.04, seed: int = 0):
        self.base, self.rng, self.seen = base, random.Random(seed), set()

    def __call__(self, fn):
        threads = min(torch.get_num_threads(), 2)
        wall = self.base * (1 + 0.08 * self.rng.random())
        if fn not in self.seen:
            self.seen.add(fn)
            return 10 * wall, 10 * wall * threads
        if self.rng.random() < 0.25:
            return 2 * wall, 0.4 * 2 * wall * threads
        return wall, wall * threads


@pytest.mark.parametrize("seed", range(5))
def test_quick_within_a_few_percent_of_full(two_cores, seed):
    quick = calibrate(quick=True, dtypes=(torch.float32,), run=NoisyMachine(seed=seed), nbytes=SMALL)
    full = calibrate(quick=False, dtypes=(torch.float32,), run=NoisyMachine(seed=seed + 100), nbytes=SMALL)
    ideal = SMALL / 0.04
    assert ideal / 1.08 <= full.memory_bandwidth <= ideal
    assert quick.memory_bandwidth >= 0.97 * full.memory_bandwidth  # best of the quiet runs, warm-ups and waits left out
    for spec in (quick, full):
        assert spec.calibration == CALIBRATION_VERSION and not spec.under_load
        assert spec.measured["buffer_MiB"] == SMALL / 2**20


def test_calibration_under_load_is_flagged(two_cores):
    def busy(fn):  # every multi-threaded run got 60% of its CPU time
        return 0.05, 0.05 * 0.6 * min(torch.get_num_threads(), 2)

    spec = calibrate(quick=True, dtypes=(torch.float32,), run=busy, nbytes=SMALL)
    assert spec.under_load and "warning" in spec.summary() and spec.measured["under_load"] == 1.0
    # every kernel "took" 0.05 s: the best is the one that reads the most, spirit's int8 kernel
    # where it builds (its codes are the buffer, plus a float16 scale per 32 of them)
    from spirit.model import qgemm

    read = SMALL * (1 + 2 / 32) if qgemm.available() else SMALL
    assert spec.memory_bandwidth == pytest.approx(read / 0.05)


def test_calibrate_runs_for_real_on_a_small_buffer():
    """Smoke: the real kernels run over a small buffer; no timing is asserted."""
    spec = calibrate(quick=True, dtypes=(torch.float32,), nbytes=SMALL, effort=Effort(1, 2, 0.1))
    assert spec.memory_bandwidth > 1e8 and spec.matmul_peak(torch.float32) > 1e8
    assert {"gemv_fp32_GBps", "sum_fp32_GBps", "linear_bf16_GBps"} <= set(spec.measured)
    assert HardwareSpec(**json.loads(spec.to_json())) == spec
