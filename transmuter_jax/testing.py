"""Example inputs for ONNX decoders and encoders, and comparison with onnxruntime.

These helpers make it a few lines to check a model against onnxruntime::

    import transmuter_jax as tj
    from transmuter_jax.testing import example_inputs, compare_with_onnxruntime

    model = tj.load("model.onnx")
    inputs = example_inputs(model, batch=2, length=5, past=0)
    print(compare_with_onnxruntime(model, inputs))  # max abs difference per output

onnxruntime is only needed for :func:`compare_with_onnxruntime`.
"""

from __future__ import annotations

import json
import os
from collections import ChainMap
from collections.abc import Mapping, Sequence

import numpy as np

from .generation.cache import config_dims
from .onnx.model import Model, ValueInfo


def _fixed(info: ValueInfo, axis: int, default: int) -> int:
    dim = info.shape[axis] if info.shape is not None and axis < len(info.shape) else None
    return dim if isinstance(dim, int) else default


def _head_size(model: Model) -> int | None:
    """The attention head size from the configs beside the model, if any."""
    folder = os.path.dirname(os.path.abspath(model.path))
    for _ in range(2):
        genai = os.path.join(folder, "genai_config.json")
        if os.path.exists(genai):
            with open(genai) as file:
                size = json.load(file).get("model", {}).get("decoder", {}).get("head_size")
            if size:
                return int(size)
        config = os.path.join(folder, "config.json")
        if os.path.exists(config):
            with open(config) as file:
                size = config_dims(json.load(file))[1]
            if size:
                return int(size)
        folder = os.path.dirname(folder)
    return None


def _rows(value: int | Sequence[int], batch: int) -> np.ndarray:
    rows = np.broadcast_to(np.asarray(value, np.int64), (batch,))
    return rows.copy()


def _pixel_shape(model: Model, batch: int) -> list[int]:
    """The shape of ``pixel_values``: [batch, (images,) channels, height, width], the fixed
    dimensions of the signature, else 2 images, 3 channels and 32 x 32 pixels."""
    info = next((i for i in model.inputs if i.name == "pixel_values"), None)
    rank = len(info.shape) if info is not None and info.shape is not None else 4
    defaults = {rank - 3: 3, rank - 2: 32, rank - 1: 32, 1: 2} if rank == 5 else {1: 3}
    return [batch] + [_fixed(info, a, defaults.get(a, 32)) for a in range(1, rank)]


