import math
import random

import pytest
from sim import Landscape, prompts_of, run

from spirit.policies.base import ModelInfo
from spirit.policies.sp2ec import GoldenSection, Sp2ecPolicy


def search(f, lo, hi):
    gs = GoldenSection(lo, hi)
    probes = 0
    while (n := gs.next_probe()) is not None:
        gs.values[n] = f(n)
        probes += 1
    return gs.best(), probes


@pytest.mark.parametrize("peak", [3, 10, 17, 25, 31])
def test_finds_the_peak_of_unimodal_functions_in_log_probes(peak):
    best, probes = search(lambda n: 10 - abs(n - peak) ** 1.3, 1, 32)
    assert best == peak
    assert probes <= 2 * math.ceil(math.log(32, 1 / 0.618)) + 3  # O(log L), ~10 here


def test_tolerates_noise():
    rng = random.Random(0)
    hits = 0
    for trial in range(50):
        peak = rng.randint(5, 27)
        best, _ = search(lambda n: (2.0 - 0.04 * abs(n - peak)) * (1 + 0.01 * rng.gauss(0, 1)), 1, 32)
        hits += abs(best - peak) <= 2
    assert hits >= 45


def test_policy_moves_to_the_best_layer_count_and_is_lossless_in_config():
    L = 24

    def speedup(skip):
        kept = L - (len(skip.attn) if skip else 0)
        return 1.0 + 0.5 * (1 - ((kept - 16) / 8) ** 2) if kept < L else 1.0

    policy = Sp2ecPolicy(ModelInfo(L))
    run(policy, Landscape(speedup), prompts_of(0, 6), tokens=256, noise=0.01)
    assert abs(policy.best_keep - 16) <= 2
    assert max(policy.probes_per_query[1:]) <= 10
