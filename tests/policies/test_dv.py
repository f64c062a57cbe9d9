from spirit.policies.base import ModelInfo
from spirit.policies.dv import DraftVerifyPolicy
from spirit.skipset import SkipSet


def test_calibration_picks_the_fastest_measured_configuration():
    L = 12
    measured = []

    def measure(skip: SkipSet | None) -> float:
        measured.append(skip)
        if skip is None:
            return 10.0
        return 10.0 + 2.0 * len(skip.attn) - 1.5 * len(skip.mlp)  # attention skips pay here

    policy = DraftVerifyPolicy(ModelInfo(L))
    policy.calibrate(measure, trials=12)
    assert measured[0] is None and len(measured) == 13
    best = max([s for s in measured if s is not None], key=lambda s: 10.0 + 2.0 * len(s.attn) - 1.5 * len(s.mlp))
    assert policy.skip == best
    assert policy.start_request(None).config.skip == best


def test_keeps_plain_decoding_when_nothing_beats_it():
    policy = DraftVerifyPolicy(ModelInfo(8))
    policy.calibrate(lambda skip: 10.0 if skip is None else 5.0, trials=6)
    assert policy.skip is None and policy.calibrated
