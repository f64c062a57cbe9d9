"""`spirit bench-serve`: the HTTP server under 1..16 concurrent clients, one request at a
time (`max_batch` 1) against continuous batching (`max_batch` N), on Spec-Bench prompts.

The servers run **in this process**, each on its own thread and free 127.0.0.1 port
(`ServerThread`, as loadtest.py does), not as `spirit serve` subprocesses, because:
- both settings serve the *same* loaded model, so the comparison is of the scheduler alone
  (same weights, same dtype and packing, same learned draft state), with one model load;
- the tests run it on a tiny random model, which only exists in a Python process;
- the client threads cost the server little: they wait on sockets, which releases the GIL.
  (spirit's own kernels keep the GIL while they run; letting go of it, so that clients and
  the event loop run beside a pass, measured no faster: 3.12x against 3.29x at 8 clients.)
The two servers are started once each and used strictly one after the other (never both at
once), so the engine is never shared by two running schedulers.

What runs, in order:
1. a warm-up request on each server (the first request pays one-off costs);
2. the solo reference: every prompt alone (1 client) on the `max_batch` 1 server; its text
   is what every later request of that prompt must return, greedy decoding being
   deterministic whatever else the server is doing;
3. for each client count, every server setting back to back, the order of the settings
   reversed from one client count to the next (1 N, N 1, 1 N, ...), so drift of the machine
   and what the shared policy learns along the way favour neither setting.

A run of c clients sends c * ceil(P / c) requests for P prompts, so every prompt runs at
least once and every client sends as many requests as the others; clients are closed
loops (the next request goes out when the last answer has ended) pulling request indices
from one shared counter; request i asks prompt i mod P.

Figures (`RunFigures`), all from the client's side, queueing included:
- aggregate tok/s = completion tokens of every answered request / the run's wall time;
- per-request tok/s = a request's completion tokens / its latency (median over requests);
- time to first token = until the first non-empty content piece of the stream;
- latency = until the stream's end; percentiles by linear interpolation (`percentile`);
- busy tok/s = completion tokens streamed while every client had a request in flight, over
  that time (`busy_window`): from the first request to the moment the first client has no
  request left, so without the run's tail, where the last requests end one by one and fewer
  than c clients load the server. It keeps the start, where every client's first prompt
  arrives at once, so a short run's figure is not the steady state either (docs/server.md).
  A request cut by the window's end counts the share of its text that had arrived
  (`StreamedReply.tokens_by`);
- batching ratio = aggregate tok/s of `max_batch` N over `max_batch` 1 at the same client
  count; p50 latency relative to a lone request = the run's p50 latency over the same
  setting's p50 at 1 client (the solo reference's p50 when 1 client is not in the run).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from spirit.bench.questions import Question
from spirit.server.client import ChatClient, StreamedReply, counter, run_clients

DEFAULT_CLIENTS = (1, 2, 4, 8, 16)
WARMUP_TOKENS = 8  # enough to reach the decoding loop once; the output is not kept
SNIPPET = 40  # characters shown either side of a mismatch


@dataclass(frozen=True)
class LoadSettings:
    """What one `spirit bench-serve` run measures."""

    clients: tuple[int, ...] = DEFAULT_CLIENTS
    max_batches: tuple[int, ...] = (1, 8)  # always 1 first: the solo reference runs there
    max_tokens: int = 64
    method: str = "spirit"
    skip: str | None = None  # the skip set of method "static"

    def __post_init__(self) -> None:
        if not self.clients or min(self.clients) < 1:
            raise ValueError(f"--clients: every count must be >= 1, got {','.join(map(str, self.clients)) or 'none'}")
        if not self.max_batches or min(self.max_batches) < 1:
            raise ValueError(f"--max-batch must be >= 1, got {min(self.max_batches, default=0)}")
        if self.max_batches[0] != 1:
            raise ValueError("the first server setting must be max_batch 1 (the solo reference runs there)")


@dataclass(frozen=True)
class Prompt:
    """A question's first turn, sent as one user message (later turns would need the model's
    own earlier answers, which differ from method to method)."""

    question_id: int | str
    category: str
    text: str


def prompts_of(questions: Sequence[Question]) -> list[Prompt]:
    return [Prompt(q.question_id, q.category, q.turns[0]) for q in questions]


def requests_for(prompts: int, clients: int) -> int:
    """Requests in a run: every prompt once, rounded up so every client sends as many."""
    return clients * math.ceil(prompts / clients)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation between the closest ranks
    (numpy's default): for n values, rank q/100 * (n - 1). None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in 0..100, got {q}")
    ordered = sorted(values)
    if not ordered:
        return None
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Mismatch:
    """A request whose text differs from its prompt's solo greedy decoding."""

    request: int
    prompt: int  # index into the prompts
    position: int  # the first character that differs
    expected: str  # the reference around that character
    got: str

    def describe(self, prompts: Sequence[Prompt]) -> str:
        p = prompts[self.prompt]
        return (f"request {self.request} (question {p.question_id}, {p.category}), character {self.position}: "
                f"expected {self.expected!r}, got {self.got!r}")


