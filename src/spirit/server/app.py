"""The OpenAI-compatible HTTP app over one `Spirit`: `create_app(lm, ServerConfig(...))`.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both with
`stream: true` as server-sent events), GET /health, GET /metrics (Prometheus text).

A request's body is read whole and bounded before anything parses it (413 past
`max_body_bytes`, middleware.py). Its fields are checked on the event loop (schema, model
name, allowed method, sampling parameters); the prompt is tokenized, chat template included,
on a tokenizer thread, so a long prompt does not hold up other connections; then its length
is checked against the context. A wrong request gets a 4xx and an OpenAI error body; a fault
of the server's gets a 500 that names only a reference to the log (errors.py). Accepted
requests wait in the scheduler's bounded line (429 + Retry-After when it is full) and run one
at a time on its worker thread. A request that times out (504) or whose client goes away is
cancelled, which frees the engine after its current round.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from spirit.api import GenerationResult, Spirit
from spirit.engine import ContextLengthError
from spirit.request import Request as GenerationRequest
from spirit.sampling import SamplingParams
from spirit.server import methods
from spirit.server.config import DEFAULT_MAX_BODY_BYTES, ServerConfig
from spirit.server.errors import APIError, error_response, internal_error
from spirit.server.metrics import Metrics
from spirit.server.middleware import Guard
from spirit.server.scheduler import Job, QueueFull, Scheduler, SchedulerClosed
from spirit.server.schemas import ChatCompletionRequest, CompletionRequest
from spirit.skipset import SkipSet

__all__ = ["APIError", "DEFAULT_MAX_BODY_BYTES", "ServerConfig", "create_app", "error_response"]

GREEDY_BELOW = 1e-5


class _ClientGone(Exception):
    pass


class _TimedOut(Exception):
    pass


class _Events:
    """Reads a job's events, giving up at the deadline or when the client has gone away."""

    def __init__(self, request: Request, job: Job, deadline: float | None, poll_s: float) -> None:
        self.request, self.job, self.deadline, self.poll_s = request, job, deadline, poll_s
        self._getter: asyncio.Future | None = None  # kept across polls so no event is lost
        self._checked = time.perf_counter()  # when the connection was last checked

    async def next(self) -> tuple[str, object]:
        while True:
            # checked every poll_s, whether or not events came meanwhile: a fast generation
            # sends one per round and must still notice a client that went away
            if time.perf_counter() - self._checked >= self.poll_s:
                self._checked = time.perf_counter()
                if await self.request.is_disconnected():
                    raise _ClientGone
            wait = self.poll_s
            if self.deadline is not None:
                wait = min(wait, self.deadline - time.perf_counter())
                if wait <= 0:
                    raise _TimedOut
            if self._getter is None:
                self._getter = asyncio.ensure_future(self.job.events.get())
            done, _ = await asyncio.wait({self._getter}, timeout=wait)
            if done:
                event, self._getter = self._getter.result(), None
                return event

    def close(self) -> None:
        if self._getter is not None:
            self._getter.cancel()


def _job_error(exc: BaseException, ident: str) -> APIError:
    """The answer to a job that failed on the engine thread. Every input was checked before the
    job was queued (prepare), so a failure there is the server's, logged and answered 500; the
    context is the one input that is still checked there, with a message of spirit's own."""
    if isinstance(exc, ContextLengthError):
        return APIError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, SchedulerClosed):
        return APIError(503, "the server is shutting down", "server_error", code="shutting_down")
    return internal_error(exc, f"generation {ident}")


def _chat_template_refusal(exc: Exception) -> bool:
    """Whether `exc` is the chat template refusing the messages (its `raise_exception`, e.g.
    "roles must alternate"): the client's to fix. A template that does not parse is not."""
    try:
        from jinja2 import TemplateError, TemplateSyntaxError
    except ImportError:
        return False
    return isinstance(exc, TemplateError) and not isinstance(exc, TemplateSyntaxError)


