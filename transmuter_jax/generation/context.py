"""The context of generation: the decoder, its cache mode, and the generation options."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import hub
from ..onnx.model import Model
from ..onnx.trace import value_sources
from ..onnx.window import hidden_rows_matter
from .cache import CacheLayout, layout, present_name
from .errors import GenerationError
from .options import Options, merge
from .processors import from_options
from .stops import StopStrings


@dataclasses.dataclass
class Context:
    """Everything generation needs to know about a decoder.

    Attributes:
        model: the decoder.
        mode: the cache mode, "in_place", "append" or "grow".
        options: the generation options (transformers' names and defaults), file settings
            merged with the caller's.
        config: config.json of the repository.
        given: inputs the caller passes to each step (such as encoder_hidden_states).
        embed: the model that turns token ids into embeddings, for a decoder of inputs_embeds.
        image_token: the id of the token whose embeddings image features replace.
        cache: the layout of the KV cache.
        processors: the logits processors, in order.
        batch_size: the number of prompts per batch, set by compile().
        jit_options: options of jax.jit, set by compile().
        stops: the stop strings with the text of each token (None without stop_strings).
        placement: with a mesh, where the weights and cache live
            (:class:`~transmuter_jax.generation.sharding.Placement`), set by compile().
    """

    model: Model
    mode: str
    options: Options
    config: dict[str, Any]
    given: tuple[str, ...]
    embed: Model | None
    image_token: int | None
    cache: CacheLayout
    processors: list[Any] = dataclasses.field(default_factory=list)
    batch_size: int | None = None
    jit_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    compiled: Any = None
    stops: StopStrings | None = None
    placement: Any = None

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
        text = self.config.get("text_config", self.config)
        return text.get("vocab_size") or self.config.get("vocab_size")


def _rotary_rows(model: Model) -> int | None:
    """The rows of the rotary cos caches of GroupQueryAttention / RotaryEmbedding nodes."""
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
    """The cache mode of a decoder, from its graph.

    in_place: a GroupQueryAttention counts the valid rows from the values of attention_mask.
    append: the graph takes position_ids, and hidden rows after the valid ones change none of its
    attention masks (see :func:`~transmuter_jax.onnx.window.hidden_rows_matter`). grow: the
    positions come from the cache length, or a mask reads it (a sliding window).
    """
    nodes = [n for n in model.graph.proto.node if n.op_type == "GroupQueryAttention"]
    if nodes:
        sources = value_sources(model.graph)
        seqlens = nodes[0].input[5] if len(nodes[0].input) > 5 else ""
        if "attention_mask" in sources.get(seqlens, ()):
            return "in_place"
        return "grow"
    if any(i.name == "position_ids" for i in model.inputs):
        return "grow" if hidden_rows_matter(model) else "append"
    return "grow"


def context(
    repo: str | os.PathLike,
    model: Model,
    *,
    given: Sequence[str] = (),
    embed: Model | None = None,
    image_token: int | None = None,
    tokenizer: Any = None,
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
        tokenizer: with stop_strings, the :class:`~transmuter_jax.text.tokenizer.Tokenizer` that
            tells each token's text; None: the one of ``repo`` (its tokenizer.json).
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
    ctx = Context(
        model=model,
        mode=cache_mode(model),
        options=merged,
        config=config,
        given=tuple(given),
        embed=embed,
        image_token=image_token,
        cache=cache,
        processors=from_options(merged),
    )
    merged.check_supported(ctx.vocab_size)
    if merged.stop_strings:
        if tokenizer is None:
            from ..text.tokenizer import Tokenizer  # the text package sits above generation

            tokenizer = Tokenizer.from_folder(hub.folder(repo, hub.SMALL_FILES))
        ctx.stops = StopStrings(merged.stop_strings, tokenizer.token_texts)
    return ctx


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
