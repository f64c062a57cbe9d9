"""PNG plots of a benchmark (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

from spirit.bench.metrics import BASELINE, OVERALL, Figures


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> Path:
    """Lay out, write the PNG at the reports' resolution, and free the figure."""
    plt = _pyplot()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_speedup(table: dict[str, dict[str, Figures]], path: Path, title: str) -> Path:
    """Grouped bars: speedup over vanilla per category (and overall), one bar per method."""
    plt = _pyplot()
    methods = [m for m in table if m != BASELINE] or list(table)
    groups = [g for g in next(iter(table.values())) if g != OVERALL] + [OVERALL]
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(groups) * max(1, len(methods)) * 0.5 + 3), 4.2))
    for i, method in enumerate(methods):
        xs = [g + (i - (len(methods) - 1) / 2) * width for g in range(len(groups))]
        ys = [(table[method].get(c).speedup or 0.0) if table[method].get(c) else 0.0 for c in groups]
        bars = ax.bar(xs, ys, width, label=method)
        ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=7, padding=1)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right")
    ax.set_ylabel("speedup over vanilla (tokens/s ratio)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return save(fig, path)


def plot_timeline(timelines: dict[str, list[dict]], path: Path, title: str) -> Path:
    """Tokens/s (top) and draft skip ratio (bottom) per decoding window, along the stream of
    generated tokens; the background marks the category (or stream block) being answered."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 5.6), height_ratios=(3, 2))
    for method, points in timelines.items():
        xs = [p["tokens"] for p in points]
        top.plot(xs, [p["tokens_per_s"] for p in points], marker=".", markersize=3, linewidth=1, label=method)
        bottom.step(xs, [p["skip_ratio"] for p in points], where="pre", linewidth=1.2, label=method)
    reference = next((timelines[m] for m in (BASELINE, *timelines) if timelines.get(m)), [])
    spans = _segments(reference)
    for k, (start, end, label) in enumerate(spans):
        for ax in (top, bottom):
            if k % 2:
                ax.axvspan(start, end, color="0.92", zorder=0)
            if k:
                ax.axvline(start, color="0.6", linewidth=0.6, linestyle=":")
        top.text((start + end) / 2, 1.0, label, transform=top.get_xaxis_transform(), ha="center", va="bottom", fontsize=7)
    top.set_ylabel("tokens/s per window")
    bottom.set_ylabel("skip ratio")
    bottom.set_xlabel("tokens generated so far (per method)")
    bottom.set_ylim(bottom=0)
    top.legend(fontsize=8, loc="upper right")
    fig.suptitle(title, fontsize=10)
    return save(fig, path)


def _segments(points: list[dict]) -> list[tuple[float, float, str]]:
    """Consecutive stretches of one label (stream block, else category)."""
    spans: list[tuple[float, float, str]] = []
    previous = 0.0
    for p in points:
        label = f"{p['block']}: {p['category']}" if p.get("block") is not None else p["category"]
        if spans and spans[-1][2] == label:
            spans[-1] = (spans[-1][0], p["tokens"], label)
        else:
            spans.append((previous, p["tokens"], label))
        previous = p["tokens"]
    return spans
