"""Live servers over tiny random models, on free loopback ports, for the server tests."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from spirit.server import ServerConfig, ServerThread  # noqa: E402
from spirit.testing import tiny_spirit  # noqa: E402

# the static policy drafts with layer 1 skipped, so the speculative path really runs; greedy
# output must still equal plain decoding
SKIP = "attn:1;mlp:1"
DEFAULT = ServerConfig(method="static", skip=SKIP)


def start(**config) -> ServerThread:
    """A live server over a fresh tiny model, DEFAULT's settings with `config` replaced."""
    return ServerThread(tiny_spirit("llama", num_layers=4), dataclasses.replace(DEFAULT, **config)).start()


@pytest.fixture(scope="module")
def make_server():
    """Start servers with other settings; they stop at the end of the module."""
    started: list[ServerThread] = []

    def make(**config) -> ServerThread:
        started.append(start(**config))
        return started[-1]

    yield make
    for srv in started:
        srv.stop()


@pytest.fixture(scope="module")
def server(make_server):
    return make_server()


@pytest.fixture(scope="session")
def ref():
    """A second instance of the same tiny model (same seed, same weights), for expected outputs:
    the served one must not be called while the server may be using it."""
    return tiny_spirit("llama", num_layers=4)


@pytest.fixture(scope="session")
def expected(ref):
    """What Spirit.generate gives for the same greedy request (the served default: static, SKIP)."""

    def generate(prompt, max_tokens, chat=False, method="static", **kw):
        if method == "static":
            kw.setdefault("skip", SKIP)
        return ref.generate(prompt, method=method, temperature=0.0, max_new_tokens=max_tokens, chat=chat, **kw).text

    return generate
