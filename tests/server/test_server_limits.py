"""The server's limits, each with an input that hits it: body size (413), tokenizing off the
event loop, allowed methods (403), internal errors (500 without internals, logged), and no
per-request figure of the shared draft state."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from spirit.server import ServerConfig
from spirit.server.methods import default_allowed

LIMIT = 2048  # bytes: small, so that the oversized bodies stay small too


@pytest.fixture(scope="module")
def small_body_server(make_server):
    return make_server(max_body_bytes=LIMIT)


@pytest.fixture(scope="module")
def patchable(make_server):
    """A server of its own, for tests that patch its model (monkeypatch undoes it after each)."""
    return make_server()


def too_large(r: httpx.Response) -> bool:
    return r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


# -- body size ---------------------------------------------------------------------------------


def test_body_over_the_limit_is_413(small_body_server):
    url = small_body_server.url + "/v1/completions"
    r = httpx.post(url, json={"prompt": "x" * (2 * LIMIT), "max_tokens": 2}, timeout=30)
    assert too_large(r), r.text
    assert str(LIMIT) in r.json()["error"]["message"]
    # the same prompt within the limit is served
    assert httpx.post(url, json={"prompt": "x" * 100, "max_tokens": 2, "temperature": 0}, timeout=30).status_code == 200


def test_chunked_body_without_content_length_is_counted(small_body_server):
    def chunks():  # httpx sends a generator chunked: no Content-Length to go by
        yield b'{"prompt": "'
        for _ in range(8):
            yield b"y" * 512
        yield b'", "max_tokens": 2}'

    r = httpx.post(small_body_server.url + "/v1/chat/completions", content=chunks(),
                   headers={"Content-Type": "application/json"}, timeout=30)
    assert too_large(r), r.text


def test_declared_length_is_refused_before_the_body_is_read(small_body_server):
    # a gigabyte announced and never sent: the answer must come without waiting for it
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {small_body_server.host}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n")
    with socket.create_connection((small_body_server.host, small_body_server.port), timeout=10) as sock:
        sock.sendall(head.encode())
        answer = sock.recv(65536).decode("latin-1")
    assert answer.startswith("HTTP/1.1 413"), answer
    assert "request_too_large" in answer


# -- tokenizing off the event loop -------------------------------------------------------------


def test_a_slow_tokenization_does_not_block_other_connections(patchable, monkeypatch):
    srv = patchable
    lm = srv.app.state.server.lm
    entered, release = threading.Event(), threading.Event()
    encode = lm.encode

    def slow_encode(prompt, chat=False):
        entered.set()
        release.wait(10)  # a long prompt's tokenizing, held until the test lets it go
        return encode(prompt, chat)

    monkeypatch.setattr(lm, "encode", slow_encode)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, srv.url + "/v1/completions", timeout=30,
                              json={"prompt": "slow", "max_tokens": 2, "temperature": 0})
        assert entered.wait(10)
        t0 = time.perf_counter()
        health = httpx.get(srv.url + "/health", timeout=5)  # times out if the loop is blocked
        assert health.status_code == 200 and time.perf_counter() - t0 < 2
        release.set()
        assert pending.result().status_code == 200


# -- allowed methods ---------------------------------------------------------------------------


def test_default_allows_no_calibration_and_no_extra_quantization():
    assert "dv" not in default_allowed("spirit", None)  # dv calibrates offline
    assert {"spirit", "fixed"} <= set(default_allowed("spirit", None))  # int4 is built for spirit anyway
    plain = default_allowed("vanilla", None)
    assert "vanilla" in plain and not {"dv", "spirit", "fixed", "static"} & set(plain)
    assert "static" in default_allowed("vanilla", "mlp:1")  # with a skip set to run


@pytest.mark.parametrize("method,status", [("dv", 403), ("spirit", 403), ("fixed", 403), ("warp", 400)])
def test_method_outside_the_list_is_refused(server, method, status):
    allowed = server.app.state.server.allowed
    assert method not in allowed
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "method": method}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == "method" and all(m in error["message"] for m in allowed)
    if status == 403:
        assert error["code"] == "method_not_allowed"


def test_explicit_list(make_server):
    srv = make_server(method="vanilla", allow_methods="vanilla, lookup")
    url = srv.url + "/v1/chat/completions"
    messages = [{"role": "user", "content": "hi"}]
    assert httpx.post(url, json={"messages": messages, "max_tokens": 2, "method": "lookup"}, timeout=30).status_code == 200
    assert httpx.post(url, json={"messages": messages, "max_tokens": 2, "method": "swift"}, timeout=30).status_code == 403


@pytest.mark.parametrize("config,message", [
    (dict(allow_methods=("vanilla", "warp")), "unknown method 'warp'"),
    (dict(method="spirit", allow_methods=("vanilla",)), "--method spirit is not in --allow-methods"),
    (dict(method="vanilla", allow_methods=("vanilla", "static")), "needs --skip"),
    (dict(method="vanilla", allow_methods=()), "empty"),
    (dict(max_body_bytes=0), "--max-body-bytes"),
])
def test_config_errors(config, message):
    with pytest.raises(ValueError, match=message):
        ServerConfig(**config)


# -- internal errors ---------------------------------------------------------------------------

SECRET = "secret detail at /opt/private/weights.bin"


def no_internals(text: str) -> bool:
    return not any(s in text for s in ("secret", "/opt/private", "RuntimeError", "Traceback"))


@pytest.fixture
def failing_engine(patchable, monkeypatch):
    """A server whose engine fails every generation with a message that must not leak."""

    def broken_stream(*args, **kwargs):
        raise RuntimeError(SECRET)

    monkeypatch.setattr(patchable.app.state.server.lm, "stream", broken_stream)
    return patchable


class _FailingMidway:
    """A TextStream that gives one piece, then fails."""

    result = None

    def __iter__(self):
        yield "a"
        raise RuntimeError(SECRET)

    def cancel(self) -> None:
        pass


def logged_faults(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "spirit.server" and r.exc_info and SECRET in str(r.exc_info[1])]


def test_engine_fault_is_500_without_internals_and_logged(failing_engine, caplog):
    with caplog.at_level(logging.ERROR, logger="spirit.server"):
        r = httpx.post(failing_engine.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert r.status_code == 500 and no_internals(r.text), r.text
    error = r.json()["error"]
    assert error["code"] == "internal_error" and error["type"] == "server_error"
    faults = logged_faults(caplog)
    assert faults, "the fault was not logged with its traceback"
    reference = error["message"].split("reference ")[1].split(")")[0]
    assert reference in faults[-1].getMessage()


def test_engine_fault_in_a_stream_is_generic(failing_engine, caplog):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True}
    with caplog.at_level(logging.ERROR, logger="spirit.server"):
        r = httpx.post(failing_engine.url + "/v1/chat/completions", json=body, timeout=30)
    # the job fails before it starts streaming: a plain 500, like a non-streamed request
    assert r.status_code == 500 and no_internals(r.text), r.text
    assert logged_faults(caplog)


def test_fault_mid_stream_is_a_generic_error_event(patchable, monkeypatch, caplog):
    monkeypatch.setattr(patchable.app.state.server.lm, "stream", lambda *a, **k: _FailingMidway())
    body = {"prompt": "x", "max_tokens": 4, "stream": True}
    with caplog.at_level(logging.ERROR, logger="spirit.server"):
        with httpx.stream("POST", patchable.url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and all(no_internals(line) for line in lines), lines
    errors = [json.loads(line[6:])["error"] for line in lines if line.startswith('data: {"error"')]
    assert len(errors) == 1 and errors[0]["code"] == "internal_error"
    assert logged_faults(caplog)


def test_fault_in_a_handler_is_500_without_internals_and_logged(patchable, monkeypatch, caplog):
    srv = patchable

    def broken_encode(prompt, chat=False):
        raise RuntimeError(SECRET)

    monkeypatch.setattr(srv.app.state.server.lm, "encode", broken_encode)
    with caplog.at_level(logging.ERROR, logger="spirit.server"):
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert r.status_code == 500 and no_internals(r.text), r.text
    assert r.json()["error"]["code"] == "internal_error"
    assert logged_faults(caplog)
    monkeypatch.undo()  # and the server keeps serving
    assert httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30).status_code == 200


def test_chat_template_refusal_is_the_clients_error(patchable, monkeypatch):
    # templates refuse some conversations themselves (e.g. "roles must alternate"): a 400
    tokenizer = patchable.app.state.server.lm.tokenizer
    monkeypatch.setattr(tokenizer, "chat_template", "{{ raise_exception('Conversation roles must alternate') }}")
    body = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "max_tokens": 2}
    r = httpx.post(patchable.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "roles must alternate" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "messages"


# -- no figures of the shared draft state ------------------------------------------------------


def test_streamed_figures_are_the_requests_own(server):
    body = {"prompt": "Once", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data: {")]
    figures = [e["spirit"] for e in events if "spirit" in e]
    assert len(figures) == 1 and set(figures[0]) == {"method", "wall_time_s", "tokens_per_s"}