def first_difference(a: str, b: str) -> int | None:
    """The index of the first character where `a` and `b` differ (or one ends); None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def find_mismatches(reference: Sequence[str], replies: Mapping[int, StreamedReply]) -> list[Mismatch]:
    """Every answered request whose text is not its prompt's reference (request i asks prompt
    i mod len(reference)); failed requests are counted as errors, not here."""
    found = []
    for request, reply in sorted(replies.items()):
        if not reply.ok:
            continue
        prompt = request % len(reference)
        at = first_difference(reference[prompt], reply.text)
        if at is not None:
            start = max(0, at - SNIPPET)
            found.append(Mismatch(request, prompt, at, reference[prompt][start:at + SNIPPET],
                                  reply.text[start:at + SNIPPET]))
    return found


@dataclass(frozen=True)
class RunFigures:
    """One run's figures (see the module docstring); seconds; None where nothing was measured."""

    requests: int
    errors: int
    mismatches: int
    completion_tokens: int
    wall_s: float
    aggregate_tok_s: float
    request_tok_s_p50: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    latency_p50_s: float | None
    latency_p90_s: float | None
    latency_p99_s: float | None
    busy_s: float | None = None
    busy_tok_s: float | None = None


def busy_window(replies: Mapping[int, StreamedReply],
                client_of: Mapping[int, Hashable]) -> tuple[float, float] | None:
    """The (start, end) time.perf_counter() times during which every client had a request in
    flight: from the first request sent to the first client's last answer (a closed-loop
    client has one request in flight from its first send to its last answer). `client_of`:
    request index -> the client that sent it. None without replies."""
    if not replies:
        return None
    start = min(r.sent_at for r in replies.values())
    last: dict[Hashable, float] = {}
    for index, r in replies.items():
        last[client_of[index]] = max(last.get(client_of[index], start), r.ended_at)
    return start, min(last.values())


