"""spirit's int4 / int8 kernel (model/qgemm.py) against torch's weight-only ops, on one weight
shape, for several row counts, weights cycled through more memory than the last-level cache
holds (as decoding reads them), both kernels timed round-robin in one process.

    python benchmarks/kernel_speed.py --shape 8960x1536 --rows 1,2,4,8,16,64

Prints ms per product and GB/s of packed bytes for each kernel and format, and checks that
spirit's kernel is row-invariant at every row count (row i of an n-row product equals the
1-row product, bit for bit). Set ATEN_CPU_CAPABILITY=avx2 to hold both to AVX2.
"""

from __future__ import annotations

import argparse
import time

import torch

from spirit.model import qgemm, quantize


def packed_both(weight: torch.Tensor, fmt: str) -> dict[str, quantize.PackedWeight]:
    """The weight packed for spirit's kernel and for torch's op."""
    pack = quantize.quantize_int4 if fmt == "int4" else quantize.quantize_int8
    ours = pack(weight)
    real = quantize._spirit_kernel
    quantize._spirit_kernel = lambda device: False  # torch's layout, for comparison only
    try:
        theirs = pack(weight)
    finally:
        quantize._spirit_kernel = real
    return {"spirit": ours, "torch": theirs}


def time_ms(copies: list[quantize.PackedWeight], x: torch.Tensor, seconds: float) -> float:
    for w in copies[:2]:
        w.matmul(x)
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or done < len(copies):
        copies[done % len(copies)].matmul(x)
        done += 1
    return 1e3 * (time.perf_counter() - start) / done


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8960x1536", help="out x in (default: qwen2.5-1.5b's MLP up/gate)")
    p.add_argument("--rows", default="1,2,4,8,16,64")
    p.add_argument("--formats", default="int4,int8")
    p.add_argument("--working-set-mb", type=int, default=128, help="bytes of weights cycled through")
    p.add_argument("--seconds", type=float, default=0.5, help="per measurement")
    args = p.parse_args()

    status = qgemm.status()
    print(f"spirit's kernel: {status.reason}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    if not status.available:
        return 1
    out_features, in_features = (int(v) for v in args.shape.split("x"))
    weight = torch.randn(out_features, in_features) * 0.02
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{'format':6s} {'rows':>4s} {'spirit ms':>10s} {'torch ms':>9s} {'spirit GB/s':>12s} {'torch GB/s':>11s}  row-invariant")
    for fmt in args.formats.split(","):
        kernels = packed_both(weight, fmt)
        copies = {name: [w.copy() for _ in range(max(2, args.working_set_mb * 2**20 // w.nbytes))]
                  for name, w in kernels.items()}
        for n in rows:
            x = torch.randn(n, in_features, dtype=torch.bfloat16)
            one_by_one = torch.cat([kernels["spirit"].matmul(x[i : i + 1]) for i in range(n)])
            invariant = torch.equal(one_by_one, kernels["spirit"].matmul(x))
            ms = {name: [] for name in kernels}
            for _ in range(3):  # round-robin, best of three
                for name in kernels:
                    ms[name].append(time_ms(copies[name], x, args.seconds / 3))
            best = {name: min(v) for name, v in ms.items()}
            rate = {name: kernels[name].nbytes / best[name] / 1e6 for name in kernels}
            print(f"{fmt:6s} {n:4d} {best['spirit']:10.3f} {best['torch']:9.3f} {rate['spirit']:12.1f} "
                  f"{rate['torch']:11.1f}  {'yes' if invariant else 'NO'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
