"""Text generation: text or chat messages in, text out."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ..tasks import decoding, detect
from ..tasks.pipeline import OnToken, Pipeline, Request
from ..tasks.runner import Result, prompt_kind
from .tokenizer import Tokenizer

Message = Mapping[str, Any]
Prompt = str | Sequence[Message]


class TextGeneration(Pipeline):
    """A decoder-only language model with its tokenizer, from :func:`generation`.

    Attributes:
        files: the files it was loaded from (folder, exporter family, decoder).
        tokenizer: the tokenizer of ``tokenizer.json``.
        options: the default generation options (transformers' names).
    """

    TASK = detect.TEXT_GENERATION
    ALSO = (detect.IMAGE_TEXT_TO_TEXT,)  # a vision-language model's text decoder runs alone

    def __init__(
        self,
        repo,
        *,
        dtype=None,
        file=None,
        chat_template=None,
        mesh=None,
        devices=None,
        assistant_model=None,
        **options,
    ):
        super().__init__(repo, dtype=dtype, file=file, mesh=mesh, devices=devices, **options)
        self.tokenizer = Tokenizer.from_folder(self.files.folder)
        if chat_template is not None:
            self.tokenizer.chat_template = chat_template
        self.start()
        if assistant_model is not None:  # speculative decoding with a draft model
            if not isinstance(assistant_model, TextGeneration):
                assistant_model = TextGeneration(assistant_model, mesh=mesh, devices=devices)
            draft = assistant_model
            helper = (draft.files.folder, draft.decoder, draft.embed)
            decoding.check_assistant(self.files.folder, self.decoder, self.embed, helper)
            self._started().assistant = helper

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer has a (default) chat template."""
        return self.tokenizer.chat_template is not None

    def prompt_ids(self, prompt: Prompt, *, chat: bool | None = None) -> list[int]:
        """The token ids of a prompt.

        A list of messages goes through the chat template (with the generation prompt, or
        continuing a final assistant message). A string goes through it as one user message when
        the model has a chat template, unless ``chat=False``; otherwise (or with ``chat=False``)
        it is encoded as it is, with the tokenizer's special tokens. ``chat=True`` requires the
        template.
        """
        kind = prompt_kind(prompt)
        if kind == "text" and (chat is False or (chat is None and not self.has_chat_template)):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        messages = [{"role": "user", "content": prompt}] if kind == "text" else list(prompt)
        for message in messages:
            content = message.get("content")
            if isinstance(content, list | tuple) and any(
                isinstance(p, Mapping) and p.get("type") == "image" for p in content
            ):
                if _beside(self.files.decoder, "vision_encoder"):
                    raise ValueError(
                        f"text.generation runs only the text decoder of {self.files.folder!r}: "
                        "it takes no images (an image content part was given); use "
                        "vision.image_text_to_text, which runs its vision encoder"
                    )
                raise ValueError(
                    f"{self.files.folder!r} is a text-only model: it takes no images (an image "
                    "content part was given); use vision.image_text_to_text for a vision model"
                )
        text = self.chat_text(messages)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chat_text(self, messages: Sequence[Message]) -> str:
        """The chat template applied to ``messages``, as transformers' text-generation pipeline
        does: a final assistant message is continued, else the generation prompt is added."""
        last = messages[-1] if messages else {}
        if isinstance(last, Mapping) and last.get("role") == "assistant":
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=False, continue_final_message=True
            )
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def request(self, batch: Sequence[Prompt], options: dict[str, Any]) -> Request:
        """The prompt ids of a batch of prompts; the option ``chat`` (see :meth:`generate`)."""
        if isinstance(batch, str) or not isinstance(batch, Sequence) or not batch:
            raise TypeError("prompts is a non-empty list of prompts")
        chat = options.pop("chat", None)
        return Request([self.prompt_ids(p, chat=chat) for p in batch], options)

    def single(self, inputs: Any) -> bool:
        return isinstance(inputs, str) or (
            isinstance(inputs, Sequence) and bool(inputs) and isinstance(inputs[0], Mapping)
        )

    def generate(
        self,
        prompts: Sequence[Prompt],
        *,
        chat: bool | None = None,
        seed: int | None = None,
        on_token: OnToken | None = None,
        **options: Any,
    ) -> list[Result] | list[list[Result]]:
        """Generates an answer to each prompt, in one batch.

        Args:
            prompts: strings or chat-message lists.
            chat: whether string prompts go through the chat template as user messages; None
                (the default): when the model has one.
            seed: the sampling seed of the first prompt (the next get seed + 1, ...); None: random.
            on_token: called after each step with the new token of each row (int32 [rows], -1
                where a row took none).
            **options: generation options for this call (max_new_tokens, do_sample, ...).

        Returns:
            One :class:`Result` per prompt: text, token ids, log-probabilities, finish reason.
            With num_return_sequences n > 1, a list of n Results per prompt (sampling: n
            independent sequences; beam search: the n best hypotheses, best first).
        """
        return super().generate(prompts, seed=seed, on_token=on_token, chat=chat, **options)

    def __call__(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        chat: bool | None = None,
        seed: int | None = None,
        **options: Any,
    ) -> str | list[str] | list[list[str]]:
        """The answer to a prompt, or the answers to a list of prompts (see :meth:`generate`);
        with num_return_sequences n > 1, each answer is a list of n texts."""
        return super().__call__(prompts, seed=seed, chat=chat, **options)

    def stream(
        self,
        prompt: Prompt,
        *,
        chat: bool | None = None,
        seed: int | None = None,
        **options: Any,
    ) -> Iterator[Any]:
        """Yields the answer to one prompt in pieces (str) as it is generated.

        Pieces never split a multi-byte character, and they join to the text the same call
        without streaming gives. With beam search (``num_beams`` above 1) the text is final only
        when the search ends: it comes then, as one piece. With num_return_sequences n > 1 each
        piece comes as a pair ``(j, piece)`` of sequence j, and the pieces of each j join to its
        text. Closing the iterator stops generation.
        """
        return super().stream(prompt, seed=seed, chat=chat, **options)


