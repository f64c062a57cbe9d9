"""spirit on Ray Serve: two replicas of the tiny model at half a CPU each, on a local Ray
cluster of 2 CPUs started once for the module (loopback only). Skipped without the `ray`
extra; CI installs it (.ci/run)."""

from __future__ import annotations

import dataclasses
import functools
import socket
import threading
import time

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from spirit.server import ServerConfig  # noqa: E402
from spirit.server.ray_serve import NAMESPACE, REPLICA_HEADER, RayOptions, run  # noqa: E402
from spirit.testing import tiny_spirit  # noqa: E402

SKIP = "attn:1;mlp:1"  # as the other server tests: the static draft really runs
CONFIG = ServerConfig(method="static", skip=SKIP, allow_methods=("static", "vanilla", "spirit"))
OPTIONS = RayOptions(replicas=2, cpus_per_replica=0.5, sync_interval_s=0.2)
TINY = functools.partial(tiny_spirit, "llama", num_layers=4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(condition, timeout: float = 30.0, every: float = 0.1):
    """condition()'s first true value, polled until `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {condition.__name__}")


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")
    port = _free_port()
    url = run(TINY, CONFIG, OPTIONS, port=port)
    yield {"url": url, "port": port}
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def url(cluster):
    return cluster["url"]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def replica_info(url: str, wanted=lambda info: True, timeout: float = 30.0) -> dict:
    """GET /replica until a replica for which `wanted(info)` answers (Ray routes each call)."""
    def answered():
        info = httpx.get(url + "/replica", timeout=10).json()
        return info if wanted(info) else None

    return _wait(answered, timeout, every=0.02)


def replicas(url: str) -> dict[str, dict]:
    """Both replicas' /replica, by id."""
    seen: dict[str, dict] = {}

    def both() -> bool:
        info = replica_info(url)
        seen.setdefault(info["replica"], info)
        return len(seen) == 2

    _wait(both, every=0.0)
    return seen


def spirit_request(url: str, prompt: str, max_tokens: int = 8) -> httpx.Response:
    r = httpx.post(url + "/v1/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "method": "spirit"})
    assert r.status_code == 200, r.text
    return r


def test_openai_client_streaming_and_not_equals_plain_decoding(client, expected):
    out = client.completions.create(model="tiny-llama", prompt="The cat sat", max_tokens=12, temperature=0)
    assert out.choices[0].text == expected("The cat sat", 12)
    stream = client.completions.create(model="tiny-llama", prompt="Once upon", max_tokens=12, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected("Once upon", 12)
    messages = [{"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=10, temperature=0)
    assert chat.choices[0].message.content == expected(messages, 10, chat=True)
    stream = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=10, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected(messages, 10, chat=True)
    plain = client.completions.create(model="tiny-llama", prompt="abc", max_tokens=10, temperature=0,
                                      extra_body={"method": "vanilla"})
    assert plain.choices[0].text == expected("abc", 10, method="vanilla")


def test_both_replicas_take_requests(client, url):
    served = set()
    for i in range(40):
        raw = client.completions.with_raw_response.create(model="tiny-llama", prompt=f"p{i}", max_tokens=2, temperature=0)
        served.add(raw.headers[REPLICA_HEADER])
        if len(served) == 2:
            break
    assert len(served) == 2
    assert set(replicas(url)) == served
    health = httpx.get(url + "/health", timeout=10)
    assert health.json()["status"] == "ok" and health.headers[REPLICA_HEADER] in served


def _store(url: str):
    name = replica_info(url)["adaptation"]["store"]
    return ray.get_actor(name, namespace=NAMESPACE)


def _store_requests(store) -> int:
    try:
        return ray.get(store.summary.remote("spirit"), timeout=10)["task_requests"]
    except ray.exceptions.RayActorError:  # a handle to the store that was killed
        return -1


def test_a_profile_learned_through_one_replica_is_used_by_the_other(url):
    prompt = "Translate to French: the weather is nice today."
    first = spirit_request(url, prompt).headers[REPLICA_HEADER]
    store = _store(url)
    _wait(lambda: _store_requests(store) >= 1)  # the first replica published its task
    version = ray.get(store.summary.remote("spirit"))["version"]
    # the other replica has received it (it is applied at its next request's start)
    replica_info(url, lambda i: i["replica"] != first and i["adaptation"]["spirit"]["version"] >= version)
    other = None
    while other is None:
        r = spirit_request(url, prompt)
        other = r.headers[REPLICA_HEADER] if r.headers[REPLICA_HEADER] != first else None
    # it served this prompt once, so its task counts one request of its own: the rest are
    # the first replica's, learned there and started from here
    info = replica_info(url, lambda i: i["replica"] == other and i["adaptation"]["spirit"]["task_requests"] >= 2,
                        timeout=10)
    assert info["adaptation"]["spirit"]["merges"] >= 1
    _wait(lambda: _store_requests(store) >= 2)


def test_a_replica_with_another_model_refuses_to_start(cluster, url):
    from spirit.server.shared_state import Fingerprint

    generation = replica_info(url)["generation"]
    other = functools.partial(tiny_spirit, "llama", num_layers=4, seed=1)  # same name, other weights
    options = dataclasses.replace(OPTIONS, replicas=1, app_name="spirit-other", route_prefix="/other",
                                  constructor_retries=1)
    with pytest.raises(RuntimeError) as failed:
        run(other, CONFIG, options, port=cluster["port"], generation=generation)
    assert str(failed.value).startswith("replica ") and "refuses to start" in str(failed.value)
    assert "weights_digest: tensors:" in str(failed.value)  # what differs, said plainly
    serve.delete("spirit-other")
    fp = Fingerprint(**replica_info(url)["fingerprint"])
    assert fp.model == "tiny-llama"


def test_killing_a_replica_loses_no_request_the_other_can_retry(url, expected):
    """A request running on the killed replica fails (Ray's proxy answers 500); the openai
    client retries it (max_retries) and the surviving replica answers it in full. Ray Serve
    then starts a new replica, which starts from the shared learned state."""
    statuses: list[int] = []
    http = httpx.Client(event_hooks={"response": [lambda r: statuses.append(r.status_code)]}, timeout=60)
    retrying = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=3, timeout=60, http_client=http)
    victim = replicas(url)
    info = next(iter(victim.values()))
    prompts = [f"Story number {i}:" for i in range(6)]
    texts: dict[str, str] = {}

    def ask(prompt: str) -> None:
        out = retrying.completions.create(model="tiny-llama", prompt=prompt, max_tokens=200, temperature=0)
        texts[prompt] = out.choices[0].text

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    time.sleep(0.3)
    ray.kill(ray.get_actor(info["actor"], namespace="serve"), no_restart=True)
    for t in threads:
        t.join(120)
    assert {p: texts.get(p) for p in prompts} == {p: expected(p, 200) for p in prompts}
    print(f"statuses the client saw while a replica was killed: {sorted(statuses)}")
    # Serve replaces the replica; the new one pulled the shared state before serving
    store_requests = _store_requests(_store(url))
    fresh = replica_info(url, lambda i: i["replica"] not in victim, timeout=90)
    assert fresh["adaptation"]["spirit"]["task_requests"] >= min(store_requests, 2)


def test_a_lost_store_is_made_again_from_the_replicas(url):
    store = _store(url)
    name = replica_info(url)["adaptation"]["store"]
    before = _store_requests(store)
    ray.kill(store)  # the detached actor is gone, with what it held
    spirit_request(url, "Translate to French: good night.")  # replicas keep serving meanwhile
    again = _wait(lambda: _named(name), timeout=30)
    _wait(lambda: _store_requests(again) >= before, timeout=30)


def _named(name: str):
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None
