"""The hardware probe: what a pass over 1..16 rows costs here, per weight format.

Measured once per machine (CPU model and flags, torch version, threads, the kernel-steering
environment), per set of weight shapes, and kept under `~/.cache/spirit/probe/`; a later load
reads it. What it measures, on the model's own layer shapes with random weights:

- each format's linear layers of one decoder layer (attention's q/k/v/o, the MLP's gate/up/
  down) at 1, 2, 4, 8 and 16 rows: float32 and bfloat16 `F.linear`, and the weight-only
  int8 / int4 kernels that quantized drafts run (draft_model/quantized.py);
- the int kernels with both bfloat16 and float32 activations at one row, keeping the faster
  (measured: float32 activations were 10-27x slower for int4 on both CPU classes here);
- over enough copies of the layer that they do not fit the last-level cache, as a model's
  weights do not: decoding reads every weight once per pass, from memory.

The lm_head is not timed: it is a linear layer like the MLP's, so its cost is the MLP's
scaled by bytes. Non-linear work (norms, attention over the KV cache) is not in the table;
the spirit policy corrects its predictions with what windows measure.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from spirit.machine import FLOAT_FORMATS, LOWBIT_FORMATS, FormatCosts, PassCosts, last_level_cache_bytes
from spirit.model.bundled import cache_root
from spirit.model.quantize import PackedWeight, int4_fits, quantize_int4, quantize_int8

ROWS = (1, 2, 4, 8, 16)
FORMATS = FLOAT_FORMATS + LOWBIT_FORMATS
KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "SPIRIT_KERNEL")
# what holds torch's kernels, and spirit's kernel build (model/qgemm.py), back to AVX2 on a newer
# CPU: how an AVX2-only machine is emulated (set before torch loads)
AVX2_HELD_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
MIN_WORKING_SET = 64 * 2**20  # bytes of weights cycled through per timed pass, at least ...
MAX_WORKING_SET = 1536 * 2**20  # ... and at most (a VM may report a huge shared L3)
MIN_TIME_S = 0.05  # each pass size is timed for at least this long ...
MIN_PASSES = 2  # ... and at least this many passes (the minimum is kept)
PROBE_VERSION = 2  # bump when what is measured changes, so kept results are not reused


def machine_key() -> str:
    """This CPU (model name and flags), torch and the environment that steers its kernels."""
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.exists() else platform.processor()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
    env = [f"{name}={os.environ.get(name, '')}" for name in KERNEL_ENV]
    from spirit.model import qgemm

    lowbit_kernel = f"lowbit-kernel={qgemm.status().isa or 'torch'}"
    return "|".join([*lines, torch.__version__, str(torch.get_num_threads()), *env, lowbit_kernel])


def machine_label() -> str:
    """A short human-readable name for this machine's kernel setting."""
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")),
                 platform.processor() or "unknown CPU")
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    isa = "AVX-512 BF16" if "avx512_bf16" in flags else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    steered = [f"{n}={os.environ[n]}" for n in KERNEL_ENV if os.environ.get(n)]
    return f"{model} ({isa}), torch {torch.__version__}, {torch.get_num_threads()} threads" + (
        f", {' '.join(steered)}" if steered else "")


@dataclass(frozen=True)
class LayerShapes:
    """The linear layers a decoder layer and the head hold (Llama, Qwen2/3, Mistral, Gemma)."""

    hidden: int
    intermediate: int
    q_out: int
    kv_out: int
    vocab: int
    num_layers: int

    @classmethod
    def from_config(cls, config) -> "LayerShapes":
        config = getattr(config, "text_config", None) or config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(config.hidden_size, config.intermediate_size, heads * head_dim, kv_heads * head_dim,
                   config.vocab_size, config.num_hidden_layers)

    def linears(self) -> dict[str, tuple[tuple[int, int], ...]]:
        """(out, in) of each linear, grouped as the cost table reports them."""
        h, i = self.hidden, self.intermediate
        return {"attention": ((self.q_out, h), (self.kv_out, h), (self.kv_out, h), (h, self.q_out)),
                "mlp": ((i, h), (i, h), (h, i))}

    def key(self) -> str:
        return f"{self.hidden}x{self.intermediate}x{self.q_out}x{self.kv_out}"


_KEPT: dict[Path, PassCosts] = {}  # this process's probes, by their file


def probe(shapes: LayerShapes, keep: bool = True) -> PassCosts:
    """The cost table for these shapes on this machine: read from the cache if measured
    before (milliseconds), else measured (seconds: 10.6 s for qwen2.5-1.5b's shapes on a
    2-core Xeon) and kept. keep=False measures afresh and replaces what was kept."""
    path = _path(shapes)
    if keep:
        if path in _KEPT:
            return _for_model(_KEPT[path], shapes)
        try:
            _KEPT[path] = PassCosts.from_dict(json.loads(path.read_text()))
            return _for_model(_KEPT[path], shapes)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # nothing kept yet, or a damaged file: measure again
    costs = measure(shapes)
    _KEPT[path] = costs
    _save(path, costs)
    return costs


def _path(shapes: LayerShapes) -> Path:
    digest = hashlib.sha256(f"{machine_key()}|{shapes.key()}|{ROWS}|{PROBE_VERSION}".encode()).hexdigest()[:16]
    return cache_root() / "probe" / f"{shapes.key()}-{digest}.json"


