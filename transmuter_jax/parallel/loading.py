"""``transmuter_jax.load``: an ONNX model on the default device, or straight onto a mesh's shards.

This composes the two floors below it: the tracer (:mod:`transmuter_jax.onnx`, which knows
nothing of meshes) and the sharding rules (:mod:`.sharding`)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from ..onnx.model import Model, graph_errors
from ..onnx.model import load as load_onnx
from ..runtime import compile_cache
from . import sharding


def load(
    onnx_file: str | os.PathLike,
    *,
    outputs: Sequence[str] | None = None,
    mesh: jax.sharding.Mesh | None = None,
    shard_overrides: Mapping[str, Any] | None = None,
    shard_small: int | None = None,
) -> Model:
    """Loads an ONNX model as a :class:`~transmuter_jax.onnx.Model`.

    Args:
        onnx_file: path of the ``.onnx`` file; external data must lie in its folder.
        outputs: names of the graph outputs to compute; the graph is pruned to what they need.
        mesh: a mesh with axes "model" and/or "data": the weights go from the file straight to
            their shards by the sharding rules (:mod:`transmuter_jax.parallel.sharding`), so
            that no device ever holds a whole split weight; the CPU kernels' packing is skipped.
            ``generation.compile(..., mesh=)`` keeps this placement.
        shard_overrides: with ``mesh``, partition specs by initializer name that win over the
            rules (None: replicated), as ``generation.compile`` takes them.
        shard_small: with ``mesh``, embeddings and LM heads of fewer elements stay replicated
            (default 65536).

    Returns:
        The model, whose weights are on the default JAX device, or on ``mesh``.
    """
    if mesh is None:
        return load_onnx(onnx_file, outputs=outputs)
    compile_cache.configure()
    path = os.fspath(onnx_file)
    with graph_errors(path, "load"):  # the rules read the graph's structure
        small = sharding.SMALL if shard_small is None else shard_small
        host = Model(path, outputs=outputs, host=True)
        return sharding.place_model(host, mesh, small=small, overrides=shard_overrides)
