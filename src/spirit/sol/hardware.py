"""Hardware specs: peak FLOP/s per dtype, memory and cache bandwidth.

Datasheet specs ship as JSON files next to this module (dense peaks, not the "with sparsity"
figures). `this-cpu` is measured by `calibrate()` and saved under the spirit cache, because a
CPU's datasheet says little about what torch reaches on it (e.g. bf16 matmul without
AVX-512 BF16 is emulated and far below the fp32 peak).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from spirit.machine import last_level_cache_bytes
from spirit.model.bundled import cache_root

THIS_CPU = "this-cpu"
_DATA = Path(__file__).with_name("hardware")


class HardwareNotFoundError(ValueError):
    """Unknown hardware name, or `this-cpu` before any calibration."""


def dtype_key(dtype: torch.dtype | str) -> str:
    """'bfloat16', 'float32', ...; all float8 variants share the key 'float8'."""
    name = str(dtype).removeprefix("torch.")
    if name.startswith("float8"):
        return "float8"
    return {"half": "float16", "float": "float32", "double": "float64"}.get(name, name)


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    description: str
    memory_bandwidth: float  # bytes/s from main memory (HBM or DRAM)
    matmul_flops: dict[str, float]  # peak FLOP/s of matrix ops per dtype key (dense)
    vector_flops: dict[str, float]  # peak FLOP/s of elementwise / reduction ops per dtype key
    llc_bytes: int  # last-level cache size (GPU L2, CPU L3)
    cache_bandwidth: float  # bytes/s when the working set stays in the last-level cache
    source: str = ""
    measured: dict = field(default_factory=dict)  # raw calibration figures, for the record

    def matmul_peak(self, dtype: torch.dtype | str) -> float:
        return _peak(self.matmul_flops, dtype)

    def vector_peak(self, dtype: torch.dtype | str) -> float:
        return _peak(self.vector_flops, dtype)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    def summary(self) -> str:
        mm = ", ".join(f"{k} {v / 1e12:.3g}" for k, v in self.matmul_flops.items())
        return (f"{self.name}: memory {self.memory_bandwidth / 1e9:.1f} GB/s, "
                f"cache {self.cache_bandwidth / 1e9:.1f} GB/s over {self.llc_bytes / 2**20:.0f} MiB, "
                f"matmul TFLOP/s {mm}")


def _peak(table: dict[str, float], dtype: torch.dtype | str) -> float:
    key = dtype_key(dtype)
    if key in table:
        return table[key]
    # An unlisted dtype gets the fastest listed peak, so the bound stays a lower bound.
    return max(table.values())


def this_cpu_path() -> Path:
    return cache_root() / "hardware" / f"{THIS_CPU}.json"


def available() -> list[str]:
    return sorted(p.stem for p in _DATA.glob("*.json")) + [THIS_CPU]


def load_hardware(name: str | HardwareSpec, calibrate_if_missing: bool = False) -> HardwareSpec:
    """A spec by name ('h100-sxm', 'h200', 'b200', 'a100', 'this-cpu') or from a JSON path."""
    if isinstance(name, HardwareSpec):
        return name
    if name == THIS_CPU:
        path = this_cpu_path()
        if not path.exists():
            if not calibrate_if_missing:
                raise HardwareNotFoundError(
                    f"this CPU is not calibrated yet ({path} is missing): run `spirit sol calibrate`")
            spec = calibrate(quick=True)
            save_hardware(spec, path)
            return spec
    elif (_DATA / f"{name}.json").exists():
        path = _DATA / f"{name}.json"
    elif name.endswith(".json") and Path(name).exists():
        path = Path(name)
    else:
        raise HardwareNotFoundError(f"unknown hardware {name!r}; choose one of {', '.join(available())} or a .json file")
    return HardwareSpec(**json.loads(path.read_text()))


def save_hardware(spec: HardwareSpec, path: Path | None = None) -> Path:
    path = path or this_cpu_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(spec.to_json())
    os.replace(tmp, path)
    return path


def _median_seconds(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _best_rate(fn, work: float, repeats: int) -> float:
    """work / median seconds of fn, the best over 1 thread and torch's thread count: on a
    machine shared with other processes a multi-threaded op can wait a scheduler quantum at
    each barrier, and one thread then runs faster."""
    threads = torch.get_num_threads()
    best = 0.0
    try:
        for t in sorted({1, threads}):
            torch.set_num_threads(t)
            best = max(best, work / _median_seconds(fn, repeats))
    finally:
        torch.set_num_threads(threads)
    return best


def calibrate(quick: bool = False, dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)) -> HardwareSpec:
    """Measure this CPU: read and copy bandwidth on buffers far larger than the last-level
    cache, in-cache read bandwidth, a vector op's FLOP/s, and a large matmul per dtype.
    Each figure is the median of repeats; bandwidth and peaks are the best of the figures
    that measure them, so that the spec stays an upper bound on speed. quick: ~2-5 s."""
    llc = last_level_cache_bytes(8 * 2**20)
    repeats = 3 if quick else 5
    measured: dict[str, float] = {}

    # Buffers of 2x and >= 8x the reported LLC: a VM may report a smaller cache than the chip
    # has, and the bandwidth is the best figure over these sizes (the bound stays a bound).
    big = max(8 * llc, 64 * 2**20 if quick else 256 * 2**20) // 4  # fp32 elements
    for label, n in (("2xLLC", 2 * llc // 4), ("large", big)):
        a = torch.ones(n, dtype=torch.float32)
        b = torch.empty_like(a)
        w = a.view(-1, 1024)
        x = torch.ones(1024)
        measured[f"read_{label}_GBps"] = _best_rate(lambda: a.sum(), a.numel() * 4, repeats) / 1e9
        measured[f"copy_{label}_GBps"] = _best_rate(lambda: b.copy_(a), 2 * a.numel() * 4, repeats) / 1e9
        measured[f"gemv_{label}_GBps"] = _best_rate(lambda: w @ x, a.numel() * 4, repeats) / 1e9
        del a, b, w

    small = torch.ones(llc // 4 // 4, dtype=torch.float32)  # a quarter of the LLC
    inner = 10
    measured["cache_read_GBps"] = _best_rate(
        lambda: [small.sum() for _ in range(inner)], inner * small.numel() * 4, repeats) / 1e9
    measured["vector_fp32_GFLOPs"] = _best_rate(
        lambda: [small.mul_(1.0) for _ in range(inner)], inner * small.numel(), repeats) / 1e9

    matmul: dict[str, float] = {}
    for dtype in dtypes:
        # emulated dtypes (bf16 without AVX-512 BF16) are ~10x slower: a smaller matmul suffices
        size = (512 if quick else 1024) if dtype in (torch.float32, torch.float64) else (256 if quick else 384)
        x = torch.randn(size, size).to(dtype)
        y = torch.randn(size, size).to(dtype)
        matmul[dtype_key(dtype)] = _best_rate(lambda: x @ y, 2 * size**3, repeats)
        measured[f"matmul_{dtype_key(dtype)}_GFLOPs"] = matmul[dtype_key(dtype)] / 1e9

    bandwidth = max(v for k, v in measured.items() if k.endswith("LLC_GBps") or k.endswith("large_GBps")) * 1e9
    cache_bw = max(measured["cache_read_GBps"] * 1e9, bandwidth)
    vector = measured["vector_fp32_GFLOPs"] * 1e9
    return HardwareSpec(
        name=THIS_CPU,
        description=f"this machine's CPU (best of 1 and {torch.get_num_threads()} threads), calibrated {time.strftime('%Y-%m-%d %H:%M')}",
        memory_bandwidth=bandwidth,
        matmul_flops=matmul,
        # a vector op on fp32 in cache; other dtypes are assumed no faster per element
        vector_flops={k: vector for k in ("float32", "bfloat16", "float16", "float64")},
        llc_bytes=llc,
        cache_bandwidth=cache_bw,
        source="spirit sol calibrate" + (" (quick)" if quick else ""),
        measured={k: round(v, 3) for k, v in measured.items()},
    )
