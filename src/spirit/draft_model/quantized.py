"""Quantized drafts: the model's own MLP weights at 8 or 4 bits, for the draft pass only.

On a CPU a decoding step is bound by reading weights (docs/benchmarks/: `aten::mm` is ~90%
of a step), and the MLPs hold ~88% of a Llama/Qwen layer's bytes. Weight-only int8 halves
those bytes and int4 quarters them; torch has CPU kernels that read them directly
(`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`). Measured here on an 8960x1536
weight, one row, weights not in cache: bf16 1.76 ms, int8 0.91 ms, int4 0.46 ms.

The draft pass runs each layer's norms and attention as the model does, and its MLP as
`down(act(gate(x)) * up(x))` over quantized copies of the same three weights, with the
model's own activation. Quantization only changes what the draft proposes: verification
always runs the full model's weights, so output is unchanged. Attention stays at full
precision: it is ~12% of the bytes, and running the model's own attention module keeps every
architecture's details (biases, q/k norms, rotary variants) exact without reimplementing them.

Formats are model/quantize.py's (int4 where the shape allows, else int8). The kernels take
activations in the dtype of their scales, `activation`: bfloat16 unless the hardware probe
found another faster, whatever the model's own dtype (a float32 model's draft casts its
activations to bfloat16 and back around each quantized product).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from spirit.model.quantize import PackedWeight, int4_fits, quantize_int4, quantize_int8

BITS = (4, 8)
# The int kernels' activation dtype, unless the hardware probe says another is faster here:
# with float32 activations torch's int4 op ran 10-27x slower and its int8 op 2.4-16x slower
# than with bfloat16 ones, on both CPU classes measured (model/probe.py records both).
DEFAULT_ACTIVATION = torch.bfloat16
# quantized MLPs that took at least this long to build are kept on disk (small models
# rebuild in milliseconds, and a file per throwaway model folder would pile up)
KEEP_AFTER_S = 1.0


class QuantizationError(ValueError):
    """A model whose MLPs the quantized draft cannot drive."""


@dataclass(frozen=True)
class QuantizedLinear:
    """A weight-only quantized copy of an `nn.Linear`: [..., in] -> [..., out]."""

    weight: PackedWeight
    bias: torch.Tensor | None

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, activation: torch.dtype = DEFAULT_ACTIVATION) -> "QuantizedLinear":
        weight = linear.weight.detach()
        out_features, in_features = weight.shape
        bias = None if linear.bias is None else linear.bias.detach()
        if bits not in BITS:
            raise QuantizationError(f"draft bits must be one of {BITS}, got {bits}")
        if bits == 4 and int4_fits(out_features, in_features, device=weight.device.type):
            return cls(quantize_int4(weight, activation), bias)
        if weight.device.type != "cpu":
            raise QuantizationError(f"a {out_features}x{in_features} weight has no {bits}-bit draft kernel on "
                                    f"{weight.device.type} (int8 runs on CPU only); use --draft-bits 0")
        return cls(quantize_int8(weight, activation), bias)

    @property
    def bits(self) -> int:
        return self.weight.bits

    @property
    def activation(self) -> torch.dtype:
        return self.weight.activation

    @property
    def out_features(self) -> int:
        return self.weight.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.weight.matmul(x.reshape(-1, x.shape[-1])).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def tensors(self) -> dict:
        return {"weight": self.weight.tensors(), "bias": self.bias}

    @classmethod
    def from_tensors(cls, state: dict) -> "QuantizedLinear":
        weight = PackedWeight.from_tensors(state["weight"])
        if not weight.usable_here():
            raise QuantizationError("kept quantized MLPs were packed for a kernel that does not run here")
        return cls(weight, state["bias"])



@dataclass(frozen=True)
class QuantizedMLP:
    """A gated MLP (Llama, Qwen2/3, Mistral, Gemma): down(act(gate(x)) * up(x))."""

    gate: QuantizedLinear
    up: QuantizedLinear
    down: QuantizedLinear
    act: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def from_mlp(cls, mlp: nn.Module, bits: int, activation: torch.dtype = DEFAULT_ACTIVATION) -> "QuantizedMLP":
        parts = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
        act = getattr(mlp, "act_fn", None)
        if not all(isinstance(p, nn.Linear) for p in parts) or act is None:
            raise QuantizationError(
                f"{type(mlp).__name__} is not a gated MLP with gate_proj/up_proj/down_proj/act_fn: "
                "quantized drafts need that layout (Llama, Qwen2/3, Mistral, Gemma)"
            )
        gate, up, down = (QuantizedLinear.from_linear(p, bits, activation) for p in parts)
        return cls(gate, up, down, act)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x)) * self.up(x))

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes


@dataclass(frozen=True)
class QuantizedMLPs:
    """Every layer's MLP at `bits`, indexed by layer: what a quantized draft pass runs."""

    bits: int
    mlps: tuple[QuantizedMLP, ...]

    @classmethod
    def build(cls, layers: list[nn.Module], bits: int, activation: torch.dtype = DEFAULT_ACTIVATION) -> "QuantizedMLPs":
        if bits not in BITS:
            raise QuantizationError(f"draft bits must be one of {BITS}, got {bits}")
        with torch.inference_mode():
            return cls(bits, tuple(QuantizedMLP.from_mlp(layer.mlp, bits, activation) for layer in layers))

    @classmethod
    def cached(cls, layers: list[nn.Module], bits: int, path: Path | None,
               activation: torch.dtype = DEFAULT_ACTIVATION) -> "QuantizedMLPs":
        """`build`, kept in `path` so that it runs once per model and machine: quantizing a
        1.5b model's MLPs to int4 took 17.5 s on 2 cores, loading the 690 MiB back 3.5 s.
        A file that does not match these layers is rebuilt and replaced."""
        if path is not None and path.exists():
            try:
                return cls.load(path, layers, bits, activation)
            except Exception:  # an old or damaged file: rebuilding is always correct
                pass
        started = time.perf_counter()
        built = cls.build(layers, bits, activation)
        if path is not None and time.perf_counter() - started >= KEEP_AFTER_S:
            built.save(path)
        return built

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # a reader never sees half a file
        layers = [{name: getattr(m, name).tensors() for name in ("gate", "up", "down")} for m in self.mlps]
        torch.save({"bits": self.bits, "layers": layers}, tmp)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path, layers: list[nn.Module], bits: int,
             activation: torch.dtype = DEFAULT_ACTIVATION) -> "QuantizedMLPs":
        device = layers[0].mlp.down_proj.weight.device if layers else torch.device("cpu")
        state = torch.load(path, weights_only=True, map_location=device)
        if state["bits"] != bits or len(state["layers"]) != len(layers):
            raise QuantizationError(f"{path} holds other quantized MLPs")
        mlps = []
        for layer, parts in zip(layers, state["layers"]):
            gate, up, down = (QuantizedLinear.from_tensors(parts[name]) for name in ("gate", "up", "down"))
            if down.out_features != layer.mlp.down_proj.out_features:
                raise QuantizationError(f"{path} was quantized from another model")
            if down.activation != activation:
                raise QuantizationError(f"{path} was built for {down.activation} activations")
            mlps.append(QuantizedMLP(gate, up, down, layer.mlp.act_fn))
        return cls(bits, tuple(mlps))

    def __getitem__(self, layer: int) -> QuantizedMLP:
        return self.mlps[layer]

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.mlps)
