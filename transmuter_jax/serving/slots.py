"""Continuous batching: the :class:`~.backend.Backend` over the engine's slots.

:class:`SlotBackend` compiles one engine of ``max_batch_size`` slots and runs it on its own
thread. Between decode chunks the thread frees the slots of requests that ended or whose client
went away, then admits waiting requests into the free slots: their prompts run together in one
prefill (up to :attr:`SlotBackend.prefill_rows` of them, through the prefix cache,
:mod:`transmuter_jax.generation.prefixes`) and each first token goes out at once; then one
chunk of every live slot runs. A chunk is ``decode_steps`` steps, or the most that are a
power of two (one at least) that last at most about :data:`JOIN_WAIT_S` at the running mean of
the step time (a step of fewer live slots costs less), so a request that arrives during a
chunk waits about that long to join; one program runs chunks of every length. Every program
these run is compiled at start-up, before the server answers /health, so no request waits for
a compile. The chunk's length changes no answer. Each slot
carries its request's own options, and rows never read each other, so a request's tokens and
log-probabilities do not depend on the others in flight (prompts prefilled together too, as
checked at start-up: :func:`~transmuter_jax.generation.prefixes.rows_agree`).

The rule for what the slots take: a structured-output constraint runs in a slot where the
slots' device table of it equals llguidance's masks (a regex, a choice, a schema of closed
objects: ``Request(constraint=...)``, docs/structured-output.md). A request with another
constraint (a grammar, json_object, a schema with strings or numbers) or more eos ids than a
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

CONSTRAINTS = ("json_schema", "json_object", "regex", "grammar", "choice", "json_whitespace")
JOIN_WAIT_S = 0.25  # a decode chunk lasts about this long at most (at least one step)
TOP_LOGPROBS = 20  # OpenAI's most top_logprobs


def _constraint(options: dict[str, Any]) -> Any:
    """The structured-output constraint of a submission's options (a generation Constraint),
    or None."""
    from ..generation import Options
    from ..generation.constraints import from_options

    given = {k: options[k] for k in CONSTRAINTS if options.get(k) not in (None, False)}
    return from_options(Options(**given)) if given else None


def _fitted(most: int, step_seconds: float) -> int:
    """The steps of a decode chunk: ``most``, or else the most that are a power of two, that
    last at most about JOIN_WAIT_S at ``step_seconds`` a step (at least one)."""
    if most * step_seconds <= JOIN_WAIT_S:
        return most
    steps = 1
    while steps * 2 < most and steps * 2 * step_seconds <= JOIN_WAIT_S:
        steps *= 2
    return steps


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
        decode_steps: the most new tokens of a decode chunk (a request waits at most one chunk
            to join); fewer (a power of two) where they would last more than about
            JOIN_WAIT_S at the step time measured at start-up.
        prefix_cache_bytes: the bound of the prefix cache (0: off).
        warm: compile the programs requests run before taking any (the server is ready when
            this returns), so no request waits for a compile.
        draft: a draft model of the same tokenizer (a ``TextGeneration``) for speculative
            decoding (docs/speculative.md): a request drafts with it the submission's
            ``num_assistant_tokens`` (0 or none: it does not); requests on the pipeline path
            do not speculate.
        draft_tokens: the draft length the warm-up compiles for (0: none).

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
        warm: bool = True,
        draft: Any = None,
        draft_tokens: int = 0,
    ):
        from .. import generation as gen
        from ..generation.prefixes import PrefixCache

        self.pipe, self.tokenizer = pipe, pipe.tokenizer
        self.decode_steps = int(decode_steps)
        self.step_seconds = 0.0  # the measured time of a decode step (a running mean)
        self._warmed = False  # the decode chunks' programs are compiled
        assistant = None
        if draft is not None:
            assistant = gen.context(draft.files.folder, draft.decoder, embed=draft.embed)
        self.draft_tokens = int(draft_tokens) if draft is not None else 0
        self.speculated = (0, 0)  # (drafted, accepted) tokens of the finished requests
        spec = gen.context(
            pipe.files.folder, pipe.decoder, embed=pipe.embed, tokenizer=pipe.tokenizer,
            assistant=assistant, **pipe.options,
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
        self._device: dict[tuple, bool] = {}  # constraint, eos ids -> the slots take it
        self.prefill_rows = 1  # the most prompts one prefill runs (see _warm)
        self.chunk_steps = self.decode_steps  # a full batch's chunk (see _warm, _chunk)
        if warm:
            self._warm()
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
        eos = options.get("eos_token_id")
        if eos is not None and len(eos) > EOS_WIDTH:
            return f"more than {EOS_WIDTH} eos ids"
        constraint = _constraint(options)
        if constraint is not None and not self._on_device(constraint, eos):
            return f"this {constraint.kind} constraint needs llguidance on the host"
        return ""

    def _on_device(self, constraint: Any, eos: Any) -> bool:
        """Whether the slots' table of ``constraint`` equals llguidance's masks (cached: the
        first look at a constraint builds its table, 0.1 to 1 s)."""
        import os

        from .. import hub
        from ..generation import constraints

        engine = self.engine
        eos = tuple(engine.eos if eos is None else eos)
        key = (constraint, eos)
        if key not in self._device:
            folder = hub.folder(engine.spec.repo, hub.SMALL_FILES)
            path = os.path.join(folder, "tokenizer.json")
            try:
                mask = constraints.processor(constraint, path, engine.vocab_size or 0, eos)
            except ValueError:  # refused here: the pipeline path says why
                mask = None
            if len(self._device) >= 256:
                self._device.pop(next(iter(self._device)))
            self._device[key] = isinstance(mask, constraints.DeviceMask)
        return self._device[key]

    def submit(self, submission: Submission, emit: Emit) -> Ticket:
        reason = self.refusal(submission)
        if reason:
            log.info("a request runs on the pipeline path: %s", reason)
            with self._lock:
                if self._closing:
                    raise RuntimeError("the backend is closing")
                if self._fallback is None:
                    self._fallback = PipelineBackend(self.pipe, self._max_batch_size)
            options = tuple((k, v) for k, v in submission.options if k != "num_assistant_tokens")
            submission = dataclasses.replace(submission, options=options)  # no draft model there
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
            num_assistant_tokens=o.get("num_assistant_tokens", 0),  # 0: no draft model here
            constraint=_constraint(o),
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
                live = len(self._slots)
                # one program for chunks of every length: the loop stops after ``steps``
                self._state, tokens = engine.generate(self._state, steps, self.decode_steps)
                took = time.perf_counter() - start
                if self._warmed:  # a first chunk compiles: not a step's time
                    self._measured(took / max(_steps(tokens), 1))
                new = "" if self._warmed else " (its first: compiled)"
                log.debug("engine: chunk of %d steps, %d slots, %.0f ms%s", steps, live,
                          took * 1000, new)  # fmt: skip
                self._warmed = True
                for token in tokens:
                    self._take(token)
            except Exception as error:  # noqa: BLE001 - handed to the requests in flight
                log.exception("the engine failed")
                self._fail_all(error)

    def _chunk(self) -> int:
        """The steps of the next chunk: ``decode_steps``, or the most that are a power of two,
        that last at most about JOIN_WAIT_S at the running mean of the step time (one at
        least), which falls as fewer slots run: a lone request takes longer chunks, with fewer
        round trips, than a full batch. One program runs them all (the loop of
        ``decode_steps`` steps, stopped after these)."""
        return _fitted(self.decode_steps, self.step_seconds)

    def _warm(self) -> None:
        """Compiles what requests run (prefill steps of each batch size in each prefill window,
        the first-token selection, insert, the decode chunk of ``decode_steps`` in each
        window), finds
        :attr:`prefill_rows`: the most prompts a prefill runs together whose rows keep their
        bits (:func:`rows_agree`), and :attr:`chunk_steps`: ``decode_steps``, or the most
        steps below it that are a power of two, that last at most about JOIN_WAIT_S at the
        measured time of a step."""
        from ..generation import Request, prefixes, slots
        from ..generation.prefixes import ROWS, PrefixCache, rows_agree
        from ..runtime import stored

        start = time.perf_counter()
        for rows in [r for r in ROWS if r <= self._max_batch_size]:
            if not rows_agree(self.engine, rows):
                log.warning(
                    "prefill steps of %d rows change a row's bits on this machine: at most %d "
                    "prompts are prefilled together", rows, self.prefill_rows,
                )  # fmt: skip
                break
            self.prefill_rows = rows
        vocab = self.engine.vocab_size or 1000
        prompt = tuple(3 + i % max(vocab - 3, 1) for i in range(8))
        k = self.draft_tokens
        most = min(self.decode_steps + 8, self.engine.slot_capacity - len(prompt))
        probes = [Request(prompt, most, eos_token_id=(), num_assistant_tokens=0)]
        if k:  # the draft model's prompt and chunk programs of the server's K
            most = self.engine.slot_capacity - len(prompt)
            most = min(self.decode_steps * (k + 1) + 2, most)
            probes.append(Request(prompt, most, eos_token_id=(), num_assistant_tokens=k))
        batches = [r for r in ROWS if r <= self.prefill_rows]
        state = prefixes.warm(self.engine, self._state, batches)  # every prefill window
        for n, probe in enumerate(probes):
            prefix = PrefixCache(self.engine, 0).prefill(probe)
            state = self.engine.insert(prefix, state, 0)
            state, _ = self.engine.generate(state, 1, self.decode_steps)
            state = slots.warm(self.engine, state, self.decode_steps)  # every window
            if n == 0:  # a step's time with every slot taking a token (a full batch)
                for slot in range(1, self._max_batch_size):
                    state = self.engine.insert(prefix, state, slot)
                for _ in range(3):
                    ran = time.perf_counter()
                    state, _ = self.engine.generate(state, 1, self.decode_steps)
                    self._measured(time.perf_counter() - ran)
                self.chunk_steps = _fitted(self.decode_steps, self.step_seconds)
                for slot in range(1, self._max_batch_size):
                    state = self.engine.free(state, slot)
            state = self.engine.free(state, 0)
        # an idle server holds the smallest window (warm left the state at the capacity)
        self._state = slots.resized(self.engine, state, slots.windows(state.capacity)[0])
        self._warmed = True
        stored.release_heap()  # the larger windows' buffers go back to the system
        log.info(
            "compiled the prefill and decode programs in %.1f s (prompts prefilled together: "
            "at most %d; decode chunks of at most %d steps with every slot running, a step "
            "%.0f ms%s)",
            time.perf_counter() - start, self.prefill_rows, self.chunk_steps,
            self.step_seconds * 1000, f"; drafts of {k} tokens" if k else "",
        )  # fmt: skip

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
        """Admits waiting runs into the free slots: their prompts run together, as many as a
        prefill batch size holds without padding rows (3 waiting: 2, then 1), at most
        :attr:`prefill_rows` per prefill, and each first token goes out at once."""
        from ..generation.prefixes import ROWS

        while True:
            free = [s for s in range(self._max_batch_size) if s not in self._slots]
            with self._lock:
                self._queue = [r for r in self._queue if not r.ticket.cancelled.is_set()]
                most = min(len(free), self.prefill_rows, len(self._queue))
                runs = self._queue[: max((r for r in ROWS if r <= most), default=0)]
                del self._queue[: len(runs)]
            if not runs:
                return
            start = time.perf_counter()
            try:
                prefixes = self.prefixes.prefill_many([r.request for r in runs])
            except Exception:  # noqa: BLE001 - one at a time: the bad request fails alone
                prefixes = []
                for run in runs:
                    try:
                        prefixes += self.prefixes.prefill_many([run.request])
                    except Exception as error:  # noqa: BLE001 - the others go on
                        self._fail(run, error)
                        prefixes.append(None)
            log.debug(
                "engine: prefill of %d prompts (%s tokens), %.0f ms", len(runs),
                "+".join(str(len(r.request.prompt)) for r in runs),
                (time.perf_counter() - start) * 1000,
            )  # fmt: skip
            for run, prefix, slot in zip(runs, prefixes, free, strict=False):
                if prefix is None:
                    continue
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
        if run.request.num_assistant_tokens or run.request.prompt_lookup_num_tokens:
            from ..generation import speculative

            stats = speculative.stats(self._state, slot)
            drafted, accepted = self.speculated
            self.speculated = (drafted + stats.drafted, accepted + stats.accepted)
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
