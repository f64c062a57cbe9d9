"""A request validates itself once (request.py); every front end gets the same answer."""

from __future__ import annotations

import pytest

from spirit.request import Request, default_draft
from spirit.skipset import DraftConfig, SkipSet


def test_a_valid_request_carries_every_option():
    r = Request.build("hi", max_new_tokens=5, method="spirit", temperature=0.5, seed=3, stop=["\n"],
                      chat=True, tag="qa", learner="mine", branches=3, profile_file="p.json")
    assert (r.max_new_tokens, r.method, r.stop, r.chat, r.tag, r.learner) == (5, "spirit", ("\n",), True, "qa", "mine")
    assert r.sampling.temperature == 0.5 and r.sampling.seed == 3
    assert r.draft == DraftConfig(**{**default_draft("spirit").__dict__, "branches": 3})
    assert str(r.profile_file) == "p.json"


@pytest.mark.parametrize("options, message", [
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
    (dict(method="warp-drive"), "unknown method 'warp-drive'"),
    (dict(method="static"), "method 'static' needs a skip set"),
    (dict(temperature=-1.0), "temperature must be"),
    (dict(skip="ffn:1", method="static"), "bad skip set part"),
])
def test_bad_options_are_refused_with_a_clear_message(options, message):
    with pytest.raises(ValueError, match=message):
        Request.build("hi", **options)


def test_unknown_keywords_are_a_type_error():
    with pytest.raises(TypeError, match="unknown generation option"):
        Request.build("hi", warp=9)


def test_a_skip_string_is_parsed_once():
    r = Request.build("hi", method="static", skip="attn:1;mlp:2")
    assert r.skip == SkipSet.parse("attn:1;mlp:2")
    assert Request.build("hi", method="hf").method == "hf"  # transformers' own generate