@dataclass
class LoadRun:
    """One server setting under one client count (or the solo reference)."""

    max_batch: int
    clients: int
    order: int  # position in the order the runs ran; the reference is 0
    wall_s: float
    replies: dict[int, StreamedReply]  # by request index
    mismatches: list[Mismatch] = field(default_factory=list)
    busy: tuple[float, float] | None = None  # busy_window's

    @property
    def errors(self) -> list[tuple[int, StreamedReply]]:
        return [(i, r) for i, r in sorted(self.replies.items()) if not r.ok]

    def figures(self) -> RunFigures:
        ok = [r for r in self.replies.values() if r.ok]
        tokens = sum(r.completion_tokens for r in ok)
        latencies = [r.latency_s for r in ok]
        ttfts = [r.first_token_s for r in ok if r.first_token_s is not None]
        per_request = [r.completion_tokens / r.latency_s for r in ok if r.latency_s > 0]
        busy_s = busy_tok_s = None
        if self.busy is not None and self.busy[1] > self.busy[0]:
            busy_s = self.busy[1] - self.busy[0]
            busy_tok_s = sum(r.tokens_by(self.busy[1]) for r in ok) / busy_s
        return RunFigures(
            requests=len(self.replies), errors=len(self.replies) - len(ok), mismatches=len(self.mismatches),
            completion_tokens=tokens, wall_s=self.wall_s, aggregate_tok_s=tokens / self.wall_s if self.wall_s > 0 else 0.0,
            request_tok_s_p50=percentile(per_request, 50), ttft_p50_s=percentile(ttfts, 50),
            ttft_p90_s=percentile(ttfts, 90), latency_p50_s=percentile(latencies, 50),
            latency_p90_s=percentile(latencies, 90), latency_p99_s=percentile(latencies, 99),
            busy_s=busy_s, busy_tok_s=busy_tok_s,
        )


@dataclass
class ServeLoadResult:
    """Everything one `spirit bench-serve` run measured: the report and results.json are
    written from this alone."""

    model: str
    dtype: str
    settings: LoadSettings
    prompts: list[Prompt]
    reference: LoadRun
    runs: list[LoadRun]  # in the order they ran
    machine: dict = field(default_factory=dict)
    exactness: dict | None = None
    elapsed_s: float = 0.0
    command: str = ""

    def run(self, max_batch: int, clients: int) -> LoadRun | None:
        return next((r for r in self.runs if r.max_batch == max_batch and r.clients == clients), None)

    def batching_ratio(self, max_batch: int, clients: int, busy: bool = False) -> float | None:
        """Aggregate tok/s (`busy`: busy tok/s) of `max_batch` over one-at-a-time, at the same
        client count."""
        run, solo = self.run(max_batch, clients), self.run(1, clients)
        if run is None or solo is None:
            return None
        figure = (lambda f: f.busy_tok_s) if busy else (lambda f: f.aggregate_tok_s)
        value, base = figure(run.figures()), figure(solo.figures())
        return value / base if value is not None and base else None

    def lone(self, max_batch: int) -> LoadRun:
        """What a run's latency is compared with: the same setting at 1 client, else the reference."""
        return self.run(max_batch, 1) or self.reference

    def relative_latency(self, run: LoadRun) -> float | None:
        p50, base = run.figures().latency_p50_s, self.lone(run.max_batch).figures().latency_p50_s
        return p50 / base if p50 is not None and base else None

    def prefill_ceiling(self) -> float | None:
        """The solo reference's total latency over its total time to first token: the most any
        batching can gain on these prompts and answer lengths. Prefill is compute-bound and
        shared by no one, so a batched run still pays every prompt's prefill in turn; even if
        decoding cost nothing, its aggregate tok/s could not exceed one-at-a-time's by more."""
        ok = [r for r in self.reference.replies.values() if r.ok and r.first_token_s is not None]
        first = sum(r.first_token_s for r in ok)
        return sum(r.latency_s for r in ok) / first if first > 0 else None

    @property
    def mismatches(self) -> int:
        return sum(len(r.mismatches) for r in self.runs)

    @property
    def errors(self) -> int:
        return sum(len(r.errors) for r in self.runs)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _body(prompt: Prompt, max_tokens: int) -> dict:
    # greedy; no "method": the server's --method applies, as for any client that names none
    return {"messages": [{"role": "user", "content": prompt.text}], "max_tokens": max_tokens, "temperature": 0}


