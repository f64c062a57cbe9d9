"""One engine, one worker thread, a bounded first-in first-out queue of generation jobs.

The engine is not thread-safe, so every generation runs on a single worker thread, in
arrival order. With `max_batch` 1 the worker decodes one job at a time. With more, it keeps
up to `max_batch` jobs decoding together (continuous batching, spirit/batch.py): a waiting job
joins at the next round, a finished one leaves at once. The event loop that serves HTTP only
submits jobs and reads their events from an asyncio queue; a job that is cancelled (client
gone, timeout) leaves the waiting line at once, or, when already running, stops after the
engine's current round (`TextStream.cancel`), which frees its place for the next job.

A job whose policy keeps one request's state between windows (`Policy.interleaved` False)
waits while another job of that same policy is decoding.
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
from spirit.batch import Batch
from spirit.stats import GenerationStats
from spirit.threads import release_openmp_workers

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
        max_batch: int = 1,
    ) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.lm = lm
        self.max_queue = max_queue
        self.max_batch = max_batch
        self._on_finish = on_finish
        self._waiting: deque[Job] = deque()
        self._active: list[Job] = []  # decoding now (at most max_batch)
        self._cond = threading.Condition()
        self._closed = False
        self._recent: deque[float] = deque(maxlen=32)  # seconds per finished job, for Retry-After
        # the engine runs on the worker thread from now on: the creating thread's idle OpenMP
        # workers (left by loading the model) would slow every pass there (spirit/threads.py)
        release_openmp_workers()
        self._thread = threading.Thread(target=self._work, name="spirit-engine", daemon=True)
        self._thread.start()

    # -- the event loop's side -------------------------------------------------------------

    def submit(self, prompt, kwargs: dict) -> Job:
        """Queue a job (called from the event loop); raises QueueFull when the line is full."""
        job = Job(prompt, kwargs, asyncio.get_running_loop())
        with self._cond:
            if self._closed:
                raise SchedulerClosed("the server is shutting down")
            # max_queue jobs may wait behind the running ones, beyond the free places of the batch
            if len(self._waiting) + len(self._active) > self.max_queue + self.max_batch - 1:
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
        return bool(self._active)

    @property
    def running(self) -> int:
        return len(self._active)

    def retry_after_s(self) -> int:
        """A guess at when a place in the line frees up: the recent mean job time, at least 1 s."""
        mean = sum(self._recent) / len(self._recent) if self._recent else 1.0
        return max(1, math.ceil(mean))

    def close(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._closed = True
            pending, self._waiting = list(self._waiting), deque()
            running = list(self._active)
            self._cond.notify_all()
        for job in pending:
            job.cancel()
            job.post("error", SchedulerClosed("the server is shutting down"))
        for job in running:
            job.cancel()
        self._thread.join(timeout)

    # -- the worker thread -----------------------------------------------------------------

    def _work(self) -> None:
        if self.max_batch > 1:
            self._work_batched()
            return
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._idle()
                if self._closed:
                    return
                job = self._waiting.popleft()
                self._active.append(job)
            try:
                self._run(job)
            finally:
                with self._cond:
                    self._active.remove(job)

    def _idle(self) -> None:
        """Wait for work (holding `_cond`), first freeing this thread's OpenMP workers: another
        server's engine in this process may run meanwhile (spirit/threads.py)."""
        release_openmp_workers()
        self._cond.wait()

    def _run(self, job: Job) -> None:
        result: GenerationResult | None = None
        error: BaseException | None = None
        try:
            stream = self._open(job)
            if not job.cancelled:  # cancelled before its turn: never touch the engine
                for piece in stream:
                    job.post("piece", piece)
            result = stream.result
            job.post("done", result)
        except Exception as exc:  # answered (and logged when a fault) by the app; the worker keeps serving
            error = exc
            job.post("error", exc)
        finally:
            self._finished(job, result, error)

    def _open(self, job: Job) -> TextStream:
        """The job's text stream (its prompt tokenized, its request checked), marked started."""
        job.started = time.perf_counter()
        stream = self.lm.stream(job.prompt, **job.kwargs)
        with job._lock:
            job._stream = stream
            if job.cancelled:
                stream.cancel()
        job.post("started")
        return stream

    def _finished(self, job: Job, result: GenerationResult | None, error: BaseException | None) -> None:
        self._recent.append(time.perf_counter() - (job.started or job.submitted))
        if self._on_finish is not None:
            try:
                self._on_finish(job, result, error)
            except Exception:  # a bookkeeping fault must not stop the worker, nor go unseen
                log.exception("the scheduler's on_finish callback failed")

    # -- continuous batching ---------------------------------------------------------------

    def _work_batched(self) -> None:
        batch = Batch(self.lm.engine, self.max_batch)
        # opened jobs whose policy is busy with another request (Policy.interleaved False);
        # they hold their place in the batch's count and join when that request leaves
        deferred: list[tuple[Job, TextStream]] = []
        while True:
            with self._cond:
                while not self._waiting and not len(batch) and not self._closed:
                    self._idle()
                if self._closed:
                    break
                free = self.max_batch - len(self._active)
                joining = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
                self._active.extend(joining)
            for job in joining:
                opened = self._open_batched(job)
                if opened is not None:
                    deferred.append(opened)
            deferred = [each for each in deferred if not self._join(batch, *each)]
            try:
                if len(batch):
                    batch.step()
            except Exception as exc:  # an engine fault fails the jobs in the batch, not the server
                log.exception("a batched decoding round failed")
                batch = Batch(self.lm.engine, self.max_batch)
                self._fail_all([job for job in self._active if all(job is not d for d, _ in deferred)], exc)
        for member in list(batch.members):  # closing: end what is decoding
            member.done(member.decoding.finish())
        batch.members.clear()

    def _open_batched(self, job: Job) -> tuple[Job, TextStream] | None:
        try:
            stream = self._open(job)
        except Exception as exc:  # a bad request: answered by the app
            self._fail_all([job], exc)
            return None
        if job.cancelled:  # cancelled before its turn: never touch the engine
            self._leave(job, stream, None)
            return None
        return job, stream

    def _join(self, batch: Batch, job: Job, stream: TextStream) -> bool:
        """Add an opened job to the batch unless its policy is busy; True if it joined (or failed)."""
        policy = stream.policy
        if not policy.interleaved and any(m.decoding.policy is policy for m in batch.members):
            return False
        try:
            decoding = stream.start()
        except Exception as exc:
            self._fail_all([job], exc)
            return True
        batch.add(decoding, emit=lambda ids: self._piece(job, stream, ids),
                  done=lambda stats: self._leave(job, stream, stats))
        return True

    def _piece(self, job: Job, stream: TextStream, ids: list[int]) -> bool:
        piece = stream.feed(ids)
        if piece:
            job.post("piece", piece)
        return not stream.stopping

    def _leave(self, job: Job, stream: TextStream, stats: GenerationStats | None) -> None:
        result = None
        if stats is not None:
            tail = stream.close(stats)
            if tail:
                job.post("piece", tail)
            result = stream.result
        job.post("done", result)
        with self._cond:
            self._active.remove(job)
        self._finished(job, result, None)

    def _fail_all(self, jobs: list[Job], exc: BaseException) -> None:
        with self._cond:
            for job in jobs:
                self._active.remove(job)
        for job in jobs:
            job.post("error", exc)
            self._finished(job, None, exc)
