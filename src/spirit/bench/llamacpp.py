"""llama.cpp as a baseline of `spirit bench`: `llamacpp` (plain decoding) and `llamacpp-lookup`
(llama-cpp-python's prompt-lookup drafting).

Why: spirit's speedups are over its own plain decoding in torch; a reader also wants to know
where that stands against the engine most people run GGUF models with on a CPU. So both
methods run llama-cpp-python on the very GGUF file the spirit model was converted from, with
the same prompt tokens (spirit's own chat-template encoding, `Spirit.encode`), greedy, the
same max_new_tokens, the same EOS stop, the same thread count, and the same timing: the wall
time of the whole request, prompt evaluation included.

What is NOT the same, and the report must be read with it: llama.cpp runs the file's own
quantized blocks (Q4_1 for smollm2-135m) with its own kernels, while spirit runs the weights
the file was dequantized to (bf16 by default, or spirit's own int8/int4 packing). Their greedy
tokens therefore differ from vanilla's in places; metrics.OTHER_ENGINES labels that agreement
as llama.cpp's, not as a spirit losslessness failure. And llama-cpp-python's lookup drafting
needs logits for every evaluated position (it turns `logits_all` on), so its prompt
evaluation also runs the lm_head on every prompt token: that is the binding as users run it.

llama-cpp-python is an optional extra (`pip install -e '.[llamacpp]'`, built from source);
it is imported only when one of these methods runs. A build with llama.cpp's AMX kernels is
refused: on our Xeon they crash the process (see `_import_llama_cpp` for the rebuild).
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from spirit.stats import Counters, GenerationStats

PLAIN = "llamacpp"
LOOKUP = "llamacpp-lookup"
METHODS = (PLAIN, LOOKUP)
INSTALL = "pip install -e '.[llamacpp]'"
# llama-cpp-python's README: 10 drafted tokens suit a GPU, "2 performs better for cpu-only machines"
LOOKUP_TOKENS = 2
LOOKUP_NGRAM = 2  # the binding's default: match the last 2 (then 1) tokens in the context
# n_ctx at least this (a power of two above prompt + max_new_tokens otherwise), so a bench run
# loads the model once; lookup keeps an n_ctx x vocab float32 logits array, so not the model's full context
MIN_CONTEXT = 2048
ALLOW_AMX = "SPIRIT_LLAMACPP_AMX"  # "1": run a llama.cpp build with AMX kernels anyway (see _import_llama_cpp)


def available() -> bool:
    """Whether llama-cpp-python is installed (found, not imported: listing methods must not
    load llama.cpp's libraries into every `spirit bench`)."""
    return importlib.util.find_spec("llama_cpp") is not None


def missing_message(methods: Sequence[str]) -> str:
    return (f"method(s) {', '.join(map(repr, methods))} need llama-cpp-python, which is not installed; "
            f"install the optional extra with {INSTALL} (it builds llama.cpp from source, a few minutes)")


def gguf_file(lm) -> Path:
    """The GGUF file the loaded model was converted from: llama.cpp must run that same file."""
    from spirit.model.loader import gguf_source

    source = gguf_source(lm.name, Path(lm.folder))
    if source is None:
        raise ValueError(f"llamacpp needs a GGUF model (a bundled model name or a .gguf file that still exists): "
                         f"model {lm.name} was loaded from {lm.folder}, which was not converted from one")
    return source


def context_size(needed: int, limit: int) -> int:
    """n_ctx for a request of `needed` tokens: a power of two, at least MIN_CONTEXT, at most
    `limit` (the model's context, which spirit's own check keeps `needed` within)."""
    return min(limit, max(MIN_CONTEXT, 1 << max(0, needed - 1).bit_length()))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class DraftLog:
    """Wraps llama-cpp-python's drafter to record what it proposed and how long it took.

    The binding verifies greedily (a drafted token is kept iff the model picks it at that
    position), so a round's accepted drafts are the common prefix of its draft and the tokens
    the request actually produced from that position: the counts are exact, not estimated."""

    drafter: Callable
    prompt_tokens: int = 0
    proposals: list[tuple[int, list[int]]] = field(default_factory=list)  # (output position, draft)
    time_s: float = 0.0

    def start(self, prompt_tokens: int) -> None:
        self.prompt_tokens, self.proposals, self.time_s = prompt_tokens, [], 0.0

    def __call__(self, input_ids, /, **kwargs):
        t0 = time.perf_counter()
        draft = self.drafter(input_ids, **kwargs)
        self.time_s += time.perf_counter() - t0
        if len(draft):
            # input_ids ends with the token just picked, not yet evaluated: the draft continues after it
            self.proposals.append((len(input_ids) - self.prompt_tokens, [int(t) for t in draft]))
        return draft

    def counters(self, out: Sequence[int]) -> Counters:
        c = Counters(new_tokens=max(0, len(out) - 1), draft_time_s=self.time_s)
        for at, draft in self.proposals:
            if at < len(out):
                c.draft_rounds += 1
                c.drafted += len(draft)
                c.accepted += common_prefix(draft, out[at:])
        return c


def _import_llama_cpp():
    import os

    try:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except (ImportError, OSError) as exc:  # absent, or a build whose shared library does not load
        raise ValueError(f"{missing_message(METHODS)} ({exc})") from exc
    # A native build on a CPU with AMX compiles llama.cpp's AMX kernels, and on our Xeon their
    # first matmul kills the process (SIGSEGV at ldtilecfg; llama.cpp issue 20824): refuse
    # with the fix instead of losing the whole bench run. The flag is fixed at compile time.
    amx = "AMX_INT8 = 1" in llama_cpp.llama_print_system_info().decode(errors="replace")
    if amx and os.environ.get(ALLOW_AMX) != "1":
        raise ValueError(
            "this llama-cpp-python build uses llama.cpp's AMX kernels, which crash on some CPUs (a segfault "
            "on ours); rebuild it without them: CFLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' "
            "CXXFLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' pip install --force-reinstall --no-cache-dir "
            f"--no-deps llama-cpp-python=={llama_cpp.__version__} (or set {ALLOW_AMX}=1 where they work)"
        )
    return llama_cpp.Llama, LlamaPromptLookupDecoding


@dataclass
class LlamaCppMethod:
    """A `MethodRunner` running llama-cpp-python on the loaded model's GGUF file.

    The `Llama` is opened on first use (the warm-up, so loading is never timed) and kept for
    the bench run; only a request that would not fit its context opens it again, larger,
    before the clock starts. Every request starts from a cleared context: no prompt cache."""

    name: str
    _llama: object | None = field(default=None, init=False, repr=False)
    _n_ctx: int = field(default=0, init=False, repr=False)
    _drafts: DraftLog | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.name not in METHODS:
            raise ValueError(f"unknown llama.cpp method {self.name!r}; choose one of {', '.join(METHODS)}")

    @property
    def lookup(self) -> bool:
        return self.name == LOOKUP

    def __call__(self, lm, prompt: list[dict] | str, max_new_tokens: int, tag: str | None, *, warmup: bool = False):
        # warm-up or not is the same: nothing is kept between requests (the context is cleared)
        ids = lm.encode(prompt, chat=not isinstance(prompt, str))  # spirit's own prompt tokens
        lm.engine.check_fits(len(ids), max_new_tokens)  # the same limit, and error, as spirit's requests
        llama = self._open(lm, self.context_needed(len(ids), max_new_tokens))
        return self._generate(llama, lm, ids, max_new_tokens)

    def context_needed(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """Slots a request needs: its prompt and output, and with lookup the drafts evaluated
        past the last kept token (llama-cpp-python writes their logits past n_ctx otherwise,
        and fails with a shape error: seen on a 1984-token prompt with 64 new tokens)."""
        return prompt_tokens + max_new_tokens + (LOOKUP_TOKENS + 1 if self.lookup else 0)

    def _open(self, lm, needed: int):
        if self._llama is not None and needed <= self._n_ctx:
            return self._llama
        path = gguf_file(lm)  # refuse a non-GGUF model before asking for llama.cpp
        Llama, PromptLookup = _import_llama_cpp()
        import torch

        if self._llama is not None:
            self._llama.close()
        n_ctx = context_size(needed, lm.engine.max_context)
        self._drafts = DraftLog(PromptLookup(max_ngram_size=LOOKUP_NGRAM, num_pred_tokens=LOOKUP_TOKENS)) if self.lookup else None
        threads = torch.get_num_threads()  # spirit's thread count, so the engines get the same cores
        # With a draft model the binding keeps every position's logits, but it sizes that array
        # by its `logits_all` argument: left False, it holds n_batch (512) rows and a prompt
        # longer than that fails ("could not broadcast ... into shape (0,)", seen on a
        # 664-token prompt). Asking for logits_all sizes it by n_ctx, which is what it writes.
        self._llama = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                            n_gpu_layers=0, draft_model=self._drafts, logits_all=self.lookup, verbose=False)
        self._n_ctx = n_ctx
        return self._llama

    def _generate(self, llama, lm, ids: list[int], max_new_tokens: int):
        from spirit.api import GenerationResult

        if self._drafts is not None:
            self._drafts.start(len(ids))
        out: list[int] = []
        prefill = 0.0
        t0 = time.perf_counter()
        # Clear the context so the whole prompt is evaluated, as spirit's engine does: left
        # alone, generate() would reuse the KV cache of the previous request's common prefix
        # (a turn's earlier turns, the same question asked in the warm-up), an advantage no
        # other method gets. After reset() generate() finds no cached tokens to match.
        llama.reset()
        tokens = llama.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0, repeat_penalty=1.0)
        try:
            for token in tokens:
                if not out:  # the prompt's evaluation and the first pick: spirit's prefill
                    prefill = time.perf_counter() - t0
                out.append(int(token))
                if out[-1] in lm.eos_token_ids or len(out) >= max_new_tokens:
                    break  # EOS is kept in the tokens, as spirit keeps it
        finally:
            tokens.close()
        wall = time.perf_counter() - t0
        counters = self._drafts.counters(out) if self._drafts is not None else Counters(new_tokens=max(0, len(out) - 1))
        stats = GenerationStats(prompt_tokens=len(ids), new_tokens=len(out), wall_time_s=wall,
                                prefill_time_s=prefill, counters=counters)
        # decoded once, after the clock stops (spirit decodes as it streams: a few microseconds a token)
        text = lm.tokenizer.decode(out, skip_special_tokens=True)
        finish = "stop" if out and out[-1] in lm.eos_token_ids else "length"
        return GenerationResult(text, out, stats, finish, self.name)

    def learned_from(self) -> str:
        what = "nothing: llama.cpp's context is cleared before every request, so no KV or prompt cache carries over"
        if self.lookup:
            what += (f"; its drafts (llama-cpp-python's prompt lookup, {LOOKUP_TOKENS} tokens) come from the "
                     "request's own prompt and output only")
        return what
