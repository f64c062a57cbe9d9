"""Speed-of-light (SOL) analysis: lower bounds on the time of a graph or a decoding step.

    from spirit.sol import decode_step_seconds, load_hardware
    decode_step_seconds(config, torch.bfloat16, context=512, hardware="h200")

A graph is captured with fake tensors (spirit.sol.capture), costed op by op
(spirit.sol.costs) and bounded on a hardware spec (spirit.sol.bounds); decoding has a
closed form from the model's config (spirit.sol.decode).
"""

from __future__ import annotations

import json
from pathlib import Path

from spirit.sol.bounds import Bounds, bounds
from spirit.sol.capture import Captured, capture
from spirit.sol.costs import GraphCost, graph_cost
from spirit.sol.decode import (DecodeCost, Speculation, decode_cost, decode_step_seconds, speculative_speedup,
                               trace_decode_step)
from spirit.sol.hardware import HardwareNotFoundError, HardwareSpec, calibrate, load_hardware, save_hardware
from spirit.sol.measure import percent_of_sol, sol_score

__all__ = [
    "Bounds", "Captured", "DecodeCost", "GraphCost", "HardwareNotFoundError", "HardwareSpec", "Speculation",
    "analyze", "bounds", "calibrate", "capture", "decode_cost", "decode_step_seconds", "graph_cost",
    "load_config", "load_hardware", "percent_of_sol", "save_hardware", "sol_score", "speculative_speedup",
    "trace_decode_step",
]


def analyze(target, args: tuple, hardware: str | HardwareSpec = "this-cpu", kwargs: dict | None = None) -> tuple[GraphCost, Bounds]:
    """Capture a module or function on `args`, cost it, and bound it on `hardware`."""
    cost = graph_cost(capture(target, args, kwargs))
    return cost, bounds(cost, load_hardware(hardware, calibrate_if_missing=True))


def load_config(name_or_path: str):
    """A transformers config from a config.json, a Hugging Face folder, or a spirit model name
    (bundled names are fetched if needed; no weights are read)."""
    from transformers import AutoConfig

    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".json":
        data = json.loads(path.read_text())
        if "model_type" not in data:
            raise ValueError(f"{path} has no model_type; is it a Hugging Face config.json?")
        return AutoConfig.for_model(data.pop("model_type"), **data)
    if path.is_dir() and (path / "config.json").exists():
        return AutoConfig.from_pretrained(str(path))
    from spirit.model.loader import resolve

    _, folder = resolve(name_or_path)
    return AutoConfig.from_pretrained(str(folder))
