"""`spirit bench-serve`: the figures, the comparison with solo decoding, the command end to
end on a tiny random model, and bad input refused before any model loads."""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys

import numpy as np
import pytest

from spirit.bench.serve_cli import parse_clients
from spirit.bench.serve_load import (
    LoadRun, LoadSettings, ServeLoadResult, busy_window, find_mismatches, first_difference, percentile, requests_for,
    run_order,
)
from spirit.cli import build_parser, main
from spirit.server.client import StreamedReply

SKIP = "attn:1;mlp:1"  # static drafts with layer 1 skipped: the speculative path runs on the tiny model


def reply(text: str, latency: float = 1.0, tokens: int = 4, first: float | None = 0.1, status: int = 200,
          error: str | None = None) -> StreamedReply:
    return StreamedReply(status, text, tokens, latency, first, error)


# -- figures -------------------------------------------------------------------------------------


@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_interpolates_like_numpy(q):
    values = [0.3, 5.0, 1.2, 9.9, 2.2, 2.2, 7.1]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edges():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([4.0], 99) == 4.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_run_figures():
    run = LoadRun(2, 2, 1, wall_s=2.0, replies={
        0: reply("a", latency=1.0, tokens=4, first=0.2), 1: reply("b", latency=2.0, tokens=8, first=0.4),
        2: reply("", status=500, error="boom", tokens=0, first=None),
    })
    f = run.figures()
    assert (f.requests, f.errors, f.completion_tokens) == (3, 1, 12)
    assert f.aggregate_tok_s == 6.0  # answered tokens over the run's wall time
    assert f.request_tok_s_p50 == 4.0  # 4/1 and 8/2
    assert f.ttft_p50_s == pytest.approx(0.3) and f.latency_p50_s == 1.5 and f.latency_p99_s == pytest.approx(1.99)


def streamed(sent: float, latency: float, tokens: int, text: str, arrivals=()) -> StreamedReply:
    return StreamedReply(200, text, tokens, latency, arrivals[0][0] if arrivals else None, None, sent, tuple(arrivals))


def test_tokens_by_counts_the_text_that_had_arrived():
    r = streamed(10.0, 4.0, 8, "abcdefgh", [(1.0, 2), (2.0, 6), (3.5, 8)])
    assert r.ended_at == 14.0
    assert [r.tokens_by(t) for t in (10.5, 11.0, 12.9, 13.6, 14.0, 99.0)] == [0.0, 2.0, 6.0, 8.0, 8.0, 8.0]
    assert streamed(0.0, 1.0, 3, "").tokens_by(0.5) == 0.0 and streamed(0.0, 1.0, 3, "").tokens_by(1.0) == 3.0


def test_the_busy_window_ends_with_the_first_client_to_run_out():
    # client A: requests 0 and 2 (ends at 9); client B: requests 1 and 3 (ends at 6); B's
    # last answer is where fewer than 2 clients load the server
    replies = {0: streamed(1.0, 3.0, 4, "aaaa", [(1.0, 2), (3.0, 4)]), 1: streamed(1.5, 2.0, 2, "bb", [(2.0, 2)]),
               2: streamed(4.0, 5.0, 10, "c" * 10, [(1.0, 5), (4.0, 8), (5.0, 10)]), 3: streamed(3.5, 2.5, 2, "dd", [(2.5, 2)])}
    assert busy_window(replies, {0: "A", 1: "B", 2: "A", 3: "B"}) == (1.0, 6.0)
    assert busy_window({}, {}) is None
    run = LoadRun(2, 2, 1, wall_s=8.0, replies=replies, busy=(1.0, 6.0))
    f = run.figures()
    # by 6.0: requests 0, 1, 3 whole (4 + 2 + 2) and half of request 2's text (5 of 10 characters)
    assert f.busy_s == 5.0 and f.busy_tok_s == pytest.approx((4 + 2 + 2 + 5) / 5.0)
    assert f.aggregate_tok_s == 18 / 8.0
    assert LoadRun(2, 2, 1, wall_s=8.0, replies=replies).figures().busy_tok_s is None


