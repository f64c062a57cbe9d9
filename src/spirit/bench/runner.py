"""Run methods on questions, interleaved, and gather the figures.

The runner takes a loaded `Spirit` and questions; it never parses arguments or loads models
(that is `spirit.bench.cli`). Each method is a `MethodRunner`, looked up by name, so tests can
add a fake (for instance one that breaks losslessness on purpose).

Order: after a warm-up of every method, question by question, every method in turn, the
order rotated from question to question (question k starts with method k mod M: A B C,
B C A, C A B, ...), so slow drift of the machine (thermals, other tenants) hits all methods
alike and no method always runs first, right after another method's pass, or last.
Multi-turn questions run turn by turn within one method's turn, each method continuing its
own conversation with the chat template, as Spec-Bench does.

No method learns from another's output: adaptive policies are kept per method inside the
`Spirit`, and each method has its own learned draft state in the engine (its learner, named
after it), so both carry from one question to the next of that method only: a category run
and a stream run are both one stream per method. Warm-ups use throwaway policies and a
throwaway learner, so the measured stream starts fresh.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from spirit.request import Request, default_draft
from spirit.bench.metrics import BASELINE, QuestionRun, TurnResult, compare_lossless, summarize
from spirit.bench.questions import Block, Question
from spirit.skipset import DraftConfig, SkipSet, skipset_from_sublayers

WARMUP_TOKENS = 16  # enough to run the prefill and a few draft rounds of every method once
WARMUP_LEARNER = "warm-up"  # the engine's learned draft state while warming up, dropped after


class MethodRunner(Protocol):
    """Answers one turn; `warmup=True` must leave the method's kept state untouched."""

    def __call__(self, lm, prompt: list[dict] | str, max_new_tokens: int, tag: str | None, *, warmup: bool = False): ...


@dataclass(frozen=True)
class SpiritMethod:
    """A method of `Spirit.generate`: a registered policy name, or "hf", with its own learned
    draft state (`learner`, the method's name unless given)."""

    name: str
    skip: SkipSet | None = None  # only for policies that take one ("static")
    draft: DraftConfig | None = None  # drafting knobs; None: the policy's default_draft
    learner: str | None = None

    @property
    def learner_key(self) -> str:
        return self.learner or self.name

    def _kwargs(self) -> dict:
        given = {"skip": self.skip, "draft": self.draft}
        return {k: v for k, v in given.items() if v is not None}

    def __call__(self, lm, prompt, max_new_tokens, tag, *, warmup=False):
        chat = not isinstance(prompt, str)
        kwargs = dict(method=self.name, max_new_tokens=max_new_tokens, chat=chat, tag=tag, temperature=0.0)
        if warmup and self.name != "hf":
            # a throwaway policy and learner: the kept ones must start the measured stream fresh
            from spirit.policies import REGISTRY

            extra = {"skip": self.skip.validate(lm.num_layers)} if self.skip is not None else {}
            draft = self.draft or default_draft(self.name)
            lm.engine.quantized_mlps(draft.draft_bits)  # built or loaded once, like the weights
            policy = REGISTRY.create(self.name, lm.info, draft, **extra)
            try:
                return lm.generate(prompt, policy=policy, learner=WARMUP_LEARNER, **kwargs, **self._kwargs())
            finally:
                lm.engine.learners.forget(WARMUP_LEARNER)
        return lm.generate(prompt, learner=self.learner_key, **kwargs, **self._kwargs())

    def learned_from(self) -> str:
        """What this method's kept state learns from, for the report."""
        from spirit.policies import REGISTRY, Policy

        if self.name == "hf":
            return "nothing: transformers' generate keeps no state between requests"
        draft = self.draft or default_draft(self.name)
        table = "its draft-head token table" if draft.draft_vocab else "a draft-head token table it does not use"
        factory = REGISTRY.factories.get(self.name)
        if factory is not None and not getattr(factory, "calibrated", True):
            policy = "its policy: an offline calibration on fixed prompts of its own"
        elif factory is not None and factory.learn is not Policy.learn:
            policy = "its policy: the speeds of its own decoding windows"
        else:
            policy = "its policy keeps no state"
        return f"its own prompts and outputs only ({table}, learner '{self.learner_key}'); {policy}"


def default_methods() -> list[str]:
    """What runs when no method is named: spirit's policies and "hf". llama.cpp's run only
    when named (they need a GGUF model and an optional build)."""
    from spirit.policies import REGISTRY

    return REGISTRY.names() + ["hf"]


