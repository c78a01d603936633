"""A request's own inputs in the slots: its encoder's outputs, image features, M-RoPE positions.

An encoder-decoder's decoder takes inputs the caller gives (:attr:`~.context.Context.given`:
encoder_hidden_states and encoder_attention_mask, or a cross-attention cache an encoder made);
a vision-language model takes the features of the prompt's image tokens and, with M-RoPE, the
prompt's positions. A :class:`~.slots.Request` carries its own (``Request(inputs=...)``, one
row each, as generate()'s ``inputs``): :func:`of` checks them and pads the encoder's rows to a
bucket where the decoder takes an ``encoder_attention_mask`` (the mask hides the padding, and
attention over rows the mask hides adds exact zeros, so a request's tokens do not depend on
the width its slot holds). The slots hold every live request's given inputs in one array per
input, each row padded to the widest (:func:`fitted`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from ..onnx.dtypes import device_dtype
from .cache import CACHE_PREFIXES, SEQ, bucket
from .errors import GenerationError

if TYPE_CHECKING:
    from .engine import Engine

MASK = "encoder_attention_mask"  # the input that lets rows of the encoder's outputs be padding
FEATURES = "image_features"  # [image tokens of the prompt, H]
POSITIONS = "position_ids"  # [axes, prompt tokens]: M-RoPE positions of the prompt


@dataclasses.dataclass(frozen=True, eq=False)
class Inputs:
    """A request's inputs, checked.

    Attributes:
        given: the decoder's given inputs, batch 1, the encoder's rows padded to ``width``.
        width: the encoder's rows (0: the given inputs have none).
        features: [image tokens, H] the prompt's image features, or None.
        positions: [axes, prompt] the prompt's positions, or None (0, 1, 2, ...).
        delta: a new token's position minus its index in the row (M-RoPE).
    """

    given: dict[str, np.ndarray]
    width: int = 0
    features: np.ndarray | None = None
    positions: np.ndarray | None = None
    delta: int = 0


NONE = Inputs({})


def takes(engine: Engine) -> bool:
    """Whether requests to ``engine`` may carry inputs (given inputs, images, M-RoPE)."""
    return bool(engine.given) or engine.image_token is not None or axes(engine) == 3


def axes(engine: Engine) -> int:
    """The axes of the decoder's position_ids: 0 (none), 1, or 3 (M-RoPE)."""
    info = next((i for i in engine.model.inputs if i.name == "position_ids"), None)
    if info is None:
        return 0
    return 3 if info.shape is not None and len(info.shape) == 3 else 1


def encoder_axis(name: str) -> int:
    """The axis of a given input that runs over the encoder's rows: 2 in a cross-attention
    cache [B, heads, rows, head_size], else 1 ([B, rows, H], [B, rows])."""
    return SEQ if name.startswith(CACHE_PREFIXES) else 1


