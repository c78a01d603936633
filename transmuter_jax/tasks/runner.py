"""What the task pipelines share: resolving a repo, compiled contexts per options, runs."""

from __future__ import annotations

import dataclasses
import os
import queue
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import default, hub
from .. import generation as gen
from ..generation.options import seed_value
from ..onnx.model import Model
from ..parallel import load, sharding
from . import decoding

if TYPE_CHECKING:  # the tasks build their tokenizers; text/ imports this module
    from ..text.tokenizer import Tokenizer

KEEP_CONTEXTS = 8  # compiled contexts kept per pipeline (one per batch size and options)


@dataclasses.dataclass
class Result:
    """One generated answer.

    Attributes:
        text: the new text (special tokens skipped).
        token_ids: the new token ids, without the eos token.
        logprobs: the log-probability of each new token (with token_logprobs=True), else None.
        finish_reason: "eos" when an eos token ended it, "length" when the token limit did,
            "stop" when a stop string did (with ``stop=``, the text ends before it).
        top_logprobs: with top_logprobs=k, for each new token the k most probable
            (token id, log-probability) pairs, best first; else None.
    """

    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    top_logprobs: list[list[tuple[int, float]]] | None = None


def texts_of(results: list) -> list:
    """The text of each Result of ``results``, keeping lists of Results as lists of texts."""
    return [[r.text for r in x] if isinstance(x, list) else x.text for x in results]


def resolve(repo: str | os.PathLike | None, dtype: str | None, file: str | None) -> hub.Files:
    """The files of ``repo``: None or a default-model alias ("default", "default-int4",
    "default-optimum") is the default model, prepared on first use."""
    if repo is None or (isinstance(repo, str) and repo in default.ALIASES):
        folder = default.path(default.export_for(repo, dtype))
        return hub.files(folder, file=file)
    return hub.files(repo, dtype=dtype, file=file)


def _frozen(value: Any) -> Any:
    if isinstance(value, Mapping):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    return value


