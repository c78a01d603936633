"""The context of generation: the decoder, its cache mode, and the generation options."""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import hub
from ..onnx.errors import ModelFileError
from ..onnx.model import Model
from . import constraints
from .cache import CacheLayout, Mode, detect, layout, present_name
from .errors import GenerationError
from .options import Options, merge
from .processors import from_options
from .stops import StopStrings, token_texts

PREFILLS = ("buckets", "pow2", "exact")
"""The prompt rules: "buckets" runs a prompt in one step padded to a bucket (a multiple of 16
up to 64 tokens, then of 64; chunks of :data:`~transmuter_jax.generation.cache.PREFILL_CAP`
tokens past it); "pow2" in power-of-two parts (45 tokens as 32, 8, 4, 1); "exact" in one step
of its own length (a program per length; the default of a graph whose values mix positions,
:data:`WHOLE_TENSOR_OPS`)."""

WHOLE_TENSOR_OPS = frozenset({"DynamicQuantizeLinear", "DynamicQuantizeMatMul"})
"""Ops whose result at one position depends on every position of their input (a scale from the
whole tensor): padding a prompt step would change its real tokens' values."""


@dataclasses.dataclass(frozen=True, eq=False)
class Context:
    """The specification of generation with a decoder: frozen; per-call options make a new one
    (:func:`dataclasses.replace`, :meth:`with_options`).

    Attributes:
        model: the decoder.
        cache_mode: the cache mode object of the graph (:class:`~.cache.Mode`); ``compile``
            refines a grow mode (padded, buckets or exact).
        options: the generation options (transformers' names and defaults), file settings
            merged with the caller's.
        config: config.json of the repository.
        given: inputs the caller passes to each step (such as encoder_hidden_states).
        embed: the model that turns token ids into embeddings, for a decoder of inputs_embeds.
        image_token: the id of the token whose embeddings image features replace.
        cache: the layout of the KV cache.
        processors: the logits processors, in order (built-in names, then a task's own pairs).
        stops: the stop strings with the text of each token (None without stop_strings).
        texts: the text of each token id (read where stop strings need them), or any object
            whose ``token_texts`` gives them (a tokenizer), or None.
        prefill: how prompts run, one of :data:`PREFILLS`.
        repo: the model's folder or hub id (its tokenizer.json is the vocabulary of a
            constraint).
        constraint: the processors of the options' constraint (json_schema, regex, grammar,
            choice, json_object), after all others; empty without one.
        assistant: the specification of a draft model of the same vocabulary (speculative
            decoding, docs/speculative.md), or None.
    """

    model: Model
    cache_mode: Mode
    options: Options
    config: Any
    given: tuple[str, ...]
    embed: Model | None
    image_token: int | None
    cache: CacheLayout
    processors: tuple[Any, ...] = ()
    stops: StopStrings | None = None
    texts: Any = None
    prefill: str = "buckets"
    repo: str = ""
    constraint: tuple[Any, ...] = ()
    assistant: Context | None = None

    @property
    def token_texts(self) -> tuple[str | None, ...] | None:
        """The text of each token id (None: unknown)."""
        texts = self.texts
        return texts if texts is None or isinstance(texts, tuple) else tuple(texts.token_texts)

    @property
    def mode(self) -> str:
        """The name of the cache mode: "in_place", "append" or "grow"."""
        return self.cache_mode.name

    def with_options(self, **options: Any) -> Context:
        """A new specification: these options over this one's (its processors rebuilt from them,
        a task's own processors kept after them)."""
        merged = self.options.replace(**options)
        merged.check_supported(self.vocab_size)
        custom = tuple(
            p for p in self.processors if not isinstance(p, str) and p not in self.constraint
        )
        stops = self.stops
        if merged.stop_strings != self.options.stop_strings:
            stops = _stops(merged, self.token_texts)
        constraint = self.constraint
        if constraints.from_options(merged) != constraints.from_options(self.options):
            constraint = _constraint(merged, self.repo, self.vocab_size)
        return dataclasses.replace(
            self,
            options=merged,
            processors=(*from_options(merged), *custom, *constraint),
            stops=stops,
            constraint=constraint,
        )

    @property
    def eos(self) -> tuple[int, ...]:
        """The eos token ids (empty: none)."""
        return self.options.eos_token_id

    @property
    def position_limit(self) -> int | None:
        """The most tokens a row can hold (prompt and new ones): config.json's
        max_position_embeddings (or max_target_positions, n_positions), or the rows of a rotary
        cache in the graph, whichever is smaller; None when neither says."""
        limits = []
        text = self.config.get("text_config", self.config)
        for key in ("max_position_embeddings", "max_target_positions", "n_positions"):
            if isinstance(text.get(key), int) and text[key] > 0:
                limits.append(int(text[key]))
                break
        rotary = _rotary_rows(self.model)
        if rotary:
            limits.append(rotary)
        return min(limits) if limits else None

    @property
    def vocab_size(self) -> int | None:
        """The vocabulary size: the logits' last dimension, else config.json's."""
        logits = next((o for o in self.model.outputs if o.name == "logits"), None)
        if logits is not None and logits.shape and isinstance(logits.shape[-1], int):
            return logits.shape[-1]
        return hub.vocab_size(self.config)


