"""One engine, one worker thread, a bounded first-in first-out queue of generation jobs.

The engine is not thread-safe and decodes a batch of one, so every generation runs on a
single worker thread, in arrival order. The event loop that serves HTTP only submits jobs
and reads their events from an asyncio queue; a job that is cancelled (client gone, timeout)
leaves the waiting line at once, or, when already running, stops after the engine's current
round (`TextStream.cancel`), which frees the engine for the next job.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spirit.api import GenerationResult, Spirit, TextStream

log = logging.getLogger("spirit.server")


class QueueFull(Exception):
    """More jobs are waiting than the queue holds; the client should retry later."""


class SchedulerClosed(Exception):
    pass


@dataclass
class Job:
    """One generation: the `Spirit.stream` keyword arguments and the events it produced.

    Events posted to `events`, in order: ("started", None), then ("piece", text) any number of
    times, then ("done", GenerationResult); or ("error", exception) at any point.
    """

    prompt: Any  # text, chat messages or token ids, as Spirit.stream takes them
    kwargs: dict
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None
    cancelled: bool = False
    _stream: TextStream | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def post(self, kind: str, value: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def cancel(self) -> None:
        """Stop this job (thread-safe): it leaves the queue, or stops after the current round."""
        with self._lock:
            self.cancelled = True
            if self._stream is not None:
                self._stream.cancel()


class Scheduler:
    def __init__(
        self,
        lm: Spirit,
        max_queue: int = 16,
        on_finish: Callable[[Job, GenerationResult | None, BaseException | None], None] | None = None,
    ) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.lm = lm
        self.max_queue = max_queue
        self._on_finish = on_finish
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._recent: deque[float] = deque(maxlen=32)  # seconds per finished job, for Retry-After
        self._thread = threading.Thread(target=self._work, name="spirit-engine", daemon=True)
        self._thread.start()

    # -- the event loop's side -------------------------------------------------------------

    def submit(self, prompt, kwargs: dict) -> Job:
        """Queue a job (called from the event loop); raises QueueFull when the line is full."""
        job = Job(prompt, kwargs, asyncio.get_running_loop())
        with self._cond:
            if self._closed:
                raise SchedulerClosed("the server is shutting down")
            # max_queue jobs may wait behind the one running
            if len(self._waiting) + (self._running is not None) > self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting")
            self._waiting.append(job)
            self._cond.notify()
        return job

    def withdraw(self, job: Job) -> None:
        """Cancel a job; a waiting one leaves the line now and frees its place."""
        job.cancel()
        with self._cond:
            try:
                self._waiting.remove(job)
            except ValueError:
                pass

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        return self._running is not None

    def retry_after_s(self) -> int:
        """A guess at when a place in the line frees up: the recent mean job time, at least 1 s."""
        mean = sum(self._recent) / len(self._recent) if self._recent else 1.0
        return max(1, math.ceil(mean))

    def close(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._closed = True
            pending, self._waiting = list(self._waiting), deque()
            running = self._running
            self._cond.notify_all()
        for job in pending:
            job.cancel()
            job.post("error", SchedulerClosed("the server is shutting down"))
        if running is not None:
            running.cancel()
        self._thread.join(timeout)

    # -- the worker thread -----------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._running = self._waiting.popleft()
            try:
                self._run(job)
            finally:
                with self._cond:
                    self._running = None

    def _run(self, job: Job) -> None:
        job.started = time.perf_counter()
        result: GenerationResult | None = None
        error: BaseException | None = None
        try:
            stream = self.lm.stream(job.prompt, **job.kwargs)
            with job._lock:
                job._stream = stream
                if job.cancelled:
                    stream.cancel()
            job.post("started")
            if not job.cancelled:  # cancelled before its turn: never touch the engine
                for piece in stream:
                    job.post("piece", piece)
            result = stream.result
            job.post("done", result)
        except Exception as exc:  # answered (and logged when a fault) by the app; the worker keeps serving
            error = exc
            job.post("error", exc)
        finally:
            self._recent.append(time.perf_counter() - job.started)
            if self._on_finish is not None:
                try:
                    self._on_finish(job, result, error)
                except Exception:  # a bookkeeping fault must not stop the worker, nor go unseen
                    log.exception("the scheduler's on_finish callback failed")
