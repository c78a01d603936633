"""The one seam between the server and the generation engine.

The scheduler (scheduler.py) talks to the engine only through the narrow protocol of this
module, :class:`Backend`:

* ``submit(submission, emit) -> Ticket``: a request's prompt ids and options
  (:class:`Submission`); the engine thread calls ``emit(event)`` for each new token of each
  choice (:class:`Event`: token id, log-probability, top log-probabilities, text piece), then
  once per choice with its ``finish_reason`` and final :class:`Final` answer;
* ``cancel(ticket)``: the request's client went away: it gets no more events and its rows
  stop taking device time as soon as the engine allows;
* ``waiting`` / ``running``: the requests queued and in flight (the metrics read them);
* ``close()``: stops admitting, ends what is in flight, joins the engine thread.

:class:`PipelineBackend` implements it today over the text-generation pipeline
(``transmuter_jax.text.generation``) and ``generation.generate``'s per-step ``on_token``
events, on its own thread so that the event loop never blocks on a device call. It batches
statically: when the engine is free it takes the requests waiting with the same options
(greedy ones; a sampling request runs alone so that its seed gives the library's tokens) into
one batch call; a request that arrives meanwhile waits for that call to end. When the engine's
slots (``engine.prefill / insert / generate / free``) land, only this module changes: a
``SlotBackend`` whose thread loops prefill-insert-generate(decode_steps)-free, admitting waiting
requests between decode chunks (true continuous batching), with the same protocol.

It calls the pipeline's public ``run`` (token ids in, each step's event out, Results at the
end).
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # the library's reason -> OpenAI's


@dataclasses.dataclass(frozen=True)
class Submission:
    """One request as the engine takes it.

    Attributes:
        prompt: the prompt's token ids.
        options: generation options, transformers' names (max_new_tokens, do_sample, ...).
        seed: the sampling seed.
        n: the choices.
        stop: stop strings (cut from the text).
        presence_penalty, frequency_penalty: OpenAI's penalties over the generated tokens.
    """

    prompt: tuple[int, ...]
    options: tuple[tuple[str, Any], ...]
    seed: int
    n: int = 1
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def sampling(self) -> bool:
        """Whether the request samples (else greedy)."""
        return bool(dict(self.options).get("do_sample"))

    def batch_key(self) -> tuple:
        """Requests with equal keys run in one batch call."""
        return (self.options, self.n, self.stop, self.presence_penalty, self.frequency_penalty)


@dataclasses.dataclass(frozen=True)
class Final:
    """A choice's answer: text, token ids, log-probabilities, top log-probabilities."""

    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


@dataclasses.dataclass(frozen=True)
class Event:
    """A new token of one choice (``token`` set), or its end (``finish_reason`` set).

    Attributes:
        choice: the choice's index.
        text: the text this event adds (may be "").
        token: the token id, or None for the end.
        logprob: its log-probability (when asked).
        top: the top (token id, log-probability) pairs of its step (when asked).
        finish_reason: "stop" or "length" at the end, else None.
        final: the choice's whole answer at the end.
    """

    choice: int
    text: str = ""
    token: int | None = None
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    final: Final | None = None


Emit = Callable[[Event], None]


class Ticket:
    """A submitted request: its submission, where its events go, whether it is cancelled."""

    def __init__(self, submission: Submission, emit: Emit):
        self.submission, self.emit = submission, emit
        self.cancelled = threading.Event()


class Backend(Protocol):
    """What the scheduler needs of the engine (see the module docstring)."""

    def submit(self, submission: Submission, emit: Emit) -> Ticket: ...

    def cancel(self, ticket: Ticket) -> None: ...

    @property
    def waiting(self) -> int: ...

    @property
    def running(self) -> int: ...

    def close(self, timeout: float = 10.0) -> None: ...


class _Stopped(Exception):
    """Raised in on_token when every request of a batch call is cancelled."""


class _Text:
    """Streams one choice's text, holding back what could still be the start of a stop string."""

    def __init__(self, tokenizer: Any, stop: Sequence[str]):
        self.stream = tokenizer.streamer(skip_special_tokens=True)
        self.stop, self.shown, self.over = tuple(stop), "", False
        self.pending = ""

    def push(self, token: int) -> str:
        """The text that ``token`` adds and no stop string can change."""
        piece = self.stream.push([token])
        if self.over:
            return ""
        if not self.stop:
            self.shown += piece
            return piece
        text = self.shown + self.pending + piece
        start = len(self.shown)
        hits = [i for s in self.stop if (i := text.find(s, max(0, start - len(s) + 1))) >= 0]
        if hits:
            self.over, cut = True, max(start, min(hits))
        else:
            cut = max(start, len(text) - (max(map(len, self.stop)) - 1))
        out, self.pending = text[start:cut], text[cut:]
        self.shown += out
        return out

    def rest(self, final: str) -> str:
        """What the final text has beyond what was shown."""
        return final[len(self.shown) :] if final.startswith(self.shown) else ""


