"""Two simulated machines for the spirit policy's cost side, with a task landscape on each.

The pass-cost tables are the shapes of what the hardware probe measured for
qwen2.5-coder-1.5b (ms of a full pass's linear layers, 1/2/4/8/16 rows): on an AVX-512 BF16
Xeon a bf16 pass costs about the same for 1..16 rows; held back to AVX2 kernels, 4 rows cost
~2.5x one row and 16 rows ~7x. A window's speed in the simulator comes from the same
decomposition the policy predicts with (cost_model.py): a task's acceptance over the
machine's round cost, with an overhead factor the probe does not see.
"""

from __future__ import annotations

from sim import Landscape

from spirit.machine import FormatCosts, PassCosts
from spirit.policies.cost_model import Acceptance, CostModel, speed
from spirit.skipset import DraftConfig

LAYERS = 28
VOCAB = 151936
ROWS = (1, 2, 4, 8, 16)


def _costs(bf16: tuple[float, ...], int4: tuple[float, ...], name: str) -> PassCosts:
    # per layer: attention holds ~1/9 of a layer's bytes; the head is ~1.9 MLPs
    def fmt(series: tuple[float, ...], activation: str = "bfloat16") -> FormatCosts:
        per_layer = tuple(ms / (LAYERS + 1.9) for ms in series)
        return FormatCosts(activation, tuple(x / 9 for x in per_layer), tuple(8 * x / 9 for x in per_layer))

    return PassCosts(ROWS, LAYERS, 1.9 * 9 / 8, {"bfloat16": fmt(bf16), "int4": fmt(int4)}, machine=name)


XEON = _costs((206, 186, 188, 183, 196), (83, 84, 101, 176, 364), "simulated AVX-512 BF16")
AVX2 = _costs((226, 354, 556, 886, 1639), (103, 109, 174, 339, 671), "simulated AVX2")

# The spirit policy's default drafting levers (lookup, int4 draft MLPs, reduced head, trees).
DRAFT = DraftConfig(ngram=True, draft_vocab=32768, branches=2, draft_bits=4, threshold=0.5)
OVERHEAD = 1.1  # what the machine really charges over the probe's linear-layer prediction


def landscape(machine: PassCosts, per_token: float = 0.8, drafted: float = 3.0) -> Landscape:
    """A task on `machine`: drafts that skip nothing accept `per_token` of `drafted` tokens
    per round, less as more sublayers are skipped."""
    model = CostModel(LAYERS, VOCAB, machine)

    def acceptance(config: DraftConfig) -> Acceptance:
        ratio = config.skip.ratio(LAYERS) if config.skip else 0.0
        rate = max(0.05, per_token - 1.5 * ratio) if config.skip is not None else per_token / 2
        share = 1.0 if config.skip is not None else 0.4
        return Acceptance(1 + rate * drafted, drafted, share, 0.0 if config.skip is not None else 1.0)

    def round_cost(config: DraftConfig) -> float:
        return OVERHEAD * model.predicted_round_cost(config, acceptance(config))

    return Landscape(
        speedup=lambda skip: 1.0,
        config_speedup=lambda config: speed(acceptance(config), round_cost(config)) if config.speculative else 1.0,
        round_cost=round_cost,
    )
