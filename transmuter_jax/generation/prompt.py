"""prompt_inputs(): the inputs of one step over padded text with an empty cache."""

from __future__ import annotations

import numpy as np

from ..onnx.model import Model
from .cache import detect, layout


def prompt_inputs(
    model: Model, batch_size: int, length: int, config: dict | None = None
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The inputs of a decoder other than input_ids for one step with an empty cache.

    Args:
        model: the decoder.
        batch_size: rows.
        length: tokens of each row (padding included).
        config: config.json, for the cache dimensions a graph does not declare.

    Returns:
        (inputs, static inputs): cache length 0 (or an empty buffer of ``length`` rows for a
        GroupQueryAttention cache), use_cache_branch 0, positions from 0 in each row, an attention
        mask that counts every token. A model without a cache gives two empty dicts.
    """
    entries = layout(model, config or {}).entries
    if not entries:
        return {}, {}
    names = {i.name: i for i in model.inputs}
    rows = detect(model).prompt_rows(length)
    inputs: dict[str, np.ndarray] = {}
    for entry in entries:
        shape = (batch_size, entry.heads, 0 if entry.cross else rows, entry.head_size)
        inputs[entry.input] = np.zeros(shape, entry.dtype)
    if "attention_mask" in names:
        inputs["attention_mask"] = np.ones((batch_size, length), np.int64)
    if "position_ids" in names:
        positions = np.broadcast_to(np.arange(length), (batch_size, length))
        shape = names["position_ids"].shape
        if shape is not None and len(shape) == 3:
            positions = np.broadcast_to(positions, (3, batch_size, length))
        inputs["position_ids"] = np.ascontiguousarray(positions, dtype=np.int64)
    static = {}
    if "use_cache_branch" in names:
        static["use_cache_branch"] = np.array([False])
    return inputs, static