def test_the_prefill_ceiling_is_solo_latency_over_solo_time_to_first_token():
    reference = LoadRun(1, 1, 0, wall_s=9.0, replies={
        0: reply("a", latency=5.0, first=1.0), 1: reply("b", latency=3.0, first=1.0),
        2: reply("", status=500, error="boom", latency=40.0, first=None)})  # a failure counts for nothing
    result = ServeLoadResult("tiny", "float32", LoadSettings(), [], reference, [])
    assert result.prefill_ceiling() == 4.0  # (5 + 3) / (1 + 1)
    result.reference = LoadRun(1, 1, 0, wall_s=1.0, replies={0: reply("", first=None)})
    assert result.prefill_ceiling() is None


def test_requests_and_order():
    assert [requests_for(26, c) for c in (1, 2, 4, 8, 16)] == [26, 26, 28, 32, 32]
    assert run_order(LoadSettings(clients=(1, 2, 4), max_batches=(1, 8))) == [(1, 1), (8, 1), (8, 2), (1, 2), (1, 4), (8, 4)]


# -- the comparison with solo decoding -----------------------------------------------------------


def test_an_injected_mismatch_is_found():
    reference = ["abc", "hello world"]
    replies = {0: reply("abc"), 1: reply("hello there"), 2: reply("abX"), 3: reply("hello world"),
               4: reply("", status=429, error="busy")}  # a failure is an error, not a mismatch
    found = find_mismatches(reference, replies)
    assert [(m.request, m.prompt, m.position) for m in found] == [(1, 1, 6), (2, 0, 2)]
    assert found[0].expected == "hello world" and found[0].got == "hello there"
    assert find_mismatches(reference, {0: reply("abc"), 1: reply("hello world")}) == []


def test_first_difference():
    assert first_difference("abc", "abc") is None
    assert first_difference("abc", "ab") == 2 and first_difference("", "x") == 0 and first_difference("xbc", "abc") == 0


# -- the command ---------------------------------------------------------------------------------


@pytest.fixture
def questions(tmp_path):
    path = tmp_path / "q.jsonl"
    rows = [(1, "qa", "What is rain?"), (2, "qa", "Name a river."), (3, "math", "What is 2 + 2?")]
    path.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t, "and then?"]}) + "\n"
                            for i, c, t in rows))
    return path


