"""Continuous batching: the rounds of many requests in one full-model pass, with speculation
chosen for the whole batch by measured speed.

A decode step reads every weight once whatever its rows, so a pass over 8 rows costs far
less than 8 passes over 1. Speculation spends those spare rows on one request's guesses,
batching on other requests; `allot_drafts` chooses between them each round: it gives each
request the number of draft tokens (0 allowed) that maximizes the batch's expected committed
tokens per second, from the measured cost of a pass as a function of its rows
(`PassCostModel`, learned online) and each request's measured acceptance and drafting cost.

A round of `Batch.step`:
1. at most one prefill chunk of a joining request (a pass of its own, so a long prompt holds
   the others up one chunk at a time; engine.Decoding explains why it runs alone);
2. every decoding request proposes its tree with its own policy's configuration, within its
   allotted draft tokens; model drafts of requests whose configurations skip the same
   sublayers run together, one packed pass per draft step for all of them (sharing each
   reading of the weights), the others alone;
3. one full-model pass packs all their trees (model/adapter.py `forward_packed`): the rows go
   through the linear layers together and each row attends to its own request's cache;
4. each request verifies and commits its rows; finished requests leave, new ones join.

Where the load-time check found the kernels row-invariant (model/exactness.py), every row of
a packed pass gets the bits it would get alone, so each request's output equals its solo
decoding bit for bit; the pass is kept within `exactness.max_rows` rows for that. Elsewhere
the batch still decodes correctly, but a request's tokens may differ in near-ties from solo.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from spirit.engine import Decoding, Engine, Round
from spirit.proposers.self_draft import SelfDraft, draft_together
from spirit.stats import GenerationStats
from spirit.tree import MAX_NODES

PRIOR_ACCEPTANCE = 0.5  # a request's acceptance before it has drafted (the batch's mean once known)
PRIOR_ROW_SHARE = 0.1  # without any measurement: each extra row costs this share of a 1-row pass
COST_MEMORY = 0.8  # weight of the previous estimate in each pass-cost update (an EMA per row count)


class PassCostModel:
    """Seconds of a full-model pass as a function of its rows, learned online.

    Each measured row count keeps an exponential moving average of its pass times. A row count
    not measured yet is predicted from the nearest measured one, scaled by the shape of
    `seed` (the hardware probe's cost curve, model/probe.py) or, without one, by a prior of
    PRIOR_ROW_SHARE per extra row. Only ratios of predictions matter to `allot_drafts`.
    """

    def __init__(self, seed: Callable[[int], float] | None = None) -> None:
        self.seed = seed
        self.measured: dict[int, float] = {}

    def observe(self, rows: int, seconds: float) -> None:
        old = self.measured.get(rows)
        self.measured[rows] = seconds if old is None else COST_MEMORY * old + (1 - COST_MEMORY) * seconds

    def _shape(self, rows: int) -> float:
        if self.seed is not None:
            return self.seed(rows)
        return 1.0 + PRIOR_ROW_SHARE * (rows - 1)

    def predict(self, rows: int) -> float:
        if rows in self.measured:
            return self.measured[rows]
        if not self.measured:
            return self._shape(rows)
        nearest = min(self.measured, key=lambda n: (abs(n - rows), n))
        return self.measured[nearest] * self._shape(rows) / self._shape(nearest)


@dataclass(frozen=True)
class DraftDemand:
    """What one request could use this round: up to `max_draft` draft tokens (its policy's
    limit; 0 when its configuration does not speculate), each accepted with probability
    `acceptance`, each costing `draft_cost_s` to draft (0 for prompt lookup)."""

    max_draft: int
    acceptance: float
    draft_cost_s: float = 0.0

    def expected_tokens(self, drafts: int) -> float:
        """Committed tokens expected from a chain of `drafts`: 1 + a + a^2 + ... + a^drafts."""
        a = min(max(self.acceptance, 0.0), 0.999)
        return (1 - a ** (drafts + 1)) / (1 - a)


def allot_drafts(demands: Sequence[DraftDemand], pass_cost: Callable[[int], float], max_rows: int) -> list[int]:
    """Draft tokens per request that maximize expected committed tokens per second for the
    batch: each request has one row for its pending token; draft tokens are added one at a
    time where they raise the batch's expected throughput most, until none does or the pass
    would exceed `max_rows` rows. Expected tokens grow ever more slowly with each extra draft
    (a^k) while costs grow, so the greedy steps stop at the best allotment they can reach."""
    drafts = [0] * len(demands)
    rows = len(demands)

    def throughput(counts: list[int], total_rows: int) -> float:
        tokens = sum(d.expected_tokens(k) for d, k in zip(demands, counts))
        seconds = pass_cost(total_rows) + sum(d.draft_cost_s * k for d, k in zip(demands, counts))
        return tokens / seconds

    best = throughput(drafts, rows)
    while rows < max_rows:
        choice, choice_speed = None, best
        for i, demand in enumerate(demands):
            if drafts[i] >= demand.max_draft:
                continue
            drafts[i] += 1
            speed = throughput(drafts, rows + 1)
            drafts[i] -= 1
            if speed > choice_speed:
                choice, choice_speed = i, speed
        if choice is None:
            break
        drafts[choice] += 1
        rows += 1
        best = choice_speed
    return drafts


@dataclass
class Member:
    """A request in the batch: its decoding state and where its tokens go. `emit` gets each
    round's new tokens and answers whether to go on (False: a stop string, a client that
    left); `done` gets the request's figures when it ends."""

    decoding: Decoding
    emit: Callable[[list[int]], bool]
    done: Callable[[GenerationStats], None]
    stopped: bool = False


