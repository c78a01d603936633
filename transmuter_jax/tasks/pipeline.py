"""The base of every task pipeline: the model's files, its task, the mesh, the decoder, the
defaults, and generate / ``__call__`` / stream with a public ``on_token=`` callback.

A task implements only its own part:

- its constructor calls :meth:`Pipeline.__init__` (which resolves the model and refuses one of
  another task), builds its tokenizer, processors and encoders, then :meth:`Pipeline.start`
  with what its decoder takes beside the tokens;
- :meth:`Pipeline.request` turns a batch of its inputs into a :class:`Request` (prompt token
  ids, the given inputs and the generation options);
- :meth:`Pipeline.single` says whether ``__call__`` got one input or a list;
- :meth:`Pipeline.finish` turns the results into the task's output (by default, as they are).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from . import detect
from .runner import Result, Runner, load_decoder, mesh_of, resolve, texts_of

OnToken = Callable[[np.ndarray], None]


@dataclasses.dataclass(frozen=True)
class Request:
    """What one call gives the decoder.

    Attributes:
        prompts: the token ids of each prompt.
        options: the generation options of the call (transformers' names).
        inputs: the decoder's given inputs beside the tokens (encoder states, image features,
            positions), one row per prompt; None: none.
        processors: the task's own logits processors, after the generation options' ones.
        state: what the task's :meth:`Pipeline.finish` reads beside the results (such as the
            chunks of long audio).
    """

    prompts: list[list[int]]
    options: dict[str, Any]
    inputs: Mapping[str, Any] | None = None
    processors: tuple[Any, ...] = ()
    state: Any = None


class Pipeline:
    """A model of one task and its decoder, run by the generation engine.

    Attributes:
        files: the files it was loaded from (folder, exporter family, decoder, encoder, embed).
        task: the :class:`~transmuter_jax.tasks.detect.Task` of the model.
        mesh: the ``jax.sharding.Mesh`` the decoder runs over, or None.
        options: the default generation options given at construction (transformers' names).
        tokenizer: the tokenizer of ``tokenizer.json`` (set by the task).
        decoder: the decoder model (set by :meth:`start`).
    """

    TASK: ClassVar[detect.Task]
    ALSO: ClassVar[tuple[detect.Task, ...]] = ()  # other tasks whose models it also runs

    def __init__(
        self,
        repo: str | os.PathLike | None,
        *,
        dtype: str | None = None,
        file: str | None = None,
        mesh: Any = None,
        devices: Sequence[Any] | None = None,
        **options: Any,
    ):
        self.files = resolve(repo, dtype, file)
        self.task = detect.check(self.TASK, repo, self.files, self.ALSO)
        self.mesh = mesh_of(mesh, devices)
        self.options = dict(options)
        self.tokenizer: Any = None
        self.decoder: Any = None
        self.embed: Any = None
        self._runner: Runner | None = None

    def load_decoder(self) -> tuple[Any, Any]:
        """The decoder and (for a decoder of inputs_embeds) its embedding model, on the mesh."""
        return load_decoder(self.files, self.mesh)

    def start(
        self,
        decoder: Any = None,
        embed: Any = None,
        *,
        given: Sequence[str] = (),
        options: Mapping[str, Any] | None = None,
    ) -> None:
        """Makes the decoder ready to generate (loaded here unless given): ``given``, the names
        of the inputs it takes beside the tokens; ``options``, the default generation options
        of the decoder (None: the pipeline's :attr:`options`)."""
        if decoder is None:
            decoder, embed = self.load_decoder()
        self.decoder, self.embed = decoder, embed
        self._runner = Runner(
            self.files.folder, decoder, embed=embed, given=given,
            options=self.options if options is None else options, tokenizer=self.tokenizer,
            mesh=self.mesh,
        )  # fmt: skip

    def _started(self) -> Runner:
        if self._runner is None:
            raise RuntimeError(f"{type(self).__name__} has not started its decoder")
        return self._runner

    @property
    def defaults(self) -> dict[str, Any]:
        """The options a call starts from: transformers' defaults, generation_config.json, then
        the pipeline's options."""
        return dict(self._started().defaults)

    @property
    def compiled_shapes(self) -> int:
        """How many decoder step shapes have been compiled so far."""
        return self._started().compiled_shapes

    @property
    def engines(self) -> tuple[Any, ...]:
        """The compiled generation engines kept now (``generation.Engine``), least recently
        used first."""
        return self._started().engines

    def chosen(self, batch: int, options: Mapping[str, Any]) -> Any:
        """The generation options (``generation.Options``) a call of ``batch`` prompts with
        ``options`` runs with (``decoder_start_token_id``, ``num_beams``, ...)."""
        return self._started().chosen(batch, {**options})

    # ------------------------------------------------------------------ the task's own part

    def request(self, batch: Sequence[Any], options: dict[str, Any]) -> Request:
        """The :class:`Request` of a batch of the task's inputs and the call's options."""
        raise NotImplementedError

    def single(self, inputs: Any) -> bool:
        """Whether ``__call__`` was given one input (not a list of them)."""
        return isinstance(inputs, str)

    def finish(self, results: list, request: Request) -> list:
        """The task's output of the ``results`` of ``request`` (by default, as they are)."""
        return results

    # ------------------------------------------------------------------ shared by every task

    def generate(
        self,
        inputs: Sequence[Any],
        *,
        seed: int | None = None,
        on_token: OnToken | None = None,
        **options: Any,
    ) -> list:
        """Generates after each input, in one batch.

        Args:
            inputs: the task's inputs (prompts, texts, images, conversations, ...).
            seed: the sampling seed of the first input (the next get seed + 1, ...); None:
                random.
            on_token: called after each step with the new token of each row of the batch
                (int32 [rows]; -1 where a row took none, such as a step of its prompt).
            **options: generation options for this call (max_new_tokens, do_sample, ...).

        Returns:
            One :class:`~transmuter_jax.tasks.runner.Result` per input (text, token ids,
            log-probabilities, finish reason); with num_return_sequences n > 1, a list of n.
        """
        request = self.request(inputs, dict(options))
        return self.finish(self.run(request, seed=seed, on_token=on_token), request)

    def generate_ids(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        seed: int | None = None,
        on_token: OnToken | None = None,
        inputs: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> list[Result] | list[list[Result]]:
        """Generates after prompts given as token ids (``inputs``: the decoder's given inputs,
        one row per prompt), as :meth:`generate` does after the task's own prompts."""
        ids = [list(map(int, p)) for p in prompts]
        return self.run(Request(ids, dict(options), inputs), seed=seed, on_token=on_token)

    def __call__(self, inputs: Any, *, seed: int | None = None, **options: Any) -> Any:
        """The text for one input, or the texts for a list of them (see :meth:`generate`); with
        num_return_sequences n > 1, each is a list of n texts."""
        single = self.single(inputs)
        texts = texts_of(self.generate([inputs] if single else inputs, seed=seed, **options))
        return texts[0] if single else texts

    def stream(self, input: Any, *, seed: int | None = None, **options: Any) -> Iterator[Any]:
        """Yields the text for one input in pieces (str) as it is generated.

        Pieces never split a multi-byte character, and they join to the text the same call
        without streaming gives. With beam search the text is final only when the search ends:
        it comes then, as one piece. With num_return_sequences n > 1 each piece comes as a pair
        ``(j, piece)`` of sequence j, and the pieces of each j join to its text. Closing the
        iterator stops generation.
        """
        return self.stream_request(self.request([input], dict(options)), seed=seed)

    def stream_request(self, request: Request, *, seed: int | None = None) -> Iterator[Any]:
        """Yields the text after the one prompt of ``request`` in pieces (see :meth:`stream`)."""
        return self._started().stream(
            self.tokenizer, request.prompts[0], request.options, seed=seed,
            inputs=request.inputs, processors=request.processors,
        )  # fmt: skip

    def run(
        self,
        request: Request,
        *,
        seed: int | None = None,
        on_token: OnToken | None = None,
        on_step: Callable[[Mapping[str, np.ndarray]], None] | None = None,
    ) -> list:
        """The results of ``request`` (see :meth:`generate`), before :meth:`finish`.

        ``on_step``: called with each step's whole event (the tokens, finished flags and, when
        asked, log-probabilities: see :func:`transmuter_jax.generation.generate`'s on_token),
        after ``on_token``.
        """
        tell = on_step
        if on_token is not None:

            def tell(event: Mapping[str, np.ndarray]) -> None:
                on_token(np.asarray(event["token"]))
                if on_step is not None:
                    on_step(event)

        return self._started().run(
            self.tokenizer, request.prompts, request.options, seed=seed, inputs=request.inputs,
            on_token=tell, processors=request.processors,
        )  # fmt: skip
