from sim import Landscape, Log, prompts_of, ratio_peak, run

from spirit.policies.base import ModelInfo
from spirit.policies.spirit import SpiritPolicy

L = 24


def exploit_ratio(policy: SpiritPolicy, log: Log, request: int) -> float:
    configs = log.configs_of(request)
    return configs[-1].skip.ratio(L) if configs[-1].skip else 0.0


def test_finds_the_best_ratio_within_a_few_requests():
    policy = SpiritPolicy(ModelInfo(L))
    log = run(policy, Landscape(ratio_peak(0.3)), prompts_of(0, 6), noise=0.01)
    assert abs(exploit_ratio(policy, log, 5) - 0.3) <= 0.05
    # the search (5 ratios + refinement + pattern swaps) fits in the first three requests
    search_windows = sum(1 for h in policy.history if h["trial"] in ("ratio", "pattern"))
    assert search_windows <= 12
    assert all(c.speculative for c in log.configs_of(5)[:-1] if c.skip is not None)


def test_chooses_plain_decoding_when_speculation_never_pays():
    policy = SpiritPolicy(ModelInfo(L))
    log = run(policy, Landscape(lambda skip: 1.0 - (skip.ratio(L) if skip else 0.0)), prompts_of(0, 5), noise=0.01)
    assert all(not c.speculative for c in log.configs_of(4))
    assert policy.profile.ratio == 0.0


def test_readapts_to_a_new_task_and_restores_a_returning_one():
    policy = SpiritPolicy(ModelInfo(L))
    task_a, task_b = Landscape(ratio_peak(0.3)), Landscape(ratio_peak(0.1, height=1.3))
    log = run(policy, task_a, prompts_of(0, 5), noise=0.01)
    assert abs(exploit_ratio(policy, log, 4) - 0.3) <= 0.05
    log = run(policy, task_b, prompts_of(1, 5), noise=0.01, log=log)
    assert abs(exploit_ratio(policy, log, 9) - 0.1) <= 0.05
    assert len(policy.profiles) == 2
    log = run(policy, task_a, prompts_of(0, 1, length=40)[:1], noise=0.01, log=log)
    first = log.configs_of(10)[0]
    assert first.skip is not None and abs(first.skip.ratio(L) - 0.3) <= 0.05  # restored at once


def test_length_normalization_does_not_mistake_long_context_for_a_shift():
    slowing = Landscape(ratio_peak(0.3), plain_tps=lambda ctx: 40.0 / (1 + ctx / 500))
    policy = SpiritPolicy(ModelInfo(L))
    run(policy, slowing, prompts_of(0, 4), tokens=128, start_context=100, noise=0.01)
    assert policy.profile.stage in ("pattern", "exploit")
    searches = policy.profile.searches
    # long requests: context grows from 2,000 to 4,000 tokens, raw speed halves
    run(policy, slowing, prompts_of(0, 3), tokens=2000, start_context=2000, noise=0.01)
    assert policy.profile.searches == searches


def test_a_real_shift_in_speed_triggers_a_re_search():
    policy = SpiritPolicy(ModelInfo(L))
    run(policy, Landscape(ratio_peak(0.3)), prompts_of(0, 5), noise=0.01)
    searches = policy.profile.searches
    # same prompts, but now the 0.3 configuration is slow (e.g. a hardware or task change)
    run(policy, Landscape(ratio_peak(0.1, height=1.3)), prompts_of(0, 3), noise=0.01)
    assert policy.profile.searches > searches


def test_state_round_trips_through_json():
    import json

    policy = SpiritPolicy(ModelInfo(L))
    run(policy, Landscape(ratio_peak(0.3)), prompts_of(0, 4))
    restored = SpiritPolicy(ModelInfo(L))
    restored.load_state_dict(json.loads(json.dumps(policy.state_dict())))
    assert restored.profiles == policy.profiles and restored.order == policy.order


def test_settled_on_plain_decoding_it_reprobes_rarely_and_finds_a_change():
    from spirit.policies.spirit import REPROBE_EVERY

    policy = SpiritPolicy(ModelInfo(L))
    never = Landscape(lambda skip: 1.0 - (skip.ratio(L) if skip else 0.0))
    log = run(policy, never, prompts_of(0, 30), tokens=240, noise=0.01)
    speculative_windows = sum(1 for _, c, *_ in log.windows if c.speculative)
    exploit_windows = sum(1 for h in policy.history if h["trial"] == "exploit")
    assert speculative_windows <= 2 + exploit_windows // REPROBE_EVERY
    # speculation starts to pay (say, longer contexts): a later re-probe finds it
    log = run(policy, Landscape(ratio_peak(0.3)), prompts_of(0, 30), tokens=240, noise=0.01, log=log)
    assert log.windows[-1][1].speculative


def test_a_new_task_inherits_plain_decoding_then_checks_and_finds_its_own_ratio():
    policy = SpiritPolicy(ModelInfo(L))
    never = Landscape(lambda skip: 1.0 - (skip.ratio(L) if skip else 0.0))
    log = run(policy, never, prompts_of(0, 4), noise=0.01)
    log = run(policy, Landscape(ratio_peak(0.3)), prompts_of(1, 12), noise=0.01, log=log)
    assert len(policy.profiles) == 2
    assert not log.configs_of(4)[0].speculative  # no probe on arrival
    assert abs(exploit_ratio(policy, log, 15) - 0.3) <= 0.1  # found after its re-probe
