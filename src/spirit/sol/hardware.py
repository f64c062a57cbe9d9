"""Hardware specs: peak FLOP/s per dtype, memory and cache bandwidth.

Datasheet specs ship as JSON files next to this module (dense peaks, not the "with sparsity"
figures). `this-cpu` is measured by `calibrate()` and saved under the spirit cache, because a
CPU's datasheet says little about what torch reaches on it (e.g. bf16 matmul without
AVX-512 BF16 is emulated and far below the fp32 peak).

What `this-cpu` assumes, so that its bounds stay lower bounds on time:
- memory_bandwidth is the best read rate any of several kernels (an fp32 reduction, fp32
  GEMV, the bf16 linear and the int8 weight-only matmul decoding runs) reaches with all of
  torch's threads over one buffer of 2.5x the last-level cache (at least 256 MiB), pages
  touched first, after a warm-up, best of the runs that had the CPUs to themselves. A
  working set this size is treated as streaming from memory: a model whose bytes per token
  are well under ~2x the LLC may run faster than its decode bound (see cache_bandwidth),
  a larger one cannot beat it.
- a run counts only if this process had the CPUs throughout (its CPU time >= 90% of
  threads x wall time): on a machine shared with other jobs a run that waited for a core
  measures the other jobs, not the memory. The first calibration method took medians of
  3-5 runs whether or not the CPUs were busy, and on a shared 2-core VM reported 10.3 GB/s
  where the kernels reach ~31 GB/s: bounds that decoding then "beat" by 30-40%.
  `CALIBRATION_VERSION` marks the method: a kept calibration from an older one is redone
  (or refused, where the caller does not allow calibrating).
- quick and full calibrations measure the same buffer with the same kernels; quick keeps
  fewer quiet runs per kernel (best of 5 vs 15) and waits less for a quiet machine.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from spirit.machine import last_level_cache_bytes
from spirit.model.bundled import cache_root

THIS_CPU = "this-cpu"
# The method `calibrate()` measures by; a kept `this-cpu` made by an older one is redone.
# 1 (unversioned): medians of 3-5 runs, busy CPUs included. 2: best quiet run of several
# read kernels with all threads over one buffer of 2.5x the LLC, in quick and full alike.
CALIBRATION_VERSION = 2
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
    calibration: int = 0  # this-cpu: the CALIBRATION_VERSION that measured it (0: a datasheet, or before versions)

    @property
    def under_load(self) -> bool:
        """A calibration that found no run with the CPUs to itself: its figures are low."""
        return bool(self.measured.get("under_load"))

    def matmul_peak(self, dtype: torch.dtype | str) -> float:
        return _peak(self.matmul_flops, dtype)

    def vector_peak(self, dtype: torch.dtype | str) -> float:
        return _peak(self.vector_flops, dtype)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    def summary(self) -> str:
        mm = ", ".join(f"{k} {v / 1e12:.3g}" for k, v in self.matmul_flops.items())
        text = (f"{self.name}: memory {self.memory_bandwidth / 1e9:.1f} GB/s, "
                f"cache {self.cache_bandwidth / 1e9:.1f} GB/s over {self.llc_bytes / 2**20:.0f} MiB, "
                f"matmul TFLOP/s {mm}")
        if self.under_load:
            text += ("\nwarning: other processes held the CPUs during every run of the calibration: the figures are "
                     "low and bounds from them may be beaten; calibrate again when the machine is idle")
        return text


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
    """A spec by name ('h100-sxm', 'h200', 'b200', 'a100', 'this-cpu') or from a JSON path.

    `this-cpu` is the kept calibration; if there is none, or it was made by an older
    calibration method (`CALIBRATION_VERSION`), a quick one is run and kept when
    `calibrate_if_missing`, else HardwareNotFoundError."""
    if isinstance(name, HardwareSpec):
        return name
    if name == THIS_CPU:
        path = this_cpu_path()
        spec, why = _kept_this_cpu(path)
        if spec is not None:
            return spec
        if not calibrate_if_missing:
            raise HardwareNotFoundError(f"{why}: run `spirit sol calibrate`")
        if path.exists():
            print(f"spirit: {why}; running a quick calibration (`spirit sol calibrate` for a full one)", file=sys.stderr)
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


def _kept_this_cpu(path: Path) -> tuple[HardwareSpec | None, str]:
    """The kept calibration if it is current, else (None, why not)."""
    if not path.exists():
        return None, f"this CPU is not calibrated yet ({path} is missing)"
    try:
        spec = HardwareSpec(**json.loads(path.read_text()))
    except (ValueError, TypeError) as err:
        return None, f"this CPU's kept calibration ({path}) is unreadable ({err})"
    if spec.calibration < CALIBRATION_VERSION:
        return None, (f"this CPU's kept calibration ({path}) was made by an older calibration method "
                      f"(version {spec.calibration} < {CALIBRATION_VERSION}) that underestimated its memory bandwidth")
    return spec, ""


def save_hardware(spec: HardwareSpec, path: Path | None = None) -> Path:
    path = path or this_cpu_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(spec.to_json())
    os.replace(tmp, path)
    return path


# A run is quiet when this process's CPU time over all its threads is at least this share of
# threads x wall time: it had the cores to itself, no other job (or the hypervisor) held one.
QUIET_SHARE = 0.9
_ROW = 4096  # columns of the weight matrices the read kernels stream


@dataclass(frozen=True)
class Effort:
    """How long `calibrate()` looks at each figure: until `quiet_runs` quiet runs, at most
    `max_runs` runs, or `budget_s` seconds (the time it waits for a quiet machine), after
    one warm-up run."""

    quiet_runs: int
    max_runs: int
    budget_s: float


QUICK = Effort(quiet_runs=5, max_runs=25, budget_s=1.5)
FULL = Effort(quiet_runs=15, max_runs=60, budget_s=5.0)


@dataclass(frozen=True)
class Timing:
    best_quiet_s: float | None  # the fastest quiet run; None when no run was quiet
    best_s: float  # the fastest run, quiet or not
    quiet: int
    runs: int  # timed runs (0: given up after the warm-up, too slow to matter)

    @property
    def seconds(self) -> float:
        return self.best_quiet_s if self.best_quiet_s is not None else self.best_s

    @property
    def loaded(self) -> bool:
        """Timed, but no run had the CPUs to itself."""
        return self.runs > 0 and self.best_quiet_s is None


Runner = Callable[[Callable[[], object]], tuple[float, float]]


def timed_run(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process over all its threads) of one fn()."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def time_quiet(fn: Callable[[], object], threads: int, effort: Effort, run: Runner = timed_run,
               give_up_s: float = math.inf) -> Timing:
    """Time fn() with `threads` torch threads: a warm-up run, then runs until `effort` is
    spent, keeping the fastest and the fastest quiet one. A warm-up slower than
    `give_up_s` ends it there (a kernel that cannot be the fastest)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        wall, _ = run(fn)
        if wall > give_up_s:
            return Timing(None, wall, 0, 0)
        width = min(threads, _cores())
        best = best_quiet = math.inf
        quiet = runs = 0
        deadline = time.perf_counter() + effort.budget_s
        while quiet < effort.quiet_runs and runs < effort.max_runs and (runs == 0 or time.perf_counter() < deadline):
            wall, cpu = run(fn)
            runs += 1
            best = min(best, wall)
            if cpu >= QUIET_SHARE * width * wall:
                quiet += 1
                best_quiet = min(best_quiet, wall)
    finally:
        torch.set_num_threads(saved)
    return Timing(best_quiet if quiet else None, best, quiet, runs)


