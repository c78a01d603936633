"""The jitted decoder step: tokens and cache in, last-token logits and the next cache out.

One step runs the decoder over ``S`` tokens of every row (a power of two while prompts are fed,
1 after), gathers the logits of each row's last real token, and updates the cache, all in one
XLA program. The cache buffers are donated, so XLA updates them in place.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..onnx.dtypes import device_dtype
from ..onnx.model import Model
from ..onnx.rewrite import NotPaddable, PaddedPast, pad_past
from ..runtime import switch
from ..runtime.jit import jit_options
from ..runtime.stored import StoredJit
from . import cache as cache_modes
from .cache import chunk  # noqa: F401  (the power-of-two rule, named here before)
from .programs import jit_key, placement_key, program


def probe_inputs(
    model: Model, layout: cache_modes.CacheLayout, past: int, *, batch: int = 2, step: int = 3
) -> dict[str, Any]:
    """Abstract inputs of one step after ``past`` cached tokens, for :func:`pad_past`.

    Static inputs (use_cache_branch) are numpy arrays that pick the branch reading the cache;
    the others are jax.ShapeDtypeStruct. Dimensions are known from the inputs' names (tokens,
    attention_mask, cache) and their symbolic dimensions; other dimensions refuse the probe.
    """
    entries = {e.input: e for e in layout.entries}
    encoder = 5  # rows of the cross-attention cache and the encoder outputs
    dims: dict[Any, int] = {}
    for info in model.inputs:
        shape = info.shape or ()
        if info.name in entries and len(shape) == 4:
            dims[shape[0]] = batch
            dims[shape[2]] = encoder if entries[info.name].cross else past
        elif info.name in ("input_ids", "inputs_embeds") and len(shape) >= 2:
            dims[shape[0]], dims[shape[1]] = batch, step
    inputs: dict[str, Any] = {}
    for info in model.inputs:
        dtype = device_dtype(np.dtype(info.dtype))
        if info.name in model.static_inputs:
            inputs[info.name] = np.ones(info.shape, np.dtype(info.dtype))
            continue
        if info.name in entries:
            entry = entries[info.name]
            shape = (batch, entry.heads, encoder if entry.cross else past, entry.head_size)
        elif info.name == "attention_mask":
            shape = (batch, past + step)
        elif info.shape is not None and all(isinstance(d, int) or d in dims for d in info.shape):
            shape = tuple(d if isinstance(d, int) else dims[d] for d in info.shape)
        else:
            raise NotPaddable(f"cannot tell the shape of input {info.name!r} {info.shape}")
        inputs[info.name] = jax.ShapeDtypeStruct(shape, dtype)
    return inputs


_PADDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> layout -> result


def pad_grow(ctx: Any) -> tuple[PaddedPast | None, str]:
    """The decoder of a grow context rewritten for a padded cache, else None and the reason.

    The result is kept per decoder and cache layout: contexts of one decoder share it.
    """
    known = _PADDED.setdefault(ctx.model, {})
    if ctx.cache not in known:
        past = [e.input for e in ctx.cache.entries if not e.cross]
        try:
            padded = pad_past(ctx.model, lambda n: probe_inputs(ctx.model, ctx.cache, n), past)
            known[ctx.cache] = (padded, "")
        except NotPaddable as error:
            known[ctx.cache] = (None, str(error))
    return known[ctx.cache]


REAL = "transmuter_jax::real"  # the feed's [B] real tokens of each row (Steps' ``real``)
LIVE = "transmuter_jax::live"  # the feed's [B] rows whose outputs are read (others: skipped)


@dataclasses.dataclass
class Steps:
    """The compiled steps of a context, one per (step length, cache length, branch), and in grow
    on a padded cache, the cache's rows after the step.

    Attributes:
        mode: the cache mode.
        padding: the decoder rewritten for a padded grow cache, or None.
    """

    ctx: Any  # the engine: model, embed, cache layout, placement, image_token, jit_options
    mode: cache_modes.Mode
    padding: PaddedPast | None = None
    shapes: set[tuple] = dataclasses.field(default_factory=set)  # the shapes this engine ran
    held: dict = dataclasses.field(default_factory=dict)  # the programs this engine keeps

    def __call__(self, cache, feed, lengths, last, rows: int | None = None, real=None):
        """Runs one step.

        Args:
            cache: the cache arrays by input name (donated).
            feed: "tokens" [B, S] int32, attention_mask, position_ids, the given inputs, and for
                image features "image_features" [B, S, H] with "image_mask" [B, S].
            lengths: [B] int32 valid cached tokens of each row before the step.
            last: [B] int32 index in the step of each row's last real token (or [B, P]: the
                logits of P tokens of each row, [B, P, V], as speculative decoding verifies).
            rows: in grow on a padded cache, its rows after the step.
            real: [B] the real tokens of each row's step (its padding after them), for a cache
                mode that drops the padding (:meth:`~.cache.Mode.real_input`); None: all real.

        Returns:
            (logits [B, V] float32 of each row's last real token, the next cache)
        """
        ctx = self.ctx
        length = cache_modes.cache_length(cache, ctx.cache)
        branch = self.mode.branch(length)
        padded = self.padding is not None and rows is not None
        rows = rows if padded else None
        if real is not None and rows is not None:
            given = self.mode.real_input(real, feed["tokens"].shape[1])
            feed = feed if given is None else {**feed, REAL: given}
        self.shapes.add((feed["tokens"].shape[1], length, branch) + ((rows,) if padded else ()))
        donate = self.mode.donated(length, rows)
        key = self.key("step", branch, rows)

        def make():
            options = jit_options(dict(ctx.jit_options))
            donated = (2,) if donate else ()
            step = self.function(branch, rows)
            return StoredJit(step, key, donate_argnums=donated, **options)

        fn = program(("step", key, donate, self.local()), make, self.held)
        embed_params = ctx.embed.params if ctx.embed is not None else {}
        # What varies between calls of one compiled function: the step's inputs, the cache's
        # rows (self and cross attention) and the batch.
        signature = (
            tuple((name, np.shape(v), np.dtype(v.dtype)) for name, v in feed.items()),
            tuple(np.shape(cache[e.input]) for e in _firsts(ctx.cache)),
            np.shape(lengths),
        )
        return fn(signature, ctx.model.params, embed_params, cache, feed, lengths, last)

    def key(self, kind: str, branch: bool, rows: int | None, *more: Any) -> tuple:
        """What a stored program of this context computes beyond its arguments' shapes."""
        ctx, padding = self.ctx, self.padding if rows is not None else None
        return (
            kind,
            (padding.model if padding is not None else ctx.model).fingerprint,
            ctx.embed.fingerprint if ctx.embed is not None else None,
            self.mode.name,
            type(self.mode).__name__,
            ctx.cache,
            branch,
            rows,
            padding.input if padding is not None else None,
            *more,
        )

    def local(self) -> tuple:
        """What a program of this engine closes over beyond :meth:`key` (kept in memory only):
        the placement, the image token and the jit options."""
        ctx = self.ctx
        return (placement_key(ctx.placement), ctx.image_token, jit_key(ctx.jit_options))

    def function(self, branch: bool, rows: int | None):
        """The pure step ``(params, embed_params, cache, feed, lengths, last) -> (logits, cache)``
        for the cache branch ``branch`` (and a padded grow cache of ``rows`` rows)."""
        return _step_function(self.ctx, self.mode, branch, self.padding, rows)


@functools.cache
def _firsts(layout: cache_modes.CacheLayout) -> tuple[cache_modes.CacheEntry, ...]:
    """The first self-attention and the first cross-attention entries (all others alike)."""
    firsts = {}
    for entry in layout.entries:
        firsts.setdefault(entry.cross, entry)
    return tuple(firsts.values())


def _step_function(
    ctx: Any,
    mode: cache_modes.Mode,
    branch: bool,
    padding: PaddedPast | None,
    rows: int | None,
):
    model, embed, layout = ctx.model, ctx.embed, ctx.cache
    if rows is None:
        padding = None
    if padding is not None:
        model = padding.model
    static = {name: np.array([branch], dtype=bool) for name in model.static_inputs}
    names = {i.name for i in model.inputs}
    placed = ctx.model.params  # concrete arrays: whether they span a mesh

    def step(params, embed_params, cache, feed, lengths, last):
        inputs = {k: v for k, v in feed.items() if k in names}
        tokens = feed["tokens"]  # [B, S]
        if "inputs_embeds" in names:
            ids_in, features_in = embed_inputs(embed)
            embed_out = embed.outputs[0].name
            given = {ids_in: tokens}
            if features_in is not None:  # a graph that merges image features itself
                given[features_in] = _merged_rows(embed, features_in, ctx.image_token, feed)
            embeds = embed.trace({}, embed_params, given)[embed_out]
            if "image_features" in feed:  # [B, S, H] replace the image tokens' embeddings
                swap = feed["image_mask"][..., None]
                embeds = jnp.where(swap, feed["image_features"].astype(embeds.dtype), embeds)
            inputs["inputs_embeds"] = embeds
        else:
            inputs["input_ids"] = tokens
        inputs.update(cache)
        if padding is not None:  # the rows before each row's valid ones
            have = jnp.int32(cache_modes.cache_length(cache, layout))
            inputs[padding.input] = have - (lengths if padding.per_row else lengths[0])
        with switch.off_over_mesh(placed):  # a mesh: no custom calls
            # the LM head of each row's last real token only: [B, 1, V] ([B, P, V]: last [B, P])
            outputs = model.trace_last(static, params, inputs, last, live=feed.get(LIVE))
        logits = outputs["logits"]
        logits = logits[:, 0] if jnp.ndim(last) == 1 else logits
        last_logits = logits.astype(jnp.float32)  # [B, V] ([B, P, V]: last [B, P])
        new = mode.write(layout, cache, outputs, lengths, rows, real=feed.get(REAL))
        if ctx.placement is not None:  # the next cache keeps the input's shardings (donation)
            new = ctx.placement.constrain_cache(new)
            last_logits = ctx.placement.readable(last_logits)  # the selection's input
        return last_logits, new

    return step


def embed_inputs(embed) -> tuple[str, str | None]:
    """The names of the token ids input of an embedding graph and of its image features input
    (None if it has none): an onnxruntime-genai embedding graph takes input_ids (integers) and
    image_features [tokens, hidden] (floats), and replaces the k-th image token's embedding by
    feature row k itself."""
    if len(embed.inputs) == 1:
        return embed.inputs[0].name, None
    ints = [i.name for i in embed.inputs if np.dtype(i.dtype).kind in "iu"]
    floats = [i.name for i in embed.inputs if np.dtype(i.dtype).kind == "f"]
    if len(embed.inputs) != 2 or len(ints) != 1 or len(floats) != 1:
        shown = [(i.name, i.dtype) for i in embed.inputs]
        raise ValueError(
            f"the embedding graph {embed.path!r} takes {shown}: not token ids alone, nor token "
            "ids and image features"
        )
    return ints[0], floats[0]


def _merged_rows(embed, name: str, image_token: int | None, feed) -> jnp.ndarray:
    """What an embedding graph that merges image features takes in ``name`` for this step's
    tokens: [B*S, H], row k the feature of the k-th image token of the step (row-major), the
    feed's image features where the step has them, zeros elsewhere (a generated image token)."""
    tokens = feed["tokens"]
    n = tokens.shape[0] * tokens.shape[1]
    width = next(i.shape for i in embed.inputs if i.name == name)[-1]
    if "image_features" in feed:
        width = feed["image_features"].shape[-1]
    if not isinstance(width, int):
        raise ValueError(f"the embedding graph {embed.path!r} gives {name} no fixed width")
    dtype = np.dtype(next(i.dtype for i in embed.inputs if i.name == name))
    rows = jnp.zeros((n, width), dtype)
    if image_token is None or "image_features" not in feed:
        return rows
    hits = (tokens == image_token).reshape(-1)
    order = jnp.where(hits, jnp.cumsum(hits) - 1, n)  # n: dropped
    given = jnp.where(feed["image_mask"].reshape(-1, 1), feed["image_features"].reshape(n, -1), 0)
    return rows.at[order].set(given.astype(dtype), mode="drop")
