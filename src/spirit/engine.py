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

The engine measures and the policy decides: the policy's `Plan` says what a window runs and
for how many new tokens; at its end the engine reports a `WindowStats` carrying the plan back
and asks for the next one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from spirit import proposers
from spirit.draft_model.learners import SHARED_LEARNER, DraftLearners
from spirit.draft_model.quantized import DEFAULT_ACTIVATION, QuantizedMLPs
from spirit.machine import DRAFT_BITS_FORMAT, PassCosts
from spirit.model.adapter import SkippableModel
from spirit.model.lowbit import PackedLinear
from spirit.plan import Plan
from spirit.policies.base import ModelInfo, Policy, RequestInfo, VanillaPolicy
from spirit.proposers import DraftContext, DraftResources, Proposer
from spirit.sampling import GumbelNoise, SamplingParams, pick, probabilities, randomness
from spirit.skipset import DraftConfig, SkipSet
from spirit.stats import Counters, GenerationStats, WindowStats
from spirit.tree import MAX_NODES, DraftTree
from spirit.verify import verify_tree_greedy, verify_tree_gumbel, verify_tree_sampling

_NO_SKIP = SkipSet()
PROBE_TOKENS = 32  # committed tokens a teacher-forced agreement probe scores


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
    plan: Plan
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
        # the learned draft state (draft_model/learners.py): a request drafts with and
        # teaches its learner's only
        self.learners = DraftLearners(model.head_rows)
        self.sources: tuple[type[Proposer], ...] = proposers.SOURCES  # the draft sources rounds ask
        self._quantized: dict[int, QuantizedMLPs] = {}  # draft bits -> the MLPs at those bits
        # a low-bit target's own MLPs are already packed: its drafts run them, not copies
        self._packed_target = isinstance(model.layers[0].mlp.down_proj, PackedLinear)
        self.quantized_cache = quantized_cache  # where quantized MLPs are kept: "<it>-int4.pt"
        # Every full-model pass after prefill is exact (row-wise attention, padded to the rows
        # this machine's kernels need) where the load-time check found that the kernels allow it:
        # then each verified token's logits are bit-identical to a plain step's.
        self.exact = model.exactness.exact

    def quantized_mlps(self, bits: int) -> QuantizedMLPs | None:
        """The model's MLPs quantized to `bits` for drafts (None for 0), on first use: built
        (17.5 s for int4 of a 1.5b model on 2 cores) or loaded from `quantized_cache`."""
        if not bits or self._packed_target:
            return None
        if bits not in self._quantized:
            activation = DEFAULT_ACTIVATION
            if self.costs is not None:
                activation = getattr(torch, self.costs.activation(DRAFT_BITS_FORMAT[bits]))
            path = None
            if self.quantized_cache is not None:
                suffix = "" if activation == DEFAULT_ACTIVATION else f"-{str(activation).removeprefix('torch.')}"
                if self.model.device.type != "cpu":  # each device's kernels pack int4 their own way
                    suffix += f"-{self.model.device.type}"
                path = self.quantized_cache.with_name(f"{self.quantized_cache.name}-int{bits}{suffix}.pt")
            self._quantized[bits] = QuantizedMLPs.cached(self.model.layers, bits, path, activation)
        return self._quantized[bits]

    @property
    def heads(self):
        """The shared learner's draft heads."""
        return self.learners.get(SHARED_LEARNER)

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

        plan = self._known_sources(policy.start_request(request))
        heads = self.learners.start(learner, prompt_ids, settings.eos_token_ids)
        sources = proposers.for_request(DraftResources(self.model, self.quantized_mlps, heads.head), self.sources)
        cache = self.model.new_cache(len(prompt_ids) + settings.max_new_tokens + max(PROBE_TOKENS, MAX_NODES) + 2)
        prompt = torch.tensor([prompt_ids], device=self.model.device)
        logits = self.model.forward(prompt, 0, cache, _NO_SKIP, last_only=True)[0]
        first = self._pick(logits, sampling, generator, len(prompt_ids))
        ids = list(prompt_ids) + [first]
        stats.prefill_time_s = time.perf_counter() - t_start
        budget = settings.max_new_tokens - 1
        window = _Window(plan, time.perf_counter())
        done = first in settings.eos_token_ids or budget == 0
        yield [first]  # the prefill's token; windows measure decoding only
        done = done or (stop_requested is not None and stop_requested())

        while not done:
            config = window.plan.config
            if config.probe is not None and window.probe_agreement is None:
                window.probe_agreement = self._probe(ids, cache, config.probe, window.counters)
            if config.speculative:
                context = DraftContext(ids, cache, config, sampling, generator, settings.eos_token_ids)
                new = self._speculative_round(context, sources, budget, window.counters)
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
            if window.counters.new_tokens >= window.plan.window_tokens and not done:
                window = self._close_window(window, request, policy, stats, len(ids), final=False)

        self._close_window(window, request, policy, stats, len(ids), final=True)
        self.learners.finish(learner, ids[len(prompt_ids) :])
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
        step = torch.tensor([[ids[-1]]], device=self.model.device)
        logits = self.model.forward(step, committed, cache, _NO_SKIP, exact=self.exact)[0]
        token = self._pick(logits, sampling, generator, committed + 1)
        counters.verify_time_s += time.perf_counter() - t0
        return [token]

    def _speculative_round(
        self, context: DraftContext, sources: list[Proposer], budget: int, counters: Counters
    ) -> list[int]:
        ids, cache, sampling, generator = context.ids, context.cache, context.sampling, context.generator
        # drafting more than budget - 1 tokens cannot pay: the verification adds one more
        limit = min(context.config.max_draft, budget - 1, MAX_NODES - 1)
        if limit < 1:
            return self._plain_step(ids, cache, sampling, generator, counters)
        t0 = time.perf_counter()
        source, tree = self._propose(context, sources, limit)
        if source is None:  # nothing to verify: this round is a plain step
            counters.draft_time_s += time.perf_counter() - t0
            return self._plain_step(ids, cache, sampling, generator, counters)
        if self.exact and tree.size > self.model.exactness.max_rows:
            tree = tree.truncated(self.model.exactness.max_rows)  # larger passes are not row-invariant here
        t1 = time.perf_counter()
        committed = len(ids) - 1
        device = self.model.device
        verify_input = torch.tensor([tree.tokens], device=device)
        if tree.is_chain():  # causal by slot: the adapter's cheaper default mask
            target_logits = self.model.forward(verify_input, committed, cache, _NO_SKIP, exact=self.exact)  # [size, vocab]
        else:
            target_logits = self.model.forward(
                verify_input, committed, cache, _NO_SKIP,
                positions=tree.positions(committed, device), visible=tree.visible(committed, device), exact=self.exact,
            )
        if sampling.greedy:
            verdict = verify_tree_greedy(tree, target_logits)
        elif isinstance(generator, GumbelNoise):
            verdict = verify_tree_gumbel(tree, target_logits, sampling, generator, committed)
        else:
            verdict = verify_tree_sampling(tree, probabilities(target_logits, sampling), generator)
        cache.keep_path(committed + 1, [committed + node for node in verdict.path])
        t2 = time.perf_counter()
        for each in sources:
            each.accepted(tree, verdict.path)
        counters.draft_time_s += t1 - t0
        counters.verify_time_s += t2 - t1
        counters.draft_rounds += 1
        counters.lookup_rounds += source.model_free
        counters.drafted += tree.drafted
        counters.accepted += verdict.accepted
        return [tree.tokens[node] for node in verdict.path] + [verdict.next_token]

    @staticmethod
    def _propose(context: DraftContext, sources: list[Proposer], limit: int) -> tuple[Proposer | None, DraftTree]:
        """The first tree that drafts a token, from the sources this window's configuration
        enables, in their listed order; each but the last knows a later one would be asked."""
        enabled = [source for source in sources if source.enabled(context.config)]
        for n, source in enumerate(enabled):
            tree = source.propose(replace(context, fallback=n < len(enabled) - 1), limit)
            if tree.drafted:
                return source, tree
        return None, DraftTree(context.ids[-1])

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
        device = self.model.device
        inputs = torch.tensor([ids[committed - n : committed]], device=device)
        targets = torch.tensor(ids[committed - n + 1 : committed + 1], device=device)
        positions = torch.arange(committed - n, committed, device=device)
        visible = torch.zeros(n, committed + n, dtype=torch.bool, device=device)
        visible[:, : committed - n] = True
        visible[:, committed:] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
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
            plan=window.plan,
            counters=window.counters,
            wall_time_s=now - window.started,
            context_length=context_length,
            probe_agreement=window.probe_agreement,
            final=final,
        )
        stats.counters.add(window.counters)
        config = window.plan.config
        described = config.describe(self.model.shape.num_layers)
        stats.configs.append(described)
        stats.windows.append(
            {
                "config": described,
                "skip_ratio": config.skip.ratio(self.model.shape.num_layers) if config.skip else 0.0,
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
        return _Window(self._known_sources(policy.on_window(feedback)), now)

    def _known_sources(self, plan: Plan) -> Plan:
        known = {source.name for source in self.sources}
        for name in plan.config.sources:
            if name not in known:
                raise ValueError(f"unknown draft source {name!r}; this engine has {', '.join(sorted(known))}")
        return plan