_ROTARY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its rotary rows


def _rotary_rows(model: Model) -> int | None:
    """The rows of the rotary cos caches of GroupQueryAttention / RotaryEmbedding nodes (read
    once per model: every generate call asks)."""
    if model not in _ROTARY:
        _ROTARY[model] = _read_rotary_rows(model)
    return _ROTARY[model]


def _read_rotary_rows(model: Model) -> int | None:
    rows = []
    for node in model.graph.proto.node:
        at = {"GroupQueryAttention": 7, "RotaryEmbedding": 2}.get(node.op_type)
        if at is None or len(node.input) <= at or not node.input[at]:
            continue
        value = model.params.get(node.input[at], model.graph.constants.get(node.input[at]))
        if value is not None and len(np.shape(value)) == 2:
            rows.append(int(np.shape(value)[0]))
    return min(rows) if rows else None


def cache_mode(model: Model) -> str:
    """The name of the cache mode of a decoder, from its graph (see :func:`.cache.detect`)."""
    return detect(model).name


def context(
    repo: str | os.PathLike,
    model: Model,
    *,
    given: Sequence[str] = (),
    embed: Model | None = None,
    image_token: int | None = None,
    tokenizer: Any = None,
    processors: Sequence[Any] = (),
    prefill: str | None = None,
    assistant: Context | None = None,
    **options: Any,
) -> Context:
    """The context of generation for ``model``.

    Args:
        repo: the model's folder or hub id, with config.json and generation_config.json.
        model: the decoder, from :func:`transmuter_jax.load`.
        given: the names of other inputs the caller gives to each step (encoder outputs:
            encoder_hidden_states, and the cross-attention cache of a decoder that takes it
            from the caller, such as past_key_cross_0 of an onnxruntime-genai Whisper).
        embed: for a decoder of inputs_embeds, the model of the token embeddings.
        image_token: the id of the image token whose embeddings image features replace.
        tokenizer: with stop_strings, any object whose ``token_texts`` gives the text of each
            token id (a :class:`~transmuter_jax.text.tokenizer.Tokenizer`); None: the texts read
            from ``repo``'s tokenizer.json.
        processors: a task's own processors ``(state, process)`` (see :mod:`.processors`), after
            the built-in ones.
        prefill: how prompts run, one of :data:`PREFILLS`; None: "buckets" (one padded step),
            or "exact" for a graph with one of :data:`WHOLE_TENSOR_OPS`.
        assistant: a draft model's specification (its own ``context``) of the same vocabulary:
            speculative decoding drafts num_assistant_tokens tokens with it and verifies them in
            one step of this model (docs/speculative.md).
        **options: generation options with transformers' names (max_new_tokens, do_sample,
            eos_token_id, ...), they override generation_config.json; also token_logprobs and
            decode_steps (new tokens per dispatch on the device; 1: one step at a time).
    """
    config = hub.read_json(repo, "config.json")
    merged = merge(config, hub.read_json(repo, "generation_config.json"), options)
    names = {i.name for i in model.inputs}
    missing = [g for g in given if g not in names]
    if missing:
        raise GenerationError(
            f"given inputs {missing} are not inputs of the decoder {model.path!r}"
        )
    if "inputs_embeds" in names and "input_ids" not in names and embed is None:
        raise GenerationError(
            f"{model.path!r} takes inputs_embeds: pass embed=, the model of the embeddings"
        )
    cache = layout(model, config)
    if not cache.entries:
        raise GenerationError(f"{model.path!r} has no KV cache inputs (past_key_values.*)")
    missing = [g for g in cache.given if g not in given]
    if missing:
        raise GenerationError(
            f"the decoder {model.path!r} takes the cross-attention cache from the caller "
            f"({', '.join(missing)}: no step computes it, the encoder does, as "
            f"{', '.join(present_name(g) for g in missing[:2])}, ...); name them in given= and "
            "pass the encoder's arrays to generate in inputs"
        )
    if prefill is None:
        whole = any(op in WHOLE_TENSOR_OPS for _, op in model.all_op_types)
        prefill = "exact" if whole else "buckets"
    if prefill not in PREFILLS:
        raise GenerationError(f"prefill must be one of {PREFILLS}, got {prefill!r}")
    texts = tokenizer
    if merged.stop_strings:
        texts = tuple(tokenizer.token_texts) if tokenizer is not None else folder_texts(repo)
    ctx = Context(
        model=model,
        cache_mode=detect(model),
        options=merged,
        config=config,
        given=tuple(given),
        embed=embed,
        image_token=image_token,
        cache=cache,
        processors=(*from_options(merged), *processors),
        stops=_stops(merged, texts),
        texts=texts,
        prefill=prefill,
        repo=os.fspath(repo),
    )
    merged.check_supported(ctx.vocab_size)
    if assistant is not None:
        ctx = dataclasses.replace(ctx, assistant=_assistant(ctx, assistant))
    constraint = _constraint(merged, ctx.repo, ctx.vocab_size)
    if constraint:  # compiled now: a bad one is refused before any generation
        ctx = dataclasses.replace(
            ctx, processors=(*ctx.processors, *constraint), constraint=constraint
        )
    return ctx


