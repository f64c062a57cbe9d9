"""On the real bundled smollm2-135m in bf16: a seeded sampled request (Gumbel mode, the default
for a seeded request) gives plain seeded decoding's tokens exactly, with spirit's defaults, on
a fresh draft state and on one that learned from every earlier request."""

import pytest
from test_smollm2 import EXACTNESS_PROMPTS, lm_bf16  # noqa: F401 (the fixture)

from spirit.request import default_draft
from spirit.policies import REGISTRY
from spirit.policies.base import ModelInfo

pytestmark = pytest.mark.integration


def test_seeded_sampling_gives_plain_decodings_tokens_in_bf16(lm_bf16):
    info = ModelInfo(lm_bf16.num_layers, lm_bf16.name)
    learning = REGISTRY.create("spirit", info, default_draft("spirit"))  # kept across requests
    diverged, accepted = [], 0
    for seed, prompt in enumerate(EXACTNESS_PROMPTS):
        kw = dict(chat=True, max_new_tokens=64, temperature=0.7, seed=seed)
        plain = lm_bf16.generate(prompt, method="vanilla", learner="vanilla", **kw)
        new_policy = REGISTRY.create("spirit", info, default_draft("spirit"))
        # nothing learned before: a new policy and a new draft state
        fresh = lm_bf16.generate(prompt, method="spirit", policy=new_policy, learner=f"fresh-{seed}", **kw)
        learned = lm_bf16.generate(prompt, method="spirit", policy=learning, learner="learning", **kw)
        lm_bf16.engine.learners.forget(f"fresh-{seed}")
        accepted += fresh.stats.counters.accepted + learned.stats.counters.accepted
        diverged += [(seed, name) for name, out in (("fresh", fresh), ("learned", learned))
                     if out.token_ids != plain.token_ids]
    assert not diverged, f"{len(diverged)} of {2 * len(EXACTNESS_PROMPTS)} requests diverged: {diverged}"
    assert accepted > 0, "no draft was accepted"
