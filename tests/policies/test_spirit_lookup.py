"""The spirit policy with prompt lookup as a draft source it switches per window."""

from sim import Landscape, prompts_of, run

from spirit.policies.base import LookupPolicy, ModelInfo
from spirit.policies.spirit import SpiritPolicy
from spirit.skipset import DraftConfig

L = 24


def landscape(lookup_gain: float, skip_peak: float = 0.2, skip_gain: float = 0.2) -> Landscape:
    """Lookup alone speeds decoding up by lookup_gain; layer skipping adds up to skip_gain
    at skip_peak (single-peaked in the ratio); plain decoding is 1.0."""
    def speedup(config: DraftConfig) -> float:
        r = config.skip.ratio(L) if config.skip else 0.0
        # single-peaked in the ratio, as the policy assumes (a negative gain: every ratio costs)
        skip = max(-0.5, skip_gain - abs(skip_gain) * ((r - skip_peak) / skip_peak) ** 2) if r > 0 else 0.0
        if not config.speculative:
            return 1.0
        return (lookup_gain if config.ngram else 1.0) + skip
    return Landscape(speedup=lambda skip: 1.0, config_speedup=speedup)


def last_config(log, request: int) -> DraftConfig:
    return log.configs_of(request)[-1]


def test_settles_on_lookup_with_the_best_ratio_when_both_pay():
    policy = SpiritPolicy(ModelInfo(L), DraftConfig(ngram=True))
    log = run(policy, landscape(1.3), prompts_of(0, 6), noise=0.01)
    final = last_config(log, 5)
    assert final.ngram
    assert final.skip is not None and abs(final.skip.ratio(L) - 0.2) <= 0.05
    assert policy.profile.drafting


def test_settles_on_lookup_alone_when_skipping_costs():
    policy = SpiritPolicy(ModelInfo(L), DraftConfig(ngram=True))
    log = run(policy, landscape(1.3, skip_gain=-0.4), prompts_of(0, 6), noise=0.01)
    final = last_config(log, 5)
    assert final.ngram and final.skip is None


def test_falls_back_to_plain_decoding_when_lookup_is_slower():
    policy = SpiritPolicy(ModelInfo(L), DraftConfig(ngram=True))
    log = run(policy, landscape(0.8, skip_gain=-0.4), prompts_of(0, 6), noise=0.01)
    final = last_config(log, 5)
    assert not final.speculative
    assert not policy.profile.drafting


def test_calibration_windows_are_plain_decoding():
    # the speed model must be fit on plain windows: lookup windows are not plain
    policy = SpiritPolicy(ModelInfo(L), DraftConfig(ngram=True))
    log = run(policy, landscape(1.3), prompts_of(0, 1))
    assert not log.configs_of(0)[0].speculative
    assert policy.speed.calibrated


def test_lookup_policy_always_drafts_by_lookup_only():
    policy = LookupPolicy(ModelInfo(L), DraftConfig(ngram_tokens=5))
    config = policy.plan().config
    assert config.ngram and config.skip is None and config.ngram_tokens == 5 and config.speculative


def test_a_search_runs_the_best_so_far_between_two_trials():
    # short requests: a search that ran trials back to back would spend whole requests on them
    policy = SpiritPolicy(ModelInfo(L), DraftConfig(ngram=True))
    run(policy, landscape(1.3), prompts_of(0, 8), tokens=64, noise=0.01)
    kinds = [h["trial"] for h in policy.history]
    trials = ("ratio", "pattern")
    assert "best" in kinds and "pattern" in kinds
    assert not any(a in trials and b in trials for a, b in zip(kinds, kinds[1:]))


def test_with_lookup_the_first_search_measures_lookup_alone_first():
    policy = SpiritPolicy(ModelInfo(L), DraftConfig(ngram=True))
    run(policy, landscape(1.3), prompts_of(0, 2), noise=0.01)
    first_trial = next(h for h in policy.history if h["trial"] == "ratio")
    assert first_trial["ratio"] == 0.0


def test_a_new_task_inherits_lookup_alone_without_a_trial_on_arrival():
    policy = SpiritPolicy(ModelInfo(L), DraftConfig(ngram=True))
    log = run(policy, landscape(1.3, skip_gain=-0.4), prompts_of(0, 6), noise=0.01)
    assert last_config(log, 5).skip is None and policy.profile.drafting
    log = run(policy, landscape(1.3, skip_gain=-0.4), prompts_of(1, 3), noise=0.01, log=log)
    assert len(policy.profiles) >= 2 and all(p.drafting for p in policy.profiles)
    arrivals = [c for r in (6, 7, 8) for c in log.configs_of(r) if c.speculative]
    assert arrivals and all(c.ngram and c.skip is None for c in arrivals)


def test_a_larger_ratio_must_beat_every_smaller_one_by_the_margin():
    from spirit.policies.spirit import MARGIN, _best_ratio

    assert _best_ratio({0.0: 1.40, 0.1: 1.40 * (1 + MARGIN / 2)}) == 0.0  # a near-tie: skip less
    assert _best_ratio({0.0: 1.40, 0.1: 1.40 * (1 + 2 * MARGIN)}) == 0.1
    assert _best_ratio({0.0: 1.0, 0.1: 1.2, 0.2: 1.21, 0.3: 1.5}) == 0.3
    assert _best_ratio({0.1: 0.9, 0.2: 0.8}) == 0.1
