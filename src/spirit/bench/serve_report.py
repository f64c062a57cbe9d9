"""`spirit bench-serve`'s outputs: results.json (every request), report.md (tables), two PNG
plots (aggregate tok/s and p50 latency against clients, one line per server setting), and
the same table on the terminal."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from spirit.bench.machine import kernel_lines, machine_line, peak_rss_bytes
from spirit.bench.plots import _pyplot, save
from spirit.bench.report import _row, exactness_line
from spirit.bench.serve_load import LoadRun, ServeLoadResult

HEAD = ["max batch", "clients", "requests", "agg tok/s", "vs batch 1", "busy tok/s", "busy s", "req tok/s p50",
        "TTFT p50 s", "TTFT p90 s", "latency p50 s", "p90 s", "p99 s", "p50 / lone", "errors", "mismatches"]


def _num(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def table_rows(result: ServeLoadResult) -> list[list[str]]:
    """One row per (setting, clients), grouped by clients: the cells of `HEAD`."""
    rows = []
    for run in sorted(result.runs, key=lambda r: (r.clients, r.max_batch)):
        f = run.figures()
        ratio = result.batching_ratio(run.max_batch, run.clients) if run.max_batch != 1 else None
        rows.append([str(run.max_batch), str(run.clients), str(f.requests), _num(f.aggregate_tok_s),
                     _num(ratio, suffix="x"), _num(f.busy_tok_s), _num(f.busy_s, 1), _num(f.request_tok_s_p50),
                     _num(f.ttft_p50_s, 3), _num(f.ttft_p90_s, 3), _num(f.latency_p50_s, 3),
                     _num(f.latency_p90_s, 3), _num(f.latency_p99_s, 3),
                     _num(result.relative_latency(run), suffix="x"), str(f.errors), str(f.mismatches)])
    return rows


def text_table(head: list[str], rows: list[list[str]]) -> str:
    """Right-aligned columns for the terminal."""
    widths = [max(len(c) for c in column) for column in zip(head, *rows)]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in [head, *rows])


def markdown_table(head: list[str], rows: list[list[str]]) -> list[str]:
    return [_row(head), _row(["---"] * len(head)), *(_row(r) for r in rows)]


def batching_rows(result: ServeLoadResult) -> list[list[str]]:
    """Per client count: each setting's aggregate tok/s and batched over one at a time, then
    the same for busy tok/s (while every client had a request in flight)."""
    rows = []
    for clients in result.settings.clients:
        cells = [str(clients)]
        for busy in (False, True):
            for max_batch in result.settings.max_batches:
                run = result.run(max_batch, clients)
                f = run.figures() if run else None
                cells.append(_num(None if f is None else f.busy_tok_s if busy else f.aggregate_tok_s))
            cells += [_num(result.batching_ratio(b, clients, busy), suffix="x") for b in result.settings.max_batches[1:]]
        rows.append(cells)
    return rows


def batching_head(result: ServeLoadResult) -> list[str]:
    batches = result.settings.max_batches
    return ["clients", *(f"agg tok/s, batch {b}" for b in batches), *(f"batch {b} / batch 1" for b in batches[1:]),
            *(f"busy tok/s, batch {b}" for b in batches), *(f"busy: batch {b} / batch 1" for b in batches[1:])]


def mismatch_lines(result: ServeLoadResult) -> list[str]:
    """Every mismatch and every failed request, by run."""
    lines = []
    for run in result.runs:
        where = f"max_batch {run.max_batch}, {run.clients} clients"
        lines += [f"- {where}: {m.describe(result.prompts)}" for m in run.mismatches]
        lines += [f"- {where}: request {i} failed (HTTP {r.status}): {r.error}" for i, r in run.errors]
    return lines


def summary(result: ServeLoadResult) -> str:
    """What the terminal shows: the table, the batching ratios, mismatches and errors."""
    lines = [text_table(HEAD, table_rows(result)), "", text_table(batching_head(result), batching_rows(result)),
             f"prefill ceiling (solo latency / solo time to first token): {_num(result.prefill_ceiling(), suffix='x')}"]
    problems = mismatch_lines(result)
    lines += ["", f"identical to the solo greedy text: {'yes' if not result.mismatches else 'NO'} "
                  f"({result.mismatches} mismatches, {result.errors} failed requests)", *problems[:20]]
    if len(problems) > 20:
        lines.append(f"... {len(problems) - 20} more in results.json")
    lines.append(f"total {result.elapsed_s:.1f} s")
    return "\n".join(lines)


def _run_dict(run: LoadRun, result: ServeLoadResult) -> dict:
    return {
        "max_batch": run.max_batch, "clients": run.clients, "order": run.order, **asdict(run.figures()),
        "batching_ratio": result.batching_ratio(run.max_batch, run.clients) if run.max_batch != 1 else None,
        "busy_batching_ratio": result.batching_ratio(run.max_batch, run.clients, busy=True) if run.max_batch != 1 else None,
        "p50_latency_vs_lone": result.relative_latency(run) if run is not result.reference else None,
        "mismatch_details": [asdict(m) for m in run.mismatches],
        "requests_detail": [
            {"request": i, "prompt": i % len(result.prompts), "question_id": result.prompts[i % len(result.prompts)].question_id,
             "status": r.status, "error": r.error, "completion_tokens": r.completion_tokens,
             "latency_s": round(r.latency_s, 6), "first_token_s": None if r.first_token_s is None else round(r.first_token_s, 6),
             "sent_s": None if run.busy is None else round(r.sent_at - run.busy[0], 6)}
            for i, r in sorted(run.replies.items())
        ],
    }


def results_dict(result: ServeLoadResult) -> dict:
    s = result.settings
    return {
        "command": result.command, "model": result.model, "dtype": result.dtype, "method": s.method,
        "settings": asdict(s), "machine": result.machine, "exactness": result.exactness,
        "elapsed_s": round(result.elapsed_s, 3), "process_peak_rss_mb": round(peak_rss_bytes() / 2**20, 1),
        "prompts": [{"question_id": p.question_id, "category": p.category} for p in result.prompts],
        "reference": _run_dict(result.reference, result),
        "reference_texts": [result.reference.replies[i].text for i in range(len(result.prompts))],
        "runs": [_run_dict(r, result) for r in result.runs],
        "mismatches": result.mismatches, "errors": result.errors, "prefill_ceiling": result.prefill_ceiling(),
    }


def _series(result: ServeLoadResult, value) -> dict[int, tuple[list[int], list[float]]]:
    """Per setting: the client counts it ran and `value(figures)` at each, where measured."""
    series = {}
    for max_batch in result.settings.max_batches:
        points = [(c, value(run.figures())) for c in result.settings.clients if (run := result.run(max_batch, c))]
        points = [(c, v) for c, v in points if v is not None]
        series[max_batch] = ([c for c, _ in points], [v for _, v in points])
    return series


def plot_against_clients(series: dict[int, tuple[list[int], list[float]]], path: Path, ylabel: str, title: str) -> Path:
    """One line per server setting against the number of concurrent clients (log2 axis)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for max_batch, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=f"max_batch {max_batch}")
    clients = sorted({x for xs, _ in series.values() for x in xs})
    ax.set_xscale("log", base=2)
    ax.set_xticks(clients, [str(c) for c in clients])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return save(fig, path)