def available_methods() -> list[str]:
    """Every method a bench can run here: llama.cpp's only where llama-cpp-python is installed."""
    from spirit.bench import llamacpp

    return default_methods() + (list(llamacpp.METHODS) if llamacpp.available() else [])


def check_methods(methods: Sequence[str]) -> None:
    """Unknown names are a user error that lists the known ones; llama.cpp's without
    llama-cpp-python, one that says what to install."""
    from spirit.bench import llamacpp

    known = available_methods()
    missing = [m for m in methods if m in llamacpp.METHODS and m not in known]
    if missing:
        raise ValueError(llamacpp.missing_message(missing))
    unknown = [m for m in methods if m not in known]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(map(repr, unknown))}; available: {', '.join(known)}")


def default_static_skip(num_layers: int, ratio: float = 0.2) -> SkipSet:
    """MLPs of every other middle layer, round(ratio * 2L) sublayers, nearest the middle first.

    A plain, reproducible baseline for "static" (the first and last layer are kept, as every
    layer-skip paper does); a tuned skip set is what the adaptive methods are for."""
    middle = list(range(1, num_layers - 1)) if num_layers > 2 else list(range(num_layers))
    centre = (num_layers - 1) / 2
    alternate = sorted(middle[::2], key=lambda i: abs(i - centre))
    others = sorted(middle[1::2], key=lambda i: abs(i - centre))
    count = min(len(middle), max(1, round(ratio * 2 * num_layers)))
    return skipset_from_sublayers([("mlp", i) for i in (alternate + others)[:count]])


def build_runners(methods: Sequence[str], skip: SkipSet | None) -> dict[str, MethodRunner]:
    """Runners for method names (checked by `check_methods`)."""
    from spirit.bench.llamacpp import METHODS as LLAMACPP, LlamaCppMethod

    check_methods(methods)
    return {m: LlamaCppMethod(m) if m in LLAMACPP else SpiritMethod(m, skip if m == "static" else None) for m in methods}


def learned_from(runner: MethodRunner) -> str:
    describe = getattr(runner, "learned_from", None)
    return describe() if describe is not None else "not stated (a caller-supplied runner)"


def with_baseline(methods: Sequence[str]) -> list[str]:
    """Vanilla first (named or not: it is the reference for speedups and for the lossless
    check), then the others in the given order, each once."""
    return [BASELINE, *(m for m in dict.fromkeys(methods) if m != BASELINE)]


def rotated(methods: Sequence[str], slot: int) -> list[str]:
    """The methods in the order question `slot` runs them: starting with method slot mod M."""
    k = slot % len(methods) if methods else 0
    return [*methods[k:], *methods[:k]]


def schedule(questions: Sequence[Question], methods: Sequence[str]) -> list[tuple[int, Question, str]]:
    """(slot, question, method) in interleaved order: every method on question 0, then on
    question 1, and so on, each question's order rotated one further (see `rotated`)."""
    return [(slot, q, m) for slot, q in enumerate(questions) for m in rotated(methods, slot)]


class RssSampler:
    """Highest resident set size while a block of code runs, sampled by a light thread."""

    def __init__(self, interval_s: float = 0.1) -> None:
        import psutil

        self._process = psutil.Process(os.getpid())
        self._interval = interval_s
        self.peak = 0

    def _sample(self) -> None:
        self.peak = max(self.peak, self._process.memory_info().rss)

    def __enter__(self) -> "RssSampler":
        self.peak = 0
        self._stop = threading.Event()
        self._sample()

        def loop() -> None:
            while not self._stop.wait(self._interval):
                self._sample()

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def as_prompt(lm, messages: list[dict]) -> list[dict] | str:
    """Chat messages for a model with a chat template; a plain transcript otherwise."""
    if getattr(lm.tokenizer, "chat_template", None):
        return messages
    lines = [f"{'User' if m['role'] == 'user' else 'Assistant'}: {m['content']}" for m in messages]
    return "\n\n".join(lines) + "\n\nAssistant:"


def answer(lm, runner: MethodRunner, question: Question, max_new_tokens: int) -> list[TurnResult]:
    """Ask the question's turns in order, continuing the conversation with each answer."""
    messages: list[dict] = []
    turns = []
    for text in question.turns:
        messages.append({"role": "user", "content": text})
        result = runner(lm, as_prompt(lm, messages), max_new_tokens, question.category)
        turns.append(TurnResult(result.text, list(result.token_ids), result.stats, result.finish_reason))
        messages.append({"role": "assistant", "content": result.text})
    return turns


