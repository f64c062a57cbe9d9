"""Gumbel mode end to end: a seeded sampled request gives plain seeded decoding's text, token
for token, whatever the draft and whatever the engine learned before (sampling.py says why).

The guarantee needs each verified token's logits to equal a plain step's. In float32 on tiny
models they agree to within rounding that never decides a pick here; in bf16 it holds where the
model's load-time exactness check passed (model/exactness.py), and the bf16 test runs only there.
The distribution of Gumbel-mode samples is tested with the rejection mode's chi-square tests
(test_sampling_engine.py, test_tree_sampling.py) and in test_verify_gumbel.py.
"""

import pytest
import torch

from spirit.engine import DecodeSettings, Engine
from spirit.model.adapter import SkippableModel
from spirit.policies.base import LookupPolicy, ModelInfo, StaticPolicy, VanillaPolicy
from spirit.sampling import SamplingParams
from spirit.skipset import DraftConfig, SkipSet
from spirit.testing import tiny_model, tiny_spirit

PROMPT = [10, 20, 30, 10, 20, 30, 10, 20, 40, 50]
NEW = 30
INFO = ModelInfo(4)
DRAFTS = {  # policies whose drafts differ in every way they can
    "chain": lambda: StaticPolicy(INFO, DraftConfig(max_draft=4, threshold=0.0), skip=SkipSet.parse("mlp:2")),
    "tree+head+lookup": lambda: StaticPolicy(
        INFO, DraftConfig(max_draft=5, threshold=0.0, branches=3, branch_below=1.0, draft_vocab=64, ngram=True),
        skip=SkipSet.parse("attn:1,2;mlp:2"),
    ),
    "lookup": lambda: LookupPolicy(INFO, DraftConfig(ngram=True, ngram_tokens=4, branches=2)),
}


def sample(engine: Engine, policy, seed: int, prompt=PROMPT, params: dict | None = None) -> tuple[list[int], int]:
    """The request's tokens and how many drafts were accepted."""
    sampling = SamplingParams(**(params or dict(temperature=0.7, seed=seed)))
    decoding = engine.decode(prompt, DecodeSettings(max_new_tokens=NEW, sampling=sampling), policy)
    out = []
    while True:
        try:
            out.extend(next(decoding))
        except StopIteration as end:
            return out, end.value.counters.accepted


def assert_draft_invariant(model: SkippableModel, seeds=range(4)) -> None:
    engine = Engine(model)
    accepted = 0
    for seed in seeds:
        plain, _ = sample(Engine(model), VanillaPolicy(INFO), seed)
        for name, policy in DRAFTS.items():
            out, n = sample(engine, policy(), seed)
            assert out == plain, (name, seed)
            accepted += n
    assert accepted > 20, "the drafts must be accepted sometimes, or the test shows nothing"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_a_seeded_request_gives_plain_decodings_text_whatever_the_draft(arch):
    """Float32; one engine serves every draft in turn, so each request also follows others."""
    assert_draft_invariant(SkippableModel(tiny_model(arch, num_layers=4, logit_scale=2.0)))


def test_in_bf16_where_the_kernels_are_exact():
    model = SkippableModel(tiny_model("qwen2", num_layers=4, logit_scale=2.0, dtype=torch.bfloat16, hidden=128))
    if not model.exactness.exact:
        pytest.skip(f"bf16 passes are not bit-exact on this machine: {model.exactness.reason}")
    assert_draft_invariant(model)


def test_a_seeded_request_repeats_on_a_learning_engine():
    """The reduced draft head learns from every request, so the draft changes from request to
    request; the text does not (with rejection sampling it does: test_tree_sampling.py)."""
    model = SkippableModel(tiny_model("gemma3", num_layers=4, logit_scale=2.0))
    engine = Engine(model)
    policy = DRAFTS["tree+head+lookup"]
    first, _ = sample(engine, policy(), 1)
    version = engine.heads.table.version
    for other in range(3):  # other prompts, other seeds, greedy and sampled: all learned from
        sample(engine, policy(), other, prompt=[100 + other, 7, 7, 9], params=dict(temperature=1.0, seed=other))
        sample(engine, policy(), other, prompt=[200 + other, 8, 9], params=dict())
    assert engine.heads.table.version > version  # the draft did change
    assert sample(engine, policy(), 1)[0] == first
    assert sample(Engine(model), VanillaPolicy(INFO), 1)[0] == first


def test_the_explicit_rejection_mode_still_samples():
    model = SkippableModel(tiny_model("llama", num_layers=4, logit_scale=2.0))
    params = dict(temperature=0.7, seed=3, mode="rejection")
    a, _ = sample(Engine(model), DRAFTS["chain"](), 3, params=params)
    b, _ = sample(Engine(model), DRAFTS["chain"](), 3, params=params)
    assert a == b and len(a) == NEW  # seeded: a fresh engine repeats it


def test_spirit_with_its_defaults_gives_vanillas_sampled_text():
    """Through the API, with spirit's own levers (quantized drafts, reduced head, trees,
    lookup) and its online policy: the seeded text is vanilla's."""
    lm = tiny_spirit("llama", num_layers=4, logit_scale=2.0)
    accepted = 0
    for seed in range(3):
        kw = dict(max_new_tokens=NEW, temperature=0.7, seed=seed)
        vanilla = lm.generate("the cat sat on the mat. the cat", method="vanilla", **kw)
        spirit = lm.generate("the cat sat on the mat. the cat", method="spirit", **kw)
        assert spirit.token_ids == vanilla.token_ids, seed
        accepted += spirit.stats.counters.accepted
    if accepted == 0:  # the policy chose by measured speed; where nothing pays here, nothing was drafted
        pytest.skip("spirit's policy found no draft faster than plain decoding on this machine")
    rejection = lm.generate("the cat", method="vanilla", sampling_mode="rejection", **kw)
    gumbel = lm.generate("the cat", method="vanilla", sampling_mode="gumbel", **kw)
    assert rejection.token_ids != gumbel.token_ids  # the mode reaches the engine


def test_the_command_line_and_the_server_take_the_mode(tmp_path, capsys):
    import json

    from pydantic import ValidationError

    from spirit import cli
    from spirit.server.schemas import CompletionRequest
    from spirit.testing import byte_tokenizer

    tiny_model("llama", num_layers=4, logit_scale=2.0).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    base = ["generate", "--model", str(tmp_path), "--dtype", "fp32", "--prompt", "the cat sat", "--max-new-tokens",
            "20", "--json", "--temperature", "0.7", "--seed", "3"]
    out = {}
    for method, extra in (("vanilla", []), ("static", ["--skip", "mlp:2", "--threshold", "0"])):
        for mode in ("gumbel", "rejection"):
            assert cli.main([*base, "--method", method, *extra, "--sampling-mode", mode]) == 0
            out[method, mode] = json.loads(capsys.readouterr().out)
    assert out["static", "gumbel"]["stats"]["acceptance_rate"] > 0  # so that the equality shows something
    assert out["static", "gumbel"]["token_ids"] == out["vanilla", "gumbel"]["token_ids"]
    assert out["vanilla", "gumbel"]["token_ids"] != out["vanilla", "rejection"]["token_ids"]
    assert CompletionRequest(prompt="x", sampling_mode="gumbel").sampling_mode == "gumbel"
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="x", sampling_mode="typical")
