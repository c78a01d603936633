"""The asyncio side of a request: admission (a bounded queue), its events, its timings.

A :class:`Group` is one request: a :class:`Job` per prompt carries its events from the engine
thread (backend.py) to the event loop. Closing the group's iterator (a client that went away,
an engine error) cancels every job of the request in the backend. Each request that ends
(finished, cancelled, failed or refused) gets one log line.
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


OUTCOMES = ("finished", "cancelled", "failed", "refused")  # how a request ends (its log line)


@dataclasses.dataclass
class Timing:
    """When a job arrived, got its first token and ended; the tokens of each choice."""

    arrival: float
    first: float | None = None
    end: float | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)


class Job:
    """One prompt of a request in the backend: its timing, token counts and outcome.

    Its events go to its :class:`Group` as they arrive, counted and timed then (not when read).
    """

    def __init__(self, group: Group, index: int, submission: Submission):
        self.group, self.index, self.submission = group, index, submission
        self.timing = Timing(now(), tokens=[0] * submission.n)
        self.outcome: str | None = None  # set when the job ends: one of OUTCOMES
        self._open = submission.n
        loop = asyncio.get_running_loop()
        self._ticket = group.scheduler.backend.submit(
            submission, lambda e: loop.call_soon_threadsafe(self._arrive, e)
        )

    def _arrive(self, event: Event) -> None:
        """Counts and times ``event`` (on the event loop), then queues it for the group."""
        if self.outcome is not None:  # cancelled: the backend may still send a few
            return
        if event.finish_reason == "error":
            self.group._queue.put_nowait((self.index, event))
            self._end("failed")
            return
        t = self.timing
        if event.token is not None:
            if t.first is None:
                t.first = now()
            t.tokens[event.choice] += 1
        if event.final is not None:  # the choice's answer: its tokens are the count
            t.tokens[event.choice] = len(event.final.token_ids)
        if event.finish_reason is not None:
            self._open -= 1
        self.group._queue.put_nowait((self.index, event))
        if not self._open:
            self._end("finished")

    def cancel(self) -> None:
        """Stops the job unless it has ended: the backend gives it no more events."""
        if self.outcome is None:
            self.group.scheduler.backend.cancel(self._ticket)
            self._end("cancelled")

    def _end(self, outcome: str) -> None:
        self.outcome, self.timing.end = outcome, now()
        self.group.scheduler.ended(self)
        self.group._ended()


class Group:
    """One request's jobs (a prompt each; chat has one): iterate :meth:`events` to get their
    events as they come. It logs one line when its last job ends, or when it is refused."""

    def __init__(self, scheduler: Scheduler, request_id: str, submissions: list[Submission]):
        self.scheduler, self.id, self.submissions = scheduler, request_id, submissions
        self.arrival = now()
        self.jobs: list[Job] = []
        self.outcome: str | None = None  # set when the request ends: one of OUTCOMES
        self._queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

    @property
    def completion_tokens(self) -> int:
        """The tokens of every choice of every job so far (each choice's own count)."""
        return sum(sum(job.timing.tokens) for job in self.jobs)

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        """(job index, event) pairs as they come until every choice of every job has ended;
        raises RuntimeError for an engine error. Leaving early cancels every open job."""
        remaining = sum(s.n for s in self.submissions)
        try:
            while remaining:
                index, event = await self._queue.get()
                if event.finish_reason == "error":
                    raise RuntimeError(event.text)
                if event.finish_reason is not None:
                    remaining -= 1
                yield index, event
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Cancels every job that has not ended."""
        for job in self.jobs:
            job.cancel()

    def _refuse(self) -> None:
        self.outcome = "refused"
        self.cancel()
        self.scheduler.log(self)

    def _ended(self) -> None:
        if self.outcome is None and len(self.jobs) == len(self.submissions):
            outcomes = {job.outcome for job in self.jobs}
            if None not in outcomes:
                ranked = ("failed", "cancelled", "finished")
                self.outcome = next(o for o in ranked if o in outcomes)
                self.scheduler.log(self)


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

    def submit(self, request_id: str, submissions: list[Submission]) -> Group:
        """The jobs of one request, a prompt each, admitted together; raises ApiError 400 when
        it has more prompts than the queue ever holds, 429 when the queue is full, 503 when the
        server is stopping (no job of the request runs then)."""
        if len(submissions) > self.max_queue:
            raise ApiError(
                400,
                f"prompt: {len(submissions)} prompts in one request, more than the server's "
                f"queue of {self.max_queue} holds (--max-queue): send at most {self.max_queue}",
                param="prompt",
            )
        group = Group(self, request_id, list(submissions))
        try:
            for index, submission in enumerate(group.submissions):
                self._admit()
                group.jobs.append(Job(group, index, submission))
        except BaseException as error:
            group._refuse()  # its log line
            error.logged = True  # type: ignore[attr-defined]
            raise
        self.metrics.prompt_tokens.inc(sum(len(s.prompt) for s in group.submissions))
        return group

    def _admit(self) -> None:
        if self.closing:
            raise ApiError(503, "the server is shutting down", type="server_error")
        if self.backend.waiting >= self.max_queue:
            raise ApiError(
                429,
                f"the queue is full ({self.max_queue} requests waiting): retry later",
                type="rate_limit_error",
                code="queue_full",
            )

    def ended(self, job: Job) -> None:
        """Records a job that ended in the metrics: its tokens, and its timings if it finished."""
        t, m = job.timing, self.metrics
        m.generation_tokens.inc(sum(t.tokens))
        if job.outcome != "finished":
            return
        m.latency.observe(t.end - t.arrival)
        if t.first is not None:
            m.ttft.observe(t.first - t.arrival)
            steps = max(t.tokens)  # the choices decode together
            if steps > 1:
                m.tpot.observe((t.end - t.first) / (steps - 1))

    def log(self, group: Group) -> None:
        """The request's one log line: its id, outcome, prompt and completion tokens (each
        choice's own count, summed), time to the first token and total time."""
        firsts = [job.timing.first for job in group.jobs if job.timing.first is not None]
        ends = [job.timing.end for job in group.jobs if job.timing.end is not None]
        ttft = f"{(min(firsts) - group.arrival) * 1000:.0f} ms" if firsts else "-"
        total = (max(ends, default=now()) - group.arrival) * 1000
        log.info(
            "request %s %s: %d prompt tokens, %d completion tokens, first token %s, total %.0f ms",
            group.id,
            group.outcome,
            sum(len(s.prompt) for s in group.submissions),
            group.completion_tokens,
            ttft,
            total,
        )
