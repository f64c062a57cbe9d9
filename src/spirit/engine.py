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

A request's state between rounds is a `Decoding` (propose, one full-model pass over its
segment, commit). `Engine.decode` runs one request's rounds alone; batch.py runs several
requests' rounds with their segments packed into one pass. Both run the same `Decoding`.
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
from spirit.model.adapter import Segment, SkippableModel
from spirit.model import qgemm
from spirit.model.lowbit import PackedLinear
from spirit.plan import Plan
from spirit.policies.base import ModelInfo, Policy, RequestInfo, VanillaPolicy
from spirit.proposers import DraftContext, DraftResources, Proposer
from spirit.proposers.self_draft import ChainDraft, SelfDraft
from spirit.sampling import GumbelNoise, SamplingParams, pick, probabilities, randomness
from spirit.skipset import DraftConfig, SkipSet
from spirit.stats import Counters, GenerationStats, WindowStats
from spirit.tree import MAX_NODES, DraftTree
from spirit.verify import verify_tree_greedy, verify_tree_gumbel, verify_tree_sampling

_NO_SKIP = SkipSet()
PROBE_TOKENS = 32  # committed tokens a teacher-forced agreement probe scores
# prompt tokens per prefill pass: compute-bound at this size on CPUs, and short enough that a
# new request's prefill holds the others in a batch up for one such pass at a time
PREFILL_CHUNK = 128


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
                elif qgemm.available():  # spirit's kernel packs its own way too
                    suffix += "-qgemm"
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

    def start(
        self,
        prompt_ids: list[int],
        settings: DecodeSettings,
        policy: Policy | None = None,
        tag: str | None = None,
        learner: str = SHARED_LEARNER,
    ) -> "Decoding":
        """A request's decoding state, before its prefill; its rounds run alone (`decode`) or
        packed with other requests' (batch.py). Raises ContextLengthError if it cannot fit."""
        return Decoding(self, prompt_ids, settings, policy or VanillaPolicy(self.info), tag, learner)

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
        decoding = self.start(prompt_ids, settings, policy, tag, learner)
        first: list[int] = []
        while not first:
            first = decoding.prefill_chunk()
        yield first  # the prefill's token; windows measure decoding only
        while not decoding.done and not (stop_requested is not None and stop_requested()):
            round_ = decoding.propose()
            t0 = time.perf_counter()
            logits = self.model.forward_packed([decoding.segment(round_)], exact=self.exact)[0]
            yield decoding.commit(round_, logits, time.perf_counter() - t0)
        return decoding.finish()

    # -- one step of each kind -------------------------------------------------------------

    def _pick(
        self, logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | GumbelNoise | None,
        position: int,
    ) -> int:
        """The token at absolute `position` (its index in prompt + output)."""
        return pick(logits, sampling, generator, position)

    @staticmethod
    def _propose(context: DraftContext, sources: list[Proposer], limit: int,
                 together: bool = False) -> tuple[Proposer | None, DraftTree | ChainDraft]:
        """The first tree that drafts a token, from the sources this window's configuration
        enables, in their listed order; each but the last knows a later one would be asked.
        `together`: a model draft is not run but returned as its chain (SelfDraft.start), for a
        batch to run with others; it drafts a token whenever it is asked for one."""
        enabled = [source for source in sources if source.enabled(context.config)]
        for n, source in enumerate(enabled):
            asked = replace(context, fallback=n < len(enabled) - 1)
            if together and isinstance(source, SelfDraft):
                return source, source.start(asked, limit)
            tree = source.propose(asked, limit)
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


@dataclass
class Round:
    """What one round of a request verifies: `tree` (a lone root is a plain step), the
    source that drafted it (None for a plain step) and the time its drafting took.
    `chain`: a model draft still to run (the tree is then its root alone): a batch runs it
    with the chains of other requests that share its configuration, then `Decoding.drafted`
    makes the round."""

    tree: DraftTree
    source: Proposer | None
    draft_time_s: float = 0.0
    chain: ChainDraft | None = None

    @property
    def plain(self) -> bool:
        return self.source is None