def _pixel_mask(pixels: Sequence[int]) -> np.ndarray:
    """A ``pixel_attention_mask`` [batch, (images,) height, width] for pixel values of shape
    ``pixels``: the first image of a row is whole, the others are padded images whose real
    pixels are the top-left half of each edge (as a batch of images of different sizes)."""
    *lead, _, height, width = pixels
    mask = np.zeros((*lead, height, width), bool)
    mask[..., : max(1, height // 2), : max(1, width // 2)] = True
    if len(lead) == 2:
        mask[:, 0] = True
    else:
        mask[0] = True
    return mask


def example_inputs(
    model: Model,
    *,
    batch: int = 1,
    length: int = 1,
    past: int | Sequence[int] = 0,
    buffer: int | None = None,
    encoder_length: int = 16,
    vocab: int = 64,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Inputs for one step of a decoder (or one run of an encoder), made from its signature.

    Args:
        model: the loaded model.
        batch: rows.
        length: new tokens per row.
        past: valid cached tokens, one for all rows or one per row.
        buffer: length of the past key/value buffers when they are longer than the valid rows
            (a GroupQueryAttention cache); the attention mask then spans the buffer, with ones for
            the valid rows and the new tokens of each row.
        encoder_length: length of encoder outputs (cross attention) or of encoder inputs.
        vocab: token ids are drawn below this.
        seed: seed of the random values.

    Returns:
        One numpy array per input of ``model``.
    """
    rng = np.random.default_rng(seed)
    past_rows = _rows(past, batch)
    cache = int(past_rows.max()) if buffer is None else buffer
    if buffer is not None and int(past_rows.max()) + length > buffer:
        raise ValueError(f"past {past} + length {length} does not fit in buffer {buffer}")
    total = cache + length if buffer is None else buffer
    valid = past_rows + length
    inputs: dict[str, np.ndarray] = {}
    for info in model.inputs:
        name, dtype = info.name, np.dtype(info.dtype)
        if name in ("input_ids", "decoder_input_ids"):
            inputs[name] = rng.integers(0, vocab, (batch, length)).astype(dtype)
        elif name == "inputs_embeds":
            hidden = _fixed(info, 2, 64)
            inputs[name] = rng.standard_normal((batch, length, hidden)).astype(dtype)
        elif name in ("attention_mask", "decoder_attention_mask"):
            columns = np.arange(total)
            if buffer is None:
                # Right-aligned: each row's valid past ends where the new tokens start.
                mask = columns[None, :] >= (cache - past_rows)[:, None]
            else:
                mask = columns[None, :] < valid[:, None]
            inputs[name] = mask.astype(dtype)
        elif name == "position_ids":
            start = past_rows if buffer is not None else np.full(batch, cache)
            positions = start[:, None] + np.arange(length)[None, :]
            if info.shape is not None and len(info.shape) == 3:
                positions = np.broadcast_to(positions, (3, batch, length))
            inputs[name] = positions.astype(dtype)
        elif name == "cache_position":
            inputs[name] = (cache + np.arange(length)).astype(dtype)
        elif name == "use_cache_branch":
            inputs[name] = np.array([cache > 0], dtype)
        elif name.startswith("past_key_values") or name.startswith("past_key"):
            heads, head_dim = _fixed(info, 1, 4), _fixed(info, 3, _head_size(model) or 16)
            rows = encoder_length if ".encoder." in name else cache
            if ".encoder." in name and cache == 0:
                rows = 0
            values = rng.standard_normal((batch, heads, rows, head_dim))
            if buffer is not None:  # rows after each row's valid past are free: zeros
                free = np.arange(rows)[None, :] >= past_rows[:, None]
                values[free[:, None, :, None].repeat(heads, 1).repeat(head_dim, 3)] = 0
            inputs[name] = values.astype(dtype)
        elif name == "encoder_hidden_states":
            hidden = _fixed(info, 2, 64)
            inputs[name] = rng.standard_normal((batch, encoder_length, hidden)).astype(dtype)
        elif name == "encoder_attention_mask":
            inputs[name] = np.ones((batch, encoder_length), dtype)
        elif name == "input_features":
            mels = _fixed(info, 1, 80)
            frames = _fixed(info, 2, encoder_length)
            inputs[name] = rng.standard_normal((batch, mels, frames)).astype(dtype)
        elif name == "pixel_values":
            inputs[name] = rng.standard_normal(_pixel_shape(model, batch)).astype(dtype)
        elif name == "pixel_attention_mask":
            inputs[name] = _pixel_mask(_pixel_shape(model, batch)).astype(dtype)
        else:
            raise ValueError(f"no example value for input {name!r} {info.dtype} {info.shape}")
    return inputs


ORT_HINT = "pip install 'transmuter_jax[ort]'"


def _onnxruntime():
    """onnxruntime, or a ModuleNotFoundError that says how to install it."""
    try:
        import onnxruntime
    except ModuleNotFoundError as error:
        if error.name != "onnxruntime":
            raise
        raise ModuleNotFoundError(
            f"comparing with onnxruntime needs onnxruntime, which is not installed: {ORT_HINT} "
            "(in a checkout: pip install -e '.[ort]')",
            name="onnxruntime",
        ) from None
    return onnxruntime


def compare_with_onnxruntime(
    model: Model,
    inputs: Mapping[str, np.ndarray],
    *,
    session_path: str | None = None,
) -> dict[str, float]:
    """Runs ``model`` and onnxruntime on ``inputs``; returns the max abs difference per output.

    Args:
        model: the loaded model.
        inputs: one array per input.
        session_path: the ONNX file onnxruntime runs; ``model.path`` by default.

    Raises:
        ModuleNotFoundError: onnxruntime is not installed (the message says how to install it).
    """
    ort = _onnxruntime()

    options = ort.SessionOptions()
    session = ort.InferenceSession(
        session_path or model.path, options, providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in model.outputs]
    want = dict(zip(names, session.run(names, dict(inputs)), strict=True))
    got = model(inputs)
    diffs = {}
    for name in names:
        a, b = np.asarray(got[name], np.float64), np.asarray(want[name], np.float64)
        if a.shape != b.shape:
            raise AssertionError(f"output {name!r}: shape {a.shape} vs onnxruntime {b.shape}")
        diffs[name] = float(np.abs(a - b).max()) if a.size else 0.0
    return diffs


def first_divergence(
    model: Model, inputs: Mapping[str, np.ndarray], *, atol: float = 1e-4
) -> tuple[str, str, float] | None:
    """The first node of the graph whose output differs from onnxruntime's by more than ``atol``.

    Runs the graph node by node without compiling it, and onnxruntime with every node output of
    the main graph exposed. Values that onnxruntime leaves unspecified (the free rows of a
    GroupQueryAttention buffer) can differ without a bug: read the result with that in mind.

    Returns:
        (node label, output name, max abs difference), or None when every output agrees.
    """
    import jax.numpy as jnp
    import onnx
    from onnx import helper

    from .onnx.dtypes import to_device_dtype

    ort = _onnxruntime()
    from .onnx.trace import node_label, run_nodes

    proto = onnx.load(model.path)
    exposed = {o.name for o in proto.graph.output}
    for node in proto.graph.node:
        for name in node.output:
            if name and name not in exposed:
                proto.graph.output.append(helper.make_empty_tensor_value_info(name))
                exposed.add(name)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    want = dict(zip(names, session.run(names, dict(inputs)), strict=True))

    values = {i.name: to_device_dtype(np.asarray(inputs[i.name])) for i in model.inputs}
    values = {k: v if k in model.static_inputs else jnp.asarray(v) for k, v in values.items()}
    scope = ChainMap({**model.graph.constants, **model.params, **values})
    run_nodes(model.graph, scope)
    for node in model.graph.proto.node:
        for name in node.output:
            if not name or name not in want:
                continue
            expected = np.asarray(want[name])
            actual = np.asarray(scope[name])
            if expected.dtype.kind not in "fcbiu" or actual.shape != expected.shape:
                if actual.shape != expected.shape:
                    return node_label(node), name, float("inf")
                continue
            if expected.size == 0:
                continue
            a, b = actual.astype(np.float64), expected.astype(np.float64)
            bad = ~np.isclose(a, b, rtol=0, atol=atol, equal_nan=True)
            if bad.any():
                with np.errstate(invalid="ignore"):
                    return node_label(node), name, float(np.abs(a - b)[bad].max())
    return None
