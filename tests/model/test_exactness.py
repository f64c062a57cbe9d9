"""Exact verification: tree logits equal one-token steps bit for bit, where the check says so.

The tiny models here have hidden size 128: with 64, PyTorch runs their smallest products
(M x N x K <= 4096) on another kernel than larger passes, so they are not row-invariant, and
the load-time check rightly says so (tested below too).
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from spirit.tree import DraftTree
from spirit.engine import DecodeSettings, Engine
from spirit.model import exactness as exactness_module
from spirit.model.adapter import SkippableModel
from spirit.model.attention import RowKeys
from spirit.policies.base import ModelInfo, StaticPolicy
from spirit.skipset import DraftConfig, SkipSet
from spirit.testing import ARCHITECTURES, tiny_model

NO_SKIP = SkipSet()
CAPACITY = 160


@pytest.fixture(scope="module", params=ARCHITECTURES)
def bf16_model(request) -> SkippableModel:
    model = SkippableModel(tiny_model(request.param, dtype=torch.bfloat16, hidden=128))
    if not model.exactness.exact:
        pytest.skip(f"this CPU's kernels are not row-invariant for {request.param}: {model.exactness.reason}")
    return model


def _prefilled(model: SkippableModel, prompt: list[int]):
    cache = model.new_cache(CAPACITY)
    model.forward(torch.tensor([prompt]), 0, cache, NO_SKIP)
    return cache


def _stepped_logits(model: SkippableModel, prompt: list[int], path_tokens: list[int]) -> torch.Tensor:
    """Plain decoding: the pending token and each path token, one exact one-token pass each."""
    cache = _prefilled(model, prompt)
    for j, token in enumerate(path_tokens):
        logits = model.forward(torch.tensor([[token]]), len(prompt) + j, cache, NO_SKIP, exact=True)[0]
    return logits


@st.composite
def prompts_and_trees(draw):
    vocab = 264
    prompt = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=60))
    tree = DraftTree(draw(st.integers(0, vocab - 1)))
    for _ in range(draw(st.integers(1, 20))):
        tree.add(draw(st.integers(0, tree.size - 1)), draw(st.integers(0, vocab - 1)))
    return prompt, tree


@settings(max_examples=6, deadline=None)
@given(case=prompts_and_trees())
def test_tree_verification_equals_one_token_steps(bf16_model, case):
    prompt, tree = case
    committed = len(prompt)
    cache = _prefilled(bf16_model, prompt)
    verified = bf16_model.forward(
        torch.tensor([tree.tokens]), committed, cache, NO_SKIP,
        positions=tree.positions(committed), visible=tree.visible(committed), exact=True,
    )
    for node in range(tree.size):
        path = [tree.tokens[n] for n in [0, *tree.path_to(node)]]
        assert torch.equal(_stepped_logits(bf16_model, prompt, path), verified[node]), f"node {node}"


def test_chain_verification_equals_one_token_steps(bf16_model):
    prompt, chain = list(range(30, 70)), [5, 17, 200, 3, 99, 42, 7, 8]
    cache = _prefilled(bf16_model, prompt)
    verified = bf16_model.forward(torch.tensor([chain]), len(prompt), cache, NO_SKIP, exact=True)
    for j in range(len(chain)):
        assert torch.equal(_stepped_logits(bf16_model, prompt, chain[: j + 1]), verified[j])


def test_padded_one_token_step_equals_unpadded_when_kernels_allow_one_row(bf16_model):
    """Padding rows see nothing and are seen by nothing: a 1-row step padded to 2 rows
    gives the 1-row result wherever 1-row products are row-invariant."""
    if bf16_model.exactness.min_rows != 1:
        pytest.skip("1-row products are not row-invariant here")
    prompt = list(range(10, 50))
    one = bf16_model.forward(torch.tensor([[7]]), len(prompt), _prefilled(bf16_model, prompt), NO_SKIP, exact=True)
    two = bf16_model.forward(
        torch.tensor([[7]]), len(prompt), _prefilled(bf16_model, prompt), NO_SKIP, exact=True, min_rows=2
    )
    assert torch.equal(one, two)


def test_row_keys_from_mask():
    allowed = torch.tensor([
        [True, True, False, False],
        [True, False, True, False],
        [False, False, False, False],
    ])
    rows = RowKeys.from_mask(allowed).slots
    assert rows[0] == slice(0, 2)
    assert rows[1].tolist() == [0, 2]
    assert rows[2] is None


class _RowCountDependentLinear(nn.Linear):
    """A linear layer whose result changes with the number of rows in the pass, like a kernel
    that takes another path for larger products."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out + 1e-2 if x.shape[0] > 3 else out