@dataclass
class BenchResult:
    model: str
    dtype: str
    methods: list[str]
    questions: list[Question]
    runs: list[QuestionRun]
    blocks: list[Block] | None = None
    settings: dict = field(default_factory=dict)
    machine: dict = field(default_factory=dict)
    sol: dict | None = None
    elapsed_s: float = 0.0
    decode: Callable[[list[int]], str] | None = None
    # whether this machine's kernels let verification reproduce plain decoding bit for bit
    # (the model's `exactness`: "exact", "reason", ...); None where the model does not say
    exactness: dict | None = None

    def by_category(self):
        return summarize(self.runs)

    def by_block(self):
        return summarize(self.runs, key=lambda r: r.block) if self.blocks else {}

    def lossless(self):
        return compare_lossless(self.runs, self.decode)

    def order_of(self, slot: int) -> list[str]:
        """The methods in the order they actually ran question `slot`."""
        return [r.method for r in sorted((r for r in self.runs if r.slot == slot), key=lambda r: r.order)]


def exactness_of(lm) -> dict | None:
    """The loaded model's own statement of whether verification is bit-exact here, if any."""
    exactness = getattr(lm, "exactness", None)
    return exactness.to_dict() if exactness is not None else None


def run_bench(
    lm,
    questions: Sequence[Question] | None = None,
    methods: Sequence[str] = ("vanilla",),
    *,
    blocks: Sequence[Block] | None = None,
    max_new_tokens: int = 128,
    skip: SkipSet | None = None,
    runners: dict[str, MethodRunner] | None = None,
    warmup: bool = True,
    progress: bool = True,
) -> BenchResult:
    """Run `methods` on `questions` (or on the questions of stream `blocks`), interleaved.

    `runners` maps extra method names to runners (tests, experiments); the other names are
    looked up among the registered policies, "hf" and llama.cpp's (bench/llamacpp.py).
    """
    from tqdm import tqdm

    from spirit.bench.llamacpp import METHODS as LLAMACPP_METHODS
    from spirit.bench.machine import machine_info, vanilla_sol

    Request.build("", max_new_tokens=max_new_tokens)  # every turn's options, checked once before the run
    if blocks is not None:
        questions = [q for b in blocks for q in b.questions]
        block_of = [b.index for b in blocks for _ in b.questions]
    else:
        questions = list(questions or [])
        block_of = [None] * len(questions)
    if not questions:
        raise ValueError("no questions to run (check --categories / --per-category)")
    methods = with_baseline(methods)
    given = dict(runners or {})
    if "static" in methods and skip is None:
        skip = default_static_skip(lm.num_layers)
    table = {**build_runners([m for m in methods if m not in given], skip), **given}

    t_start = time.perf_counter()
    if warmup:
        first = questions[0]
        prompt = as_prompt(lm, [{"role": "user", "content": first.turns[0]}])
        for m in tqdm(methods, desc="warm-up", unit="method", disable=not progress, leave=False):
            table[m](lm, prompt, min(WARMUP_TOKENS, max_new_tokens), first.category, warmup=True)

    runs: list[QuestionRun] = []
    order = schedule(questions, methods)
    sampler = RssSampler()
    bar = tqdm(order, desc="bench", unit="answer", disable=not progress, dynamic_ncols=True)
    for n, (slot, question, method) in enumerate(bar):
        bar.set_postfix_str(f"running {method} q{question.question_id} {question.category}")
        with sampler:
            turns = answer(lm, table[method], question, max_new_tokens)
        runs.append(QuestionRun(method, question, turns, slot, n, block_of[slot], sampler.peak))
    bar.close()

    result = BenchResult(
        model=lm.name,
        dtype=str(lm.dtype).removeprefix("torch."),
        methods=methods,
        questions=list(questions),
        runs=runs,
        blocks=list(blocks) if blocks is not None else None,
        settings={
            "max_new_tokens": max_new_tokens,
            "temperature": 0.0,
            "warmup": warmup,
            "static_skip": str(skip) if skip is not None else None,
            "order": f"interleaved by question, rotated: question k starts with method k mod {len(methods)} "
                     f"({' '.join(methods)}, then {' '.join(rotated(methods, 1))}, ...)",
            "learned_from": {m: learned_from(table[m]) for m in methods},
        },
        machine=machine_info(lm, llamacpp_ran=any(m in LLAMACPP_METHODS for m in methods)),
        decode=lambda ids: lm.tokenizer.decode(ids, skip_special_tokens=False),
        exactness=exactness_of(lm),
    )
    result.sol = vanilla_sol(lm, runs)
    result.elapsed_s = time.perf_counter() - t_start
    return result
