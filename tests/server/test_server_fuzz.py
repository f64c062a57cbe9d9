"""Fuzz every route of the OpenAPI schema with schemathesis: never a 5xx."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.config import SchemathesisConfig  # noqa: E402

from spirit.api import from_pretrained_model  # noqa: E402
from spirit.server import ServerConfig, ServerThread  # noqa: E402
from spirit.testing import byte_tokenizer, tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def fuzz_server():
    # a short context bounds the work any accepted request can ask for
    lm = from_pretrained_model(tiny_model("llama", 2), byte_tokenizer(), name="tiny-llama", max_context=24)
    srv = ServerThread(lm, ServerConfig(method="vanilla", max_queue=4, request_timeout_s=20, chat_max_tokens=4)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_server):
    # the coverage phase alone sends some 250 boundary-value bodies per route; the examples and
    # fuzzing phases, bounded by max_examples, keep the run to seconds
    config = SchemathesisConfig.from_dict({"phases": {"coverage": {"enabled": False}, "stateful": {"enabled": False}}})
    return schemathesis.openapi.from_dict(fuzz_server.app.openapi(), config=config)


schema = schemathesis.pytest.from_fixture("fuzz_schema")


@schema.parametrize()
@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors(case, fuzz_server):
    response = case.call(base_url=fuzz_server.url, timeout=30)
    assert response.status_code < 500, f"{case.method} {case.path} {case.body!r} -> {response.text}"
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
