"""spirit's int4/int8 kernel against another version of itself, on the same packed weights,
interleaved in one process: the way to tell whether a kernel change pays.

    python benchmarks/qgemm_ab.py --against HEAD~1 --shapes 17920x1536,1536x8960 --rows 1,4,16,128
    python benchmarks/qgemm_ab.py --define SPIRIT_TILE_BYTES=16384 --define SPIRIT_TILE_BYTES=65536

Each variant is the kernel sources (`--against REV`: as committed at REV, read with git show;
`--define NAME=VALUE`: the working tree's with a preprocessor definition) built as an extension
of its own next to the working tree's (the current one, "now"). Weights are packed once
(model/quantize.py) and cycled through `--working-set-mb` of copies, so they are not
cache-resident unless the shape is small. Prints ms per product per variant and rows and the
ratio to "now", and checks that every variant gives the same output bits as "now" when
`--same-bits` (a loop-order change must not change a bit).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from spirit.model import qgemm, quantize

ROOT = Path(__file__).resolve().parents[1]


def build(name: str, sources: dict[str, str], defines: list[str], workdir: Path):
    """An extension from the given source texts (file name -> text), under its own name."""
    from torch.utils.cpp_extension import load

    directory = workdir / name
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for file_name, text in sources.items():
        path = directory / file_name
        path.write_text(text)
        paths.append(str(path))
    flags = qgemm._compile_flags() + [f"-D{d}" for d in defines]
    return load(name=f"qgemm_ab_{name}", sources=paths, extra_cflags=flags, extra_ldflags=["-fopenmp"],
                build_directory=str(directory), verbose=False)


def sources_at(rev: str | None) -> dict[str, str]:
    out = {}
    for path in qgemm.SOURCES:
        if rev is None:
            out[path.name] = path.read_text()
        else:
            relative = path.relative_to(ROOT)
            out[path.name] = subprocess.run(["git", "show", f"{rev}:{relative}"], cwd=ROOT, capture_output=True,
                                            text=True, check=True).stdout
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", action="append", default=[], help="a git revision whose kernel to compare")
    p.add_argument("--define", action="append", default=[], help="NAME=VALUE for a variant of the working tree's kernel")
    p.add_argument("--shapes", default="17920x1536,1536x8960", help="out x in, comma-separated")
    p.add_argument("--rows", default="1,4,16,128")
    p.add_argument("--format", default="int4", choices=("int4", "int8"))
    p.add_argument("--working-set-mb", type=int, default=128)
    p.add_argument("--seconds", type=float, default=0.4, help="per measurement")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds; the best of them is kept")
    p.add_argument("--same-bits", action="store_true", help="require every variant's output to equal now's")
    args = p.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="qgemm-ab-"))
    try:
        return compare(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def compare(args: argparse.Namespace, workdir: Path) -> int:
    variants = {"now": build("now", sources_at(None), [], workdir)}
    for rev in args.against:
        variants[rev] = build("rev_" + "".join(c if c.isalnum() else "_" for c in rev), sources_at(rev), [], workdir)
    for define in args.define:
        variants[define] = build("def_" + "".join(c if c.isalnum() else "_" for c in define), sources_at(None), [define], workdir)
    bits = 8 if args.format == "int8" else 4
    failed = False
    for shape in args.shapes.split(","):
        out_features, in_features = (int(v) for v in shape.split("x"))
        weight = torch.randn(out_features, in_features) * 0.02
        packed = (quantize.quantize_int4 if args.format == "int4" else quantize.quantize_int8)(weight)
        if packed.kernel != "spirit":
            raise SystemExit(f"spirit's kernel does not pack {shape} here ({qgemm.status().reason})")
        copies = max(1, args.working_set_mb * 2**20 // packed.codes.numel())
        weights = [packed.codes.clone() for _ in range(copies)]
        offsets = packed.offsets if packed.offsets is not None else torch.empty(0)
        none = torch.empty(0)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, in_features).bfloat16()
            reference = variants["now"].qgemm(x, packed.codes, packed.scales, offsets, none, bits)
            best = {name: float("inf") for name in variants}
            for repeat in range(args.repeats):
                for name, module in (variants.items() if repeat % 2 == 0 else reversed(variants.items())):
                    calls, started = 0, time.perf_counter()
                    while time.perf_counter() - started < args.seconds:
                        module.qgemm(x, weights[calls % copies], packed.scales, offsets, none, bits)
                        calls += 1
                    best[name] = min(best[name], (time.perf_counter() - started) / calls)
                    if args.same_bits and repeat == 0 and name != "now":
                        same = torch.equal(module.qgemm(x, packed.codes, packed.scales, offsets, none, bits), reference)
                        if not same:
                            print(f"DIFFERENT BITS: {name} at {shape}, {rows} rows", file=sys.stderr)
                            failed = True
            line = "  ".join(f"{name} {best[name] * 1e3:8.3f} ms ({best[name] / best['now']:.2f}x)" for name in variants)
            print(f"{shape:>11s} rows {rows:4d}: {line}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