class Decoding:
    """One request between rounds: its tokens, its KV cache, its policy's window and its
    draft sources. A round is `propose` (probe and draft, alone: they run this request's own
    draft configuration), then one full-model pass over `segment(round)` (alone or packed
    with other requests' segments), then `commit` of that pass's logits.

    Prefill runs in chunks of PREFILL_CHUNK tokens, each pass alone, the same way whether the
    request decodes alone or among others: that keeps its KV bit for bit the same either way,
    and a long prompt holds the others up one chunk at a time, not for its whole length.
    """

    def __init__(
        self, engine: Engine, prompt_ids: list[int], settings: DecodeSettings, policy: Policy, tag: str | None,
        learner: str,
    ) -> None:
        engine.check_fits(len(prompt_ids), settings.max_new_tokens)
        self.engine = engine
        self.model = engine.model
        self.settings = settings
        self.policy = policy
        self.learner = learner
        engine._requests += 1
        self.request = RequestInfo(engine._requests, tuple(prompt_ids), settings.max_new_tokens, tag)
        # a generator (rejection mode) or per-position Gumbel noise (gumbel mode; sampling.py)
        self.generator = randomness(settings.sampling, self.model.shape.vocab_size)
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        self.started = time.perf_counter()
        self.plan = engine._known_sources(policy.start_request(self.request))
        heads = engine.learners.start(learner, prompt_ids, settings.eos_token_ids)
        self.sources = proposers.for_request(
            DraftResources(self.model, engine.quantized_mlps, heads.head), engine.sources)
        self.cache = self.model.new_cache(len(prompt_ids) + settings.max_new_tokens + max(PROBE_TOKENS, MAX_NODES) + 2)
        self.ids = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.prefilled = 0  # prompt tokens in the cache so far
        self.budget = settings.max_new_tokens
        self.window: _Window | None = None
        self.done = False

    @property
    def prefilling(self) -> bool:
        return self.window is None

    @property
    def acceptance(self) -> float | None:
        """The fraction of drafted tokens accepted so far (None before any draft)."""
        counters = self.counters()
        return counters.acceptance_rate if counters.drafted else None

    @property
    def window_config(self) -> DraftConfig:
        """The draft configuration the open window runs (the policy's plan)."""
        if self.window is None:
            raise RuntimeError("the request has not been prefilled")
        return self.window.plan.config

    def counters(self) -> Counters:
        """The request's counters so far: closed windows and the open one."""
        total = Counters()
        total.add(self.stats.counters)
        if self.window is not None:
            total.add(self.window.counters)
        return total

    def prefill_chunk(self) -> list[int]:
        """Run the next chunk of the prompt; at the last one, return [the first new token]."""
        device = self.model.device
        end = min(self.prefilled + PREFILL_CHUNK, self.prompt_len)
        chunk = torch.tensor([self.ids[self.prefilled : end]], device=device)
        if end < self.prompt_len:
            self.model.hidden_states(chunk, self.prefilled, self.cache, _NO_SKIP, prefill=True)
            self.prefilled = end
            return []
        logits = self.model.forward(chunk, self.prefilled, self.cache, _NO_SKIP, last_only=True, prefill=True)[0]
        self.prefilled = end
        first = self.engine._pick(logits, self.settings.sampling, self.generator, self.prompt_len)
        self.ids.append(first)
        self.budget -= 1
        self.stats.prefill_time_s = time.perf_counter() - self.started
        self.window = _Window(self.plan, time.perf_counter())
        self.done = first in self.settings.eos_token_ids or self.budget == 0
        return [first]

    def propose(self, draft_limit: int | None = None, together: bool = False) -> Round:
        """This round's tree: drafted by the window's configuration, at most `draft_limit`
        drafted tokens (a batch's budget; None: the configuration's own limit), or a plain step.
        `together`: a model draft comes back as the round's `chain`, not run (Round)."""
        window = self._window()
        config = window.plan.config
        # The probe measures the window's draft for its policy; a batch that allots this request
        # no draft tokens this round does not run that draft, so it waits for a round that does
        # (in a batch of 8 the probes cost 4% of the run's time, for drafts it never bought).
        if config.probe is not None and window.probe_agreement is None and draft_limit != 0:
            window.probe_agreement = self.engine._probe(self.ids, self.cache, config.probe, window.counters)
        pending = DraftTree(self.ids[-1])
        # drafting more than budget - 1 tokens cannot pay: the verification adds one more
        limit = min(config.max_draft, self.budget - 1, MAX_NODES - 1)
        if draft_limit is not None:
            limit = min(limit, draft_limit)
        if not config.speculative or limit < 1:
            return Round(pending, None)
        t0 = time.perf_counter()
        context = DraftContext(self.ids, self.cache, config, self.settings.sampling, self.generator,
                               self.settings.eos_token_ids)
        source, tree = self.engine._propose(context, self.sources, limit, together)
        draft_time = time.perf_counter() - t0
        if isinstance(tree, ChainDraft):
            return Round(pending, source, draft_time, chain=tree)
        if source is None:  # nothing to verify: this round is a plain step
            window.counters.draft_time_s += draft_time
            return Round(pending, None)
        return self._fitted(Round(tree, source, draft_time))

    def drafted(self, round_: Round, draft_time_s: float) -> Round:
        """The round once its chain has run (in a batch, with others: `draft_time_s` is this
        request's share of those passes)."""
        assert round_.chain is not None
        return self._fitted(Round(round_.chain.tree(), round_.source, round_.draft_time_s + draft_time_s))

    def _fitted(self, round_: Round) -> Round:
        exactness = self.model.exactness
        if self.engine.exact and round_.tree.size > exactness.max_rows:
            # larger passes are not row-invariant here
            return Round(round_.tree.truncated(exactness.max_rows), round_.source, round_.draft_time_s)
        return round_

    def segment(self, round_: Round) -> Segment:
        """The rows this round's full-model pass runs for this request."""
        committed = len(self.ids) - 1
        device = self.model.device
        tree = round_.tree
        tokens = torch.tensor(tree.tokens, device=device)
        if tree.is_chain():  # causal by slot: the adapter's cheaper default mask
            return Segment(tokens, committed, self.cache)
        return Segment(tokens, committed, self.cache, tree.positions(committed, device), tree.visible(committed, device))

    def commit(self, round_: Round, logits: torch.Tensor, pass_time_s: float) -> list[int]:
        """Verify the round's tree against the full model's `logits` [size, vocab]; commit
        and return the new tokens (cut at EOS and at max_new_tokens)."""
        window = self._window()
        counters = window.counters
        t0 = time.perf_counter()
        committed = len(self.ids) - 1
        sampling = self.settings.sampling
        if round_.plain:
            counters.draft_time_s += round_.draft_time_s  # a batch may cut a drafted tree to a plain step
            new = [self.engine._pick(logits[0], sampling, self.generator, committed + 1)]
        else:
            tree = round_.tree
            if sampling.greedy:
                verdict = verify_tree_greedy(tree, logits)
            elif isinstance(self.generator, GumbelNoise):
                verdict = verify_tree_gumbel(tree, logits, sampling, self.generator, committed)
            else:
                verdict = verify_tree_sampling(tree, probabilities(logits, sampling), self.generator)
            self.cache.keep_path(committed + 1, [committed + node for node in verdict.path])
            for each in self.sources:
                each.accepted(tree, verdict.path)
            counters.draft_time_s += round_.draft_time_s
            counters.draft_rounds += 1
            counters.lookup_rounds += round_.source.model_free
            counters.drafted += tree.drafted
            counters.accepted += verdict.accepted
            new = [tree.tokens[node] for node in verdict.path] + [verdict.next_token]
        counters.verify_time_s += pass_time_s + time.perf_counter() - t0
        eos_at = next((i for i, t in enumerate(new) if t in self.settings.eos_token_ids), None)
        if eos_at is not None:
            new = new[: eos_at + 1]
        new = new[: self.budget]  # a cut only happens on the request's last round
        self.ids.extend(new)
        self.budget -= len(new)
        counters.new_tokens += len(new)
        self.done = eos_at is not None or self.budget <= 0
        return new

    def _window(self) -> _Window:
        """The open window; a full one is closed (its figures go to the policy) first."""
        if self.window is None:
            raise RuntimeError("the request has not been prefilled")
        if self.window.counters.new_tokens >= self.window.plan.window_tokens:
            self.window = self.engine._close_window(self.window, self.request, self.policy, self.stats, len(self.ids),
                                                    final=False)
        return self.window

    def finish(self) -> GenerationStats:
        """End the request (done or stopped): the last window goes to the policy, the output
        to the learner; returns the request's figures."""
        if self.window is not None:
            self.engine._close_window(self.window, self.request, self.policy, self.stats, len(self.ids), final=True)
        self.engine.learners.finish(self.learner, self.ids[self.prompt_len :])
        self.stats.new_tokens = len(self.ids) - self.prompt_len
        self.stats.wall_time_s = time.perf_counter() - self.started
        self.done = True
        return self.stats
