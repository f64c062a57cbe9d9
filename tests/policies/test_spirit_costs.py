"""The spirit policy's cost side: costs are the machine's, acceptance is the task's."""

import json
from dataclasses import replace

from machines import AVX2, DRAFT, LAYERS, VOCAB, XEON, landscape
from sim import Log, prompts_of, run

from spirit.plan import Plan
from spirit.policies.base import ModelInfo, RequestInfo
from spirit.policies.cost_model import Acceptance, CostModel, speed, window_figures
from spirit.policies.spirit import SpiritPolicy
from spirit.skipset import DraftConfig, skipset_from_sublayers
from spirit.stats import Counters, WindowStats

TASKS = 13
REQUESTS = 40
TOKENS = 64


def arm(sublayers) -> DraftConfig:
    """The default draft skipping `sublayers` ([kind, layer] pairs)."""
    return replace(DRAFT, skip=skipset_from_sublayers(sublayers))


def _first_requests() -> set[int]:
    """Request ids of each task's first request in `stream`."""
    ids, start = set(), 0
    for task in range(TASKS):
        ids.add(start)
        start += REQUESTS // TASKS + (1 if task < REQUESTS % TASKS else 0)
    return ids


def stream(machine, policy: SpiritPolicy, seed: int = 0) -> Log:
    """40 requests over 13 tasks, each task's requests together (as Spec-Bench runs them),
    each task accepting drafts at its own rate."""
    log = Log()
    per_task = [REQUESTS // TASKS + (1 if t < REQUESTS % TASKS else 0) for t in range(TASKS)]
    for task, count in enumerate(per_task):
        rate = 0.55 + 0.35 * ((task * 7) % TASKS) / TASKS  # 0.55 .. 0.9 per drafted token
        run(policy, landscape(machine, per_token=rate), prompts_of(task, count), tokens=TOKENS, noise=0.02,
            seed=seed + task, log=log)
    return log


def off_plain_tokens(log: Log) -> float:
    """Share of decoded tokens spent in windows that did not run plain decoding."""
    return sum(w for _, c, _, w in log.windows if c.speculative) / sum(w for *_, w in log.windows)


def mean_speed(log: Log) -> float:
    # every simulated window decodes at plain speed 20 tok/s times its speedup
    return sum(tps for _, _, tps, _ in log.windows) / len(log.windows) / 20.0


def policy_on(machine) -> SpiritPolicy:
    return SpiritPolicy(ModelInfo(LAYERS, costs=machine.with_target("bfloat16"), vocab=VOCAB), DRAFT)


def test_on_a_machine_where_no_arm_pays_the_stream_stays_on_plain_decoding():
    # each arm really is slower than plain decoding on every task here ...
    for rate in (0.55, 0.9):
        lay = landscape(AVX2, per_token=rate)
        for ratio in (0.0, 0.1, 0.3):
            skip = skipset_from_sublayers([("attn", i) for i in range(int(ratio * 2 * LAYERS))])
            for ngram in (True, False):
                assert lay.speedup_of(replace(DRAFT, skip=skip, ngram=ngram)) < 1.0
        assert lay.speedup_of(replace(DRAFT, skip=None)) < 1.0  # lookup alone
    # ... and the policy, told the machine's costs by the probe, barely tries them
    policy = policy_on(AVX2)
    log = stream(AVX2, policy)
    assert off_plain_tokens(log) <= 0.05
    # every task's first request runs plain decoding from its first token
    assert not any(c.speculative for r, c, *_ in log.windows if r in _first_requests())


def test_without_the_probe_the_first_task_pays_and_the_rest_learn_from_it():
    """The reference point for the test above: without the probe the policy must measure the
    arms' costs itself, on its first task; costs are the machine's, so later tasks reuse them."""
    log = stream(AVX2, SpiritPolicy(ModelInfo(LAYERS), DRAFT))
    off_plain = {r for r, c, *_ in log.windows if c.speculative}
    assert 0 in off_plain  # the first request explores
    first_task_requests = set(range(min(_first_requests() - {0})))
    assert off_plain <= first_task_requests  # later tasks stay plain


def test_where_arms_pay_the_probe_changes_nothing_but_it_still_finds_them():
    with_probe = stream(XEON, policy_on(XEON))
    without = stream(XEON, SpiritPolicy(ModelInfo(LAYERS), DRAFT))
    assert mean_speed(with_probe) >= mean_speed(without) - 0.02
    assert mean_speed(with_probe) > 1.3
    # the first task's search takes no more trials than without the probe
    probe_policy = policy_on(XEON)
    run(probe_policy, landscape(XEON), prompts_of(0, 3), tokens=TOKENS, noise=0.02)
    plain_policy = SpiritPolicy(ModelInfo(LAYERS), DRAFT)
    run(plain_policy, landscape(XEON), prompts_of(0, 3), tokens=TOKENS, noise=0.02)
    trials = lambda p: sum(1 for h in p.history if h["trial"] in ("ratio", "pattern", "source"))  # noqa: E731
    assert trials(probe_policy) <= trials(plain_policy)
    assert probe_policy.profile.drafting or probe_policy.profile.skip


def test_a_rare_short_trial_checks_a_prediction_that_ruled_everything_out():
    policy = policy_on(AVX2)
    log = run(policy, landscape(AVX2), prompts_of(0, 60), tokens=TOKENS, noise=0.02)
    trials = [(r, c) for r, c, *_ in log.windows if c.speculative]
    assert 1 <= len(trials) <= 3  # ~ one per REPROBE_GATED plain windows
    assert policy.costs.costs  # and what it measured now corrects the prediction


def test_window_figures_recover_the_decomposition():
    # 10 rounds of 4 drafted / 2 accepted (3 tokens each) and 5 plain steps: 35 tokens; each
    # round costs 2.5 plain steps of 0.1 s: 10 * 0.25 + 5 * 0.1 = 3.0 s
    stats = WindowStats(0, Plan(DRAFT), Counters(new_tokens=35, draft_rounds=10, drafted=40, accepted=20, lookup_rounds=4),
                        3.0, 500)
    acceptance, cost = window_figures(stats, 0.1)
    assert abs(cost - 2.5) < 1e-9
    assert (acceptance.tokens_per_round, acceptance.drafted_per_round) == (3.0, 4.0)
    assert abs(acceptance.round_share - 10 / 15) < 1e-9 and acceptance.lookup_share == 0.4
    assert abs(speed(acceptance, cost) - (35 / 30)) < 1e-9  # 35 tokens in 30 plain-step times


def test_predictions_follow_the_probe_and_learn_a_correction():
    model = CostModel(LAYERS, VOCAB, AVX2.with_target("bfloat16"))
    draft = arm([])  # int4 draft, skips nothing
    xeon = CostModel(LAYERS, VOCAB, XEON.with_target("bfloat16"))
    assert model.predict(draft) < 1.0 < xeon.predict(draft)
    acceptance = Acceptance(3.0, 3.0, 1.0)
    predicted = model.predicted_round_cost(draft, acceptance)
    model.observe(draft, acceptance, 2 * predicted)
    assert abs(model.round_cost(draft, acceptance) - 2 * predicted) < 1e-9
    # an arm not measured yet takes the mean correction
    other = arm([("attn", 10)])
    assert abs(model.round_cost(other, acceptance) / model.predicted_round_cost(other, acceptance) - 2) < 1e-9


def test_cost_state_round_trips_and_is_dropped_on_another_machine():
    policy = policy_on(XEON)
    run(policy, landscape(XEON), prompts_of(0, 3), tokens=TOKENS)
    state = json.loads(json.dumps(policy.state_dict()))
    same = policy_on(XEON)
    same.load_state_dict(state)
    assert same.costs.costs.keys() == policy.costs.costs.keys() and same.costs.costs
    assert same.profiles[0].acceptance.keys() == policy.profiles[0].acceptance.keys()
    other = policy_on(AVX2)
    other.load_state_dict(state)
    assert not other.costs.costs  # another machine's round costs would mislead
    assert other.costs.shared.keys() == policy.costs.shared.keys()  # what tasks accept holds


def test_without_a_probe_an_unmeasured_arm_is_always_worth_a_trial():
    policy = SpiritPolicy(ModelInfo(LAYERS), DRAFT)
    policy.start_request(RequestInfo(0, prompts_of(0, 1)[0], TOKENS))
    assert policy.costs.predict(arm([("mlp", 3)])) is None
    assert policy._trial_window(arm([("mlp", 3)])) is not None
    assert CostModel(LAYERS).predict(DraftConfig()) == 1.0  # plain decoding is the reference
