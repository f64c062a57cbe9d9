"""One generation request as a value that validates itself once.

Every front end builds one: the Python API (`Spirit.generate` / `stream`), the CLI, the HTTP
server and the benchmark all pass their options to `Request.build`, so a bad option gets the
same clear error from each of them, and nothing downstream checks it again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from spirit.draft_model.learners import SHARED_LEARNER
from spirit.policies import REGISTRY
from spirit.sampling import SamplingParams
from spirit.skipset import DraftConfig, SkipSet

BASELINE_METHODS = ("hf",)  # methods that are not a policy: transformers' own generate
_DRAFT_KNOBS = {f.name for f in fields(DraftConfig)} - {"skip", "probe"}


@dataclass(frozen=True)
class Request:
    prompt: str | Sequence[dict] | Sequence[int]  # text, chat messages, or token ids
    max_new_tokens: int = 128
    method: str = "vanilla"
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    chat: bool = False
    tag: str | None = None  # a label for the policy's records (e.g. a benchmark category)
    learner: str = SHARED_LEARNER  # whose learned draft state it drafts with and teaches (Engine.decode)
    skip: SkipSet | None = None  # the skip set of method "static"
    draft: DraftConfig = field(default_factory=DraftConfig)  # the drafting knobs the policy works with
    profile_file: Path | None = None  # where the policy's learned state is loaded from and saved

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        known = REGISTRY.names() + list(BASELINE_METHODS)
        if self.method not in known:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(sorted(known))}")
        if self.method == "static" and self.skip is None:
            raise ValueError("method 'static' needs a skip set, e.g. --skip 'attn:4,9;mlp:4,9,12'")

    @classmethod
    def build(
        cls,
        prompt,
        *,
        max_new_tokens: int = 128,
        method: str = "vanilla",
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        sampling_mode: str = "auto",
        stop: Sequence[str] = (),
        chat: bool = False,
        skip: SkipSet | str | None = None,
        draft: DraftConfig | None = None,
        profile_file: str | Path | None = None,
        tag: str | None = None,
        learner: str = SHARED_LEARNER,
        **knobs,
    ) -> "Request":
        """From the options every front end takes. `draft` or its fields as keywords
        (max_draft, threshold, ngram, draft_vocab, branches, ...; see DraftConfig) set the
        drafting knobs, on top of the method's defaults. `sampling_mode`: gumbel, rejection
        or auto (see SamplingParams.mode)."""
        unknown = sorted(set(knobs) - _DRAFT_KNOBS)
        if unknown:
            raise TypeError(f"unknown generation option(s): {', '.join(unknown)}")
        if isinstance(skip, str):
            skip = SkipSet.parse(skip)
        draft = replace(draft or default_draft(method), **knobs)
        sampling = SamplingParams(temperature, top_p, top_k, seed, sampling_mode)
        return cls(prompt, max_new_tokens, method, sampling, tuple(stop), chat, tag, learner, skip, draft,
                   Path(profile_file) if profile_file else None)


def default_draft(method: str) -> DraftConfig:
    """The drafting knobs a method runs with unless told otherwise (its policy's
    `default_draft`; "hf" and unknown names get DraftConfig(), unknown ones fail later)."""
    factory = REGISTRY.factories.get(method)
    return getattr(factory, "default_draft", DraftConfig())