def width_of(rows: int) -> int:
    """The encoder rows a request's given inputs are padded to: a multiple of 16 up to 64, then
    of 64 (few programs; the mask hides the padding)."""
    return -(-rows // 16) * 16 if rows <= 64 else bucket(rows)


def of(engine: Engine, prompt: Sequence[int], inputs: Mapping[str, Any] | None) -> Inputs:
    """The checked inputs of a request to ``engine`` with ``prompt``; raises GenerationError
    naming a missing, unknown or misshapen one."""
    inputs = dict(inputs or {})
    given = tuple(engine.given)
    known = set(given) | ({FEATURES} if engine.image_token is not None else set())
    known |= {POSITIONS} if axes(engine) == 3 else set()
    unknown = sorted(set(inputs) - known)
    if unknown:
        takes_ = ", ".join(sorted(known)) or "none"
        raise GenerationError(f"the request's inputs {unknown} are not the engine's ({takes_})")
    missing = [n for n in given if n not in inputs]
    if missing:
        raise GenerationError(
            f"the request needs inputs {missing} (the encoder's outputs, one row), which the "
            "specification says are given"
        )
    infos = {i.name: i for i in engine.model.inputs}
    arrays, widths = {}, set()
    for name in given:
        a = _numeric(name, inputs[name])
        if a.ndim < 2 or a.shape[0] != 1:
            raise GenerationError(
                f"input {name!r} must be one row (a leading axis of 1), got shape {a.shape}"
            )
        _check_shape(name, a, infos[name].shape)
        arrays[name] = a.astype(device_dtype(np.dtype(infos[name].dtype)))
        widths.add(a.shape[encoder_axis(name)])
    if len(widths) > 1:
        raise GenerationError(f"the given inputs have encoder rows of different lengths {widths}")
    width = widths.pop() if widths else 0
    if MASK in arrays and width:
        arrays = padded(arrays, width_of(width))
        width = width_of(width)
    features = _features(engine, prompt, inputs.get(FEATURES))
    positions, delta = _positions(engine, prompt, inputs.get(POSITIONS))
    return Inputs(arrays, width, features, positions, delta)


def _numeric(name: str, value: Any) -> np.ndarray:
    a = np.asarray(value)
    if not (np.issubdtype(a.dtype, np.number) or a.dtype == bool):
        raise GenerationError(f"input {name!r} must be numbers, got an array of {a.dtype}")
    return a


def _check_shape(name: str, a: np.ndarray, declared: Any) -> None:
    """Raises GenerationError where ``a`` has another rank or fixed size than the decoder's
    input ``name`` declares (besides the batch and the encoder's rows)."""
    if declared is None:
        return
    axis = encoder_axis(name)
    wrong = len(declared) != a.ndim or any(
        isinstance(d, int) and i not in (0, axis) and d != a.shape[i]
        for i, d in enumerate(declared)
    )
    if wrong:
        shown = tuple(d if isinstance(d, int) else str(d) for d in declared)
        raise GenerationError(f"input {name!r} has shape {a.shape}; the decoder takes {shown}")


def _features(engine: Engine, prompt: Sequence[int], given: Any) -> np.ndarray | None:
    if given is None:
        return None
    features = _numeric(FEATURES, given)
    count = list(prompt).count(engine.image_token)
    if features.ndim != 2 or features.shape[0] != count:
        raise GenerationError(
            f"image_features must be [image tokens, H] for the prompt's {count} image tokens, "
            f"got shape {features.shape}"
        )
    return features


def _positions(engine: Engine, prompt: Sequence[int], given: Any) -> tuple[np.ndarray | None, int]:
    if given is None:
        return None, 0
    positions = _numeric(POSITIONS, given)
    n = axes(engine)
    if positions.ndim == 3 and positions.shape[1] == 1:  # [axes, 1, prompt]: one row
        positions = positions[:, 0]
    if positions.shape != (n, len(prompt)) or not np.issubdtype(positions.dtype, np.integer):
        raise GenerationError(
            f"position_ids must be integers of shape ({n}, {len(prompt)}) (axes, prompt "
            f"tokens), got {positions.dtype} {positions.shape}"
        )
    positions = positions.astype(np.int64)
    return positions, int(positions.max()) + 1 - len(prompt)


def padded(arrays: Mapping[str, Any], width: int) -> dict[str, Any]:
    """``arrays`` (given inputs) with ``width`` encoder rows: their rows, then zeros."""
    out = {}
    for name, a in arrays.items():
        axis = encoder_axis(name)
        have = a.shape[axis]
        if have == width:
            out[name] = a
            continue
        pad = [(0, 0)] * a.ndim
        pad[axis] = (0, width - have)
        out[name] = (np if isinstance(a, np.ndarray) else jnp).pad(a, pad)
    return out


def joined(engine: Engine, each: Sequence[Inputs]) -> tuple[dict[str, np.ndarray], int]:
    """The given inputs of several requests as one batch, padded to the widest, and its width;
    raises GenerationError for widths that differ where the decoder takes no mask."""
    if not engine.given:
        return {}, 0
    width = max(i.width for i in each)
    if any(i.width != width for i in each) and MASK not in engine.given:
        raise GenerationError(
            f"the requests' encoder outputs have {sorted({i.width for i in each})} rows, and "
            f"{engine.spec.model.path!r} takes no {MASK} to pad them: prefill them apart"
        )
    rows = [padded(i.given, width) for i in each]
    return {n: np.concatenate([r[n] for r in rows]) for n in engine.given}, width


def width(given: Mapping[str, Any]) -> int:
    """The encoder rows of given inputs (0: none)."""
    return next((a.shape[encoder_axis(n)] for n, a in given.items()), 0)


def fitted(
    engine: Engine,
    slots_given: dict[str, jax.Array],
    slots_cache: dict[str, jax.Array],
    one_given: dict[str, jax.Array],
    one_cache: dict[str, jax.Array],
    batch: int,
) -> tuple[dict, dict, dict, dict]:
    """The slots' given inputs and cache, and a prefix's (batch 1), at one encoder width: the
    wider of the two (the slots start with copies of the prefix's row). Raises GenerationError
    where the widths differ and the decoder takes no mask (before anything changes)."""
    have, new = width(slots_given), width(one_given)
    if slots_given and have != new and MASK not in engine.given:
        raise GenerationError(
            f"the slots hold encoder outputs of {have} rows and the request's have {new}, and "
            f"{engine.spec.model.path!r} takes no {MASK} to pad them: use another engine"
        )
    for name, a in one_given.items():
        if slots_given and _other_axes(name, a) != _other_axes(name, slots_given[name]):
            raise GenerationError(
                f"the request's {name!r} has shape {tuple(a.shape)}, the slots' "
                f"{tuple(slots_given[name].shape)}"
            )
    if not slots_given:
        slots_given = {n: jnp.repeat(jnp.asarray(a), batch, axis=0) for n, a in one_given.items()}
    target = max(have, new)
    cross = {e.input for e in engine.cache.entries if e.cross}
    slots_cache = _cross_rows(slots_cache, cross, target)
    one_cache = _cross_rows(one_cache, cross, target)
    return padded(slots_given, target), slots_cache, padded(one_given, target), one_cache


def _other_axes(name: str, a: Any) -> tuple[int, ...]:
    shape = list(np.shape(a))[1:]
    del shape[encoder_axis(name) - 1]
    return tuple(shape)


def _cross_rows(cache: dict[str, jax.Array], cross: set[str], rows: int) -> dict:
    """``cache`` whose cross-attention arrays hold ``rows`` rows (theirs first, zeros after)."""
    if not any(n in cross and a.shape[SEQ] != rows for n, a in cache.items()):
        return cache
    return {n: _with_rows(a, rows) if n in cross else a for n, a in cache.items()}


@functools.partial(jax.jit, static_argnums=(1,))
def _with_rows(a: jax.Array, rows: int) -> jax.Array:
    have = a.shape[SEQ]
    if have > rows:
        return jax.lax.slice_in_dim(a, 0, rows, axis=SEQ)
    pad = [(0, 0)] * a.ndim
    pad[SEQ] = (0, rows - have)
    return jnp.pad(a, pad)


def step_images(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    each: Sequence[Inputs],
    fed: Sequence[int],
    real: Sequence[int],
    size: int,
) -> dict[str, np.ndarray]:
    """The feed's image_mask [n, size] and image_features [n, size, H] of a prompt step that
    feeds ``real[i]`` tokens of prompt i from ``fed[i]`` ({} where no row feeds an image)."""
    token = engine.image_token
    rows = [(i, inp) for i, inp in enumerate(each) if inp.features is not None]
    if token is None or not rows:
        return {}
    width = rows[0][1].features.shape[1]
    mask = np.zeros((len(prompts), size), bool)
    features = np.zeros((len(prompts), size, width), rows[0][1].features.dtype)
    for i, inp in rows:
        part = np.asarray(prompts[i][fed[i] : fed[i] + real[i]])
        hits = np.flatnonzero(part == token)
        used = list(prompts[i][: fed[i]]).count(token)
        mask[i, hits] = True
        features[i, hits] = inp.features[used : used + len(hits)]
    if not mask.any():
        return {}
    return {"image_mask": mask, "image_features": features}


def step_positions(
    engine: Engine, each: Sequence[Inputs], fed: Sequence[int], size: int
) -> np.ndarray | None:
    """The feed's position_ids of a prompt step of ``size`` tokens from ``fed[i]`` of each
    prompt ([n, size], or [3, n, size] with M-RoPE; None without position_ids): a prompt's
    given positions where it has them, else 0, 1, 2, ... (padding continues them)."""
    n = axes(engine)
    if not n:
        return None
    at = np.arange(size)[None, :] + np.asarray(fed, np.int64)[:, None]
    if n == 1:
        return at.astype(np.int32)
    out = np.broadcast_to(at, (3, len(each), size)).copy()
    for i, inp in enumerate(each):
        if inp.positions is not None:
            part = inp.positions[:, fed[i] : fed[i] + size]
            out[:, i, : part.shape[1]] = part
    return out.astype(np.int32)
