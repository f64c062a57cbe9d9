"""Freeing a thread's OpenMP workers (spirit/threads.py), and the server's worker doing it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from spirit.threads import _libgomp, release_openmp_workers

needs_libgomp = pytest.mark.skipif(_libgomp() is None, reason="torch's OpenMP runtime here is not GNU libgomp")


def thread_count() -> int:
    return len(list(Path("/proc/self/task").iterdir()))


def parallel_sum() -> torch.Tensor:
    """Work big enough that torch runs it on its OpenMP workers."""
    return torch.arange(2_000_000, dtype=torch.float64).sin().sum()


@needs_libgomp
def test_the_calling_threads_workers_are_freed_and_come_back_when_needed():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        expected = parallel_sum()
        assert release_openmp_workers()
        fewer = thread_count()
        release_openmp_workers()  # nothing left to free: still fine
        assert parallel_sum() == expected  # a new pool, the same result
        deadline = time.monotonic() + 5
        while thread_count() <= fewer and time.monotonic() < deadline:
            time.sleep(0.01)
        assert thread_count() == fewer + 1  # the pool's one worker is back
        assert release_openmp_workers()
        deadline = time.monotonic() + 5
        while thread_count() > fewer and time.monotonic() < deadline:
            time.sleep(0.01)
        assert thread_count() == fewer
    finally:
        torch.set_num_threads(before)


def test_the_server_worker_frees_the_loading_threads_workers_and_its_own_when_idle(monkeypatch):
    from spirit.server import scheduler
    from spirit.testing import tiny_spirit

    calls: list[str] = []
    monkeypatch.setattr(scheduler, "release_openmp_workers", lambda: calls.append(threading.current_thread().name))
    lm = tiny_spirit("llama", num_layers=2)
    for max_batch in (1, 4):
        calls.clear()
        sched = scheduler.Scheduler(lm, max_batch=max_batch)
        try:
            deadline = time.monotonic() + 10
            while "spirit-engine" not in calls and time.monotonic() < deadline:
                time.sleep(0.01)
            # the creating thread first (the model was loaded there), then the idle worker
            assert calls[0] == threading.current_thread().name and "spirit-engine" in calls, calls
        finally:
            sched.close()
