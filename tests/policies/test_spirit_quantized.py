"""The spirit policy with quantized drafts: ratio 0 is a draft arm (every sublayer kept, the
MLPs quantized), measured like any ratio, and plain decoding still the floor."""

from sim import Landscape, prompts_of, run

from spirit.policies.base import ModelInfo
from spirit.policies.spirit import SpiritPolicy
from spirit.skipset import DraftConfig, SkipSet

L = 24


def landscape(quantized_gain: float, skip_gain: float = -0.3) -> Landscape:
    """The quantized draft alone (ratio 0) speeds decoding up by quantized_gain; skipping
    sublayers on top changes that by skip_gain at ratio 0.2, single-peaked in the ratio."""
    def speedup(config: DraftConfig) -> float:
        if not config.speculative:
            return 1.0
        assert config.draft_bits == 4, "every draft arm keeps the base's quantization"
        r = config.skip.ratio(L)
        return quantized_gain + (skip_gain * (1 - ((r - 0.2) / 0.2) ** 2) if r > 0 else 0.0)
    return Landscape(speedup=lambda skip: 1.0, config_speedup=speedup)


def base() -> DraftConfig:
    return DraftConfig(draft_bits=4)


def test_the_first_search_measures_the_quantized_draft_that_skips_nothing_first():
    policy = SpiritPolicy(ModelInfo(L), base())
    log = run(policy, landscape(1.5), prompts_of(0, 2), noise=0.01)
    first_trial = next(h for h in policy.history if h["trial"] == "ratio")
    assert first_trial["ratio"] == 0.0
    drafts = [c for r in (0, 1) for c in log.configs_of(r) if c.speculative]
    assert drafts[0].skip == SkipSet() and not drafts[0].ngram


def test_settles_on_the_quantized_draft_alone_when_skipping_costs():
    policy = SpiritPolicy(ModelInfo(L), base())
    log = run(policy, landscape(1.5), prompts_of(0, 6), noise=0.01)
    final = log.configs_of(5)[-1]
    assert final.skip == SkipSet() and final.draft_bits == 4
    assert policy.profile.drafting and policy.profile.ratio == 0.0


def test_skips_on_top_when_that_pays():
    policy = SpiritPolicy(ModelInfo(L), base())
    log = run(policy, landscape(1.3, skip_gain=0.3), prompts_of(0, 8), noise=0.01)
    final = log.configs_of(7)[-1]
    assert final.skip is not None and abs(final.skip.ratio(L) - 0.2) <= 0.05


def test_falls_back_to_plain_decoding_when_the_quantized_draft_is_slower():
    policy = SpiritPolicy(ModelInfo(L), base())
    log = run(policy, landscape(0.8), prompts_of(0, 6), noise=0.01)
    assert not log.configs_of(5)[-1].speculative
    assert not policy.profile.drafting


def test_profiles_saved_before_the_rename_still_load():
    policy = SpiritPolicy(ModelInfo(L), base())
    run(policy, landscape(1.5), prompts_of(0, 3), noise=0.01)
    state = policy.state_dict()
    for p in state["profiles"]:
        p["lookup"] = p.pop("drafting")
    restored = SpiritPolicy(ModelInfo(L), base())
    restored.load_state_dict(state)
    assert [p.drafting for p in restored.profiles] == [p.drafting for p in policy.profiles]


def with_lookup(quantized_gain: float, lookup_gain: float) -> Landscape:
    """Quantized drafts at ratio 0 give quantized_gain; lookup first adds lookup_gain (a
    negative one where lookup's weak drafts pre-empt the model's better ones); skipping costs."""
    def speedup(config: DraftConfig) -> float:
        if not config.speculative:
            return 1.0
        r = config.skip.ratio(L) if config.skip is not None else 0.0
        return quantized_gain + (lookup_gain if config.ngram else 0.0) - (1.5 * r if r > 0 else 0.0)
    return Landscape(speedup=lambda skip: 1.0, config_speedup=speedup)


def test_switches_prompt_lookup_off_where_it_pre_empts_better_drafts():
    policy = SpiritPolicy(ModelInfo(L), DraftConfig(draft_bits=4, ngram=True))
    log = run(policy, with_lookup(1.6, -0.3), prompts_of(0, 6), noise=0.01)
    final = log.configs_of(5)[-1]
    assert final.skip == SkipSet() and not final.ngram and not policy.profile.ngram
    assert any(h["trial"] == "source" for h in policy.history)


def test_keeps_prompt_lookup_where_it_pays():
    policy = SpiritPolicy(ModelInfo(L), DraftConfig(draft_bits=4, ngram=True))
    log = run(policy, with_lookup(1.6, 0.3), prompts_of(0, 6), noise=0.01)
    final = log.configs_of(5)[-1]
    assert final.skip == SkipSet() and final.ngram


def test_a_new_task_starts_from_its_neighbours_lookup_choice():
    policy = SpiritPolicy(ModelInfo(L), DraftConfig(draft_bits=4, ngram=True))
    log = run(policy, with_lookup(1.6, -0.3), prompts_of(0, 6), noise=0.01)
    log = run(policy, with_lookup(1.6, -0.3), prompts_of(1, 2), noise=0.01, log=log)
    assert len(policy.profiles) >= 2 and not policy.profiles[-1].ngram


def test_a_new_task_measures_the_ratio_0_draft_first_even_after_a_skipping_neighbour():
    # the first task pays for skipping 20% on top; a second task then starts its local search
    # with the quantized draft alone, not with a near-zero skip ratio inherited from it
    policy = SpiritPolicy(ModelInfo(L), DraftConfig(draft_bits=4, ngram=True))
    log = run(policy, landscape(1.3, skip_gain=0.3), prompts_of(0, 8), noise=0.01)
    assert policy.profiles[0].ratio > 0
    run(policy, landscape(1.3, skip_gain=0.3), prompts_of(1, 1), noise=0.01, log=log)
    assert len(policy.profiles) == 2
    second = [h for h in policy.history if h["profile"] == 1 and h["trial"] == "ratio"]
    assert second and second[0]["ratio"] == 0.0



def test_plain_refresh_windows_are_short():
    # a refresh of the speed model runs at plain speed: it must not take a whole short request
    from spirit.policies.spirit import EXPLOIT_WINDOW, PLAIN_REFRESH, PLAIN_WINDOW, Stage

    policy = SpiritPolicy(ModelInfo(L), base())
    run(policy, landscape(1.5), prompts_of(0, 6), noise=0.01)
    assert policy.profile.stage == Stage.EXPLOIT
    policy.windows_since_plain = PLAIN_REFRESH
    plan = policy.plan()
    assert not plan.config.speculative and plan.window_tokens == PLAIN_WINDOW < EXPLOIT_WINDOW
    policy.windows_since_plain = 0
    plan = policy.plan()
    assert plan.config.speculative and plan.window_tokens == EXPLOIT_WINDOW
