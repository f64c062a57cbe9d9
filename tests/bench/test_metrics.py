"""Aggregation, the answer format and the lossless comparison, against hand-computed values."""

import pytest

from spirit.bench.answers import accept_lengths, answer_record
from spirit.bench.metrics import (
    OVERALL, Figures, QuestionRun, TurnResult, aggregate, compare_lossless, decoding_steps, first_divergence, speedup,
    summarize,
)
from spirit.bench.questions import Question
from spirit.stats import Counters, GenerationStats


def stats(new, wall, prefill=0.0, rounds=0, drafted=0, accepted=0, draft_t=0.0, verify_t=0.0):
    return GenerationStats(
        prompt_tokens=5, new_tokens=new, wall_time_s=wall, prefill_time_s=prefill,
        counters=Counters(new_tokens=new - 1, draft_rounds=rounds, drafted=drafted, accepted=accepted,
                          draft_time_s=draft_t, verify_time_s=verify_t),
    )


def turn(s, ids=None):
    return TurnResult("text", list(ids) if ids is not None else list(range(s.new_tokens)), s, "length")


Q1 = Question(1, "qa", ("a",))
Q2 = Question(2, "qa", ("b", "c"))
Q3 = Question(3, "math", ("d",))


def spec_runs():
    # q1: 10 tokens in 2 s (5 tok/s); 3 rounds, 9 drafted, 6 accepted -> 1 + 3 + 0 plain = 4 steps
    r1 = QuestionRun("static", Q1, [turn(stats(10, 2.0, 0.5, 3, 9, 6, 0.4, 0.9))], slot=0, order=1, peak_rss_bytes=100 * 2**20)
    # q2: 6 + 4 tokens in 1 + 3 s (2.5 tok/s); turn 1: 1 round, 4 drafted, 2 accepted -> plain 6-1-2-1 = 2 -> 4 steps
    #                                            turn 2: no rounds -> 4 steps
    r2 = QuestionRun("static", Q2, [turn(stats(6, 1.0, 0.2, 1, 4, 2, 0.1, 0.5)), turn(stats(4, 3.0, 0.3, 0, 0, 0, 0.0, 2.0))],
                     slot=1, order=3, peak_rss_bytes=120 * 2**20)
    return [r1, r2]


def base_runs():
    return [
        QuestionRun("vanilla", Q1, [turn(stats(10, 4.0, 0.5, verify_t=3.5))], slot=0, order=0),  # 2.5 tok/s
        QuestionRun("vanilla", Q2, [turn(stats(6, 2.0)), turn(stats(4, 3.0))], slot=1, order=2),  # 2.0 tok/s
    ]


def test_decoding_steps():
    assert decoding_steps(stats(10, 1.0, rounds=3, accepted=6)) == 4
    assert decoding_steps(stats(6, 1.0, rounds=1, accepted=2)) == 4
    assert decoding_steps(stats(4, 1.0)) == 4  # vanilla: one pass per token
    assert decoding_steps(GenerationStats()) == 0


def test_aggregate_hand_computed():
    f = aggregate(spec_runs())
    assert f.questions == 2 and f.turns == 3
    assert f.new_tokens == 20
    assert f.wall_time_s == pytest.approx(6.0)
    assert f.tokens_per_s == pytest.approx((5.0 + 2.5) / 2)  # mean over questions, not 20 / 6
    assert f.decode_tokens_per_s == pytest.approx(20 / (6.0 - 1.0))
    assert f.counters.draft_rounds == 4 and f.counters.drafted == 13 and f.counters.accepted == 8
    assert f.counters.acceptance_rate == pytest.approx(8 / 13)
    assert f.counters.mean_accepted == pytest.approx(8 / 4)
    assert f.decoding_steps == 12
    assert f.committed_per_step == pytest.approx(20 / 12)
    split = f.time_split()
    assert split["prefill"] == pytest.approx(1.0 / 6) and split["draft"] == pytest.approx(0.5 / 6)
    assert split["verify"] == pytest.approx(3.4 / 6) and split["other"] == pytest.approx(1.1 / 6)
    assert f.peak_rss_bytes == 120 * 2**20
    d = f.to_dict()
    assert d["tokens_per_s"] == 3.75 and d["acceptance_rate"] == 0.6154 and d["peak_rss_mb"] == 120.0


