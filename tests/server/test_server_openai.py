"""The official openai client against a live server: same text as Spirit.generate."""

from __future__ import annotations

import httpx
import pytest

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_completion_equals_generate(client, ref, expected):
    out = client.completions.create(model="tiny-llama", prompt="The cat sat", max_tokens=12, temperature=0)
    assert out.choices[0].text == expected("The cat sat", 12)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens == len(ref.encode("The cat sat"))
    assert out.usage.completion_tokens <= 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_streamed_completion_equals_generate(client, ref, expected):
    stream = client.completions.create(model="tiny-llama", prompt="Once upon", max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected("Once upon", 12)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 12


def test_chat_equals_generate(client, ref, expected):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    out = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=10, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected(messages, 10, chat=True)
    assert out.usage.prompt_tokens == len(ref.encode(messages, chat=True))


def test_streamed_chat_equals_generate(client, ref, expected):
    messages = [{"role": "user", "content": "Tell me"}]
    stream = client.chat.completions.create(model="tiny-llama", messages=messages, max_completion_tokens=10,
                                            temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert text == expected(messages, 10, chat=True)


def test_stop_seed_and_method_override(client, ref, expected):
    full = expected("abc", 16)
    stop = full[3:5] if len(full) > 5 else None
    out = client.completions.create(model="tiny-llama", prompt="abc", max_tokens=16, temperature=0, stop=stop,
                                    extra_body={"method": "vanilla"})
    assert out.choices[0].text == expected("abc", 16, method="vanilla", stop=[stop] if stop else ())
    # the request's own method and timing; no draft figures (they reflect other users' requests)
    assert out.model_extra["spirit"]["method"] == "vanilla"
    assert set(out.model_extra["spirit"]) == {"method", "wall_time_s", "tokens_per_s"}
    sampled = [client.completions.create(model="tiny-llama", prompt="abc", max_tokens=8, temperature=0.9, top_p=0.9,
                                         seed=7).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]  # same seed, same sample


def test_every_method_and_one_shared_policy(make_server):
    from spirit.policies import REGISTRY

    methods = [m for m in REGISTRY.names() if m not in ("hf", "static")]
    server = make_server(allow_methods=(*methods, "static"))
    lm = server.app.state.server.lm
    # what the allowed methods need was built before the first request: dv's calibration
    assert "dv" in [key[0] for key in lm._policies]
    for method in methods:
        for i in range(2):
            r = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"prompt": f"p{i}", "max_tokens": 6, "temperature": 0, "method": method})
            assert r.status_code == 200, r.text
            assert r.json()["spirit"]["method"] == method
    # one kept policy per method: successive requests feed the same adaptive state
    kept = [key[0] for key in lm._policies]
    assert sorted(kept) == sorted(set(kept)) and set(methods) <= set(kept)
