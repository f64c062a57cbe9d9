"""The Python API: `spirit.load(...)` returns a `Spirit`, which generates text.

    import spirit
    lm = spirit.load("smollm2-135m")
    out = lm.generate("Write a haiku about rain", max_new_tokens=64, method="spirit")
    print(out.text, out.stats.tokens_per_s)
    for piece in lm.stream("Tell me a story", chat=True):
        print(piece, end="", flush=True)

Policies are created once per method and kept, so that successive requests to the same
`Spirit` form the stream that adaptive methods learn from.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from spirit.engine import DecodeSettings, Decoding, Engine
from spirit.machine import PassCosts
from spirit.model.adapter import SkippableModel
from spirit.model.exactness import Exactness
from spirit.model.loader import LoadedModel, weights_digest
from spirit.model.loader import load as load_model
from spirit.model.probe import LayerShapes, probe
from spirit.policies import REGISTRY, ModelInfo, Policy
from spirit.request import Request
from spirit.skipset import DraftConfig, SkipSet
from spirit.stats import GenerationStats


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    finish_reason: str  # "stop" (EOS or a stop string), "length", or "cancelled"
    method: str = "vanilla"

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "method": self.method,
            "stats": self.stats.to_dict(),
        }


class TextStream:
    """Iterator of text pieces; `.result` holds the GenerationResult once it is exhausted.

    Alone, iterating runs the request on the engine. In a batch (server/scheduler.py), the
    batch runs `start()`'s decoding and hands each round's tokens to `feed`, then `close`."""

    def __init__(self, lm: "Spirit", request: Request, prompt_ids: list[int], policy: Policy) -> None:
        self._lm = lm
        self._request = request
        self._prompt_ids = prompt_ids
        self._policy = policy
        self._cancelled = False
        self._stop_hit = False
        self._ids: list[int] = []
        self._emitted = ""
        self.result: GenerationResult | None = None

    def cancel(self) -> None:
        """Ask the engine to stop after its current round (e.g. the client went away).
        Safe to call from another thread; the stream then ends with finish_reason "cancelled"."""
        self._cancelled = True

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def stopping(self) -> bool:
        """A stop string was produced or the stream was cancelled: decode no further."""
        return self._stop_hit or self._cancelled

    def _settings(self) -> DecodeSettings:
        return DecodeSettings(self._request.max_new_tokens, self._request.sampling, self._lm.eos_token_ids)

    def start(self) -> Decoding:
        """The request's decoding state, for a batch to run (engine.Decoding)."""
        return self._lm.engine.start(self._prompt_ids, self._settings(), self._policy, self._request.tag,
                                     learner=self._request.learner)

    def feed(self, ids: list[int]) -> str:
        """Take newly committed tokens; return the text they add ("" while a stop string or a
        multi-byte character may still be forming)."""
        self._ids.extend(ids)
        text = self._lm.tokenizer.decode(self._ids, skip_special_tokens=True)
        cut = _find_stop(text, self._request.stop)
        if cut is not None:
            text, self._stop_hit = text[:cut], True
        elif text.endswith("\ufffd"):
            return ""  # maybe half a multi-byte character: wait for the rest
        return self._advance(text)

    def _advance(self, text: str) -> str:
        piece = text[len(self._emitted):] if len(text) > len(self._emitted) and text.startswith(self._emitted) else ""
        self._emitted = text
        return piece

    def close(self, stats: GenerationStats) -> str:
        """End the stream with the engine's figures: sets `.result`; returns the last text
        (pieces that ended in a truly invalid byte sequence)."""
        tail = ""
        if not self._stop_hit:
            tail = self._advance(self._lm.tokenizer.decode(self._ids, skip_special_tokens=True))
        ids = self._ids
        if self._stop_hit or (ids and ids[-1] in self._lm.eos_token_ids):
            finish = "stop"
        elif self._cancelled and len(ids) < self._request.max_new_tokens:
            finish = "cancelled"
        else:
            finish = "length"
        self.result = GenerationResult(self._emitted, ids, stats, finish, self._request.method)
        return tail

    def __iter__(self) -> Iterator[str]:
        decoding = self._lm.engine.decode(
            self._prompt_ids, self._settings(), self._policy, self._request.tag,
            stop_requested=lambda: self.stopping, learner=self._request.learner,
        )
        while True:
            try:
                ids = next(decoding)
            except StopIteration as end:
                stats: GenerationStats = end.value
                break
            piece = self.feed(ids)
            if piece:
                yield piece
        tail = self.close(stats)
        if tail:
            yield tail


