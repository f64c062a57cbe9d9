"""Measured time against the bound: % of SOL and the SOL score of SOL-ExecBench.

SOL score (SOL-ExecBench): for a candidate time T_k, a baseline time T_b and the bound T_sol,
    S = 1 / (1 + (T_k - T_sol) / (T_b - T_sol))
so S = 1 at the bound, 0.5 when the candidate equals the baseline, toward 0 when slower.
% of SOL = T_sol / T_measured (100% = at the speed of light).
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn


def sol_score(candidate_s: float, baseline_s: float, sol_s: float) -> float:
    if baseline_s <= sol_s:
        raise ValueError(f"the baseline ({baseline_s:.3g}s) must be slower than the bound ({sol_s:.3g}s)")
    return 1.0 / (1.0 + (candidate_s - sol_s) / (baseline_s - sol_s))


def percent_of_sol(measured_s: float, sol_s: float) -> float:
    return 100.0 * sol_s / measured_s


def time_call(fn, repeats: int = 10, warmup: int = 2, budget_s: float = 10.0) -> float:
    """Median wall time of fn() over up to `repeats` runs, stopping early past `budget_s`."""
    with torch.inference_mode():
        for _ in range(warmup):
            fn()
        times = []
        deadline = time.perf_counter() + budget_s
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            if time.perf_counter() > deadline:
                break
    return statistics.median(times)


@dataclass
class KernelProblem:
    """A KernelBench-style file: `Model`, `get_inputs()`, `get_init_inputs()`."""

    path: Path
    model_cls: type
    get_inputs: object
    get_init_inputs: object

    def build(self) -> tuple[nn.Module, tuple]:
        init = self.get_init_inputs() if self.get_init_inputs else []
        model = self.model_cls(*init).eval()
        return model, tuple(self.get_inputs())


def load_problem(spec: str) -> KernelProblem:
    """`path/to/file.py` or `path/to/file.py:ClassName` (default class `Model`)."""
    path_text, cls_name = spec, "Model"
    head, _, tail = spec.rpartition(":")
    if head.endswith(".py"):
        path_text, cls_name = head, tail
    path = Path(path_text)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    mod_name = f"_spirit_sol_{path.stem}_{abs(hash(str(path.resolve())))}"
    loader_spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[mod_name] = module
    loader_spec.loader.exec_module(module)
    cls = getattr(module, cls_name, None)
    if cls is None:
        raise ValueError(f"{path} defines no class {cls_name}")
    if not hasattr(module, "get_inputs"):
        raise ValueError(f"{path} defines no get_inputs()")
    return KernelProblem(path, cls, module.get_inputs, getattr(module, "get_init_inputs", None))


def measure_decode_step(causal_lm: nn.Module, context: int, skip=None, steps: int = 8, budget_s: float = 20.0) -> float:
    """Median seconds of one decode step (1 token after `context` cached positions) through
    spirit's adapter, with the sublayers of `skip` left out. The cache holds random keys:
    the time of a step does not depend on their values."""
    from spirit.model.adapter import SkippableModel
    from spirit.skipset import SkipSet

    sm = SkippableModel(causal_lm)
    cache = sm.new_cache(context + 1)
    for t in (*cache.keys, *cache.values):
        t.normal_()
    ids = torch.zeros(1, 1, dtype=torch.long, device=sm.device)
    skip = skip or SkipSet()
    return time_call(lambda: sm.forward(ids, context, cache, skip), repeats=steps, warmup=1, budget_s=budget_s)
