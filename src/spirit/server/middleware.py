"""The ASGI middleware in front of every route: API key, body size limit, request metrics, and
the last word on exceptions no handler took.

The body is read here, whole and bounded, before FastAPI parses it: a body past the limit is
refused with 413 without being parsed, validated or tokenized, and without the server holding
more of it than the limit. A declared Content-Length past the limit is refused before any of
the body is read; without one (chunked uploads), or when it understates, the bytes are counted
as they come.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Awaitable, Callable

from spirit.server.errors import error_response, internal_error, log
from spirit.server.metrics import Metrics

Message = dict
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")
CLIENT_CLOSED = 499  # nginx's "client closed request": for the metrics, nobody reads it


class _Disconnected(Exception):
    pass


def route_label(path: str) -> str:
    """The metrics label of a path: a known route, or "other" (no label per client-chosen path)."""
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return "other"


def declared_length(scope: dict) -> int | None:
    """The Content-Length header as a number, or None when absent (the HTTP server rejects a
    malformed one before the app sees the request)."""
    for name, value in scope["headers"]:
        if name == b"content-length" and value.strip().isdigit():
            return int(value)
    return None


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body, or None as soon as more than `limit` bytes came (the rest is
    left unread). Raises _Disconnected when the client goes away meanwhile."""
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the app the body already read, then hands over to the connection's
    own (so the app still hears of a disconnect)."""
    given = False

    async def receive_again() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return receive_again


class _NotedSend:
    """Passes messages on, noting the status and whether the response has started."""

    def __init__(self, send: Send) -> None:
        self.send, self.status, self.started = send, 500, False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status, self.started = message["status"], True
        await self.send(message)


class Guard:
    """Outermost of the app's own layers, so that its checks run before any parsing and every
    answer, its own refusals and 500s included, is counted in the metrics."""

    def __init__(self, app, metrics: Metrics, max_body_bytes: int, api_key: str | None = None) -> None:
        self.app, self.metrics, self.max_body_bytes = app, metrics, max_body_bytes
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        noted = _NotedSend(send)
        try:
            await self._handle(scope, receive, noted)
        except _Disconnected:
            noted.status = CLIENT_CLOSED
        except Exception as exc:  # a bug: logged with its traceback, answered without internals
            context = f"{scope.get('method', '?')} {scope['path']}"
            if noted.started:  # too late for a 500: the stream just ends
                log.error("%s failed after its response started", context, exc_info=exc)
            else:
                await internal_error(exc, context).response()(scope, receive, noted)
        finally:
            self.metrics.observe_request(route_label(scope["path"]), noted.status, time.perf_counter() - t0)

    async def _handle(self, scope: dict, receive: Receive, send: Send) -> None:
        if not self._authorized(scope):
            response = error_response(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                      code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        declared = declared_length(scope)
        body = None if declared is not None and declared > self.max_body_bytes else await read_body(receive, self.max_body_bytes)
        if body is None:
            return await self._too_large(declared)(scope, receive, send)
        await self.app(scope, replay(body, receive), send)

    def _authorized(self, scope: dict) -> bool:
        if self.expected is None or scope["path"] == "/health":  # /health stays open for load balancers
            return True
        given = dict(scope["headers"]).get(b"authorization", b"")
        return hmac.compare_digest(given, self.expected)

    def _too_large(self, declared: int | None):
        size = f"{declared} bytes" if declared is not None and declared > self.max_body_bytes else "more"
        return error_response(413, f"the request body is too large: {size}, this server accepts at most "
                                   f"{self.max_body_bytes} bytes (--max-body-bytes)", code="request_too_large")
