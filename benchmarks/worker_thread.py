"""A full-model pass on the thread that loaded the model, and on another thread with and
without the loading thread's OpenMP workers freed first (spirit/threads.py): what a server's
worker thread pays when they are left behind.

    python benchmarks/worker_thread.py --model qwen2.5-coder-1.5b --rows 1,8

Each setting times `--passes` exact passes per row count (one request's pass of that many
rows at position 200, as in batched decoding) and prints the best and the median.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

import spirit
from spirit.skipset import SkipSet
from spirit.threads import release_openmp_workers


def timed_passes(model, cache, rows: list[int], passes: int) -> dict[int, list[float]]:
    times: dict[int, list[float]] = {}
    for n in rows:
        for _ in range(passes):
            ids = torch.randint(100, 5000, (1, n))
            t0 = time.perf_counter()
            model.forward(ids, 200, cache, SkipSet(), exact=True)
            times.setdefault(n, []).append(time.perf_counter() - t0)
    return times


def on_thread(work) -> dict[int, list[float]]:
    result: dict[int, list[float]] = {}
    worker = threading.Thread(target=lambda: result.update(work()))
    worker.start()
    worker.join()
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--rows", default="1,8")
    p.add_argument("--passes", type=int, default=8)
    args = p.parse_args()
    lm = spirit.load(args.model, dtype="auto", weights="auto")
    model = lm.engine.model
    cache = model.new_cache(1024)
    model.forward(torch.randint(100, 5000, (1, 200)), 0, cache, SkipSet(), prefill=True)
    rows = [int(r) for r in args.rows.split(",")]
    work = lambda: timed_passes(model, cache, rows, args.passes)  # noqa: E731
    work()  # warm-up
    settings = {"loading thread": work(), "worker thread, loading thread's workers left": on_thread(work)}
    freed = release_openmp_workers()
    settings["worker thread, loading thread's workers freed"] = on_thread(work)
    print(f"{args.model}, {torch.get_num_threads()} threads; OpenMP workers freed: {freed}")
    for name, times in settings.items():
        figures = ", ".join(f"{n} rows {1000 * min(t):.1f} ms (median {1000 * statistics.median(t):.1f})"
                            for n, t in times.items())
        print(f"  {name}: {figures}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
