import random

import pytest

from spirit.skipset import DraftConfig, SkipSet, SkipSetError, random_skipset, sublayer_ids


def test_parse_round_trip():
    s = SkipSet.parse("attn:4,9;mlp:4,9,12")
    assert s.attn == {4, 9} and s.mlp == {4, 9, 12}
    assert SkipSet.parse(str(s)) == s
    assert s.size == 5


def test_parse_layers_and_empty():
    assert SkipSet.parse("layers:1,2") == SkipSet(frozenset({1, 2}), frozenset({1, 2}))
    assert SkipSet.parse("").is_empty()


@pytest.mark.parametrize("bad", ["attn4", "ffn:1", "attn:x", "mlp:1,,a"])
def test_parse_errors(bad):
    with pytest.raises(SkipSetError):
        SkipSet.parse(bad)


def test_validate_names_missing_layer():
    with pytest.raises(SkipSetError, match=r"layer\(s\) \[30\]"):
        SkipSet.parse("attn:30").validate(30)
    SkipSet.parse("attn:29").validate(30)


def test_ratio_and_vector_round_trip():
    s = SkipSet.parse("attn:1;mlp:1,2")
    assert s.ratio(4) == pytest.approx(3 / 8)
    assert SkipSet.from_vector(s.to_vector(4)) == s


def test_random_skipset_keeps_first_and_last_layer():
    rng = random.Random(0)
    for _ in range(50):
        s = random_skipset(10, 0.4, rng)
        assert s.size == 8
        assert 0 not in s.attn | s.mlp and 9 not in s.attn | s.mlp
    assert len(sublayer_ids(10)) == 16


def test_draft_config_is_a_hashable_value():
    a = DraftConfig(SkipSet.parse("attn:1"))
    assert a == DraftConfig(SkipSet.parse("attn:1")) and hash(a) == hash(DraftConfig(SkipSet.parse("attn:1")))
    assert not DraftConfig().speculative and a.speculative
