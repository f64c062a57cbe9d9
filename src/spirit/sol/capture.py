"""Capture a module or function as an ATen graph with fake tensors (shapes, strides, dtypes).

First `torch.export.export(strict=False)`; where export refuses (a custom cache object, data-
dependent Python), `make_fx(pre_dispatch=True)` with fake tracing. Both stop above the
CompositeImplicit decompositions, so `linear`, `scaled_dot_product_attention`, `softmax`,
`layer_norm` and `rms_norm` stay single nodes. Parameters and buffers become placeholders
marked as weights; no real data is read, so a model built on the meta device works too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx, nn


@dataclass
class Captured:
    graph: fx.Graph
    weights: set[str] = field(default_factory=set)  # placeholder names that hold parameters or buffers
    method: str = ""  # "export" or "make_fx"
    fallback_reason: str = ""  # why export was not used, if it was not


def capture(target: nn.Module | Callable, args: tuple, kwargs: dict | None = None, use_export: bool = True) -> Captured:
    kwargs = kwargs or {}
    reason = ""
    if use_export and isinstance(target, nn.Module):
        try:
            return _export(target, args, kwargs)
        except Exception as exc:  # export raises many kinds; the fallback covers them all
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    captured = _make_fx(target, args, kwargs)
    captured.fallback_reason = reason
    return captured


def _export(module: nn.Module, args: tuple, kwargs: dict) -> Captured:
    from torch.export.graph_signature import InputKind

    ep = torch.export.export(module, args, kwargs, strict=False)
    weights = {
        spec.arg.name for spec in ep.graph_signature.input_specs
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
    }
    return Captured(ep.graph_module.graph, weights, "export")


def _make_fx(target: nn.Module | Callable, args: tuple, kwargs: dict) -> Captured:
    from torch.fx.experimental.proxy_tensor import make_fx

    if isinstance(target, nn.Module):
        state = {**dict(target.named_parameters()), **dict(target.named_buffers())}
        names = list(state)

        def run(weights: list[torch.Tensor], call_args: tuple, call_kwargs: dict):
            with nn.utils.stateless._reparametrize_module(target, dict(zip(names, weights))):
                return target(*call_args, **call_kwargs)

        gm = make_fx(run, tracing_mode="fake", pre_dispatch=True)(list(state.values()), args, kwargs)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        return Captured(gm.graph, {n.name for n in placeholders[: len(names)]}, "make_fx")
    gm = make_fx(lambda a, k: target(*a, **k), tracing_mode="fake", pre_dispatch=True)(args, kwargs)
    return Captured(gm.graph, set(), "make_fx")
