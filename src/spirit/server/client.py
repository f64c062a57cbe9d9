"""The client side of the server's load tools (loadtest.py, `spirit bench-serve`): closed-loop
clients on threads, and one streamed chat completion timed from the client's side.

Only the standard library (http.client): the load tools need nothing beyond the serve
extra, and a client that reads server-sent events line by line sees each chunk when it
arrives, which is what a time to first token needs.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

T = TypeVar("T")
C = TypeVar("C")  # a client's connection

# seconds one socket read may wait: a request queued behind 15 others on a slow model sends
# nothing for minutes; a hung server still ends the run, with an error, instead of never
READ_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class StreamedReply:
    """One streamed chat completion as its client saw it (times from sending the request)."""

    status: int  # HTTP status; 200 with `error` set means the stream carried an error event
    text: str  # the completion's text, every content piece joined
    completion_tokens: int  # the server's usage figure (stream_options.include_usage)
    latency_s: float  # until the stream's end ("data: [DONE]")
    first_token_s: float | None  # until the first non-empty content piece; None: there was none
    error: str | None = None
    sent_at: float = 0.0  # time.perf_counter() when the request went out
    arrivals: tuple[tuple[float, int], ...] = ()  # per content piece: (seconds since sent, characters so far)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def ended_at(self) -> float:
        return self.sent_at + self.latency_s

    def tokens_by(self, moment: float) -> float:
        """Completion tokens streamed by `moment` (a time.perf_counter() time): all of them once
        the stream has ended; before, that share of the text's characters times the usage
        figure (the server counts tokens only at the end; within one answer, characters are
        close enough to proportional to tokens for a load figure)."""
        if moment >= self.ended_at:
            return float(self.completion_tokens)
        arrived = max((chars for seconds, chars in self.arrivals if self.sent_at + seconds <= moment), default=0)
        return self.completion_tokens * arrived / len(self.text) if self.text else 0.0


class ChatClient:
    """One client's keep-alive connection to a server, streaming chat completions. Not
    thread-safe: one per client thread (reusing it keeps TCP setup out of the timings)."""

    def __init__(self, base_url: str, timeout_s: float = READ_TIMEOUT_S) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"expected a plain http:// server address, got {base_url!r}")
        self._conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s)

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> "ChatClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stream_chat(self, body: dict) -> StreamedReply:
        """POST /v1/chat/completions with `stream: true` and usage, and read it to the end."""
        payload = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}).encode()
        t0 = time.perf_counter()
        try:
            self._conn.request("POST", "/v1/chat/completions", payload, {"Content-Type": "application/json"})
            response = self._conn.getresponse()
            if response.status != 200:
                detail = _error_message(response.read())
                return StreamedReply(response.status, "", 0, time.perf_counter() - t0, None, detail, t0)
            return _read_events(response, t0)
        except (OSError, http.client.HTTPException) as exc:
            self.close()  # unusable now; the next request opens a new connection
            return StreamedReply(0, "", 0, time.perf_counter() - t0, None, f"{type(exc).__name__}: {exc}", t0)


def _error_message(body: bytes) -> str:
    """The message of an OpenAI error body, or the body's start when it is not one."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:500].decode("utf-8", "replace")


def _read_events(response: http.client.HTTPResponse, t0: float) -> StreamedReply:
    """The server-sent events of one chat completion: content pieces, usage, or an error."""
    pieces: list[str] = []
    arrivals: list[tuple[float, int]] = []
    chars = 0
    first: float | None = None
    tokens = 0
    error: str | None = None
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue  # the blank line between events
        data = line[len(b"data:"):].strip()
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            error = str(event["error"].get("message", event["error"]))
            continue
        if event.get("usage"):
            tokens = int(event["usage"]["completion_tokens"])
        for choice in event.get("choices", ()):
            piece = choice.get("delta", {}).get("content")
            if piece:
                now = time.perf_counter() - t0
                if first is None:
                    first = now
                pieces.append(piece)
                chars += len(piece)
                arrivals.append((now, chars))
    response.read()  # drain, so the connection can carry the next request
    return StreamedReply(200, "".join(pieces), tokens, time.perf_counter() - t0, first, error, t0, tuple(arrivals))


def run_clients(clients: int, take: Callable[[], int | None], connect: Callable[[], AbstractContextManager[C]],
                send: Callable[[C, int], T]) -> tuple[dict[int, T], float]:
    """`clients` closed-loop clients on threads. Each opens its own connection (`connect()`,
    closed when it ends), then asks `take` for the next request index (None: no more) and
    runs `send(connection, index)`, one request at a time. Returns every index's result and
    the wall time from the clients' start to the last answer.

    `take` is called under a lock, so a plain counter or a deadline check is enough."""
    if clients < 1:
        raise ValueError(f"clients must be >= 1, got {clients}")
    results: dict[int, T] = {}
    lock = threading.Lock()

    def client() -> None:
        with connect() as connection:
            while True:
                with lock:
                    index = take()
                if index is None:
                    return
                result = send(connection, index)
                with lock:
                    results[index] = result

    threads = [threading.Thread(target=client, name=f"spirit-client-{k}", daemon=True) for k in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def counter(n: int) -> Callable[[], int | None]:
    """A `take` for `run_clients`: 0, 1, ..., n - 1, then None."""
    state = iter(range(n))
    return lambda: next(state, None)
