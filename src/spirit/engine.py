"""The decoding engine: prefill, then rounds of draft-with-skipped-sublayers and verify.

State of one request (batch size 1):
- `ids`: prompt + generated tokens; the last one is *pending*: emitted but not yet in the
  KV cache.
- `committed`: number of cache slots holding the full model's KV, always len(ids) - 1.

A speculative round from the pending token x0:
  draft   x0, d1, ... through the skipping model in slots committed, committed+1, ...
  verify  [x0, d1..dk] through the full model in slots committed..committed+k (one pass)
  commit  x0 plus the n accepted drafts; the recovered/bonus token becomes pending.
Rejected slots are simply not advanced over (see model/kv_cache.py); nothing is copied.

The engine measures and the policy decides: every `policy.window_tokens` new tokens it
reports a `WindowStats` and asks for the next `DraftConfig`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from spirit.drafts.layerskip import draft_layerskip
from spirit.drafts.ngram import STRONG_MATCH, NgramIndex
from spirit.drafts.quantized import DEFAULT_ACTIVATION, QuantizedMLPs
from spirit.machine import DRAFT_BITS_FORMAT, PassCosts
from spirit.drafts.tree import MAX_NODES, DraftTree
from spirit.drafts.vocab import DraftHeads
from spirit.model.adapter import SkippableModel
from spirit.policies.base import Policy, RequestInfo, VanillaPolicy, ModelInfo
from spirit.sampling import GumbelNoise, SamplingParams, pick, probabilities, randomness
from spirit.skipset import DraftConfig, SkipSet
from spirit.stats import Counters, GenerationStats, WindowStats
from spirit.verify import verify_tree_greedy, verify_tree_gumbel, verify_tree_sampling

_NO_SKIP = SkipSet()
PROBE_TOKENS = 32  # committed tokens a teacher-forced agreement probe scores
SHARED_LEARNER = "shared"  # the learned draft state every request uses unless told otherwise


class ContextLengthError(ValueError):
    pass


@dataclass(frozen=True)
class DecodeSettings:
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class _Window:
    config: DraftConfig
    started: float
    counters: Counters = field(default_factory=Counters)
    probe_agreement: float | None = None


class Engine:
    def __init__(self, model: SkippableModel, max_context: int | None = None, quantized_cache: Path | None = None,
                 costs: PassCosts | None = None) -> None:
        self.model = model
        # this machine's pass costs (model/probe.py), when measured: the activation dtype each
        # low-bit draft kernel is fast with here
        self.costs = costs
        self.max_context = max_context or model.shape.max_positions
        self._requests = 0
        # reduced-vocabulary draft heads and the token frequencies they come from, one set per
        # learner: a request learns from and drafts with its learner's only. Every request
        # shares one unless its caller names another (the benchmark gives each method its
        # own, so no method drafts from another's output)
        self.heads = DraftHeads(model.lm_head.weight)  # the shared learner's
        self.learners: dict[str, DraftHeads] = {SHARED_LEARNER: self.heads}
        self._quantized: dict[int, QuantizedMLPs] = {}  # draft bits -> the MLPs at those bits
        self.quantized_cache = quantized_cache  # where quantized MLPs are kept: "<it>-int4.pt"
        # Every full-model pass after prefill is exact (row-wise attention, padded to the rows
        # this machine's kernels need) where the load-time check found that the kernels allow it:
        # then each verified token's logits are bit-identical to a plain step's.
        self.exact = model.exactness.exact

    def quantized_mlps(self, bits: int) -> QuantizedMLPs | None:
        """The model's MLPs quantized to `bits` for drafts (None for 0), on first use: built
        (17.5 s for int4 of a 1.5b model on 2 cores) or loaded from `quantized_cache`."""
        if not bits:
            return None
        if bits not in self._quantized:
            activation = DEFAULT_ACTIVATION
            if self.costs is not None:
                activation = getattr(torch, self.costs.activation(DRAFT_BITS_FORMAT[bits]))
            path = None
            if self.quantized_cache is not None:
                suffix = "" if activation == DEFAULT_ACTIVATION else f"-{str(activation).removeprefix('torch.')}"
                path = self.quantized_cache.with_name(f"{self.quantized_cache.name}-int{bits}{suffix}.pt")
            self._quantized[bits] = QuantizedMLPs.cached(self.model.layers, bits, path, activation)
        return self._quantized[bits]

    def draft_heads(self, learner: str = SHARED_LEARNER) -> DraftHeads:
        """The learned draft state of `learner`, fresh (the rank prior alone) on first use."""
        if learner not in self.learners:
            self.learners[learner] = DraftHeads(self.model.lm_head.weight)
        return self.learners[learner]

    def forget(self, learner: str) -> None:
        """Drop what `learner` learned (e.g. a throwaway warm-up's); the shared one stays."""
        if learner != SHARED_LEARNER:
            self.learners.pop(learner, None)

    @property
    def info(self) -> ModelInfo:
        return ModelInfo(self.model.shape.num_layers, costs=self.costs, vocab=self.model.shape.vocab_size)

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        if prompt_len < 1:
            raise ContextLengthError("the prompt is empty")
        if prompt_len + max_new_tokens > self.max_context:
            raise ContextLengthError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"model's context of {self.max_context} tokens"
            )

    def decode(
        self,
        prompt_ids: list[int],
        settings: DecodeSettings,
        policy: Policy | None = None,
        tag: str | None = None,
        stop_requested: Callable[[], bool] | None = None,
        learner: str = SHARED_LEARNER,
    ) -> Iterator[list[int]]:
        """Yield newly committed token ids as they are produced; return GenerationStats.

        Stops at max_new_tokens, right after an EOS token (which is included), or when
        `stop_requested()` turns true after a yield (a stop string, a client that left).
        The reduced draft head is `learner`'s, and learns this request's prompt and output.
        """
        self.check_fits(len(prompt_ids), settings.max_new_tokens)
        policy = policy or VanillaPolicy(self.info)
        self._requests += 1
        request = RequestInfo(self._requests, tuple(prompt_ids), settings.max_new_tokens, tag)
        sampling = settings.sampling
        # a generator (rejection mode) or per-position Gumbel noise (gumbel mode; sampling.py)
        generator = randomness(sampling, self.model.shape.vocab_size)
        stats = GenerationStats(prompt_tokens=len(prompt_ids))
        t_start = time.perf_counter()

        config = policy.start_request(request)
        heads = self.draft_heads(learner)
        heads.table.observe(prompt_ids)  # a prompt's tokens are likely to be copied
        heads.table.pin(settings.eos_token_ids)
        lookup = NgramIndex()
        cache = self.model.new_cache(len(prompt_ids) + settings.max_new_tokens + max(PROBE_TOKENS, MAX_NODES) + 2)
        prompt = torch.tensor([prompt_ids])
        logits = self.model.forward(prompt, 0, cache, _NO_SKIP, last_only=True)[0]
        first = self._pick(logits, sampling, generator, len(prompt_ids))
        ids = list(prompt_ids) + [first]
        stats.prefill_time_s = time.perf_counter() - t_start
        budget = settings.max_new_tokens - 1
        window = _Window(config, time.perf_counter())
        done = first in settings.eos_token_ids or budget == 0
        yield [first]  # the prefill's token; windows measure decoding only
        done = done or (stop_requested is not None and stop_requested())

        while not done:
            if window.config.probe is not None and window.probe_agreement is None:
                window.probe_agreement = self._probe(ids, cache, window.config.probe, window.counters)
            if window.config.speculative:
                new = self._speculative_round(
                    ids, cache, window.config, sampling, generator, budget, window.counters, lookup,
                    settings.eos_token_ids, heads,
                )
            else:
                new = self._plain_step(ids, cache, sampling, generator, window.counters)
            eos_at = next((i for i, t in enumerate(new) if t in settings.eos_token_ids), None)
            if eos_at is not None:
                new = new[: eos_at + 1]
            new = new[:budget]  # a cut only happens on the request's last round
            ids.extend(new)
            budget -= len(new)
            window.counters.new_tokens += len(new)
            done = eos_at is not None or budget <= 0
            yield new
            done = done or (stop_requested is not None and stop_requested())
            if window.counters.new_tokens >= policy.window_tokens and not done:
                window = self._close_window(window, request, policy, stats, len(ids), final=False)

        self._close_window(window, request, policy, stats, len(ids), final=True)
        heads.table.observe(ids[len(prompt_ids) :])
        stats.new_tokens = len(ids) - len(prompt_ids)
        stats.wall_time_s = time.perf_counter() - t_start
        return stats

    # -- one step of each kind -------------------------------------------------------------

    def _pick(
        self, logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | GumbelNoise | None,
        position: int,
    ) -> int:
        """The token at absolute `position` (its index in prompt + output)."""
        return pick(logits, sampling, generator, position)

    def _plain_step(
        self, ids: list[int], cache, sampling: SamplingParams, generator, counters: Counters
    ) -> list[int]:
        t0 = time.perf_counter()
        committed = len(ids) - 1
        logits = self.model.forward(torch.tensor([[ids[-1]]]), committed, cache, _NO_SKIP, exact=self.exact)[0]
        token = self._pick(logits, sampling, generator, committed + 1)
        counters.verify_time_s += time.perf_counter() - t0
        return [token]

    def _speculative_round(
        self,
        ids: list[int],
        cache,
        config: DraftConfig,
        sampling: SamplingParams,
        generator,
        budget: int,
        counters: Counters,
        lookup: NgramIndex,
        stop_ids: frozenset[int] = frozenset(),
        heads: DraftHeads | None = None,
    ) -> list[int]:
        # drafting more than budget - 1 tokens cannot pay: the verification adds one more
        limit = min(config.max_draft, budget - 1, MAX_NODES - 1)
        if limit < 1:
            return self._plain_step(ids, cache, sampling, generator, counters)
        t0 = time.perf_counter()
        tree = self._propose(ids, cache, config, sampling, generator, limit, lookup, counters, stop_ids, heads)
        if tree.drafted == 0:  # nothing to verify: this round is a plain step
            counters.draft_time_s += time.perf_counter() - t0
            return self._plain_step(ids, cache, sampling, generator, counters)
        if self.exact and tree.size > self.model.exactness.max_rows:
            tree = tree.truncated(self.model.exactness.max_rows)  # larger passes are not row-invariant here
        t1 = time.perf_counter()
        committed = len(ids) - 1
        verify_input = torch.tensor([tree.tokens])
        if tree.is_chain():  # causal by slot: the adapter's cheaper default mask
            target_logits = self.model.forward(verify_input, committed, cache, _NO_SKIP, exact=self.exact)  # [size, vocab]
        else:
            target_logits = self.model.forward(
                verify_input, committed, cache, _NO_SKIP,
                positions=tree.positions(committed), visible=tree.visible(committed), exact=self.exact,
            )
        if sampling.greedy:
            verdict = verify_tree_greedy(tree, target_logits)
        elif isinstance(generator, GumbelNoise):
            verdict = verify_tree_gumbel(tree, target_logits, sampling, generator, committed)
        else:
            verdict = verify_tree_sampling(tree, probabilities(target_logits, sampling), generator)
        cache.keep_path(committed + 1, [committed + node for node in verdict.path])
        t2 = time.perf_counter()
        counters.draft_time_s += t1 - t0
        counters.verify_time_s += t2 - t1
        counters.draft_rounds += 1
        counters.drafted += tree.drafted
        counters.accepted += verdict.accepted
        return [tree.tokens[node] for node in verdict.path] + [verdict.next_token]

    def _propose(
        self, ids, cache, config: DraftConfig, sampling, generator, limit: int, lookup: NgramIndex, counters: Counters,
        stop_ids: frozenset[int] = frozenset(), heads: DraftHeads | None = None,
    ) -> DraftTree:
        """Prompt lookup first (free); the skipping model when lookup finds no match (with a
        skip draft on offer, no match of STRONG_MATCH tokens): the policy measures
        which of the two pays (lookup alone is the ratio-0 arm)."""
        if config.ngram:
            shortest = STRONG_MATCH if config.skip is not None else None
            tree = lookup.propose(ids, min(config.ngram_tokens, limit), config.branches, shortest=shortest)
            if tree.drafted:
                counters.lookup_rounds += 1
                return tree
        if config.skip is None:
            return DraftTree(ids[-1])
        head = (heads or self.heads).head(config.draft_vocab)
        mlps = self.quantized_mlps(config.draft_bits)
        return draft_layerskip(self.model, ids, cache, config, sampling, generator, limit, head, mlps, stop_ids)

    def _probe(self, ids: list[int], cache, skip: SkipSet, counters: Counters) -> float | None:
        """Teacher-forced top-1 agreement of `skip` with the last committed tokens.

        Runs the draft on ids[c-n .. c-1] (positions c-n..c-1) in scratch slots [c, c+n),
        attending to the full model's KV of everything before c-n, and counts how often its
        argmax equals the token that actually followed. Slots >= c are overwritten by the
        next pass, so the committed cache is untouched.
        """
        committed = len(ids) - 1
        n = min(PROBE_TOKENS, committed - 1)
        if n < 4:
            return None
        t0 = time.perf_counter()
        inputs = torch.tensor([ids[committed - n : committed]])
        targets = torch.tensor(ids[committed - n + 1 : committed + 1])
        positions = torch.arange(committed - n, committed)
        visible = torch.zeros(n, committed + n, dtype=torch.bool)
        visible[:, : committed - n] = True
        visible[:, committed:] = torch.ones(n, n, dtype=torch.bool).tril()
        logits = self.model.forward(inputs, committed, cache, skip, positions=positions, visible=visible)
        agreement = float((logits.argmax(dim=-1) == targets).float().mean())
        counters.probe_time_s += time.perf_counter() - t0
        return agreement

    def _close_window(
        self,
        window: _Window,
        request: RequestInfo,
        policy: Policy,
        stats: GenerationStats,
        context_length: int,
        final: bool,
    ) -> _Window:
        now = time.perf_counter()
        feedback = WindowStats(
            request_id=request.request_id,
            config=window.config,
            counters=window.counters,
            wall_time_s=now - window.started,
            context_length=context_length,
            probe_agreement=window.probe_agreement,
            final=final,
        )
        stats.counters.add(window.counters)
        described = window.config.describe(self.model.shape.num_layers)
        stats.configs.append(described)
        stats.windows.append(
            {
                "config": described,
                "skip_ratio": window.config.skip.ratio(self.model.shape.num_layers) if window.config.skip else 0.0,
                "new_tokens": window.counters.new_tokens,
                "wall_time_s": round(feedback.wall_time_s, 6),
                "tokens_per_s": round(feedback.tokens_per_s, 3),
                "acceptance_rate": round(window.counters.acceptance_rate, 4),
                "context_length": context_length,
            }
        )
        if final:
            policy.end_request(feedback)
            return window
        # the policy's deciding time is counted in the next window, which starts now
        return _Window(policy.on_window(feedback), now)