class _Penalties:
    """OpenAI's presence and frequency penalties as a processor of the library: the score of
    each token j drops by count[j] * frequency + (count[j] > 0) * presence, ``count`` its
    occurrences among the generated tokens."""

    def __init__(self, presence: float, frequency: float):
        self.presence, self.frequency = presence, frequency

    def state(self, row: dict[str, Any]) -> Any:
        import numpy as np

        counts = np.bincount(np.asarray(row["generated"], np.int64), minlength=row["vocab"])
        counts = counts[: row["vocab"]].astype(np.float32)
        return counts * self.frequency + (counts > 0) * np.float32(self.presence)

    @staticmethod
    def process(logits: Any, bias: Any) -> Any:
        return logits - bias


class PipelineBackend:
    """The :class:`Backend` over a text-generation pipeline, batching statically.

    Args:
        pipe: a ``transmuter_jax.text.TextGeneration``.
        max_batch_size: the most rows of one batch call.
    """

    def __init__(self, pipe: Any, max_batch_size: int = 8):
        self.pipe, self.max_batch_size = pipe, int(max_batch_size)
        self.tokenizer = pipe.tokenizer
        self._lock = threading.Condition()
        self._queue: list[Ticket] = []
        self._running: list[Ticket] = []
        self._closing = False
        self._penalties: dict[tuple[float, float], tuple] = {}
        self._thread = threading.Thread(target=self._loop, name="transmuter-serve", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return sum(not t.cancelled.is_set() for t in self._running)

    def submit(self, submission: Submission, emit: Emit) -> Ticket:
        ticket = Ticket(submission, emit)
        with self._lock:
            if self._closing:
                raise RuntimeError("the backend is closing")
            self._queue.append(ticket)
            self._lock.notify()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        ticket.cancelled.set()
        with self._lock:
            if ticket in self._queue:
                self._queue.remove(ticket)

    def close(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._closing = True
            for ticket in self._queue + self._running:
                ticket.cancelled.set()
            self._queue.clear()
            self._lock.notify()
        self._thread.join(timeout)

    # -- the engine thread --------------------------------------------------------------------

    def _take(self) -> list[Ticket] | None:
        with self._lock:
            while not self._queue and not self._closing:
                self._lock.wait()
            if self._closing:
                return None
            first = self._queue.pop(0)
            batch = [first]
            if not first.submission.sampling:
                key = first.submission.batch_key()
                for ticket in list(self._queue):
                    if len(batch) >= self.max_batch_size:
                        break
                    if ticket.submission.batch_key() == key:
                        self._queue.remove(ticket)
                        batch.append(ticket)
            self._running = batch
            return batch

    def _loop(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            try:
                self._run(batch)
            except _Stopped:
                pass
            except Exception as error:  # noqa: BLE001 - handed to each request
                for ticket in batch:
                    if not ticket.cancelled.is_set():
                        ticket.emit(Event(0, finish_reason="error", text=str(error)))
            finally:
                with self._lock:
                    self._running = []

    def _processors(self, first: Submission) -> tuple:
        key = (first.presence_penalty, first.frequency_penalty)
        if key == (0.0, 0.0):
            return ()
        if key not in self._penalties:
            penalty = _Penalties(*key)
            self._penalties[key] = ((penalty.state, penalty.process),)
        return self._penalties[key]

    def _run(self, batch: list[Ticket]) -> None:
        first = batch[0].submission
        options = dict(first.options)
        sampling = first.sampling
        n = first.n if sampling else 1  # greedy: one row gives every (equal) choice
        if sampling and first.n > 1:
            options["num_return_sequences"] = first.n
        texts = [[_Text(self.tokenizer, first.stop) for _ in range(t.submission.n)] for t in batch]
        eos = set(self.pipe.defaults.get("eos_token_id") or ())
        if "eos_token_id" in options:
            eos = set(options["eos_token_id"] or ())

        def on_token(event: dict[str, Any]) -> None:
            if all(t.cancelled.is_set() for t in batch):
                raise _Stopped
            tokens = event["token"]
            for row, token in enumerate(tokens):
                token = int(token)
                request, j = divmod(row, n)
                if request >= len(batch) or token < 0 or token in eos:
                    continue
                ticket = batch[request]
                if ticket.cancelled.is_set():
                    continue
                logprob = top = None
                if "logprob" in event:
                    logprob = float(event["logprob"][row])
                if "top_ids" in event:
                    ids, values = event["top_ids"][row], event["top_logprobs"][row]
                    top = [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]
                choices = [j] if sampling else range(ticket.submission.n)
                for c in choices:
                    piece = texts[request][c].push(token)
                    ticket.emit(Event(c, piece, token, logprob, top))

        prompts = [list(t.submission.prompt) for t in batch]
        seed = first.seed if sampling else secrets.randbits(31)
        from ..tasks.pipeline import Request as PipelineRequest  # the library loads lazily

        request = PipelineRequest(prompts, dict(options), processors=self._processors(first))
        results = self.pipe.run(request, seed=seed, on_step=on_token)
        for request, (ticket, result) in enumerate(zip(batch, results, strict=True)):
            if ticket.cancelled.is_set():
                continue
            sequences = result if isinstance(result, list) else [result] * ticket.submission.n
            for c, seq in enumerate(sequences):
                final = Final(seq.text, list(seq.token_ids), seq.logprobs, seq.top_logprobs)
                rest = texts[request][c].rest(seq.text)
                ticket.emit(Event(c, rest, finish_reason=FINISH[seq.finish_reason], final=final))


def now() -> float:
    """The clock the server measures with."""
    return time.perf_counter()