def _assistant(ctx: Context, assistant: Any) -> Context:
    """``assistant`` checked as the draft model of ``ctx``: a Context of the same vocabulary."""
    if not isinstance(assistant, Context):
        raise GenerationError(
            f"assistant must be a generation.context(...) of the draft model, got "
            f"{type(assistant).__name__}"
        )
    if assistant.vocab_size != ctx.vocab_size:
        raise GenerationError(
            f"the assistant model {assistant.model.path!r} has a vocabulary of "
            f"{assistant.vocab_size} tokens and {ctx.model.path!r} one of {ctx.vocab_size}: a "
            "draft model must share the target's tokenizer"
        )
    if _texts(ctx) != _texts(assistant):
        raise GenerationError(
            f"the assistant model {assistant.model.path!r} has other token texts than "
            f"{ctx.model.path!r} (another tokenizer.json): a draft model must share the target's "
            "tokenizer"
        )
    if ctx.options.num_beams > 1 or ctx.options.num_return_sequences > 1:
        raise GenerationError(
            "an assistant model (speculative decoding) gives one sequence per prompt: not with "
            "beam search or num_return_sequences > 1"
        )
    if ctx.options.prompt_lookup_num_tokens is not None:
        raise GenerationError("set an assistant model or prompt_lookup_num_tokens, not both")
    return assistant


def _texts(ctx: Context) -> tuple[str | None, ...] | None:
    """The token texts of ``ctx``: its own, else its folder's tokenizer.json's, else None."""
    if ctx.token_texts is not None:
        return ctx.token_texts
    try:
        return folder_texts(ctx.repo)
    except (OSError, ModelFileError):
        return None


def _constraint(options: Options, repo: str, vocab: int | None) -> tuple[Any, ...]:
    """The processors of the options' constraint (the mask after all other processors)."""
    constraint = constraints.from_options(options)
    if constraint is None:
        return ()
    path = os.path.join(hub.folder(repo, hub.SMALL_FILES), "tokenizer.json")
    return (constraints.processor(constraint, path, vocab or 0, options.eos_token_id),)


def _stops(options: Options, texts: Sequence[str | None] | None) -> StopStrings | None:
    if not options.stop_strings:
        return None
    if texts is None:
        raise GenerationError("stop_strings need the token texts: pass tokenizer= to context()")
    return StopStrings(options.stop_strings, texts)


def folder_texts(repo: str | os.PathLike) -> tuple[str | None, ...]:
    """The text of each token id of ``repo``'s tokenizer.json, as stop strings read it."""
    import tokenizers

    folder = hub.folder(repo, hub.SMALL_FILES)
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        raise ModelFileError(
            f"{folder} has no tokenizer.json; only fast tokenizers (tokenizer.json) are supported"
        )
    return token_texts(tokenizers.Tokenizer.from_file(path))


def max_new_tokens(repo: str | os.PathLike, prompt_length: int, **options: Any) -> int:
    """The new tokens of a decoder whose max_length counts its prompt (transformers' pipelines).

    The option max_new_tokens, else generation_config.json's; else 256 when max_length is
    absent or 20 (GenerationConfig's default); else max_length minus the prompt length.
    """
    file = hub.read_json(repo, "generation_config.json")
    if options.get("max_new_tokens") is not None:
        return int(options["max_new_tokens"])
    if file.get("max_new_tokens") is not None:
        return int(file["max_new_tokens"])
    max_length = options.get("max_length", file.get("max_length"))
    if max_length is None or max_length == 20:
        return 256
    return max(int(max_length) - prompt_length, 0)


def outputs(names: Sequence[str]) -> list[str]:
    """The outputs generation reads, logits and the present cache, in the order of ``names``."""
    return [n for n in names if n == "logits" or n.startswith("present")]
