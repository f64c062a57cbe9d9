"""Does this machine's kernels let verification reproduce plain decoding bit for bit?

Lossless speculation needs each verification row to get exactly the logits that a plain
one-token step would give that token. Attention is made row-wise by construction
(model/attention.py). What remains is a property of the CPU's kernels, which we measure
instead of assume, on the model's own weights, at load:

- linear layers: row i of an n-row product must equal a fixed per-row function. On AVX2 CPUs
  bf16 `F.linear` is row-invariant from 1 row up; on AVX-512 BF16 Xeons (oneDNN) a 1-row
  product takes another path than a 2..32-row one for some shapes, but every pass of >= 2 rows
  agrees. So we find the smallest pass (`min_rows`, 1 or 2) whose rows every larger pass
  reproduces, and the largest pass (`max_rows`) for which that holds;
- row-wise attention: a row that reads its keys in place (a chain) and one that gathers them
  (a tree) must agree;
- end to end: a chain verified in one pass equals the same tokens stepped one by one.

The engine then pads short passes to `min_rows` and caps verification at `max_rows`; where
the check fails it says why, and nothing claims exactness.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from spirit.model.attention import RowKeys, rowwise_attention
from spirit.model.bundled import cache_root
from spirit.model.lowbit import PackedLinear
from spirit.model.probe import machine_key
from spirit.skipset import SkipSet

if TYPE_CHECKING:
    from spirit.model.adapter import SkippableModel

PASS_ROWS = (2, 3, 4, 5, 8, 12, 16, 24, 32, 48, 64)  # pass sizes checked; verification never exceeds 64 rows
MIN_USEFUL_ROWS = 4  # below this, capping verification would cost more speed than exactness is worth here
COMPARED_OUTPUTS = 1 << 17  # outputs compared per pass size for a small layer
CHAIN_CHECK = 4  # tokens of the end-to-end chain check


@dataclass(frozen=True)
class Exactness:
    exact: bool  # verification logits equal plain one-token logits bit for bit
    min_rows: int  # exact passes run at least this many rows (padding rows see nothing)
    max_rows: int  # and at most this many (the engine caps token trees to it)
    reason: str  # one line for --stats and the bench report
    check_time_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)




def check_exactness(model: "SkippableModel") -> Exactness:
    if model.device.type == "meta":  # a model traced for its shapes (spirit sol) has no weights
        return Exactness(False, 1, PASS_ROWS[-1], "not checked: the weights are on the meta device")
    t0 = time.perf_counter()
    verdict = _check(model)
    return Exactness(**{**asdict(verdict), "check_time_s": round(time.perf_counter() - t0, 3)})


def _check(model: "SkippableModel") -> Exactness:
    linears = _distinct_linears(model)
    # what was checked: the dtype, and each packed format with its activation dtype
    dtype = " and ".join(dict.fromkeys(_described(linear) for linear in linears))
    failure = ""
    for min_rows in (1, 2):
        max_rows, why = _linear_max_rows(linears, min_rows)
        if max_rows < MIN_USEFUL_ROWS:
            failure = why
            continue
        if not _chain_agrees(model, min_rows, min(CHAIN_CHECK, max_rows)):
            failure = f"a chain verified in one pass differs from {min_rows}-row plain steps"
            continue
        break
    else:
        return Exactness(False, 1, PASS_ROWS[-1], f"not exact: {failure} ({dtype})")
    if not _attention_gather_agrees(model):
        return Exactness(False, 1, PASS_ROWS[-1], f"not exact: row-wise attention over gathered keys differs ({dtype})")
    how = "from 1 row" if min_rows == 1 else "from 2 rows (1-row steps are padded to 2)"
    capped = f", token trees capped at {max_rows} nodes" if max_rows < PASS_ROWS[-1] else ""
    return Exactness(
        True, min_rows, max_rows,
        f"exact: {dtype} linear layers row-invariant {how} up to {max_rows} rows{capped}; row-wise attention"
        + (f" (spirit's fused layers; {model.fused.prefill_reason})" if getattr(model, "fused", None) is not None else ""),
    )


def _distinct_linears(model: "SkippableModel") -> list[nn.Module]:
    """One linear layer per distinct (out, in, bias, format) shape: a decoder layer's and the
    lm_head, whether nn.Linear or packed to low bits (model/lowbit.py)."""
    found: dict[tuple, nn.Module] = {}
    for module in [*model.layers[0].modules(), model.lm_head]:
        if isinstance(module, nn.Linear) or isinstance(module, PackedLinear):
            found.setdefault((*_out_in(module), module.bias is not None, _format(module)), module)
    return list(found.values())


def _described(linear: nn.Module) -> str:
    if isinstance(linear, PackedLinear):
        return f"{linear.format} ({str(linear.activation).removeprefix('torch.')} activations, {linear.kernel} kernel)"
    return str(linear.weight.dtype).removeprefix("torch.")


def _out_in(linear: nn.Module) -> tuple[int, int]:
    return (linear.out_features, linear.in_features)


def _format(linear: nn.Module) -> str:
    """What decides the kernel path besides the shape: the dtype, or the packed format and
    the dtype of the activations it runs in."""
    if isinstance(linear, PackedLinear):
        return f"{linear.format}-{str(linear.activation).removeprefix('torch.')}-{linear.kernel}"
    return str(linear.weight.dtype)


def _linear_max_rows(linears: list[nn.Linear], min_rows: int) -> tuple[int, str]:
    """The largest checked pass size for which every layer is row-invariant (0 if none), and
    what failed first."""
    best, failure = PASS_ROWS[-1], ""
    for linear in linears:
        rows, why = _layer_max_rows(linear, min_rows)
        best, failure = min(best, rows), failure or why
    return best, failure


# Which kernel path a product takes depends on the CPU, torch, its shape, dtype and thread
# count, not on the weights' values: measured once per process for each (every tiny test model
# shares them) and kept on disk per machine, so a later load reads it instead of measuring.
_LAYER_MEASURED: dict[str, tuple[int, str]] = {}
def _measured_path() -> Path:
    digest = hashlib.sha256(f"{machine_key()}|{PASS_ROWS}|{COMPARED_OUTPUTS}".encode()).hexdigest()[:16]
    return cache_root() / "exactness" / f"{digest}.json"


def _load_measured() -> None:
    if not _LAYER_MEASURED:
        try:
            _LAYER_MEASURED.update({k: tuple(v) for k, v in json.loads(_measured_path().read_text()).items()})
        except (OSError, ValueError):
            pass  # nothing kept yet, or a damaged file: measure again


def _save_measured() -> None:
    path = _measured_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(_LAYER_MEASURED))
        tmp.replace(path)  # atomic: concurrent loads never read half a file
    except OSError:
        pass  # a read-only cache only costs measuring again


@torch.inference_mode()
def _layer_max_rows(linear: nn.Linear, min_rows: int) -> tuple[int, str]:
    """The largest checked pass size whose rows all equal the `min_rows`-row product of the
    same row (0 if even the smallest fails), and why it stops there.

    Kernels that take another path only round differently in the float32 accumulator, which
    shows in the bf16 result only near a rounding boundary: for a 64x64 weight in about 4 of
    100,000 outputs, for qwen2.5-1.5b's 1536x8960 down projection in 2 of 10,000. So each
    pass size compares about COMPARED_OUTPUTS outputs.
    """
    out_features, in_features = _out_in(linear)
    dtype, device = _io_dtype_device(linear)
    key = f"{out_features}x{in_features}|{linear.bias is not None}|{_format(linear)}|{device.type}|{torch.get_num_threads()}|{min_rows}"
    _load_measured()
    if key in _LAYER_MEASURED:
        return _LAYER_MEASURED[key]
    generator = torch.Generator().manual_seed(0)
    # every row of the passes over `rows` inputs, or three rows a pass where one row alone
    # scores a third of the outputs we want to compare (an lm_head)
    sampled = 3 * out_features >= COMPARED_OUTPUTS
    rows = PASS_ROWS[-1] if sampled else max(PASS_ROWS[-1], COMPARED_OUTPUTS // out_features)
    x = (0.5 * torch.randn(rows + 1, in_features, generator=generator)).to(device, dtype)
    filler = x[-1:]  # the other rows of a padded reference pass: any values will do
    checked = sorted({r for n in PASS_ROWS for r in (0, n // 2, n - 1)}) if sampled else range(rows)
    references = {row: linear(torch.cat([x[row : row + 1], filler.expand(min_rows - 1, -1)]))[0] for row in checked}
    result = (PASS_ROWS[-1], "")
    for n in PASS_ROWS:
        bad = _first_differing_row(linear, x, n, n if sampled else rows, references)
        if bad is not None:
            smaller = [m for m in PASS_ROWS if m < n and m >= min_rows]
            why = f"linear [{out_features}x{in_features}]: row {bad} of a {n}-row pass differs from a {min_rows}-row pass"
            result = (smaller[-1] if smaller else 0, why)
            break
    _LAYER_MEASURED[key] = result
    _save_measured()
    return result


def _io_dtype_device(linear: nn.Module) -> tuple[torch.dtype, torch.device]:
    """The dtype and device of the activations a linear layer takes in the model."""
    if isinstance(linear, PackedLinear):
        return linear.activation, linear.device
    return linear.weight.dtype, linear.weight.device


def _first_differing_row(linear: nn.Linear, x: torch.Tensor, n: int, rows: int, references: dict[int, torch.Tensor]) -> int | None:
    """Runs x[:rows] in n-row passes; the first row (within its pass) that differs from its reference."""
    for block in range(0, rows - n + 1, n):
        product = linear(x[block : block + n])
        for row in range(n):
            expected = references.get(block + row)
            if expected is not None and not torch.equal(product[row], expected):
                return row
    return None


@torch.inference_mode()
def _attention_gather_agrees(model: "SkippableModel") -> bool:
    """Row-wise attention over keys read in place (a chain) vs gathered (a tree's ancestors)."""
    attn = model.layers[0].self_attn
    shape = model.shape
    heads = model.config.num_attention_heads
    generator = torch.Generator().manual_seed(1)
    capacity, length = 96, 71

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(model.device, model.dtype)

    keys, values = rand(1, shape.num_kv_heads, capacity, shape.head_dim), rand(1, shape.num_kv_heads, capacity, shape.head_dim)
    query = rand(1, heads, 1, shape.head_dim)
    in_place = RowKeys((slice(0, length),))
    gathered = RowKeys((torch.arange(length, device=model.device),))
    a, _ = rowwise_attention(attn, query, keys, values, None, scaling=getattr(attn, "scaling", None), rows=in_place)
    b, _ = rowwise_attention(attn, query, keys, values, None, scaling=getattr(attn, "scaling", None), rows=gathered)
    return torch.equal(a, b)


@torch.inference_mode()
def _chain_agrees(model: "SkippableModel", min_rows: int, chain: int) -> bool:
    """End to end on the model: a chain of `chain` tokens verified in one exact pass gives the
    logits of the same tokens run one exact step at a time."""
    generator = torch.Generator().manual_seed(2)
    prompt_len = 5
    ids = torch.randint(0, model.shape.vocab_size, (1, prompt_len + chain), generator=generator).to(model.device)
    capacity = prompt_len + chain + PASS_ROWS[-1]
    none = SkipSet()
    together = model.new_cache(capacity)
    model.forward(ids[:, :prompt_len], 0, together, none)
    verified = model.forward(ids[:, prompt_len:], prompt_len, together, none, exact=True, min_rows=min_rows)
    stepped = model.new_cache(capacity)
    model.forward(ids[:, :prompt_len], 0, stepped, none)
    for j in range(chain):
        start = prompt_len + j
        step = model.forward(ids[:, start : start + 1], start, stepped, none, exact=True, min_rows=min_rows)[0]
        if not torch.equal(step, verified[j]):
            return False
    return True