def markdown(result: ServeLoadResult, plots: dict[str, str]) -> str:
    s = result.settings
    lone = "the same setting at 1 client" if 1 in s.clients else "the solo reference (1 client, max_batch 1)"
    lines = [
        f"# spirit bench-serve: {result.model} ({result.dtype}), method {s.method}", "",
        f"- command: `{result.command}`",
        f"- {machine_line(result.machine)}",
        f"- {len(result.prompts)} prompts (the first turn of each question, as a chat message), greedy, "
        f"max_tokens {s.max_tokens}; clients {', '.join(map(str, s.clients))}; server settings max_batch "
        f"{' and '.join(map(str, s.max_batches))}, started once each in this process, used one at a time",
        "- order: a warm-up request per server, the solo reference (each prompt alone, max_batch 1), then per "
        "client count both settings back to back, their order reversed at each next client count",
        f"- {exactness_line(result.exactness)}",
        *(f"- {line}" for line in kernel_lines(result.machine)),
        f"- total time {result.elapsed_s:.1f} s",
        f"- prefill ceiling {_num(result.prefill_ceiling(), suffix='x')}: the solo reference's total latency over its "
        "total time to first token, the most batching can gain on these prompts and answer lengths (each prompt's "
        "prefill is compute-bound and batched with no other, so it costs the same in any setting)", "",
        "Definitions (spirit.bench.serve_load): agg tok/s = completion tokens of all answered requests / the run's "
        "wall time; req tok/s = a request's completion tokens / its latency; TTFT = until the first streamed "
        "text; latency = until the stream ends, queueing included; percentiles interpolate linearly; "
        "busy tok/s = completion tokens streamed while every client had a request in flight (from the first "
        "request to the first client's last answer; `busy s`), over that time: the run without its tail, where "
        "the last requests end one by one and fewer clients load the server; "
        f"vs batch 1 = agg tok/s over max_batch 1's at the same clients; p50 / lone = p50 latency over {lone}.", "",
        "## Per setting and client count", "", *markdown_table(HEAD, table_rows(result)), "",
        "## Batching: aggregate tok/s", "", *markdown_table(batching_head(result), batching_rows(result)), "",
    ]
    lines += [f"![{name}]({file})" for name, file in plots.items()]
    problems = mismatch_lines(result)
    lines += ["", f"## Identical to the solo greedy text ({result.mismatches} mismatches, {result.errors} failed requests)", "",
              "Every request's text is compared with its prompt's solo reference.", "", *(problems or ["None."]), "",
              "## Files", "", "- `results.json`: every figure above and every request's timings", ""]
    return "\n".join(lines)


def write_outputs(result: ServeLoadResult, out: str | Path, make_plots: bool = True) -> dict[str, Path]:
    """Write report.md, results.json and the plots into `out`; returns the paths by kind."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    plots: dict[str, str] = {}
    if make_plots:
        title = f"{result.model} ({result.dtype}), {result.settings.method}, {result.settings.max_tokens} tokens"
        paths["throughput"] = plot_against_clients(_series(result, lambda f: f.aggregate_tok_s), out / "throughput.png",
                                                   "aggregate completion tokens/s", f"throughput: {title}")
        paths["latency"] = plot_against_clients(_series(result, lambda f: f.latency_p50_s), out / "latency.png",
                                                "p50 request latency (s)", f"latency: {title}")
        plots = {"aggregate tok/s against clients": "throughput.png", "p50 latency against clients": "latency.png"}
    paths["json"] = out / "results.json"
    paths["json"].write_text(json.dumps(results_dict(result), indent=1, ensure_ascii=False, default=str) + "\n",
                             encoding="utf-8")
    paths["report"] = out / "report.md"
    paths["report"].write_text(markdown(result, plots), encoding="utf-8")
    return paths
