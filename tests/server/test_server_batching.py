"""--max-batch: requests decode together (continuous batching) and each gets its solo text."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.test_server_queue import metric, wait_idle

MAX_BATCH = 4


@pytest.fixture(scope="module")
def batching_server(make_server):
    return make_server(max_batch=MAX_BATCH, max_queue=8, request_timeout_s=60, allow_methods="static,vanilla,spirit")


@pytest.mark.parametrize("method", ["static", "vanilla", "spirit"])
def test_concurrent_requests_get_their_solo_text(batching_server, expected, method):
    url = batching_server.url
    prompts = [f"client {i} says" for i in range(8)]

    def one(i: int):
        with httpx.Client(timeout=60) as c:
            body = {"prompt": prompts[i], "max_tokens": 10 + i, "temperature": 0, "method": method}
            return c.post(url + "/v1/completions", json=body)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(8), timeout=120))
    assert [r.status_code for r in answers] == [200] * 8
    for i, r in enumerate(answers):
        assert r.json()["choices"][0]["text"] == expected(prompts[i], 10 + i, method=method), i
    wait_idle(url)


def test_requests_run_together_and_a_stream_that_leaves_frees_its_place(batching_server, expected):
    url = batching_server.url
    seen_running = []

    def watch():
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            seen_running.append(metric(url, "spirit_requests_running"))
            time.sleep(0.01)

    def one(i: int):
        with httpx.Client(timeout=60) as c:
            return c.post(url + "/v1/completions", json={"prompt": f"together {i}", "max_tokens": 40, "temperature": 0})

    with ThreadPoolExecutor(6) as pool:
        watcher = pool.submit(watch)
        # a streaming client that reads one piece and goes away
        with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json={
                "prompt": "leaving early", "max_tokens": 200, "temperature": 0, "stream": True}) as r:
            next(r.iter_lines())
        answers = list(pool.map(one, range(4), timeout=120))
        watcher.result()
    assert all(r.status_code == 200 for r in answers)
    for i, r in enumerate(answers):
        assert r.json()["choices"][0]["text"] == expected(f"together {i}", 40)
    assert max(seen_running) > 1  # several requests were decoding at once
    wait_idle(url)


def test_a_bad_batch_size_fails_at_start():
    from spirit.server.config import ServerConfig

    with pytest.raises(ValueError, match="--max-batch"):
        ServerConfig(max_batch=0)