class _Server:
    """The state behind the routes: the model, its scheduler, the metrics."""

    def __init__(self, lm: Spirit, config: ServerConfig) -> None:
        self.lm, self.config = lm, config
        self.name = config.model_name or lm.name
        self.created = int(time.time())
        self.metrics = Metrics()
        if config.skip:
            SkipSet.parse(config.skip).validate(lm.num_layers)  # a layer the model lacks: fail at start
        self.allowed = config.allowed_methods
        methods.prepare(lm, self.allowed, config.skip)  # no request may start a build
        self.scheduler = Scheduler(lm, config.max_queue, on_finish=self._finished, max_batch=config.max_batch)
        self.vocab_size = int(getattr(lm.hf_model.config, "vocab_size", 0) or len(lm.tokenizer))
        # one thread: requests tokenize one at a time, as they did on the event loop (a
        # tokenizer is not safe to call from several threads at once), but off the loop
        self.tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spirit-tokenize")

    def close(self) -> None:
        self.scheduler.close()
        self.tokenizing.shutdown(wait=False, cancel_futures=True)

    def _finished(self, job: Job, result: GenerationResult | None, error: BaseException | None) -> None:
        if result is not None:
            self.metrics.observe_generation(result)

    # -- checks ----------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.name, self.lm.name):
            raise APIError(404, f"The model '{model}' does not exist; this server serves '{self.name}'",
                           param="model", code="model_not_found")

    def check_method(self, method: str | None) -> str:
        """The request's method, or the server's; a 4xx naming the allowed ones otherwise."""
        method = method or self.config.method
        allowed = ", ".join(self.allowed)
        if method in self.allowed:
            return method
        if method in methods.servable_methods():
            raise APIError(403, f"method {method!r} is not allowed on this server; allowed: {allowed} "
                                "(the server's --allow-methods)", param="method", code="method_not_allowed")
        raise APIError(400, f"unknown method {method!r}; this server allows {allowed}", param="method")

    def prepare(self, body, method: str, prompt_ids: list[int], max_tokens: int | None, param: str) -> dict:
        """The keyword arguments of Spirit.stream, or an APIError for a bad request: every
        input is checked here, so whatever fails later on the engine thread is a fault."""
        context = self.lm.engine.max_context
        if max_tokens is None:  # chat without a limit: what the context leaves, within a bound
            max_tokens = max(1, min(self.config.chat_max_tokens, context - len(prompt_ids)))
        # below this a temperature is greedy decoding (vLLM's epsilon); dividing logits by 1e-40
        # overflows float32 and the sampler would fail
        temperature = body.temperature if body.temperature >= GREEDY_BELOW else 0.0
        # a top_p that rounds to 0 in float32 would keep no token; any top_p this small keeps one
        top_p = max(body.top_p, GREEDY_BELOW)
        kwargs = dict(max_new_tokens=max_tokens, method=method, temperature=temperature, top_p=top_p,
                      top_k=body.top_k, seed=body.seed, sampling_mode=body.sampling_mode, stop=body.stop_list)
        if method == "static" and self.config.skip:
            kwargs["skip"] = self.config.skip
        try:
            SamplingParams(temperature, top_p, body.top_k, body.seed, body.sampling_mode)
            self.lm.engine.check_fits(len(prompt_ids), max_tokens)
            GenerationRequest.build(prompt_ids, **kwargs)  # the check Spirit.stream will make
        except ContextLengthError as exc:
            raise APIError(400, str(exc), param=param, code="context_length_exceeded") from None
        except ValueError as exc:  # messages of spirit's own, about the request's values
            raise APIError(400, str(exc)) from None
        return kwargs

    async def prompt_ids(self, prompt, chat: bool, param: str) -> list[int]:
        """The prompt's token ids, worked out on the tokenizer thread: templating and
        tokenizing a long prompt takes long enough to stall every other connection if done
        on the event loop (the body limit bounds how long)."""
        work = functools.partial(self._prompt_ids, prompt, chat, param)
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, work)

    def _prompt_ids(self, prompt, chat: bool, param: str) -> list[int]:
        try:
            ids = self.lm.encode(prompt, chat)
        except ValueError as exc:  # no chat template, text the tokenizer cannot encode
            raise APIError(400, str(exc), param=param) from None
        except Exception as exc:
            if not _chat_template_refusal(exc):
                raise
            raise APIError(400, f"the model's chat template refuses these messages: {exc}", param=param) from None
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})", param=param)
        if not ids:
            raise APIError(400, "the prompt encodes to no tokens", param=param)
        return ids

    # -- running ---------------------------------------------------------------------------

    async def run(self, request: Request, prompt_ids: list[int], kwargs: dict, chat: bool, stream: bool,
                  include_usage: bool) -> Response:
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        try:
            job = self.scheduler.submit(prompt_ids, kwargs)
        except QueueFull as exc:
            raise APIError(429, f"the server is busy ({exc}); retry later", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(self.scheduler.retry_after_s())}) from None
        except SchedulerClosed as exc:
            raise APIError(503, str(exc), "server_error", code="shutting_down") from None
        timeout = self.config.request_timeout_s
        events = _Events(request, job, time.perf_counter() + timeout if timeout else None, self.config.poll_s)
        try:
            kind, value = await events.next()  # "started", or an error found while starting
        except (_TimedOut, _ClientGone) as exc:
            events.close()
            self.scheduler.withdraw(job)
            if isinstance(exc, _ClientGone):
                return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
            raise APIError(504, f"the request timed out after {timeout:g} s (waiting and generating)",
                           "timeout_error", code="timeout") from None
        if kind == "error":
            events.close()
            raise _job_error(value, ident)
        if stream:
            return StreamingResponse(self._sse(events, ident, len(prompt_ids), chat, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            while True:
                kind, value = await events.next()
                if kind == "done":
                    break
                if kind == "error":
                    raise _job_error(value, ident)
        except (_TimedOut, _ClientGone) as exc:
            self.scheduler.withdraw(job)
            if isinstance(exc, _ClientGone):
                return Response(status_code=499)
            raise APIError(504, f"the request timed out after {timeout:g} s (waiting and generating)",
                           "timeout_error", code="timeout") from None
        finally:
            events.close()
        return JSONResponse(self._full_body(ident, value, len(prompt_ids), chat))

    def _usage(self, n_prompt: int, result: GenerationResult) -> dict:
        n_new = len(result.token_ids)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_new, "total_tokens": n_prompt + n_new}

    @staticmethod
    def _spirit(result: GenerationResult) -> dict:
        """The request's own figures: its method and its timing. Nothing about its drafts
        (acceptance, skip ratio, draft vocabulary, the policy's state): those depend on what
        earlier requests, other users' included, taught the shared policy and draft heads,
        and would show a client something of other users' text (docs/server.md)."""
        s = result.stats
        return {"method": result.method, "wall_time_s": round(s.wall_time_s, 6), "tokens_per_s": round(s.tokens_per_s, 3)}

    @staticmethod
    def _finish(result: GenerationResult) -> str:
        return "stop" if result.finish_reason == "stop" else "length"

    def _full_body(self, ident: str, result: GenerationResult | None, n_prompt: int, chat: bool) -> dict:
        if result is None:
            raise RuntimeError("generation ended without a result")  # a bug: logged, answered 500
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                      "logprobs": None, "finish_reason": self._finish(result)}
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": self._finish(result)}
        return {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.name, "system_fingerprint": None, "choices": [choice],
                "usage": self._usage(n_prompt, result), "spirit": self._spirit(result)}

    async def _sse(self, events: _Events, ident: str, n_prompt: int, chat: bool, include_usage: bool):
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(piece: str | None, finish: str | None = None, first: bool = False, **extra) -> str:
            if chat:
                delta = {} if piece is None else {"content": piece}
                if first:
                    delta = {"role": "assistant", "content": ""}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
            body = {"id": ident, "object": obj, "created": created, "model": self.name, "system_fingerprint": None,
                    "choices": [choice], **extra}
            return f"data: {json.dumps(body)}\n\n"

        finished = False
        try:
            if chat:
                yield chunk(None, first=True)
            while True:
                try:
                    kind, value = await events.next()
                except _TimedOut:
                    err = {"message": f"the request timed out after {self.config.request_timeout_s:g} s",
                           "type": "timeout_error", "param": None, "code": "timeout"}
                    yield f"data: {json.dumps({'error': err})}\n\n"
                    break
                if kind == "piece":
                    yield chunk(value)
                elif kind == "error":
                    finished = True
                    yield f"data: {json.dumps({'error': _job_error(value, ident).body()})}\n\n"
                    break
                elif kind == "done":
                    finished = True
                    result: GenerationResult = value
                    yield chunk(None, self._finish(result), spirit=self._spirit(result))
                    if include_usage:
                        usage = {"id": ident, "object": obj, "created": created, "model": self.name,
                                 "system_fingerprint": None, "choices": [], "usage": self._usage(n_prompt, result)}
                        yield f"data: {json.dumps(usage)}\n\n"
                    break
            yield "data: [DONE]\n\n"
        except _ClientGone:
            pass
        finally:  # also reached when the client disconnects and the response task is cancelled
            events.close()
            if not finished:
                self.scheduler.withdraw(events.job)