def test_summarize_speedup_per_category():
    math_v = QuestionRun("vanilla", Q3, [turn(stats(8, 4.0))], slot=2, order=4)  # 2 tok/s
    math_s = QuestionRun("static", Q3, [turn(stats(8, 1.0))], slot=2, order=5)  # 8 tok/s
    table = summarize(base_runs() + spec_runs() + [math_v, math_s])
    assert list(table) == ["vanilla", "static"]
    assert set(table["static"]) == {"qa", "math", OVERALL}
    assert table["static"]["qa"].speedup == pytest.approx(3.75 / 2.25)
    assert table["static"]["math"].speedup == pytest.approx(4.0)
    assert table["vanilla"]["qa"].speedup == pytest.approx(1.0)
    assert table["static"][OVERALL].tokens_per_s == pytest.approx((5 + 2.5 + 8) / 3)
    assert table["static"][OVERALL].speedup == pytest.approx(((5 + 2.5 + 8) / 3) / ((2.5 + 2 + 2) / 3))


def test_answer_record_matches_spec_bench_format():
    r2 = spec_runs()[1]
    record = answer_record(r2, "m-static-float32", answer_id="abc", tstamp=12.5)
    assert record == {
        "question_id": 2,
        "category": "qa",
        "answer_id": "abc",
        "model_id": "m-static-float32",
        "choices": [{
            "index": 0,
            "turns": ["text", "text"],
            "decoding_steps": [4, 4],
            "new_tokens": [6, 4],
            "wall_time": [1.0, 3.0],
            # turn 1: prefill 1, two plain steps 1, one round committing 6 - 1 - 2 = 3; turn 2: four 1s
            "accept_lengths": [1.0, 1.0, 1.0, 3.0, 1.0, 1.0, 1.0, 1.0],
        }],
        "tstamp": 12.5,
    }
    # what Spec-Bench's speed.py computes from it
    choice = record["choices"][0]
    assert sum(choice["new_tokens"]) / sum(choice["wall_time"]) == pytest.approx(2.5)


def test_accept_lengths_mean_is_exact():
    s = stats(10, 2.0, rounds=3, drafted=9, accepted=6)
    lengths = accept_lengths(s)
    assert lengths == [1.0, 3.0, 3.0, 3.0]
    assert sum(lengths) == s.new_tokens and len(lengths) == decoding_steps(s)


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == (1, 2, 9)
    assert first_divergence([1, 2, 3], [1, 2]) == (2, 3, None)
    assert first_divergence([1, 2], [1, 2, 7]) == (2, None, 7)
    assert first_divergence([], []) is None


def test_compare_lossless_reports_divergence_and_skips_later_turns():
    base = [
        QuestionRun("vanilla", Q1, [turn(stats(4, 1.0), [10, 11, 12, 13])], slot=0),
        QuestionRun("vanilla", Q2, [turn(stats(3, 1.0), [20, 21, 22]), turn(stats(2, 1.0), [30, 31])], slot=1),
    ]
    good = [
        QuestionRun("good", Q1, [turn(stats(4, 1.0), [10, 11, 12, 13])], slot=0),
        QuestionRun("good", Q2, [turn(stats(3, 1.0), [20, 21, 22]), turn(stats(2, 1.0), [30, 31])], slot=1),
    ]
    bad = [
        QuestionRun("bad", Q1, [turn(stats(4, 1.0), [10, 11, 12, 13])], slot=0),
        QuestionRun("bad", Q2, [turn(stats(3, 1.0), [20, 99, 22]), turn(stats(2, 1.0), [30, 31])], slot=1),
    ]
    result = compare_lossless(base + good + bad, decode=lambda ids: ",".join(map(str, ids)))
    assert result["good"].lossless and result["good"].rate == 1.0
    assert result["good"].identical_turns == 3
    ll = result["bad"]
    assert not ll.lossless and ll.rate == 0.5
    assert ll.identical_questions == 1 and ll.turns_compared == 2  # turn 2 of q2 follows a divergence
    (d,) = ll.divergences
    assert (d.method, d.question_id, d.category, d.turn, d.position) == ("bad", 2, "qa", 0, 1)
    assert (d.baseline_token, d.method_token) == (21, 99)
    assert d.baseline_piece == "21" and d.method_piece == "99"
    assert d.baseline_context == "20,21,22" and d.method_context == "20,99,22"
    data = ll.to_dict()
    assert data["lossless"] is False and data["divergences"][0]["method"] == "bad"
    assert "margin" not in data["divergences"][0] and "near_tie" not in data["divergences"][0]


def test_speedup_is_one_definition():
    assert speedup(Figures(tokens_per_s=6.0), Figures(tokens_per_s=4.0)) == pytest.approx(1.5)
    assert speedup(Figures(tokens_per_s=6.0), Figures()) is None
    table = summarize(base_runs() + spec_runs())
    assert table["static"][OVERALL].speedup == speedup(table["static"][OVERALL], table["vanilla"][OVERALL])