def test_check_detects_a_kernel_that_is_not_row_invariant(monkeypatch, tmp_path):
    monkeypatch.setattr(exactness_module, "_LAYER_MEASURED", {})
    monkeypatch.setattr(exactness_module, "_measured_path", lambda: tmp_path / "measured.json")
    layer = _RowCountDependentLinear(128, 128, dtype=torch.bfloat16)
    rows, why = exactness_module._layer_max_rows(layer, min_rows=1)
    assert rows == 3 and "4-row pass differs" in why
    assert exactness_module._linear_max_rows([layer], 2)[0] < exactness_module.MIN_USEFUL_ROWS
    kept = (tmp_path / "measured.json").read_text()
    assert "128x128" in kept  # measured once per machine, then read back


def test_a_kept_measurement_is_read_back(monkeypatch, tmp_path):
    monkeypatch.setattr(exactness_module, "_measured_path", lambda: tmp_path / "measured.json")
    monkeypatch.setattr(exactness_module, "_LAYER_MEASURED", {})
    layer = nn.Linear(128, 128, dtype=torch.bfloat16)
    first = exactness_module._layer_max_rows(layer, min_rows=1)
    monkeypatch.setattr(exactness_module, "_LAYER_MEASURED", {})
    monkeypatch.setattr(exactness_module, "_first_differing_row", lambda *a: pytest.fail("measured again"))
    assert exactness_module._layer_max_rows(layer, min_rows=1) == first



@pytest.mark.parametrize("arch", ARCHITECTURES)
@settings(max_examples=8, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 255), min_size=1, max_size=40),
    skip=st.builds(SkipSet, st.frozensets(st.integers(0, 3)), st.frozensets(st.integers(0, 3))),
    branches=st.integers(1, 3),
    ngram=st.booleans(),
)
def test_engine_speculation_equals_plain_decoding_in_bf16_near_ties(arch, prompt, skip, branches, ngram):
    """With near-uniform logits (no logit scale) argmax ties are common in bf16: any bit of
    difference between verification and plain steps would show as another token."""
    engine = _near_tie_engine(arch)
    if not engine.exact:
        pytest.skip(engine.model.exactness.reason)
    config = DraftConfig(max_draft=6, threshold=0.0, ngram=ngram, branches=branches, branch_below=1.0)
    policy = StaticPolicy(ModelInfo(4), config, skip=skip)
    settings_ = DecodeSettings(max_new_tokens=24)
    plain = [t for chunk in engine.decode(prompt, settings_) for t in chunk]
    speculative = [t for chunk in engine.decode(prompt, settings_, policy) for t in chunk]
    assert speculative == plain


@functools.cache
def _near_tie_engine(arch: str) -> Engine:
    return Engine(SkippableModel(tiny_model(arch, dtype=torch.bfloat16, hidden=128, logit_scale=1.0)))


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_transformers_generate_is_unchanged_by_the_registered_attention(arch):
    """The `hf` baseline runs the model's own forward under our registered name: it must get
    SDPA and SDPA's masks (sliding windows of 16 here, over a 40-token prompt)."""
    from spirit.testing import tiny_spirit

    lm = tiny_spirit(arch)
    prompt = list(range(40, 80))
    ours = lm.generate(prompt, max_new_tokens=8, method="hf").token_ids
    reference = tiny_model(arch)  # attn_implementation "sdpa", untouched
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):]
    assert ours == expected.tolist()


def test_the_engine_caps_verification_at_the_rows_found_row_invariant(monkeypatch):
    """Where the check finds rows invariant only up to some pass size, no exact pass is larger,
    and the output still equals plain decoding."""
    from spirit.model.exactness import Exactness

    model = SkippableModel(
        tiny_model("llama", dtype=torch.bfloat16, hidden=128), exactness=Exactness(True, 1, 4, "capped for the test")
    )
    engine = Engine(model)
    rows: list[int] = []
    forward = model.forward

    def recording(input_ids, *args, exact=False, **kwargs):
        if exact:
            rows.append(input_ids.shape[1])
        return forward(input_ids, *args, exact=exact, **kwargs)

    monkeypatch.setattr(model, "forward", recording)
    prompt = [1, 2, 3, 4] * 6
    config = DraftConfig(max_draft=8, threshold=0.0, ngram=True, branches=3, branch_below=1.0)
    plain = [t for chunk in engine.decode(prompt, DecodeSettings(max_new_tokens=30)) for t in chunk]
    policy = StaticPolicy(ModelInfo(4), config, skip=SkipSet(frozenset({1}), frozenset({2})))
    fast = [t for chunk in engine.decode(prompt, DecodeSettings(max_new_tokens=30), policy) for t in chunk]
    assert fast == plain
    assert max(rows) == 4  # trees of up to 8 chain nodes and their leaves were cut to 4 rows


def test_a_truncated_tree_is_a_tree():
    tree = DraftTree(0)
    for parent, token in [(0, 1), (1, 2), (0, 3), (2, 4), (3, 5)]:
        tree.add(parent, token)
    cut = tree.truncated(4)
    assert cut.tokens == [0, 1, 2, 3] and cut.parents == [-1, 0, 1, 0] and cut.depths == [0, 1, 2, 1]
    assert all(p < i for i, p in enumerate(cut.parents) if i)