@dataclass
class BatchStats:
    """Totals over the batch's packed passes (prefill chunks are counted apart)."""

    passes: int = 0
    rows: int = 0
    pass_time_s: float = 0.0
    most_requests: int = 0  # in one pass
    prefill_chunks: int = 0
    draft_groups: int = 0  # groups of model drafts run together (one packed pass per step)
    drafts_together: int = 0  # requests' model drafts run in those groups

    def add(self, requests: int, rows: int, seconds: float) -> None:
        self.passes, self.rows, self.pass_time_s = self.passes + 1, self.rows + rows, self.pass_time_s + seconds
        self.most_requests = max(self.most_requests, requests)


class Batch:
    """Requests decoding together on one engine; not thread-safe (one worker drives it)."""

    def __init__(self, engine: Engine, max_batch: int) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.engine = engine
        self.max_batch = max_batch
        costs = engine.costs
        seed = None
        if costs is not None and costs.target in costs.formats:
            seed = lambda rows: costs.pass_ms(costs.target, rows)  # noqa: E731 - the probe's curve, by rows
        self.pass_costs = PassCostModel(seed)
        self.members: list[Member] = []
        self.stats = BatchStats()
        # the most rows one packed pass may have: within the row-invariant range where exact
        self.max_rows = engine.model.exactness.max_rows if engine.exact else MAX_NODES

    def __len__(self) -> int:
        return len(self.members)

    @property
    def full(self) -> bool:
        return len(self.members) >= self.max_batch

    def add(self, decoding: Decoding, emit: Callable[[list[int]], bool], done: Callable[[GenerationStats], None]) -> None:
        if self.full:
            raise RuntimeError(f"the batch already holds {self.max_batch} requests")
        self.members.append(Member(decoding, emit, done))

    def step(self) -> None:
        """One round for every request (see the module docstring); finished ones leave."""
        joining = next((m for m in self.members if m.decoding.prefilling), None)
        if joining is not None:
            self.stats.prefill_chunks += 1
            first = joining.decoding.prefill_chunk()
            if first:
                self._emit(joining, first)
        decoding = [m for m in self.members if not m.decoding.prefilling and not m.decoding.done and not m.stopped]
        if decoding:
            self._decode_round(decoding)
        for member in [m for m in self.members if m.decoding.done or m.stopped]:
            self.members.remove(member)
            member.done(member.decoding.finish())

    def cancel_all(self) -> None:
        """End every request now (the server is closing): each gets its figures so far."""
        for member in self.members:
            member.done(member.decoding.finish())
        self.members.clear()

    def _decode_round(self, members: list[Member]) -> None:
        limits: list[int | None]
        if len(members) == 1:
            limits = [None]  # alone: its policy's own choice, exactly as unbatched decoding
        else:
            limits = list(allot_drafts([self._demand(m.decoding) for m in members], self.pass_costs.predict,
                                       self.max_rows))
        together = len(members) > 1
        rounds: list[Round] = [m.decoding.propose(limit, together) for m, limit in zip(members, limits)]
        rounds = self._fit(self._draft_together(members, rounds))
        segments = [m.decoding.segment(r) for m, r in zip(members, rounds)]
        rows = sum(r.tree.size for r in rounds)
        t0 = time.perf_counter()
        logits = self.engine.model.forward_packed(segments, exact=self.engine.exact)
        seconds = time.perf_counter() - t0
        self.pass_costs.observe(max(rows, self.engine.model.exactness.min_rows if self.engine.exact else 1), seconds)
        self.stats.add(len(members), rows, seconds)
        for member, round_, rows_logits in zip(members, rounds, logits):
            self._emit(member, member.decoding.commit(round_, rows_logits, seconds))

    def _draft_together(self, members: list[Member], rounds: list[Round]) -> list[Round]:
        """Run the rounds' model drafts: the chains that skip the same sublayers with the same
        MLPs step together, one packed pass per step (proposers/self_draft.py
        `draft_together`); each request is charged an equal share of its group's time."""
        groups: dict[tuple, list[int]] = {}
        for i, round_ in enumerate(rounds):
            if round_.chain is not None:
                config = round_.chain.config
                groups.setdefault((config.skip, config.draft_bits), []).append(i)
        rounds = list(rounds)
        for indices in groups.values():
            source, chains = rounds[indices[0]].source, [rounds[i].chain for i in indices]
            assert isinstance(source, SelfDraft)
            t0 = time.perf_counter()
            draft_together(self.engine.model, chains, source.mlps(chains[0].config))
            share = (time.perf_counter() - t0) / len(indices)
            self.stats.draft_groups += 1
            self.stats.drafts_together += len(indices)
            for i in indices:
                rounds[i] = members[i].decoding.drafted(rounds[i], share)
        return rounds

    def _fit(self, rounds: list[Round]) -> list[Round]:
        """Trim trees (largest first) until the pass fits `max_rows`: a request whose policy
        drafted past its allotment (a lone request) or a tree source that overshot."""
        total = sum(r.tree.size for r in rounds)
        while total > self.max_rows:
            i = max(range(len(rounds)), key=lambda j: rounds[j].tree.size)
            tree = rounds[i].tree
            keep = max(1, tree.size - (total - self.max_rows))
            # nothing drafted left: a plain step (its drafting time is still spent)
            rounds[i] = Round(tree.truncated(keep), rounds[i].source if keep > 1 else None, rounds[i].draft_time_s)
            total = sum(r.tree.size for r in rounds)
        return rounds

    def _demand(self, decoding: Decoding) -> DraftDemand:
        config = decoding.window_config
        if not config.speculative:
            return DraftDemand(0, 0.0)
        counters = decoding.counters()
        acceptance = decoding.acceptance
        if acceptance is None:
            known = [m.decoding.acceptance for m in self.members if m.decoding.acceptance is not None]
            acceptance = sum(known) / len(known) if known else PRIOR_ACCEPTANCE
        model_drafted = counters.drafted if counters.draft_rounds > counters.lookup_rounds else 0
        draft_cost = counters.draft_time_s / model_drafted if model_drafted else 0.0
        max_draft = min(config.max_draft, decoding.budget - 1, MAX_NODES - 1)
        return DraftDemand(max(0, max_draft), acceptance, draft_cost)

    def _emit(self, member: Member, tokens: list[int]) -> None:
        if not member.emit(tokens):
            member.stopped = True
