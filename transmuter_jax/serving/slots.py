"""Continuous batching: the :class:`~.backend.Backend` over the engine's slots.

:class:`SlotBackend` compiles one engine of ``max_batch_size`` slots and runs it on its own
thread. Between decode chunks the thread frees the slots of requests that ended or whose client
went away, then admits waiting requests into the free slots: each prompt runs alone (through the
prefix cache, :mod:`transmuter_jax.generation.prefixes`) and its first token goes out at once;
then one chunk of every live slot runs. A chunk is at most ``decode_steps`` steps, and fewer
where steps are slow: as many as last about :data:`JOIN_WAIT_S` (a power of two, at least one),
so a request that arrives during a chunk waits about that long to join. The chunk's length
changes no answer. Each slot carries its request's own options, and rows never read each other,
so a request's tokens and log-probabilities do not depend on the others in flight.

The rule for what the slots take: a request with a structured-output constraint
(``json_schema``, ``json_object``, ``regex``, ``grammar``, ``choice``) or more eos ids than a
slot holds runs on the pipeline path (:class:`~.backend.PipelineBackend`, on a thread of its
own) instead; :meth:`SlotBackend.refusal` says why.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

from .backend import FINISH, Emit, Event, Final, PipelineBackend, Submission, Ticket, _Text

log = logging.getLogger("transmuter_jax.serving")

CONSTRAINTS = ("json_schema", "json_object", "regex", "grammar", "choice")
JOIN_WAIT_S = 0.25  # a decode chunk lasts about this long at most (at least one step)
TOP_LOGPROBS = 20  # OpenAI's most top_logprobs


def _steps(tokens: list) -> int:
    """How many steps a chunk ran: the most tokens one slot took."""
    counts: dict[int, int] = {}
    for t in tokens:
        counts[t.slot] = counts.get(t.slot, 0) + 1
    return max(counts.values(), default=0)


@dataclasses.dataclass
class _Run:
    """One slot's work: a request's choices (one for sampling, all of them for greedy)."""

    ticket: Ticket
    choices: list[int]
    request: Any  # generation.Request
    texts: dict[int, _Text]
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    tops: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)


class SlotBackend:
    """The :class:`~.backend.Backend` over the slots of one compiled engine.

    Args:
        pipe: a ``transmuter_jax.text.TextGeneration`` (its decoder, tokenizer and defaults).
        max_batch_size: the slots.
        max_model_len: the most tokens of prompt plus answer: each slot's cache rows (rounded up
            to 64).
        decode_steps: new tokens per decode chunk (a request waits at most one chunk to join).
        prefix_cache_bytes: the bound of the prefix cache (0: off).

    Raises:
        GenerationError: when the model cannot run slots (the caller serves with
            :class:`~.backend.PipelineBackend` instead).
    """

    def __init__(
        self,
        pipe: Any,
        max_batch_size: int = 8,
        *,
        max_model_len: int = 1024,
        decode_steps: int = 8,
        prefix_cache_bytes: int = 0,
    ):
        from .. import generation as gen
        from ..generation.prefixes import PrefixCache

        self.pipe, self.tokenizer = pipe, pipe.tokenizer
        self.decode_steps = int(decode_steps)
        self.step_seconds = 0.0  # the measured time of a decode step (a running mean)
        self._sizes: set[int] = set()  # the chunk sizes that have run
        spec = gen.context(
            pipe.files.folder, pipe.decoder, embed=pipe.embed, tokenizer=pipe.tokenizer,
            **pipe.options,
        )  # fmt: skip
        capacity = -(-int(max_model_len) // 64) * 64
        self.engine = gen.compile(
            spec, int(max_batch_size), capacity=capacity, top_logprobs=TOP_LOGPROBS
        )
        self._state = self.engine.init_state()  # refuses a model the slots cannot run
        self.prefixes = PrefixCache(self.engine, prefix_cache_bytes)
        self._lock = threading.Condition()
        self._queue: list[_Run] = []
        self._slots: dict[int, _Run] = {}
        self._closing = False
        self._fallback: PipelineBackend | None = None
        self._max_batch_size = int(max_batch_size)
        self._thread = threading.Thread(target=self._loop, name="transmuter-slots", daemon=True)
        self._thread.start()

    # -- the Backend protocol -----------------------------------------------------------------

    @property
    def waiting(self) -> int:
        queued = {id(r.ticket) for r in self._queue if not r.ticket.cancelled.is_set()}
        queued -= {id(r.ticket) for r in list(self._slots.values())}
        other = self._fallback.waiting if self._fallback is not None else 0
        return len(queued) + other

    @property
    def running(self) -> int:
        live = {id(r.ticket) for r in list(self._slots.values()) if not r.ticket.cancelled.is_set()}
        other = self._fallback.running if self._fallback is not None else 0
        return len(live) + other

    def refusal(self, submission: Submission) -> str:
        """Why ``submission`` runs on the pipeline path rather than in a slot ("" when a slot
        takes it)."""
        from ..generation.slots import EOS_WIDTH

        options = dict(submission.options)
        given = [n for n in CONSTRAINTS if options.get(n) not in (None, False)]
        if given:
            return f"the slots take no {given[0]} constraint yet"
        eos = options.get("eos_token_id")
        if eos is not None and len(eos) > EOS_WIDTH:
            return f"more than {EOS_WIDTH} eos ids"
        return ""

    def submit(self, submission: Submission, emit: Emit) -> Ticket:
        if self.refusal(submission):
            with self._lock:
                if self._closing:
                    raise RuntimeError("the backend is closing")
                if self._fallback is None:
                    self._fallback = PipelineBackend(self.pipe, self._max_batch_size)
            return self._fallback.submit(submission, emit)
        ticket = Ticket(submission, emit)
        runs = self._runs(ticket)
        with self._lock:
            if self._closing:
                raise RuntimeError("the backend is closing")
            self._queue.extend(runs)
            self._lock.notify()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        ticket.cancelled.set()
        if self._fallback is not None:
            self._fallback.cancel(ticket)
        with self._lock:
            self._queue = [r for r in self._queue if r.ticket is not ticket]
            self._lock.notify()

    def close(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._closing = True
            for run in self._queue + list(self._slots.values()):
                run.ticket.cancelled.set()
            self._queue.clear()
            self._lock.notify()
        if self._fallback is not None:
            self._fallback.close(timeout)
        self._thread.join(timeout)

    # -- requests as slot runs ----------------------------------------------------------------

    def _runs(self, ticket: Ticket) -> list[_Run]:
        from ..generation import Request, return_seed
        from ..generation.options import seed_value

        sub = ticket.submission
        o = dict(sub.options)
        sampling = bool(o.get("do_sample"))
        eos = o.get("eos_token_id")
        common = dict(
            max_new_tokens=int(o["max_new_tokens"]),
            eos_token_id=None if eos is None else tuple(eos),
            do_sample=sampling,
            temperature=o.get("temperature"),
            top_k=o.get("top_k"),
            top_p=o.get("top_p"),
            min_p=o.get("min_p"),
            repetition_penalty=o.get("repetition_penalty"),
            presence_penalty=sub.presence_penalty,
            frequency_penalty=sub.frequency_penalty,
            stop_strings=tuple(sub.stop),
            logprobs=bool(o.get("token_logprobs")),
            top_logprobs=int(o.get("top_logprobs") or 0),
            logit_bias=tuple((ids[-1], bias) for ids, bias in o.get("sequence_bias") or ()),
            min_new_tokens=int(o.get("min_new_tokens") or 0),
            prompt_lookup_num_tokens=o.get("prompt_lookup_num_tokens"),  # docs/speculative.md
        )
        groups = [[j] for j in range(sub.n)] if sampling else [list(range(sub.n))]
        seed = seed_value(sub.seed)
        return [
            _Run(
                ticket,
                choices,
                Request(sub.prompt, seed=return_seed(seed, choices[0]) & 0xFFFFFFFF, **common),
                {c: _Text(self.tokenizer, sub.stop) for c in choices},
            )
            for choices in groups
        ]

    # -- the engine thread --------------------------------------------------------------------

    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._lock:
                while not self._closing and not self._queue and not self._live():
                    self._lock.wait()
                if self._closing:
                    return
            try:
                self._free_cancelled()
                self._admit()
                if not self._live():
                    continue
                steps = self._chunk()
                start = time.perf_counter()
                self._state, tokens = engine.generate(self._state, steps)
                if steps in self._sizes:  # a size's first chunk compiles: not a step's time
                    self._measured((time.perf_counter() - start) / max(_steps(tokens), 1))
                self._sizes.add(steps)
                for token in tokens:
                    self._take(token)
            except Exception as error:  # noqa: BLE001 - handed to the requests in flight
                log.exception("the engine failed")
                self._fail_all(error)

    def _chunk(self) -> int:
        """The steps of the next chunk: at most decode_steps, about JOIN_WAIT_S long."""
        steps = self.decode_steps
        while steps > 1 and steps * self.step_seconds > JOIN_WAIT_S:
            steps //= 2
        return steps

    def _measured(self, seconds: float) -> None:
        mean = self.step_seconds
        self.step_seconds = seconds if mean == 0 else 0.8 * mean + 0.2 * seconds

    def _live(self) -> bool:
        return bool(self._slots)

    def _free_cancelled(self) -> None:
        for slot, run in list(self._slots.items()):
            if run.ticket.cancelled.is_set():
                self._release(slot)

    def _release(self, slot: int) -> None:
        self._state = self.engine.free(self._state, slot)
        with self._lock:
            del self._slots[slot]

    def _admit(self) -> None:
        while True:
            free = [s for s in range(self._max_batch_size) if s not in self._slots]
            with self._lock:
                if not free or not self._queue:
                    return
                run = self._queue.pop(0)
            if run.ticket.cancelled.is_set():
                continue
            try:
                prefix = self.prefixes.prefill(run.request)
            except Exception as error:  # noqa: BLE001 - this request fails, the others go on
                self._fail(run, error)
                continue
            slot = free[0]
            with self._lock:
                self._slots[slot] = run
            self._state = self.engine.insert(prefix, self._state, slot)
            if prefix.first is None:
                self._finish(slot, "length")
            else:
                self._take(prefix.first, slot)

    def _take(self, token: Any, slot: int | None = None) -> None:
        """Hands a new token of a slot to its run's request; ends the run when it is done."""
        slot = token.slot if slot is None else slot
        run = self._slots.get(slot)
        if run is None:
            return
        if not token.eos and not run.ticket.cancelled.is_set():
            run.tokens.append(token.token)
            request = run.request
            logprob = token.logprob if request.logprobs or request.top_logprobs else None
            top = [tuple(p) for p in token.top] if request.top_logprobs else None
            if logprob is not None:
                run.logprobs.append(logprob)
            if top is not None:
                run.tops.append(top)
            for c in run.choices:
                piece = run.texts[c].push(token.token)
                run.ticket.emit(Event(c, piece, token.token, logprob, top))
        if token.done:
            self._finish(slot, token.finish_reason or "length")

    def _finish(self, slot: int, reason: str) -> None:
        from ..tasks.runner import trim

        run = self._slots[slot]
        self._release(slot)
        if run.ticket.cancelled.is_set():
            return
        sub = run.ticket.submission
        text = self.tokenizer.decode(run.tokens, skip_special_tokens=True)
        if sub.stop:
            text = trim(self.tokenizer, list(sub.prompt), run.tokens, text, sub.stop)
        request = run.request
        final = Final(
            text,
            list(run.tokens),
            list(run.logprobs) if request.logprobs or request.top_logprobs else None,
            list(run.tops) if request.top_logprobs else None,
        )
        for c in run.choices:
            rest = run.texts[c].rest(text)
            run.ticket.emit(Event(c, rest, finish_reason=FINISH[reason], final=final))

    def _fail(self, run: _Run, error: Exception) -> None:
        if not run.ticket.cancelled.is_set():
            run.ticket.cancelled.set()  # its other runs stop too
            run.ticket.emit(Event(0, finish_reason="error", text=str(error)))

    def _fail_all(self, error: Exception) -> None:
        for slot, run in list(self._slots.items()):
            self._fail(run, error)
            with self._lock:
                self._slots.pop(slot, None)
        self._state = self.engine.init_state()
