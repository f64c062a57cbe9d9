from sim import Landscape, prompts_of, run

from spirit.policies.base import ModelInfo
from spirit.policies.swift import BO_EVERY, SwiftPolicy

L = 12


def test_fixed_ratio_first_and_last_layers_kept_and_every_other_start():
    policy = SwiftPolicy(ModelInfo(L))
    start = policy.best
    assert sum(start) == round(0.45 * 2 * (L - 2))
    assert start[0] == start[L - 1] == start[L] == start[2 * L - 1] == 0
    assert all(start[i] for i in (1, 3, 5, 7, 9))


def test_keeps_improving_candidates_and_stops_at_target_matchness():
    policy = SwiftPolicy(ModelInfo(L))
    # matchness grows with how many skipped sublayers are attention (a learnable landscape)
    land = Landscape(lambda s: 1.0, matchness=lambda s: min(0.99, 0.5 + 0.06 * len(s.attn)))
    run(policy, land, prompts_of(0, 40), tokens=64)
    assert policy.best_score >= 0.95 and not policy.optimizing
    assert policy.plan().window_tokens == 64 and policy.plan().config.probe is None


def test_stops_after_300_steps_without_improvement():
    policy = SwiftPolicy(ModelInfo(L))
    run(policy, Landscape(lambda s: 1.0, matchness=lambda s: 0.5), prompts_of(0, 12), tokens=40)
    assert not policy.optimizing and policy.steps == 301  # the first sets the best, then 300 stale


def test_bayesian_suggestion_every_25_steps(monkeypatch):
    from spirit.policies import gp

    calls = []
    original = gp.suggest
    monkeypatch.setattr(gp, "suggest", lambda obs, cands, **kw: calls.append(len(obs)) or original(obs, cands))
    policy = SwiftPolicy(ModelInfo(L))
    run(policy, Landscape(lambda s: 1.0, matchness=lambda s: 0.4 + 0.01 * len(s.mlp)), prompts_of(0, 2), tokens=100)
    assert calls and all((n + 1) % BO_EVERY == 0 for n in calls)
