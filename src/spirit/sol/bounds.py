"""Three lower bounds on a graph's run time on one hardware spec (the roofline model:
Williams, Waterman, Patterson, "Roofline", CACM 2009).

- unfused: every op is its own kernel:  sum_i max(compute_i, bytes_i / BW)
- fused: one perfect kernel:  max(sum_i compute_i, io_bytes / BW), io_bytes = graph inputs
  and weights read once (only what is read of them) plus outputs written once
- cache-aware: unfused, but an intermediate whose whole live range fits in the last-level
  cache (with everything else live then) moves at cache bandwidth.

compute_i = matrix FLOPs / matmul peak(dtype) + vector FLOPs / vector peak(dtype).
fused <= cache-aware <= unfused holds because io bytes are a subset of the DRAM bytes the
cache-aware bound charges, and cache bandwidth >= memory bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from spirit.sol.costs import GraphCost, OpCost
from spirit.sol.hardware import HardwareSpec


@dataclass(frozen=True)
class Bounds:
    hardware: str
    unfused: float  # seconds
    cache_aware: float
    fused: float
    compute: float  # sum of compute time over ops
    memory: float  # io bytes / bandwidth
    matrix_flops: float
    vector_flops: float
    io_bytes: float
    op_bytes: float  # sum of bytes over ops (what the unfused bound moves)

    @property
    def sol(self) -> float:
        """The speed of light: the tightest lower bound, the fused one."""
        return self.fused

    @property
    def limiter(self) -> str:
        return "compute" if self.compute >= self.memory else "memory"


def compute_seconds(op: OpCost, hw: HardwareSpec) -> float:
    if op.dtype is None:
        return op.vector_flops / hw.vector_peak("float32") if op.vector_flops else 0.0
    return op.matrix_flops / hw.matmul_peak(op.dtype) + op.vector_flops / hw.vector_peak(op.dtype)


def _resident(cost: GraphCost, llc_bytes: float) -> set[str]:
    """Intermediates whose live range (first write .. last read) fits in the cache together
    with every other intermediate live at the same time."""
    io = cost.inputs | cost.weights | cost.outputs
    start: dict[str, int] = {}
    end: dict[str, int] = {}
    for i, op in enumerate(cost.ops):
        for r in op.writes:
            if r not in io:
                start.setdefault(r, i)
                end[r] = max(end.get(r, i), i)
        for r in op.reads:
            if r in start:
                end[r] = i
    live = [0.0] * (len(cost.ops) + 1)
    for r, s in start.items():
        for i in range(s, end[r] + 1):
            live[i] += cost.root_bytes.get(r, 0.0)
    return {r for r, s in start.items() if max(live[s : end[r] + 1]) <= llc_bytes}


def bounds(cost: GraphCost, hw: HardwareSpec) -> Bounds:
    resident = _resident(cost, hw.llc_bytes)
    unfused = cache_aware = compute = 0.0
    for op in cost.ops:
        c = compute_seconds(op, hw)
        compute += c
        unfused += max(c, op.bytes / hw.memory_bandwidth)
        in_cache = sum(b for r, b in (*op.reads.items(), *op.writes.items()) if r in resident)
        cache_aware += max(c, (op.bytes - in_cache) / hw.memory_bandwidth + in_cache / hw.cache_bandwidth)
    io = cost.io_bytes()
    memory = io / hw.memory_bandwidth
    return Bounds(hw.name, unfused, cache_aware, max(compute, memory), compute, memory,
                  cost.matrix_flops, cost.vector_flops, io, cost.bytes)