def stop_option(options: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The generation options of a pipeline's ``options`` and the stop strings of its ``stop``
    option, which sets ``stop_strings`` (the text is then cut before the first stop string)."""
    options = dict(options)
    stop = options.pop("stop", None)
    if stop is None:
        return options, ()
    stop = gen.Options(stop_strings=stop).stop_strings
    given = options.get("stop_strings")
    if given is not None and gen.Options(stop_strings=given).stop_strings != stop:
        raise ValueError(f"stop={list(stop)} and stop_strings={given!r} disagree: give one")
    options["stop_strings"] = stop
    return options, stop


def trim(tokenizer: Tokenizer, prompt: list[int], tokens: list[int], text: str, stop) -> str:
    """``text`` cut before the first of the ``stop`` strings in it, which may start in the
    prompt's text (the row stopped at the token that completed it)."""
    hits = [i for s in stop if (i := text.find(s)) >= 0]
    if hits:
        return text[: min(hits)]
    window = max(len(s) for s in stop)
    joint = tokenizer.decode(prompt[-window:] + tokens, skip_special_tokens=True)
    if not text or not joint.endswith(text):
        return text
    head = len(joint) - len(text)  # where the new text starts in ``joint``
    hits = [i for s in stop if (i := joint.find(s, max(0, head + 1 - len(s)))) >= 0]
    return text[: max(0, min(hits) - head)] if hits else text


class _Hold:
    """Holds back streamed text that could still be the start of a stop string.

    Each stop string has a Knuth-Morris-Pratt matcher that reads every character once, so a
    piece costs time in its length times the number of stop strings, whatever their lengths (a
    stop string of 100,000 characters costs what one of 3 does).
    """

    def __init__(self, stop: tuple[str, ...], before: str):
        self.stop, self.pending, self.over = stop, "", False
        self._fail = [_failure(s) for s in stop]
        self._state = [0] * len(stop)  # per stop string: its longest prefix ending the text
        for char in before:  # the text out so far (or the prompt's): a match inside it is none
            self._step(char)

    def _step(self, char: str) -> int:
        """Reads ``char`` in every matcher; the length of the longest stop string ending with
        it (0: none)."""
        ended = 0
        for i, (s, fail) in enumerate(zip(self.stop, self._fail, strict=True)):
            m = self._state[i]
            while m and s[m] != char:
                m = fail[m - 1]
            if s[m] == char:
                m += 1
            if m == len(s):
                ended, m = max(ended, m), fail[m - 1]
            self._state[i] = m
        return ended

    def push(self, piece: str) -> str:
        """The part of ``piece`` (and of what was held) that no stop string can start in."""
        if not self.stop or self.over:
            return "" if self.over else piece
        text = self.pending + piece
        for i, char in enumerate(piece, start=len(self.pending)):
            ended = self._step(char)
            if ended:  # generation stops at the first stop string that ends: cut at its start
                self.over = True
                return text[: max(0, i + 1 - ended)]
        cut = max(0, len(text) - max(self._state))
        self.pending = text[cut:]
        return text[:cut]


def _failure(s: str) -> list[int]:
    """Knuth-Morris-Pratt's table of ``s``: for each prefix, the length of its longest proper
    prefix that is also its suffix."""
    fail, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class Runner:
    """A decoder with compiled contexts per (batch, options); all share one set of steps.

    Attributes:
        defaults: the options a call starts from: transformers' defaults, generation_config.json,
            then the pipeline's options.
    """

    def __init__(
        self,
        folder: str,
        model: Model,
        *,
        embed: Model | None = None,
        given: Sequence[str] = (),
        options: Mapping[str, Any],
        tokenizer: Tokenizer | None = None,
        mesh: Any = None,
    ):
        self.folder, self.model, self.embed, self.given = folder, model, embed, tuple(given)
        self.mesh = mesh  # a jax.sharding.Mesh the steps run over, or None
        self.options, self.tokenizer = dict(options), tokenizer
        self._contexts: OrderedDict[tuple, Any] = OrderedDict()
        self._shapes: set[tuple] = set()  # the step shapes of every engine this runner made
        self.assistant: tuple[str, Model, Model | None] | None = None  # a draft model
        self.defaults = decoding.defaults(
            folder, model, given=self.given, embed=embed, tokenizer=tokenizer,
            options=stop_option(self.options)[0],
        )  # fmt: skip

    def context(self, batch: int, options: Mapping[str, Any], processors: Sequence[Any] = ()):
        """The compiled context for ``batch`` prompts and the defaults updated by ``options``;
        ``processors``: a task's own processors (see generation.processors), after the others."""
        merged = stop_option({**self.options, **options})[0]
        if self.mesh is not None:  # the rows of a batch split over "data": a multiple of it
            data = sharding.axis_size(self.mesh, sharding.DATA)
            batch = -(-batch // data) * data
        key = (batch, _frozen(merged), tuple(id(p) for p in processors))
        ctx = self._contexts.get(key)
        if ctx is not None:
            self._contexts.move_to_end(key)
            return ctx
        ctx = decoding.compiled(
            self.folder, self.model, given=self.given, embed=self.embed,
            tokenizer=self.tokenizer, options=merged, processors=processors, batch=batch,
            mesh=self.mesh, assistant=self.assistant,
        )  # fmt: skip
        self._contexts[key] = ctx
        while len(self._contexts) > KEEP_CONTEXTS:
            self._contexts.popitem(last=False)
        return ctx

    @property
    def compiled_shapes(self) -> int:
        """How many decoder step shapes have run (prompt steps and decode chunks), over every
        engine of this runner."""
        return decoding.compiled_shapes(self._shapes, self._contexts.values())

    @property
    def engines(self) -> tuple[Any, ...]:
        """The compiled engines kept now, least recently used first."""
        return tuple(self._contexts.values())

    def chosen(self, batch: int, options: Mapping[str, Any]) -> Any:
        """The generation options (``generation.Options``) a call of ``batch`` prompts with
        ``options`` runs with."""
        return decoding.chosen(self.context(batch, options))

    def run(
        self,
        tokenizer: Tokenizer,
        prompts: list[list[int]],
        options: Mapping[str, Any],
        *,
        seed: int | None = None,
        inputs: Mapping[str, Any] | None = None,
        on_token: Callable[[dict[str, np.ndarray]], None] | None = None,
        processors: Sequence[Any] = (),
    ) -> list[Result] | list[list[Result]]:
        """Generates after each prompt and decodes the new tokens: one Result per prompt, or
        with num_return_sequences n > 1 a list of n per prompt."""
        ctx = self.context(len(prompts), options, processors)
        stop = stop_option({**self.options, **options})[1]
        base = secrets.randbits(31) if seed is None else seed_value(seed)
        seeds = [base + i for i in range(len(prompts))]
        out = decoding.run(ctx, prompts, seeds, inputs, on_token)
        decoding.compiled_shapes(self._shapes, [ctx])
        if decoding.chosen(ctx).num_return_sequences == 1:
            return [_result(ctx, tokenizer, p, t, stop) for p, t in zip(prompts, out, strict=True)]
        return [
            [_result(ctx, tokenizer, p, t, stop) for t in sequences]
            for p, sequences in zip(prompts, out, strict=True)
        ]

    def stream(
        self,
        tokenizer: Tokenizer,
        prompt: list[int],
        options: Mapping[str, Any],
        *,
        seed: int | None = None,
        inputs: Mapping[str, Any] | None = None,
        processors: Sequence[Any] = (),
    ) -> Iterator[Any]:
        """Generates after one prompt, yielding text pieces as tokens come.

        The pieces join to the text :meth:`run` gives. With num_return_sequences n > 1 each
        piece comes as a pair ``(j, piece)``: a piece of sequence j (0 <= j < n, the order of
        :meth:`run`'s list), and the pieces of each j join to that sequence's text. With beam
        search the leading beams can change at any step, so nothing is final before the search
        ends: each text comes as one piece then. Generation runs in a worker thread; closing the
        iterator (or Ctrl-C while waiting on it) stops it after the current step or decode chunk.
        """
        pieces: queue.Queue = queue.Queue()
        cancel = threading.Event()
        chosen = decoding.chosen(self.context(1, options, processors))
        n, beams = chosen.num_return_sequences, chosen.num_beams > 1
        stop = stop_option({**self.options, **options})[1]
        window = max(map(len, stop), default=0)
        before = tokenizer.decode(prompt[-window:]) if stop else ""
        texts = [tokenizer.streamer(skip_special_tokens=True) for _ in range(n)]
        holds = [_Hold(stop, before) for _ in range(n)]
        out: list[list[str]] = [[] for _ in range(n)]
        ended = [False] * n
        done = object()

        def send(j: int, piece: str) -> None:
            pieces.put(piece if n == 1 else (j, piece))

        def on_token(event: dict[str, np.ndarray]) -> None:
            if cancel.is_set():
                raise _Cancelled
            if beams:
                return
            tokens, finished = event["token"], event["finished"]
            for j in range(n):  # sampled sequence j of the one prompt is row j
                token = int(tokens[j])
                if token >= 0 and not ended[j]:
                    piece = holds[j].push(texts[j].push([token]))
                    if piece:
                        out[j].append(piece)
                        send(j, piece)
                ended[j] = ended[j] or bool(finished[j])

        def work() -> None:
            try:
                result = self.run(
                    tokenizer, [prompt], options, seed=seed, inputs=inputs, on_token=on_token,
                    processors=processors,
                )[0]  # fmt: skip
                for j, sequence in enumerate([result] if n == 1 else result):
                    if beams or stop:  # the text may be cut at a stop string: send what follows
                        shown = "".join(out[j])
                        text = sequence.text
                        rest = text[len(shown) :] if text.startswith(shown) else ""
                    else:
                        rest = texts[j].finish()
                    if rest:
                        send(j, rest)
                pieces.put(done)
            except _Cancelled:
                pieces.put(done)
            except BaseException as error:  # noqa: BLE001 - handed to the reading thread
                pieces.put(error)

        worker = threading.Thread(target=work, name="transmuter-generate", daemon=True)
        worker.start()
        return _Stream(pieces, cancel, worker, done)


class _Stream(Iterator[Any]):
    """The pieces of a stream as a worker thread puts them on ``pieces``; :meth:`close` may be
    called from any thread (the reading one then ends its iteration)."""

    def __init__(self, pieces: queue.Queue, cancel: threading.Event, worker, done: object):
        self._pieces, self._cancel, self._worker, self._done = pieces, cancel, worker, done
        self._closed = False

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        try:
            item = self._pieces.get()
        except BaseException:  # Ctrl-C while waiting: stop the worker, then let it through
            self.close()
            raise
        if item is self._done:
            self.close()
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item
        return item

    def close(self) -> None:
        """Stops generation after the current step; the iteration ends (from any thread)."""
        self._closed = True
        self._cancel.set()
        self._pieces.put(self._done)  # wakes a reader waiting in another thread
        if threading.current_thread() is not self._worker:
            self._worker.join()

    def __del__(self) -> None:
        self._cancel.set()


def _result(ctx: Any, tokenizer: Tokenizer, prompt: list[int], tokens: list, stop) -> Result:
    """The Result of one generated sequence after ``prompt`` (as generate returns it); ``stop``:
    the pipeline's stop strings, cut from the text."""
    end = decoding.ended(ctx, prompt, tokens)
    text = tokenizer.decode(end.tokens, skip_special_tokens=True)
    reason = end.reason
    if stop:
        cut = trim(tokenizer, list(prompt), end.tokens, text, stop)
        reason, text = "stop" if cut != text else reason, cut
    return Result(text, end.tokens, end.logprobs, reason, end.top_logprobs)


class _Cancelled(Exception):
    """Raised in the generation thread when the reader stopped the stream."""


def output_names(path: str) -> list[str]:
    """The output names of the ONNX graph at ``path`` (its weights are not read)."""
    import onnx

    return [o.name for o in onnx.load(path, load_external_data=False).graph.output]


def load_decoder(files: hub.Files, mesh: Any = None) -> tuple[Model, Model | None]:
    """The decoder of ``files`` and, for a decoder of inputs_embeds, its embedding model (with a
    mesh, their weights placed over it). A decoder with outputs that generation does not read
    (the attention weights of some transformers.js exports) is pruned to those it reads
    (:func:`generation.outputs`)."""
    names = output_names(files.decoder)
    keep = gen.outputs(names)
    model = load(files.decoder, outputs=keep if len(keep) < len(names) else None, mesh=mesh)
    embed = load(files.embed, mesh=mesh) if files.embed else None
    return model, embed


def mesh_of(mesh: Any, devices: Sequence[Any] | None) -> Any:
    """The mesh of a pipeline's ``mesh=`` or ``devices=`` (all on "model"), or None."""
    import jax

    if mesh is not None and devices is not None:
        raise ValueError("pass mesh= or devices=, not both")
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh= must be a jax.sharding.Mesh, not {type(mesh).__name__}")
    if devices is not None:
        if isinstance(devices, str | bytes) or not isinstance(devices, Sequence | np.ndarray):
            raise TypeError(
                f"devices= must be a sequence of jax devices, not {type(devices).__name__}"
            )
        if len(devices) == 0:
            raise ValueError("devices= is empty: give one jax device or more")
        for i, device in enumerate(devices):
            if not isinstance(device, jax.Device):
                raise TypeError(
                    f"devices[{i}] must be a jax device (jax.devices()), not "
                    f"{type(device).__name__}"
                )
    return sharding.make_mesh(devices) if devices is not None else mesh


def prompt_kind(prompt: Any) -> str:
    """ "text" for a string, "chat" for a list of message dicts, else raise TypeError."""
    if isinstance(prompt, str):
        return "text"
    if isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
        return "chat"
    raise TypeError(
        "a prompt is a string or a list of chat messages ({'role': ..., 'content': ...}), "
        f"got {type(prompt).__name__}: {prompt!r:.80}"
    )