def measure(url: str, prompts: Sequence[Prompt], clients: int,
            max_tokens: int) -> tuple[dict[int, StreamedReply], float, tuple[float, float] | None]:
    """One run: `clients` closed-loop clients, each on its own connection, through
    `requests_for` requests; request i asks prompt i mod P. Returns the replies by request
    index, the wall time and the busy window."""
    client_of: dict[int, int] = {}

    def send(client: ChatClient, i: int) -> StreamedReply:
        client_of[i] = id(client)  # one connection per client thread, kept for its whole run
        return client.stream_chat(_body(prompts[i % len(prompts)], max_tokens))

    replies, wall = run_clients(clients, counter(requests_for(len(prompts), clients)), lambda: ChatClient(url), send)
    return replies, wall, busy_window(replies, client_of)


def solo_reference(url: str, prompts: Sequence[Prompt], max_tokens: int) -> LoadRun:
    """Every prompt alone on the one-at-a-time server; a failure here is the input's fault
    (a prompt too long for the context, say), so it ends the benchmark with its reason."""
    replies, wall, busy = measure(url, prompts, 1, max_tokens)
    for i, reply in sorted(replies.items()):
        if not reply.ok:
            p = prompts[i]
            raise ValueError(f"the solo reference request for question {p.question_id} ({p.category}) failed "
                             f"(HTTP {reply.status}): {reply.error}")
    return LoadRun(1, 1, 0, wall, replies, busy=busy)


def run_order(settings: LoadSettings) -> list[tuple[int, int]]:
    """(max_batch, clients) in the order they run: per client count, every setting back to
    back, the settings' order reversed from one client count to the next."""
    order = []
    for k, clients in enumerate(settings.clients):
        batches = settings.max_batches if k % 2 == 0 else tuple(reversed(settings.max_batches))
        order += [(b, clients) for b in batches]
    return order


def run_serve_load(lm, prompts: Sequence[Prompt], settings: LoadSettings,
                   log: Callable[[str], None] = _log) -> ServeLoadResult:
    """Start one server per setting over `lm`, warm each up, take the solo reference, then
    run every (setting, clients) in `run_order`; see the module docstring."""
    from contextlib import ExitStack

    from spirit.bench.machine import machine_info
    from spirit.bench.runner import exactness_of
    from spirit.server import ServerConfig, ServerThread

    if not prompts:
        raise ValueError("no prompts to send")
    t0 = time.perf_counter()
    with ExitStack() as stack:
        urls: dict[int, str] = {}
        for max_batch in settings.max_batches:
            # no request timeout: at 16 clients one at a time a request may wait for minutes,
            # and that wait is what is measured; every client fits in the queue
            config = ServerConfig(method=settings.method, skip=settings.skip, max_batch=max_batch,
                                  max_queue=max(16, max(settings.clients)), request_timeout_s=None)
            urls[max_batch] = stack.enter_context(ServerThread(lm, config)).url
            with ChatClient(urls[max_batch]) as client:
                warm = client.stream_chat(_body(prompts[0], min(WARMUP_TOKENS, settings.max_tokens)))
            if not warm.ok:
                raise ValueError(f"the warm-up request failed (HTTP {warm.status}): {warm.error}")
        log(f"solo reference: {len(prompts)} prompts, 1 client, max_batch 1")
        reference = solo_reference(urls[1], prompts, settings.max_tokens)
        texts = [reference.replies[i].text for i in range(len(prompts))]
        runs = []
        for order, (max_batch, n_clients) in enumerate(run_order(settings), 1):
            replies, wall, busy = measure(urls[max_batch], prompts, n_clients, settings.max_tokens)
            run = LoadRun(max_batch, n_clients, order, wall, replies, find_mismatches(texts, replies), busy)
            runs.append(run)
            f = run.figures()
            log(f"max_batch {max_batch:2d}, {n_clients:2d} clients: {f.requests} requests, "
                f"{f.aggregate_tok_s:.1f} tok/s, {f.errors} errors, {f.mismatches} mismatches")
    return ServeLoadResult(
        model=lm.name, dtype=str(lm.dtype).removeprefix("torch."), settings=settings, prompts=list(prompts),
        reference=reference, runs=runs, machine=machine_info(lm), exactness=exactness_of(lm),
        elapsed_s=time.perf_counter() - t0,
    )