def _save(path: Path, costs: PassCosts) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(costs.to_dict(), indent=1))
        tmp.replace(path)  # atomic: a concurrent load never reads half a file
    except OSError:
        pass  # a read-only cache only costs measuring again


def _for_model(costs: PassCosts, shapes: LayerShapes) -> PassCosts:
    """Per-layer costs are the shapes'; the layer count and the head are the model's."""
    mlp_bytes = 3 * shapes.hidden * shapes.intermediate
    return replace(costs, num_layers=shapes.num_layers, head_to_mlp=shapes.vocab * shapes.hidden / mlp_bytes)


@torch.inference_mode()
def measure(shapes: LayerShapes) -> PassCosts:
    started = time.perf_counter()
    weights = {part: [torch.randn(out, inp) / inp**0.5 for out, inp in dims] for part, dims in shapes.linears().items()}
    formats: dict[str, FormatCosts] = {}
    packed: dict = {}  # each weight quantized once per format, whatever the activation dtype
    for fmt in FORMATS:
        activations = ("bfloat16", "float32") if fmt in LOWBIT_FORMATS else (fmt,)
        rejected: dict[str, float] = {}
        if len(activations) > 1:  # one row with each activation dtype; keep the faster
            # a 10x gap needs no cache-cold timing: one copy of the MLP, one row
            one_row = {act: _time_part(weights["mlp"], fmt, act, (1,), packed, copies=1)[0] for act in activations}
            best = min(one_row, key=one_row.get)
            rejected = {act: round(ms, 4) for act, ms in one_row.items() if act != best}
            activations = (best,)
        act = activations[0]
        formats[fmt] = FormatCosts(
            act,
            tuple(round(ms, 4) for ms in _time_part(weights["attention"], fmt, act, ROWS, packed)),
            tuple(round(ms, 4) for ms in _time_part(weights["mlp"], fmt, act, ROWS, packed)),
            rejected,
        )
    costs = PassCosts(ROWS, shapes.num_layers, 1.0, formats, machine_label(), round(time.perf_counter() - started, 3))
    return _for_model(costs, shapes)


def _time_part(weights: list[torch.Tensor], fmt: str, activation: str, rows: tuple[int, ...],
               packed: dict, copies: int | None = None) -> list[float]:
    """Milliseconds of running these linears (one layer's part) over each pass size, with the
    weights cycled through copies larger than the cache, as decoding reads them."""
    layer = [_kernel(w, fmt, activation, packed) for w in weights]
    if copies is None:
        layer_bytes = sum(nbytes for _, nbytes in layer)
        working_set = min(MAX_WORKING_SET, max(MIN_WORKING_SET, 3 * last_level_cache_bytes() // 2))
        copies = max(1, min(64, working_set // max(1, layer_bytes)))
    stack = [[run.copy() for run, _ in layer] for _ in range(copies)]
    dtype = getattr(torch, activation)
    inputs = {w.shape[1] for w in weights}
    results = []
    for n in rows:
        xs = {k: torch.randn(n, k).to(dtype) for k in inputs}

        def one_pass() -> None:
            for layer_copy in stack:
                for run in layer_copy:
                    run(xs)

        for run in stack[0]:  # warm-up: first-call kernel selection
            run(xs)
        times: list[float] = []
        spent = 0.0
        while len(times) < MIN_PASSES or spent < MIN_TIME_S:
            t0 = time.perf_counter()
            one_pass()
            times.append(time.perf_counter() - t0)
            spent += times[-1]
        results.append(1e3 * min(times) / copies)
    return results


@dataclass(frozen=True)
class _Linear:
    """One weight in one format, callable on {in_features: activations}: a float weight, or a
    packed one (`packed`) run by the kernel low-bit targets and drafts use."""

    fmt: str
    weight: torch.Tensor | None
    packed: PackedWeight | None
    in_features: int

    def __call__(self, xs: dict[int, torch.Tensor]) -> torch.Tensor:
        x = xs[self.in_features]
        if self.packed is not None:
            return self.packed.matmul(x)
        return F.linear(x, self.weight)

    def copy(self) -> "_Linear":
        """The same weight at another address, so that passes read memory, not cache."""
        if self.packed is not None:
            return _Linear(self.fmt, None, self.packed.copy(), self.in_features)
        return _Linear(self.fmt, self.weight.clone(), None, self.in_features)

    @property
    def nbytes(self) -> int:
        if self.packed is not None:
            return self.packed.nbytes
        return self.weight.numel() * self.weight.element_size()


def _kernel(weight: torch.Tensor, fmt: str, activation: str, packed: dict) -> tuple[_Linear, int]:
    dtype = getattr(torch, activation)
    out_features, in_features = weight.shape
    if fmt in LOWBIT_FORMATS:
        if fmt == "int4" and not int4_fits(out_features, in_features):
            fmt = "int8"  # as quantized drafts fall back
        key = (fmt, activation, id(weight))
        if key not in packed:
            packed[key] = quantize_int4(weight, dtype) if fmt == "int4" else quantize_int8(weight, dtype)
        linear = _Linear(fmt, None, packed[key], in_features)
    else:
        linear = _Linear(fmt, weight.to(dtype).contiguous(), None, in_features)
    return linear, linear.nbytes
