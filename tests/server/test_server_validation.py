"""Bad requests get a 4xx with an OpenAI error body and the server keeps serving; API keys."""

from __future__ import annotations

import json

import httpx
import pytest


BAD = [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b"[1, 2", None),
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, "prompt"),  # beyond the context
    ("/v1/completions", {"prompt": "x" * 1100, "max_tokens": 4}, "prompt"),  # prompt longer than the context
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": 2.5}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 2}, "n"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, "model"),
    ("/v1/completions", {"prompt": "x", "method": "warp"}, "method"),
    ("/v1/completions", {"prompt": "x", "stream": "yes please"}, "stream"),
    ("/v1/completions", {"prompt": "x", "logprobs": 3}, None),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 1100}]}, "messages"),
]


@pytest.mark.parametrize("path,body,param", BAD)
def test_bad_request(server, path, body, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=30)
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    assert r.status_code == (404 if param == "model" else 400)


def test_still_serving_after_bad_requests(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 3, "temperature": 0}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
    assert httpx.get(server.url + "/nowhere").json()["error"]["message"]


@pytest.mark.parametrize("extra", [{"temperature": 1e-40}, {"top_p": 5e-324, "temperature": 1.0}])
def test_tiny_sampling_values_are_served(server, extra):
    # found by the fuzz run: these once overflowed or emptied the sampling distribution (500)
    body = {"prompt": "x", "max_tokens": 2, "seed": 1, **extra}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text


def test_api_key(make_server):
    srv = make_server(api_key="s3cret")
    body = {"prompt": "x", "max_tokens": 2, "temperature": 0}
    assert httpx.get(srv.url + "/health").status_code == 200  # open, for load balancers
    for path in ("/v1/models", "/metrics", "/openapi.json"):
        r = httpx.get(srv.url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    assert httpx.post(srv.url + "/v1/completions", json=body).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert httpx.post(srv.url + "/v1/completions", json=body, headers=wrong).status_code == 401
    right = {"Authorization": "Bearer s3cret"}
    assert httpx.post(srv.url + "/v1/completions", json=body, headers=right, timeout=30).status_code == 200
    assert httpx.get(srv.url + "/v1/models", headers=right).status_code == 200
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()
    assert openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0).models.list().data
