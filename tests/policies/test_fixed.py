"""`fixed`: spirit's default draft levers at one configuration (its ratio-0 arm), never adapting."""

from dataclasses import replace

import pytest
from sim import Landscape, prompts_of, ratio_peak, run

from spirit.request import default_draft
from spirit.policies import REGISTRY, FixedPolicy, ModelInfo, SpiritPolicy
from spirit.skipset import DraftConfig, SkipSet

L = 24
RATIO_0_ARM = replace(SpiritPolicy.default_draft, skip=SkipSet())  # the quantized model skipping nothing


def test_registered_with_spirits_default_levers():
    assert "fixed" in REGISTRY.names()
    assert default_draft("fixed") == SpiritPolicy.default_draft
    d = default_draft("fixed")
    assert d.draft_bits == 4 and d.draft_vocab > 0 and d.branches > 1 and d.ngram and d.threshold == 0.5


def test_one_configuration_for_every_window_whatever_the_speeds():
    policy = REGISTRY.create("fixed", ModelInfo(L), default_draft("fixed"))
    log = run(policy, Landscape(ratio_peak(0.3, height=2.0)), prompts_of(0, 3) + prompts_of(1, 3), noise=0.2)
    configs = {c for _, c, *_ in log.windows}
    assert configs == {RATIO_0_ARM}
    assert policy.state_dict() == {}


def test_is_the_ratio_0_arm_spirit_settles_on_when_skipping_costs():
    """Where the quantized draft alone is fastest, spirit (after its search) runs exactly
    what `fixed` runs from the first window."""
    def speedup(config: DraftConfig) -> float:
        if not config.speculative:
            return 1.0
        return 1.5 - (0.3 if config.skip and config.skip.ratio(L) > 0 else 0.0)

    spirit = SpiritPolicy(ModelInfo(L), SpiritPolicy.default_draft)
    log = run(spirit, Landscape(speedup=lambda skip: 1.0, config_speedup=speedup), prompts_of(0, 8), noise=0.01)
    assert log.configs_of(7)[-1] == FixedPolicy(ModelInfo(L), SpiritPolicy.default_draft).plan().config == RATIO_0_ARM


@pytest.mark.parametrize("ngram, expected", [(True, DraftConfig(ngram=True)), (False, DraftConfig())])
def test_without_quantized_drafts_the_arm_drafts_no_model_pass(ngram, expected):
    # as in spirit: skipping nothing at full precision is no model draft (lookup alone, or plain)
    policy = FixedPolicy(ModelInfo(L), DraftConfig(ngram=ngram))
    assert policy.plan().config == expected and policy.plan().config.skip is None


def test_generates_vanillas_tokens_on_a_tiny_model():
    from spirit.testing import tiny_spirit

    lm = tiny_spirit("llama")
    prompt = "The rain in Spain falls mainly on the plain. The rain in Spain"
    vanilla = lm.generate(prompt, method="vanilla", max_new_tokens=24)
    fixed = lm.generate(prompt, method="fixed", max_new_tokens=24)
    assert fixed.token_ids == vanilla.token_ids
    assert fixed.stats.counters.draft_rounds > 0
    assert set(fixed.stats.configs) == {RATIO_0_ARM.describe(lm.num_layers)}