@pytest.fixture
def tiny(monkeypatch):
    """spirit.load gives a tiny random model, whatever the name."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import spirit
    from spirit.testing import tiny_spirit

    monkeypatch.setattr(spirit, "load", lambda *a, **k: tiny_spirit("llama", num_layers=4))


def bench_serve(questions, out, *extra):
    return main(["bench-serve", "--model", "tiny", "--questions", str(questions), "--clients", "1,2",
                 "--max-batch", "2", "--max-tokens", "6", "--method", "static", "--skip", SKIP, "--out", str(out), *extra])


def test_end_to_end(tiny, questions, tmp_path, capsys):
    out = tmp_path / "out"
    assert bench_serve(questions, out) == 0
    stdout = capsys.readouterr().out
    assert "agg tok/s" in stdout and "batch 2 / batch 1" in stdout and "0 mismatches, 0 failed requests" in stdout
    assert {p.name for p in out.iterdir()} == {"report.md", "results.json", "throughput.png", "latency.png"}
    data = json.loads((out / "results.json").read_text())
    assert [(r["max_batch"], r["clients"]) for r in data["runs"]] == [(1, 1), (2, 1), (2, 2), (1, 2)]
    assert [r["requests"] for r in data["runs"]] == [3, 3, 4, 4] and data["mismatches"] == 0 and data["errors"] == 0
    assert all(r["completion_tokens"] > 0 and r["latency_p50_s"] > 0 and r["ttft_p50_s"] > 0 for r in data["runs"])
    assert data["runs"][0]["p50_latency_vs_lone"] == 1.0 and data["runs"][1]["batching_ratio"] > 0
    # every run has a busy window within its wall time, and the streamed tokens in it
    assert all(0 < r["busy_s"] <= r["wall_s"] and r["busy_tok_s"] > 0 for r in data["runs"])
    assert data["runs"][1]["busy_batching_ratio"] > 0 and "busy: batch 2 / batch 1" in stdout
    assert data["prefill_ceiling"] > 1 and "prefill ceiling" in stdout
    assert len(data["reference_texts"]) == 3 and data["command"].startswith("spirit bench-serve --model tiny")
    report = (out / "report.md").read_text()
    assert "machine:" in report and "spirit bench-serve --model tiny" in report and "![" in report


def test_a_mismatch_under_load_fails_the_run(tiny, questions, tmp_path, capsys, monkeypatch):
    from spirit.server.client import ChatClient

    real = ChatClient.stream_chat
    calls = itertools.count(1)

    def altered(self, body):  # 2 warm-ups and 3 reference requests, then the 10th and 15th answers changed
        got, n = real(self, body), next(calls)
        return dataclasses.replace(got, text=got.text + "!") if n > 5 and n % 5 == 0 else got

    monkeypatch.setattr(ChatClient, "stream_chat", altered)
    assert bench_serve(questions, tmp_path / "a") == 1
    captured = capsys.readouterr()
    assert "differ from their solo greedy decoding" in captured.err and "expected" in captured.out
    data = json.loads((tmp_path / "a" / "results.json").read_text())
    assert data["mismatches"] == 2 and sum(r["mismatches"] for r in data["runs"]) == 2
    assert bench_serve(questions, tmp_path / "b", "--allow-mismatch") == 0


@pytest.mark.parametrize("extra, message", [
    (["--clients", "0,2"], "--clients: every count must be >= 1, got 0"),
    (["--clients", "one"], "--clients: expected comma-separated whole numbers"),
    (["--clients", ","], "--clients is empty"),
    (["--max-batch", "0"], "--max-batch must be >= 1"),
    (["--max-tokens", "0"], "max_new_tokens must be >= 1"),
    (["--method", "warp"], "unknown method 'warp'"),
    (["--per-category", "0"], "--per-category must be >= 1"),
    (["--categories", "poetry"], "unknown category 'poetry'"),
])
def test_bad_input_is_one_line_exit_2(no_model, questions, capsys, extra, message):
    assert main(["bench-serve", "--questions", str(questions), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("spirit: error:") and message in err and "\n" not in err


def test_a_missing_question_file(no_model, tmp_path, capsys):
    assert main(["bench-serve", "--questions", str(tmp_path / "none.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "none.jsonl does not exist" in err and "Traceback" not in err


def test_without_questions_the_default_is_the_checkouts_dev_set(no_model, tmp_path, capsys, monkeypatch):
    from spirit.bench import serve_cli

    monkeypatch.setattr(serve_cli, "DEFAULT_QUESTIONS", tmp_path / "dev.jsonl")
    assert main(["bench-serve"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("spirit: error: no --questions given and the default") and "\n" not in err
    (tmp_path / "dev.jsonl").write_text(json.dumps({"question_id": 7, "category": "qa", "turns": ["hi"]}) + "\n")
    p = serve_cli.plan(build_parser().parse_args(["bench-serve"]))
    assert [q.question_id for q in p["prompts"]] == [7] and p["settings"].max_batches == (1, 8)
    assert p["settings"].clients == (1, 2, 4, 8, 16) and p["settings"].max_tokens == 64


def test_parse_clients():
    assert parse_clients("16,1,2,2,4") == (1, 2, 4, 16)


def test_without_the_extras_it_names_them(no_model, questions, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # looks uninstalled to find_spec
    assert main(["bench-serve", "--questions", str(questions)]) == 2
    err = capsys.readouterr().err
    assert "pip install -e '.[serve,bench]'" in err and "matplotlib" in err and err.count("\n") == 1
