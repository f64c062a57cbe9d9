"""Live servers over tiny random models, on free loopback ports, for the server tests."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from spirit.server import ServerConfig, ServerThread  # noqa: E402
from spirit.testing import tiny_spirit  # noqa: E402

# the static policy drafts with layer 1 skipped, so the speculative path really runs; greedy
# output must still equal plain decoding
SKIP = "attn:1;mlp:1"


@pytest.fixture(scope="session")
def ref():
    """A second instance of the same tiny model (same seed, same weights), for expected outputs:
    the served one must not be called while the server may be using it."""
    return tiny_spirit("llama", num_layers=4)


def expected(ref, prompt, max_tokens, chat=False, method="static", **kw):
    """What Spirit.generate gives for the same greedy request (the served default: static, SKIP)."""
    if method == "static":
        kw.setdefault("skip", SKIP)
    return ref.generate(prompt, method=method, temperature=0.0, max_new_tokens=max_tokens, chat=chat, **kw).text


def start(config: ServerConfig = ServerConfig(method="static", skip=SKIP), **kw) -> ServerThread:
    return ServerThread(tiny_spirit("llama", num_layers=4, **kw), config).start()


@pytest.fixture(scope="module")
def server():
    srv = start()
    yield srv
    srv.stop()
