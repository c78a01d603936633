"""The jitted decoder step: tokens and cache in, last-token logits and the next cache out.

One step runs the decoder over ``S`` tokens of every row (a power of two while prompts are fed,
1 after), gathers the logits of each row's last real token, and updates the cache, all in one
XLA program. The cache buffers are donated, so XLA updates them in place.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import cache as cache_modes
from .context import Context


def chunk(remaining: int) -> int:
    """The largest power of two at most ``remaining`` (45 tokens run as 32, 8, 4, 1)."""
    return 1 << (max(remaining, 1).bit_length() - 1)


@dataclasses.dataclass
class Steps:
    """The compiled steps of a context, one per (step length, cache length, branch)."""

    ctx: Context
    functions: dict[tuple, Any] = dataclasses.field(default_factory=dict)
    shapes: set[tuple] = dataclasses.field(default_factory=set)

    def __call__(self, cache, feed, lengths, last):
        """Runs one step.

        Args:
            cache: the cache arrays by input name (donated).
            feed: "tokens" [B, S] int32, attention_mask, position_ids, the given inputs, and for
                image features "image_features" [B, S, H] with "image_mask" [B, S].
            lengths: [B] int32 valid cached tokens of each row before the step.
            last: [B] int32 index in the step of each row's last real token.

        Returns:
            (logits [B, V] float32 of each row's last real token, the next cache)
        """
        ctx = self.ctx
        length = cache_modes.cache_length(cache, ctx.cache)
        branch = cache_modes.branch(ctx.mode, length)
        tokens = feed["tokens"]
        self.shapes.add((tokens.shape[1], length, branch))
        fn = self.functions.get(branch)
        if fn is None:
            donate = (2,) if cache_modes.donated(ctx.mode) else ()
            fn = jax.jit(_step_function(ctx, branch), donate_argnums=donate, **ctx.jit_options)
            self.functions[branch] = fn
        embed_params = ctx.embed.params if ctx.embed is not None else {}
        return fn(ctx.model.params, embed_params, cache, feed, lengths, last)


def _step_function(ctx: Context, branch: bool):
    model, embed, mode, layout = ctx.model, ctx.embed, ctx.mode, ctx.cache
    static = {name: np.array([branch], dtype=bool) for name in model.static_inputs}
    names = {i.name for i in model.inputs}

    def step(params, embed_params, cache, feed, lengths, last):
        inputs = {k: v for k, v in feed.items() if k in names}
        tokens = feed["tokens"]  # [B, S]
        if "inputs_embeds" in names:
            embed_in = embed.inputs[0].name
            embed_out = embed.outputs[0].name
            embeds = embed._function({}, embed_params, {embed_in: tokens})[embed_out]
            if "image_features" in feed:  # [B, S, H] replace the image tokens' embeddings
                swap = feed["image_mask"][..., None]
                embeds = jnp.where(swap, feed["image_features"].astype(embeds.dtype), embeds)
            inputs["inputs_embeds"] = embeds
        else:
            inputs["input_ids"] = tokens
        inputs.update(cache)
        outputs = model._function(static, params, inputs)
        logits = outputs["logits"]  # [B, S, V]
        rows = jnp.arange(logits.shape[0])
        last_logits = logits[rows, last].astype(jnp.float32)  # [B, V]
        return last_logits, cache_modes.advance(mode, layout, cache, outputs, lengths)

    return step
