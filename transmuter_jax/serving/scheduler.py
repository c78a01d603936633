"""The asyncio side of a request: admission (a bounded queue), its events, its timings.

A :class:`Job` carries one request's events from the engine thread (backend.py) to the event
loop; closing its iterator (a client that went away) cancels the request in the backend.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator

from .backend import Backend, Event, Submission, now
from .metrics import Metrics
from .protocol import ApiError

log = logging.getLogger("transmuter_jax.serving")


@dataclasses.dataclass
class Timing:
    """When a request arrived, got its first token and ended; how many tokens it got."""

    arrival: float
    first: float | None = None
    end: float | None = None
    tokens: int = 0


class Job:
    """One admitted request: iterate :meth:`events` to get its events in order."""

    def __init__(self, scheduler: Scheduler, request_id: str, submission: Submission):
        self.scheduler, self.id, self.submission = scheduler, request_id, submission
        self.timing = Timing(now())
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._ticket = scheduler.backend.submit(
            submission, lambda e: loop.call_soon_threadsafe(self._queue.put_nowait, e)
        )
        self._open = submission.n
        self.cancelled = False

    async def events(self) -> AsyncIterator[Event]:
        """The request's events until every choice has ended; raises RuntimeError for an engine
        error. Leaving early cancels the request."""
        try:
            while self._open:
                event = await self._queue.get()
                if event.finish_reason == "error":
                    raise RuntimeError(event.text)
                if event.token is not None:
                    if self.timing.first is None:
                        self.timing.first = now()
                    if event.choice == 0:
                        self.timing.tokens += 1
                if event.finish_reason is not None:
                    self._open -= 1
                yield event
        finally:
            if self._open:
                self.cancel()
            else:
                self.scheduler.finished(self)

    def cancel(self) -> None:
        """Stops the request: the backend gives it no more events."""
        if not self.cancelled:
            self.cancelled = True
            self.scheduler.backend.cancel(self._ticket)
            log.info("request %s cancelled after %d tokens", self.id, self.timing.tokens)


class Scheduler:
    """Admits requests into the backend while its queue has room.

    Args:
        backend: the engine (backend.py).
        metrics: where timings and counts go.
        max_queue: the most requests waiting for the engine; one more gets 429.
    """

    def __init__(self, backend: Backend, metrics: Metrics, max_queue: int = 64):
        self.backend, self.metrics, self.max_queue = backend, metrics, int(max_queue)
        self.closing = False

    def submit(self, request_id: str, submission: Submission) -> Job:
        """A job for ``submission``; raises ApiError 429 when the queue is full, 503 when the
        server is stopping."""
        if self.closing:
            raise ApiError(503, "the server is shutting down", type="server_error")
        if self.backend.waiting >= self.max_queue:
            raise ApiError(
                429,
                f"the queue is full ({self.max_queue} requests waiting): retry later",
                type="rate_limit_error",
                code="queue_full",
            )
        self.metrics.prompt_tokens.inc(len(submission.prompt))
        return Job(self, request_id, submission)

    def finished(self, job: Job) -> None:
        """Records a job that ended: metrics and the request's log line."""
        t = job.timing
        t.end = now()
        m = self.metrics
        tokens = t.tokens * job.submission.n
        m.generation_tokens.inc(tokens)
        m.latency.observe(t.end - t.arrival)
        ttft = None if t.first is None else t.first - t.arrival
        if ttft is not None:
            m.ttft.observe(ttft)
            if t.tokens > 1:
                m.tpot.observe((t.end - t.first) / (t.tokens - 1))
        shown = "-" if ttft is None else f"{ttft * 1000:.0f} ms"
        log.info(
            "request %s: %d prompt tokens, %d new tokens, first token %s, total %.0f ms",
            job.id,
            len(job.submission.prompt),
            tokens,
            shown,
            (t.end - t.arrival) * 1000,
        )
