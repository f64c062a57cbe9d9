"""spirit's kernel with and without AMX tile products (kernels/qgemm.cpp, "Many rows on CPUs
with AMX") on one weight shape, for several row counts, interleaved in one process.

    python benchmarks/amx_speed.py --shape 17920x1536 --format int8 --rows 1,4,8,16,32
    python benchmarks/amx_speed.py --shape 1536x8960 --format int4 --rows 8,16,32,128

The weight is packed once (model/quantize.py) with its tile panels (model/qgemm.tile_panels)
and cycled through `--working-set-mb` of copies, so it is read from memory as a model's
weights are, not from the last-level cache (these Xeons report 260-480 MiB of L3: one
weight alone stays in it and measures up to twice as fast). Each row count calls the product
without panels (the VNNI path) and with them, best of `--repeats` passes over the copies,
and checks that both give the same bits as one-row products. Below the kernel's thresholds
(SPIRIT_AMX_MIN_ROWS_*) the call with panels takes the VNNI path too, so both columns are
the same path there. Needs a CPU with AMX (Sapphire Rapids or later) and an OS that grants it.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from spirit.model import qgemm, quantize


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="17920x1536", help="out x in")
    parser.add_argument("--format", choices=["int4", "int8"], default="int8")
    parser.add_argument("--rows", default="1,8,16,32")
    parser.add_argument("--working-set-mb", type=float, default=1200.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not qgemm.amx():
        print(f"no AMX tile products here: {qgemm.status().reason}", file=sys.stderr)
        return 1
    out_features, in_features = (int(v) for v in args.shape.split("x"))
    torch.manual_seed(0)
    pack = quantize.quantize_int4 if args.format == "int4" else quantize.quantize_int8
    packed = pack(torch.randn(out_features, in_features) * 0.02, torch.bfloat16)
    panels = packed.tile_panels()
    if panels is None:
        print(f"no panels for in_features {in_features} (fewer than 512 inputs)", file=sys.stderr)
        return 1
    per_copy = packed.nbytes + panels.numel()
    copies = max(2, int(args.working_set_mb * 1e6 // per_copy))
    weights = [(packed.copy(), panels.clone()) for _ in range(copies)]
    print(f"{args.format} {args.shape}: {copies} copies, {copies * per_copy / 1e6:.0f} MB with panels "
          f"({panels.numel() / packed.nbytes:.2f}x the packed bytes); {qgemm.status().reason}")
    print(f"{'rows':>5} {'VNNI ms':>9} {'tiles ms':>9} {'tiles/VNNI time':>16}  same bits")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, in_features).bfloat16()
        best = {"vnni": float("inf"), "tiles": float("inf")}
        for _ in range(args.repeats):
            for name in best:
                started = time.perf_counter()
                for weight, weight_panels in weights:
                    weight.matmul(x, weight_panels if name == "tiles" else None)
                best[name] = min(best[name], (time.perf_counter() - started) / copies)
        tiles = packed.matmul(x, panels)
        one_row = torch.cat([packed.matmul(x[i : i + 1]) for i in range(rows)])
        same = torch.equal(tiles, one_row) and torch.equal(packed.matmul(x), one_row)
        print(f"{rows:>5} {best['vnni'] * 1e3:>9.2f} {best['tiles'] * 1e3:>9.2f} {best['tiles'] / best['vnni']:>16.2f}  "
              f"{'yes' if same else 'NO'}")
        if not same:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
