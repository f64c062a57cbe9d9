"""The policy interface: plain Python, no torch.

Data flows one way: the policy returns a `Plan` (a DraftConfig, a window length and its own
note of why), the engine decodes one window with it and reports a `WindowStats` that carries
the plan back, and the policy returns the next plan. Nothing else passes between them. Policies keep
state across requests (a stream of requests is what they adapt to) and can save it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar

from spirit.machine import PassCosts
from spirit.plan import Plan
from spirit.skipset import VANILLA, DraftConfig, SkipSet
from spirit.stats import WindowStats


@dataclass(frozen=True)
class ModelInfo:
    num_layers: int
    name: str = ""
    # this machine's pass costs for the model (machine.py), when probed: what a draft step and
    # a verification of n rows cost in plain steps, before any window measured them
    costs: PassCosts | None = field(default=None, compare=False)
    vocab: int = 0


@dataclass(frozen=True)
class RequestInfo:
    request_id: int
    prompt_tokens: tuple[int, ...]  # prompt token ids, for prompt-feature based task detection
    max_new_tokens: int
    tag: str | None = None  # optional caller label (e.g. a benchmark category); never required


class Policy(ABC):
    """Chooses the draft configuration for each window of decoding."""

    name: ClassVar[str] = ""
    # tokens per window unless a plan says otherwise
    window_tokens: ClassVar[int] = 32
    # the drafting knobs this method runs with unless the caller sets them: SWIFT's chain
    # defaults, no lookup, full draft head (the baselines are faithful reimplementations)
    default_draft: ClassVar[DraftConfig] = DraftConfig()

    def __init__(self, model: ModelInfo, base: DraftConfig = DraftConfig()) -> None:
        self.model = model
        self.base = base  # drafting knobs (max_draft, threshold) the policy leaves as given

    def config(self, skip: SkipSet | None, probe: SkipSet | None = None, **choices: Any) -> DraftConfig:
        """The base knobs with this window's skip set (and any other choice the policy makes)."""
        return replace(self.base, skip=skip, probe=probe, **choices)

    def window(self, config: DraftConfig, tokens: int | None = None, trial: tuple[str, Any] = ("", None)) -> Plan:
        """A plan for `config`, over `tokens` new tokens (default: the class's window)."""
        return Plan(config, tokens or self.window_tokens, trial)

    @abstractmethod
    def plan(self) -> Plan:
        """The plan for the next window."""

    def learn(self, stats: WindowStats) -> None:
        """Take in the figures of a finished window (default: nothing to learn)."""

    def start_request(self, request: RequestInfo) -> Plan:
        return self.plan()

    def on_window(self, stats: WindowStats) -> Plan:
        self.learn(stats)
        return self.plan()

    def end_request(self, stats: WindowStats) -> None:
        """The last (possibly partial) window of a request."""
        self.learn(stats)

    # whether several requests may decode at once (a batch, batch.py) under this one policy
    # object, their windows' feedback interleaved; False for a policy that keeps one
    # request's state between its windows (sp2ec's per-query search)
    interleaved: ClassVar[bool] = True

    # False for policies that must measure configurations offline before serving (`dv`);
    # the caller then runs `calibrate(measure)` with measure(skip) -> tokens/s, measuring on
    # the policy's own `calibration_prompts` in turn
    calibrated: bool = True
    calibration_prompts: ClassVar[tuple[str, ...]] = ()

    def calibrate(self, measure: Callable[[SkipSet | None], float]) -> None:
        """Offline calibration; nothing to do for online policies."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def describe(self) -> str:
        return self.name


class VanillaPolicy(Policy):
    """Plain decoding in the same engine: the honest baseline."""

    name = "vanilla"
    window_tokens = 64

    def plan(self) -> Plan:
        return self.window(VANILLA)  # whatever the base says: this is the reference


class StaticPolicy(Policy):
    """One fixed skip set for every window."""

    name = "static"
    window_tokens = 64

    def __init__(self, model: ModelInfo, base: DraftConfig = DraftConfig(), skip: SkipSet | None = None) -> None:
        super().__init__(model, base)
        if skip is None:
            raise ValueError("method 'static' needs a skip set, e.g. --skip 'attn:4,9;mlp:4,9,12'")
        self.skip = skip.validate(model.num_layers)

    def plan(self) -> Plan:
        return self.window(self.config(self.skip))


class LookupPolicy(Policy):
    """Prompt-lookup drafts alone (proposers/prompt_lookup.py): no draft model pass at all."""

    name = "lookup"
    window_tokens = 64

    def plan(self) -> Plan:
        return self.window(self.config(None, ngram=True))


PolicyFactory = Callable[..., Policy]


@dataclass
class PolicyRegistry:
    """Policies register by name; the CLI, the API, the benchmark and the server look them up."""

    factories: dict[str, PolicyFactory] = field(default_factory=dict)

    def register(self, cls: type[Policy]) -> type[Policy]:
        self.factories[cls.name] = cls
        return cls

    def names(self) -> list[str]:
        return sorted(self.factories)

    def create(self, name: str, model: ModelInfo, base: DraftConfig = DraftConfig(), **kwargs: Any) -> Policy:
        if name not in self.factories:
            raise ValueError(f"unknown method {name!r}; choose one of {', '.join(self.names() + ['hf'])}")
        return self.factories[name](model, base, **kwargs)


REGISTRY = PolicyRegistry()
REGISTRY.register(VanillaPolicy)
REGISTRY.register(StaticPolicy)
REGISTRY.register(LookupPolicy)