def generation(
    repo: str | os.PathLike | None = None,
    *,
    dtype: str | None = None,
    file: str | None = None,
    chat_template: str | None = None,
    mesh: Any = None,
    devices: Sequence[Any] | None = None,
    assistant_model: Any = None,
    **options: Any,
) -> TextGeneration:
    """A text-generation pipeline.

    Args:
        repo: a local folder or a hub id; None (or "default", "default-int4",
            "default-optimum") is the default model, SmolLM2-135M-Instruct, prepared on first use.
        dtype: which variant of the ONNX files (such as "fp32", "q4", "int4"); None: fp32.
        file: the decoder file to use, relative to the repo; overrides ``dtype``.
        chat_template: a Jinja chat template replacing the tokenizer's. With a chat template,
            string prompts go through it as user messages unless a call says ``chat=False``.
        mesh: a ``jax.sharding.Mesh`` with axes "model" and/or "data": the decoder's weights
            are split over it at load and its steps run over it (docs/distributed.md).
        devices: without ``mesh``, the devices of a mesh that puts them all on "model".
        assistant_model: a draft model of the same tokenizer (a folder, a hub id, "default-int4",
            or a loaded :class:`TextGeneration`): speculative decoding drafts
            ``num_assistant_tokens`` tokens with it, verified in one step of this model
            (docs/speculative.md).
        **options: default generation options, transformers' names (max_new_tokens, do_sample,
            temperature, top_k, top_p, num_beams, repetition_penalty, token_logprobs, ...).

    Returns:
        A :class:`TextGeneration`: call it with a prompt, or use ``stream`` and ``generate``.
    """
    return TextGeneration(
        repo,
        dtype=dtype,
        file=file,
        chat_template=chat_template,
        mesh=mesh,
        devices=devices,
        assistant_model=assistant_model,
        **options,
    )


def _beside(path: str, stem: str) -> bool:
    """Whether an ONNX file whose name starts with ``stem`` lies in the folder of ``path``."""
    folder = os.path.dirname(path)
    return any(n.startswith(stem) and n.endswith(".onnx") for n in os.listdir(folder))