# pydantic's name for a branch of a union in an error location: `str`, `list[int]`, `TextPart`
_UNION_BRANCH = re.compile(r"^(str|int|float|bool|list|dict|none|function-\w+|.*\[.*\]|[A-Z]\w*)$")


def _param(loc) -> str | None:
    """The dotted field path of a validation error, without "body" or union branch names."""
    parts: list[str] = []
    for p in loc:
        if p == "body":
            continue
        if isinstance(p, str) and _UNION_BRANCH.match(p):
            break
        parts.append(str(p))
    return ".".join(parts) or None


def create_app(lm: Spirit, config: ServerConfig = ServerConfig()) -> FastAPI:
    """The FastAPI app serving `lm`; its worker thread starts now and stops at shutdown."""
    server = _Server(lm, config)  # the config checked itself when it was made

    @asynccontextmanager
    async def lifespan(app):
        yield
        server.close()

    app = FastAPI(title="spirit", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible completions over spirit's self-speculative decoding.")
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON body: {first.get('msg')}", code="invalid_json")
        param = _param(first.get("loc", ()))
        same = [e for e in errors if _param(e.get("loc", ())) == param]
        said = " or ".join(dict.fromkeys(str(e.get("msg")) for e in same))  # a union: each way it failed
        message = f"{param}: {said}" if param else said
        if len(errors) > len(same):
            message += f" (and {len(errors) - len(same)} more problems)"
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    # no handler for other exceptions: Guard logs them and answers a 500 without internals

    @app.get("/health")
    async def health():
        s = server.scheduler
        return {"status": "ok", "model": server.name, "queue_depth": s.queue_depth, "busy": s.busy, "running": s.running}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        s = server.scheduler
        text = server.metrics.render(s.queue_depth, s.max_queue, s.running)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict:
        return {"id": server.name, "object": "model", "created": server.created, "owned_by": "spirit"}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model}")
    async def get_model(model: str):
        server.check_model(model)
        return model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        server.check_model(body.model)
        method = server.check_method(body.method)  # refusals that cost nothing come first
        ids = await server.prompt_ids(body.prompt, False, "prompt")
        kwargs = server.prepare(body, method, ids, body.max_tokens, "prompt")
        return await server.run(request, ids, kwargs, False, body.stream, body.include_usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        server.check_model(body.model)
        method = server.check_method(body.method)
        ids = await server.prompt_ids(body.chat_messages(), True, "messages")
        kwargs = server.prepare(body, method, ids, body.token_limit, "messages")
        return await server.run(request, ids, kwargs, True, body.stream, body.include_usage)

    app.add_middleware(Guard, metrics=server.metrics, max_body_bytes=config.max_body_bytes, api_key=config.api_key)
    return app
