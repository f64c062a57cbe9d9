"""spirit's own weight-only int4 / int8 CPU kernel (kernels/qgemm.cpp), built on first use.

Why: torch's int4 CPU op converts every weight to a float before multiplying; on two cores
that is compute-bound (about 17 GB/s of packed weights on an AMD EPYC, where the memory gives
27). This kernel multiplies int8-quantized activations (per block of 32, as llama.cpp does)
with the packed codes by integer dot products, streaming 8960x1536 int4 at about 25 GB/s
there, and it is row-invariant by construction, which exact speculation needs. Where AMX
runs, prompt chunks (which need not be exact) take `prefill_qgemm` instead: bfloat16 tile
products of the same packed weights, 2.5-6x faster at 16-128 rows on a 2-core Xeon.

The kernel is compiled once per source, torch version, CPU and instruction set with the
machine's C++ compiler (torch.utils.cpp_extension, about 30 s) and kept under
`~/.cache/spirit/kernels/`, one folder per checkout (`_build_directory`). Without a compiler,
or with `SPIRIT_KERNEL=torch`, torch's own ops run instead and `status()` says why. When torch
is held to AVX2 (`ATEN_CPU_CAPABILITY=avx2`, to stand in for an AVX2-only CPU) the kernel is
held to AVX2 too.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

KERNELS = Path(__file__).parent / "kernels"
# built as one extension: the packed products, the per-row layer pieces (model/fused.py), bindings
SOURCES = (KERNELS / "qgemm.cpp", KERNELS / "layer_ops.cpp", KERNELS / "bindings.cpp")
_NEEDED_FLAGS = ("avx2", "fma", "f16c")


@dataclass(frozen=True)
class KernelStatus:
    """Whether spirit's kernel runs here, which instruction set it uses, and why not if not."""

    available: bool
    isa: str  # "avx512-vnni" (512 bits wide), "avx512-vnni-256", "avx-vnni", "avx2"; "" when not available
    reason: str


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _held_to_avx2() -> bool:
    return os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in ("avx2", "default")


def _compile_flags() -> list[str]:
    isa = ["-mavx2", "-mfma", "-mf16c"] if _held_to_avx2() else ["-march=native"]
    return ["-O3", "-fopenmp", *isa]


