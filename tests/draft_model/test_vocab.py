"""Reduced-vocabulary draft heads: the frequency table, the head's scores, rebuilding."""

import pytest
import torch

from spirit.draft_model.vocab import DraftHead, DraftHeads, FrequencyTable

VOCAB, HIDDEN = 50, 8


def weight(seed=0):
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(seed))


def test_prior_ranks_lower_ids_higher():
    table = FrequencyTable(VOCAB)
    for n in (1, 5, 17, VOCAB):
        assert table.top(n).tolist() == list(range(n))
    assert table.top(VOCAB + 10).tolist() == list(range(VOCAB))  # capped at the vocabulary
    assert table.version == 0


def test_top_is_sorted_ascending():
    table = FrequencyTable(VOCAB)
    table.observe([40] * 400 + [30] * 300)  # beat the priors of ids 3 (250) and 4 (200)
    assert table.top(5).tolist() == [0, 1, 2, 30, 40]


def test_observed_tokens_enter_the_top():
    table = FrequencyTable(VOCAB)
    assert 45 not in table.top(10).tolist()
    table.observe([45] * 200)  # prior of id 0 is 1000, id 9 is 100: 200 beats the tail of the top 10
    top = table.top(10).tolist()
    assert 45 in top and 9 not in top and len(top) == 10
    assert table.version == 1


def test_observe_ignores_out_of_range_ids_and_empty_input():
    table = FrequencyTable(VOCAB)
    before = table.counts.clone()
    table.observe([])
    table.observe([-1, VOCAB, VOCAB + 3])
    assert torch.equal(table.counts, before) and table.version == 0
    table.observe([3, -1, 3])
    assert table.counts[3] == before[3] + 2 and table.version == 1


def test_pin_keeps_eos_in_the_top():
    table = FrequencyTable(VOCAB)
    eos = VOCAB - 1
    table.pin([eos])
    assert table.version == 1
    table.observe(list(range(1, 20)) * 100)  # many frequent tokens afterwards
    assert eos in table.top(1).tolist() and eos in table.top(3).tolist()
    v = table.version
    table.pin([eos])  # already pinned: no change, no version bump
    table.pin([-5, VOCAB])  # out of range: ignored
    assert table.version == v


def test_version_bumps_on_every_change():
    table = FrequencyTable(VOCAB)
    versions = [table.version]
    for change in ([1], [2, 3], [4]):
        table.observe(change)
        versions.append(table.version)
    table.pin([7])
    versions.append(table.version)
    assert versions == sorted(set(versions)) and len(versions) == 5


def test_head_scores_equal_the_full_lm_head_rows():
    w = weight()
    ids = torch.tensor([0, 3, 4, 17, 49])
    head = DraftHead(w, ids)
    assert head.weight.is_contiguous() and head.weight.shape == (5, HIDDEN) and head.vocab_size == VOCAB
    hidden = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(1))
    full = torch.nn.functional.linear(hidden, w)
    torch.testing.assert_close(head.scores(hidden), full[ids])
    # batched hidden states too
    batch = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(head.scores(batch), torch.nn.functional.linear(batch, w)[:, ids])


def test_head_does_not_alias_the_weight():
    w = weight()
    head = DraftHead(w, torch.tensor([1, 2]))
    expected = w[[1, 2]].clone()
    w.zero_()  # the head holds its own copy of the rows
    assert torch.equal(head.weight, expected)


def test_to_full_puts_minus_infinity_outside_the_subset():
    ids = torch.tensor([2, 5, 11])
    head = DraftHead(weight(), ids)
    sub = torch.tensor([0.5, -1.0, 3.0])
    full = head.to_full(sub)
    assert full.shape == (VOCAB,) and full.dtype == sub.dtype
    assert full[ids].tolist() == sub.tolist()
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(full[outside]).all()
    probs = torch.softmax(full, -1)  # q is exactly 0 outside the subset
    assert probs[outside].sum() == 0 and probs[ids].sum() == pytest.approx(1.0)


def test_heads_none_for_size_zero_or_the_whole_vocabulary():
    heads = DraftHeads(weight())
    assert heads.head(0) is None and heads.head(-3) is None
    assert heads.head(VOCAB) is None and heads.head(VOCAB + 1) is None
    assert heads.head(VOCAB - 1) is not None


def test_heads_follow_the_table_and_rebuild_only_when_it_changed():
    w = weight()
    heads = DraftHeads(w)
    first = heads.head(10)
    assert first.token_ids.tolist() == list(range(10))
    torch.testing.assert_close(first.weight, w[:10])
    assert heads.head(10) is first  # nothing changed
    heads.table.observe([0, 1, 2])  # the version bumps, the top 10 stays
    assert heads.head(10) is first
    heads.table.observe([33] * 500)  # 33 enters the top 10
    second = heads.head(10)
    assert second is not first and 33 in second.token_ids.tolist() and 9 not in second.token_ids.tolist()
    torch.testing.assert_close(second.weight, w[second.token_ids])
    assert heads.head(10) is second
    # heads of different sizes are kept apart
    small = heads.head(3)
    assert small.token_ids.numel() == 3 and heads.head(10) is second