def _quantized_cache(loaded: LoadedModel) -> Path | None:
    """Where this model's quantized draft MLPs are kept, keyed by its weights and dtype."""
    from spirit.model.bundled import cache_root

    digest = weights_digest(loaded.folder, str(loaded.dtype))
    return None if digest is None else cache_root() / "quantized" / f"{loaded.folder.name}-{digest}"


def _machine_costs(model: SkippableModel, weights: str) -> PassCosts | None:
    """This machine's pass costs for the model's shapes (model/probe.py), relative to a plain
    step in the model's dtype as exact decoding runs it; None off the CPU or for a dtype the
    probe does not measure (the policy then learns costs from windows alone)."""
    if model.device.type != "cpu":
        return None
    try:
        costs = probe(LayerShapes.from_config(model.config))
        plain_rows = model.exactness.min_rows if model.exactness.exact else 1
        target = weights if weights in ("int8", "int4") else str(model.dtype).removeprefix("torch.")
        return costs.with_target(target, plain_rows)
    except (AttributeError, ValueError):  # a config without the usual fields, or fp16
        return None


def _find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else None


class Spirit:
    def __init__(self, loaded: LoadedModel, max_context: int | None = None) -> None:
        self.name = loaded.name
        self.folder = loaded.folder
        self.hf_model = loaded.hf_model
        self.tokenizer = loaded.tokenizer
        self.dtype = loaded.dtype
        self.dtype_reason = loaded.dtype_reason
        self.weights = loaded.weights  # the linear layers' precision: the model that defines the output
        self.packing = loaded.packing
        self.weights_reason = loaded.weights_reason
        self.model = SkippableModel(loaded.hf_model)
        self.costs = _machine_costs(self.model, loaded.weights)
        self.engine = Engine(self.model, max_context, quantized_cache=_quantized_cache(loaded), costs=self.costs)
        self.eos_token_ids = _eos_ids(loaded)
        self._policies: dict[tuple, Policy] = {}

    @property
    def num_layers(self) -> int:
        return self.model.shape.num_layers

    @property
    def info(self) -> ModelInfo:
        """What a policy is told about the model, this machine's pass costs included."""
        return ModelInfo(self.num_layers, self.name, costs=self.costs, vocab=self.model.shape.vocab_size)

    @property
    def exactness(self) -> Exactness:
        """Whether speculation reproduces plain decoding bit for bit on this machine, and why
        (measured at load: model/exactness.py)."""
        return self.model.exactness

    # -- prompts ---------------------------------------------------------------------------

    def encode(self, prompt: str | Sequence[dict] | Sequence[int], chat: bool = False) -> list[int]:
        if not isinstance(prompt, str) and prompt and isinstance(prompt[0], int):
            return list(prompt)
        if chat or not isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError(f"model {self.name} has no chat template; drop --chat")
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt)

    # -- policies --------------------------------------------------------------------------

    def policy(
        self,
        method: str,
        skip: SkipSet | str | None = None,
        draft: DraftConfig = DraftConfig(),
        profile_file: str | Path | None = None,
        **options,
    ) -> Policy:
        """The (kept) policy for a method; adaptive policies carry state across calls."""
        if isinstance(skip, str):
            skip = SkipSet.parse(skip)
        key = (method, skip, draft, str(profile_file) if profile_file else None, tuple(sorted(options.items())))
        if key not in self._policies:
            extra = dict(options)
            if skip is not None:
                extra["skip"] = skip.validate(self.num_layers)
            policy = REGISTRY.create(method, self.info, draft, **extra)
            if profile_file and Path(profile_file).exists():
                from spirit.policies.profiles import load_profile

                load_profile(policy, Path(profile_file))
            if not policy.calibrated:
                self._calibrate(policy)
            self._policies[key] = policy
        return self._policies[key]

    def _calibrate(self, policy: Policy, tokens: int = 32) -> None:
        """Offline calibration (the `dv` baseline): measured tokens/s of a configuration on
        the calibration prompts in turn, a short run each, after one warm-up."""
        from spirit.policies.base import StaticPolicy, VanillaPolicy

        info = self.info
        prompts = [self.encode(p, chat=bool(getattr(self.tokenizer, "chat_template", None))) for p in policy.calibration_prompts]
        self.generate(prompts[0], max_new_tokens=8, policy=VanillaPolicy(info))
        turns = itertools.cycle(prompts)

        def measure(skip: SkipSet | None) -> float:
            runner = VanillaPolicy(info) if skip is None else StaticPolicy(info, policy.base, skip=skip)
            return self.generate(next(turns), max_new_tokens=tokens, policy=runner).stats.decode_tokens_per_s

        policy.calibrate(measure)

    # -- generation ------------------------------------------------------------------------

    def stream(self, prompt, *, policy: Policy | None = None, **kwargs) -> TextStream:
        request, policy = self._request(prompt, policy, **kwargs)
        return TextStream(self, request, self.encode(request.prompt, request.chat), policy)

    def generate(self, prompt, *, policy: Policy | None = None, **kwargs) -> GenerationResult:
        if kwargs.get("method") == "hf":
            return self._generate_hf(prompt, **kwargs)
        stream = self.stream(prompt, policy=policy, **kwargs)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def _request(self, prompt, policy: Policy | None, **options) -> tuple[Request, Policy]:
        """The request the options describe (Request.build validates them), and the policy
        that decodes it: the one given, or the method's kept one."""
        request = Request.build(prompt, **options)
        if request.method == "hf":
            raise ValueError("method 'hf' (transformers' generate) has no streaming; use generate()")
        if policy is None:
            policy = self.policy(request.method, request.skip, request.draft, request.profile_file)
        return request, policy

    def _generate_hf(
        self,
        prompt,
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        chat: bool = False,
        stop: Sequence[str] = (),
        **_ignored,
    ) -> GenerationResult:
        """transformers' own `generate`, timed the same way, for comparison."""
        Request.build(prompt, max_new_tokens=max_new_tokens, method="hf", temperature=temperature, top_p=top_p,
                      top_k=top_k, seed=seed, chat=chat, stop=stop)  # the same checks as every request
        ids = self.encode(prompt, chat)
        self.engine.check_fits(len(ids), max_new_tokens)
        if seed is not None:
            torch.manual_seed(seed)
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k) if temperature > 0 else dict(do_sample=False)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.hf_model.generate(
                torch.tensor([ids], device=self.hf_model.device),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=self.hf_model.device),
                max_new_tokens=max_new_tokens, eos_token_id=sorted(self.eos_token_ids) or None,
                pad_token_id=self.tokenizer.pad_token_id or next(iter(self.eos_token_ids), 0),
                stop_strings=list(stop) or None, tokenizer=self.tokenizer if stop else None, **sampling,
            )
        wall = time.perf_counter() - t0
        new = out[0, len(ids):].tolist()
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        cut = _find_stop(text, tuple(stop))
        finish = "stop" if (cut is not None or (new and new[-1] in self.eos_token_ids)) else "length"
        if cut is not None:
            text = text[:cut]
        stats = GenerationStats(prompt_tokens=len(ids), new_tokens=len(new), wall_time_s=wall)
        return GenerationResult(text, new, stats, finish, "hf")


def _eos_ids(loaded: LoadedModel) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(loaded.hf_model, "generation_config", None), loaded.hf_model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(int(loaded.tokenizer.eos_token_id))
    return frozenset(ids)


def load(name_or_path: str, dtype: torch.dtype | str | None = None, max_context: int | None = None,
         device: torch.device | str | None = None, weights: str = "auto") -> Spirit:
    """Load a bundled model name, a local folder or .gguf file, or a cached hub id, on
    `device` ("auto": CUDA where torch sees a GPU, else the CPU; CUDA is untested here), with
    its linear layers in `weights` precision ("auto"/"bf16": the dtype's; "int8", "int4":
    packed, and the output is that low-bit model's: model/lowbit.py)."""
    return Spirit(load_model(name_or_path, dtype, device, weights), max_context)


def from_pretrained_model(hf_model, tokenizer, name: str = "model", max_context: int | None = None) -> Spirit:
    """Wrap an already loaded transformers model and tokenizer (tests, notebooks)."""
    first = next(hf_model.parameters())
    return Spirit(LoadedModel(name, Path("."), hf_model.eval(), tokenizer, first.dtype, device=first.device), max_context)