def _build_directory(flags: list[str]) -> Path:
    from spirit.model.bundled import cache_root

    # -march=native code is this CPU's: the flags stand for it (the model name adds nothing).
    # The sources' folder is in the key: torch's build records the source paths, so two
    # checkouts of the same sources sharing a folder would rebuild it in turn, each replacing
    # the library the other loads.
    key = hashlib.sha256("|".join([*(source.read_text() for source in SOURCES), str(KERNELS.resolve()), torch.__version__,
                                   sys.version, platform.machine(), " ".join(sorted(_cpu_flags())),
                                   " ".join(flags)]).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"qgemm-{key}"


def _load_locked(directory: Path, build: Callable[[], ModuleType]) -> ModuleType:
    """`build()` (torch's cpp_extension.load into `directory`) under an flock of our own.

    torch guards a build with a lock file that a process killed mid-build (Ctrl-C during the
    first load) leaves behind, and every later load then waits on it forever, saying nothing.
    An flock is released when its process dies; builds of this folder all take it first, so
    while we hold it no live process is building, and a lock file left there is stale."""
    import fcntl

    with open(directory / "build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        return build()


@functools.cache
def _extension() -> tuple[ModuleType | None, str]:
    if os.environ.get("SPIRIT_KERNEL", "").lower() == "torch":
        return None, "SPIRIT_KERNEL=torch: torch's own int4/int8 ops"
    if platform.machine() not in ("x86_64", "AMD64"):
        return None, f"spirit's kernel is x86-64 only (this is {platform.machine()}): torch's own ops"
    missing = [flag for flag in _NEEDED_FLAGS if flag not in _cpu_flags()]
    if missing:
        return None, f"this CPU lacks {', '.join(missing)}: torch's own int4/int8 ops"
    flags = _compile_flags()
    directory = _build_directory(flags)
    try:
        from torch.utils.cpp_extension import load

        directory.mkdir(parents=True, exist_ok=True)
        module = _load_locked(directory, lambda: load(
            name=f"spirit_qgemm_{directory.name.split('-')[1]}", sources=[str(source) for source in SOURCES],
            extra_cflags=flags, extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False))
    except Exception as error:  # no compiler, no headers, a read-only cache: torch's ops still work
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return None, f"spirit's kernel could not be built ({first_line[:200]}): torch's own int4/int8 ops"
    tiles = ", AMX tile products for many rows" if module.amx() else ""
    return module, f"spirit's kernel ({module.isa()} integer dot products{tiles}, row-invariant)"


def status() -> KernelStatus:
    module, reason = _extension()
    return KernelStatus(module is not None, module.isa() if module is not None else "", reason)


def loaded_status() -> KernelStatus | None:
    """status() where the kernel was already loaded (or refused) in this process, else None:
    for reports, which must not start a build."""
    return status() if _extension.cache_info().currsize else None


def available() -> bool:
    return _extension()[0] is not None


def extension() -> ModuleType:
    """The built extension (all of spirit's CPU kernels); raises where it is not available."""
    module = _extension()[0]
    if module is None:
        raise RuntimeError(_extension()[1])
    return module


def qgemm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
          bias: torch.Tensor | None, bits: int, panels: torch.Tensor | None = None) -> torch.Tensor:
    """[rows, in] (float32 or bf16) x packed [out, in] -> [rows, out] in x's dtype; see
    kernels/qgemm.cpp for the formats. `panels` (tile_panels of the same weight): many-row
    products take AMX tile products where the CPU has them, with the same bits."""
    empty = _EMPTY
    return extension().qgemm(x, codes, scale, empty if offset is None else offset, empty if bias is None else bias, bits,
                             empty if panels is None else panels)


def amx() -> bool:
    """Whether many-row products can take AMX tile products here (kernels/qgemm.cpp);
    `SPIRIT_AMX=0` turns them off (to compare, or to save the panels' memory)."""
    return os.environ.get("SPIRIT_AMX", "1") != "0" and available() and extension().amx()


GROUP_INPUTS = 512  # inputs per interleaved group of 16 blocks of 32 (kernels/qgemm.cpp)
PANEL_ROWS = 16  # weight rows per tile panel


def tile_panels(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, bits: int) -> torch.Tensor | None:
    """A packed weight's interleaved groups again in AMX tile order (kernels/qgemm.cpp, "Many
    rows on CPUs with AMX"): uint8 [ceil(out / 16), panel bytes], one row per 16 weight rows n:
    per block of 32 inputs, int8 its tile (512 bytes, byte 64k + 4n + j input 4k + j of row n)
    and int4 its nibble pairs (256 bytes, byte 64c + 4n + j inputs 4c + j low and 16 + 4c + j
    high), then per block its 16 float16 scales (and offsets) by weight row. Rows past `out`
    are zero. The same codes, scales and offsets reordered: as many bytes again as the grouped
    part of the packed weight, kept beside it for many-row products. None where AMX does not
    run here or the weight has no whole group (in < 512)."""
    in_features = codes.shape[1] * (2 if bits == 4 else 1)
    groups = in_features // GROUP_INPUTS
    if groups == 0 or not amx():
        return None
    rows = codes.shape[0]
    panel_count = -(-rows // PANEL_ROWS)
    padded = panel_count * PANEL_ROWS
    blocks = groups * 16
    steps = 4 if bits == 4 else 8  # 64-byte steps per group: byte 64c + 4l + j is step c of block l

    def padded_rows(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(padded - rows, *t.shape[1:])]) if padded > rows else t

    grouped_codes = padded_rows(codes[:, : groups * 16 * steps * 4].contiguous().view(torch.uint8))
    # [panel, n, group, step, block l, j] -> [panel, group, block l, step, n, j]
    tiled = grouped_codes.view(panel_count, PANEL_ROWS, groups, steps, 16, 4).permute(0, 2, 4, 3, 1, 5)
    parts = [tiled.reshape(panel_count, -1)]
    for halves in (scale, offset) if bits == 4 else (scale,):
        by_row = padded_rows(halves.reshape(rows, -1)[:, :blocks].contiguous())  # [n, block]
        parts.append(by_row.view(panel_count, PANEL_ROWS, blocks).transpose(1, 2)
                     .reshape(panel_count, -1).view(torch.uint8))
    return torch.cat(parts, dim=1).contiguous()


def prefill_tiles() -> bool:
    """Whether prefill products take bfloat16 AMX tile products here (kernels/qgemm.cpp,
    "Prefill on CPUs with AMX"): where AMX runs (`amx()`, so `SPIRIT_AMX=0` turns them off too)."""
    return amx()


def dense_bf16() -> bool:
    """Whether torch's dense bf16 products run natively here (AVX-512 BF16, not held to AVX2)."""
    return "avx512_bf16" in _cpu_flags() and not _held_to_avx2()


def prefill_qgemm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                  bias: torch.Tensor | None, bits: int) -> torch.Tensor:
    """[rows, in] bf16 x packed [out, in] -> [rows, out] bf16 by bfloat16 tile products, for
    passes that need not be exact (prefill); only where `prefill_tiles()`."""
    return extension().prefill_qgemm(x, codes, scale, _EMPTY if offset is None else offset,
                                     _EMPTY if bias is None else bias, bits)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, out: torch.Tensor,
               bits: int) -> torch.Tensor:
    """The packed weight unpacked into `out` (bf16 [out, in], kept by the caller); returns it."""
    extension().dequantize(codes, scale, _EMPTY if offset is None else offset, out, bits)
    return out


_EMPTY = torch.empty(0)