def _available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def buffer_bytes(llc: int) -> int:
    """The bandwidth buffer, the same for quick and full: 2.5x the last-level cache and at
    least 256 MiB, but at most a third of the available memory; whole rows of _ROW fp32."""
    want = max(int(2.5 * llc), 256 * 2**20)
    avail = _available_memory()
    if avail:
        want = min(want, avail // 3)
    return max(want // (4 * _ROW), 1) * 4 * _ROW


def _read_kernels(buf: torch.Tensor) -> list[tuple[str, Callable[[], object], int]]:
    """Kernels that each read all of `buf` (fp32, a multiple of _ROW elements) once per call,
    with the bytes each reads in all: the fastest reader torch has here (fp32 GEMV), a
    reduction, the linear kernels of bf16 and int8-weight decoding (the buffer viewed as their
    weights; fp32 ones are bf16 0 and 1, and small int8 codes: no NaN or subnormal), and
    spirit's own int8 kernel where it builds (model/qgemm.py: the fastest reader on the AMD
    EPYC measured, it also reads a float16 scale per 32 codes)."""
    from spirit.model import qgemm

    w32, x32 = buf.view(-1, _ROW), torch.ones(_ROW)
    wbf, xbf = buf.view(torch.bfloat16).view(-1, _ROW), torch.ones(1, _ROW, dtype=torch.bfloat16)
    w8 = buf.view(torch.int8).view(-1, _ROW)
    scales = torch.ones(w8.shape[0], dtype=torch.bfloat16)
    nbytes = buf.numel() * buf.element_size()
    kernels = [("gemv_fp32", lambda: w32 @ x32, nbytes), ("sum_fp32", lambda: buf.sum(), nbytes),
               ("linear_bf16", lambda: F.linear(xbf, wbf), nbytes),
               ("linear_int8", lambda: torch.ops.aten._weight_int8pack_mm(xbf, w8, scales), nbytes)]
    if qgemm.available():
        block_scales = torch.full((w8.shape[0], _ROW // 32), 1e-3, dtype=torch.float16)
        kernels.append(("qgemm_int8", lambda: qgemm.qgemm(xbf, w8, block_scales, None, None, 8),
                        nbytes + block_scales.numel() * 2))
    return kernels


def measure_bandwidth(nbytes: int, effort: Effort, run: Runner = timed_run,
                      threads: int | None = None) -> tuple[float, dict[str, float], bool]:
    """(best read bytes/s, GB/s per kernel, under load) over one buffer of `nbytes`.

    Every kernel runs with all `threads` (torch's count by default): decoding does, and a
    single core cannot draw the machine's bandwidth. The fp32 GEMV also runs on one thread,
    for the record and as the figure left when every multi-threaded run was disturbed.
    `under load`: no multi-threaded run of any kernel was quiet."""
    threads = threads or torch.get_num_threads()
    buf = torch.ones(nbytes // 4, dtype=torch.float32)  # written: every page is touched before timing
    figures: dict[str, float] = {}
    best_s, quiet_any, timed_any = math.inf, False, False
    for name, fn, read in _read_kernels(buf):
        try:
            timing = time_quiet(fn, threads, effort, run, give_up_s=3 * best_s * read / nbytes)
        except (RuntimeError, NotImplementedError, AttributeError):  # a kernel this torch lacks
            continue
        figures[f"{name}_GBps"] = read / timing.seconds / 1e9
        if timing.runs:
            timed_any = True
            quiet_any = quiet_any or not timing.loaded
            best_s = min(best_s, timing.seconds)
    if threads > 1:
        w, x = buf.view(-1, _ROW), torch.ones(_ROW)
        one = time_quiet(lambda: w @ x, 1, effort, run)
        figures["gemv_fp32_1thread_GBps"] = nbytes / one.seconds / 1e9
    del buf
    return max(figures.values()) * 1e9, figures, timed_any and not quiet_any


def _rate(fn: Callable[[], object], work: float, effort: Effort, run: Runner, thread_counts) -> tuple[float, bool]:
    """(best work/s over the thread counts, no quiet run at any of them)."""
    timings = [time_quiet(fn, t, effort, run) for t in thread_counts]
    return max(work / t.seconds for t in timings), all(t.loaded for t in timings)


def calibrate(quick: bool = False, dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16),
              run: Runner = timed_run, nbytes: int | None = None, effort: Effort | None = None) -> HardwareSpec:
    """Measure this CPU: the best read bandwidth of several kernels over a buffer of 2.5x the
    last-level cache (see the module docstring), in-cache read bandwidth, a vector op's
    FLOP/s, and a large matmul per dtype, each the best quiet run (see `time_quiet`), so that
    the spec stays an upper bound on speed. quick: a few seconds on an idle machine, the
    same buffer and kernels as full, fewer runs. `run`, `nbytes` and `effort` are for tests
    (a fake timer, a small buffer, fewer runs)."""
    llc = last_level_cache_bytes(8 * 2**20)
    effort = effort or (QUICK if quick else FULL)
    threads = torch.get_num_threads()
    both = sorted({1, threads})
    nbytes = nbytes or buffer_bytes(llc)

    bandwidth, figures, loaded = measure_bandwidth(nbytes, effort, run, threads)
    measured: dict[str, float] = {"buffer_MiB": nbytes / 2**20, **figures}
    effort = replace(effort, budget_s=effort.budget_s / 3)  # the rest waits less for a quiet machine

    small = torch.ones(max(min(llc, nbytes) // 4 // 4, _ROW), dtype=torch.float32)  # a quarter of the LLC
    inner = 10
    rate, _ = _rate(lambda: [small.sum() for _ in range(inner)], inner * small.numel() * 4, effort, run, both)
    measured["cache_read_GBps"] = rate / 1e9
    rate, _ = _rate(lambda: [small.mul_(1.0) for _ in range(inner)], inner * small.numel(), effort, run, both)
    measured["vector_fp32_GFLOPs"] = rate / 1e9
    del small

    matmul: dict[str, float] = {}
    for dtype in dtypes:
        # emulated dtypes (bf16 without AVX-512 BF16) are ~10x slower: a smaller matmul suffices
        size = 1024 if dtype in (torch.float32, torch.float64) else 384
        x = torch.randn(size, size).to(dtype)
        y = torch.randn(size, size).to(dtype)
        matmul[dtype_key(dtype)], _ = _rate(lambda: x @ y, 2 * size**3, effort, run, both)
        measured[f"matmul_{dtype_key(dtype)}_GFLOPs"] = matmul[dtype_key(dtype)] / 1e9

    if loaded:
        measured["under_load"] = 1.0
    cache_bw = max(measured["cache_read_GBps"] * 1e9, bandwidth)
    vector = measured["vector_fp32_GFLOPs"] * 1e9
    note = "; other processes held the CPUs throughout: figures low" if loaded else ""
    return HardwareSpec(
        name=THIS_CPU,
        description=(f"this machine's CPU ({threads} threads; bandwidth: best quiet run of {len(figures)} read kernels "
                     f"over {nbytes / 2**20:.0f} MiB){note}, calibrated {time.strftime('%Y-%m-%d %H:%M')}"),
        memory_bandwidth=bandwidth,
        matmul_flops=matmul,
        # a vector op on fp32 in cache; other dtypes are assumed no faster per element
        vector_flops={k: vector for k in ("float32", "bfloat16", "float16", "float64")},
        llc_bytes=llc,
        cache_bandwidth=cache_bw,
        source="spirit sol calibrate" + (" (quick)" if quick else ""),
        measured={k: round(v, 3) for k, v in measured.items()},
        calibration=CALIBRATION_VERSION,
    )
