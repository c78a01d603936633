"""load(): an ONNX file as a Model that runs the whole graph as one jitted JAX function."""

from __future__ import annotations

import copy
import hashlib
import os
import time
from collections import ChainMap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import onnx.inliner
from google.protobuf.message import DecodeError
from onnx import GraphProto, TensorProto, numpy_helper

from .. import kernels
from ..kernels.build import ENV as KERNELS_ENV
from . import (
    inline,
    ops,  # noqa: F401  (registers the op implementations)
    prepack,
)
from .compiler import jit_options
from .dtypes import device_dtype, fits_device, np_dtype, to_device_dtype
from .errors import InputError, ModelFileError
from .ops.quant import INT8_ENV
from .trace import Graph, check_supported, prune, run_nodes, static_dependencies

# Initializers at most this large (elements) stay numpy constants when integer or bool, so shape
# arithmetic on them folds at trace time; larger ones, and floats above STATIC_FLOAT, are weights.
STATIC_INT = 4096
STATIC_FLOAT = 16
# A graph input can be part of the compile key (like use_cache_branch) when it is this small.
STATIC_INPUT = 8
# Files at least this large have their inline initializers read in place, not parsed.
INLINE_FILE_BYTES = 16 << 20
# Environment switches read while tracing (they change the traced program): their values are
# part of the in-memory compile key, so a program traced under one setting is never reused
# under another.
TRACE_ENVIRONMENT = (KERNELS_ENV, kernels.PORTABLE_ENV, INT8_ENV)


def trace_environment() -> tuple[tuple[str, str | None], ...]:
    """The values of the :data:`TRACE_ENVIRONMENT` switches now."""
    return tuple((name, os.environ.get(name)) for name in TRACE_ENVIRONMENT)


class ValueInfo(NamedTuple):
    """A graph input or output: name, dtype (numpy name) and shape (ints, names or None)."""

    name: str
    dtype: str
    shape: tuple[int | str | None, ...] | None


@dataclass
class CompileStat:
    """The time spent on one compiled shape."""

    key: tuple
    trace_s: float
    compile_s: float


def _value_info(info: onnx.ValueInfoProto) -> ValueInfo:
    tensor = info.type.tensor_type
    dtype = np_dtype(tensor.elem_type).name if tensor.elem_type else "unknown"
    shape = None
    if tensor.HasField("shape"):
        shape = tuple(
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in tensor.shape.dim
        )
    return ValueInfo(info.name, dtype, shape)


def _read_onnx(path: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The model, and its large inline initializers read in place (by name; see :mod:`.inline`)."""
    if not os.path.isfile(path):
        raise ModelFileError(f"no ONNX file at {path!r}")
    if os.path.getsize(path) >= INLINE_FILE_BYTES:
        try:
            found = inline.read(path)
        except (DecodeError, OSError):
            found = None
        if found is not None:
            return found.proto, found.arrays
    try:
        return onnx.load(path, load_external_data=False), {}
    except (DecodeError, ValueError, RuntimeError, OSError) as error:
        raise ModelFileError(f"{path!r} is not a readable ONNX model: {error}") from error


def _external_array(tensor: TensorProto, folder: str, path: str) -> np.ndarray:
    info = {e.key: e.value for e in tensor.external_data}
    location = info.get("location", "")
    # The named path must stay in the folder; a link there may point elsewhere (the hub cache
    # links snapshot files to its blobs).
    root = os.path.abspath(folder)
    file = os.path.normpath(os.path.join(root, location))
    if not location or os.path.isabs(location) or os.path.commonpath([root, file]) != root:
        raise ModelFileError(
            f"tensor {tensor.name!r} of {path!r} points to external data {location!r} "
            "outside the model's folder; refusing to read it"
        )
    if not os.path.isfile(file):
        raise ModelFileError(f"external data {location!r} of tensor {tensor.name!r} is missing")
    dtype = np_dtype(tensor.data_type)
    shape = tuple(tensor.dims)
    count = int(np.prod(shape, dtype=np.int64))
    offset = int(info.get("offset", 0))
    length = int(info.get("length", count * dtype.itemsize))
    if length != count * dtype.itemsize or offset + length > os.path.getsize(file):
        raise ModelFileError(
            f"external data {location!r} of tensor {tensor.name!r} is truncated or corrupt "
            f"(needs bytes {offset}..{offset + length}, file has {os.path.getsize(file)})"
        )
    if count == 0:
        return np.zeros(shape, dtype)
    return np.memmap(file, dtype=dtype, mode="r", offset=offset, shape=shape)


def _tensor_array(tensor: TensorProto, folder: str, path: str) -> np.ndarray:
    if tensor.data_location == TensorProto.EXTERNAL:
        return _external_array(tensor, folder, path)
    try:
        return numpy_helper.to_array(tensor)
    except Exception as error:  # noqa: BLE001 - any decoding failure is a corrupt file
        raise ModelFileError(f"tensor {tensor.name!r} of {path!r} is corrupt: {error}") from error


def _is_weight(array: np.ndarray) -> bool:
    limit = STATIC_INT if array.dtype.kind in "biu" else STATIC_FLOAT
    return array.size > limit and fits_device(array)


def load(onnx_file: str | os.PathLike, *, outputs: Sequence[str] | None = None) -> Model:
    """Loads an ONNX model as a :class:`Model`.

    Args:
        onnx_file: path of the ``.onnx`` file; external data must lie in its folder.
        outputs: names of the graph outputs to compute; the graph is pruned to what they need.

    Returns:
        The model, whose weights are on the default JAX device.
    """
    return Model(os.fspath(onnx_file), outputs=outputs)


class Model:
    """An ONNX graph run as one jitted JAX function, compiled once per input signature.

    Attributes:
        inputs: the graph inputs the caller gives.
        outputs: the graph outputs computed.
        static_inputs: inputs whose values select the program (such as ``use_cache_branch``):
            each distinct value compiles once.
        params: the weights, a dict of JAX arrays passed to the compiled function.
        compile_stats: trace and compile time of each compiled signature.
    """

    def __init__(self, path: str, *, outputs: Sequence[str] | None = None):
        self.path = path
        proto, in_place = _read_onnx(path)
        if proto.functions:
            proto = onnx.inliner.inline_local_functions(proto)
        folder = os.path.dirname(os.path.abspath(path))
        opsets = {}
        for entry in proto.opset_import:
            domain = "" if entry.domain in ("", "ai.onnx") else entry.domain
            opsets[domain] = entry.version
        graph = proto.graph
        available = [o.name for o in graph.output]
        if outputs is not None:
            unknown = [o for o in outputs if o not in available]
            if unknown:
                raise ValueError(f"{path!r} has no outputs {unknown}; it has {available}")
            kept = [o for o in graph.output if o.name in set(outputs)]
            del graph.output[:]
            graph.output.extend(kept)
            nodes = prune(graph, [o.name for o in kept])
            del graph.node[:]
            graph.node.extend(nodes)

        constants: dict[str, np.ndarray] = {}
        params: dict[str, jax.Array] = {}
        # On CPU with the kernels, matrix-product weights are packed once, in place of the original.
        packings = prepack.plan(graph) if kernels.enabled() else {}
        for tensor in graph.initializer:
            array = in_place.pop(tensor.name, None)
            if array is None:
                array = _tensor_array(tensor, folder, path)
            if tensor.name in packings:
                # device_put may keep the packed array without copying it (CPU, aligned).
                params[tensor.name] = jax.device_put(packings[tensor.name].pack(array))
            elif _is_weight(array):
                params[tensor.name] = jnp.asarray(to_device_dtype(np.asarray(array)))
            else:
                constants[tensor.name] = np.array(array)
        # Weights now live on the device: drop them from the graph.
        del graph.initializer[:]
        prepack.rewrite(graph, packings)

        initialized = set(constants) | set(params)
        self.inputs = [_value_info(i) for i in graph.input if i.name not in initialized]
        self.outputs = [_value_info(o) for o in graph.output]
        self.params = params
        self._graph = Graph(graph, opsets, path, constants)
        check_supported(self._graph)
        small = {
            i.name
            for i in self.inputs
            if i.shape is not None
            and all(isinstance(d, int) for d in i.shape)
            and int(np.prod(i.shape)) <= STATIC_INPUT
        }
        static = static_dependencies(self._graph) & small
        self.static_inputs = tuple(i.name for i in self.inputs if i.name in static)
        self._by_name = {i.name: i for i in self.inputs}
        self._compiled: dict[tuple, Any] = {}
        self.compile_stats: list[CompileStat] = []

    def __repr__(self) -> str:
        return f"Model({self.path!r}, inputs={len(self.inputs)}, outputs={len(self.outputs)})"

    @property
    def graph(self) -> Graph:
        """The graph this model traces (without its weights, which are :attr:`params`)."""
        return self._graph

    def with_graph(self, proto: GraphProto, *, inputs: Sequence[ValueInfo] | None = None) -> Model:
        """A model that runs ``proto`` in place of this graph, sharing this model's weights.

        Args:
            proto: the new main graph; it keeps this graph's opsets, file and constants.
            inputs: the graph inputs the caller gives (default: this model's).

        Returns:
            A new Model with its own, empty, compile cache and stats.
        """
        new = copy.copy(self)
        new.__dict__.pop("_fingerprint", None)
        graph = self._graph
        new._graph = Graph(proto, graph.opsets, graph.file, graph.constants)
        if inputs is not None:
            new.inputs = list(inputs)
        new._by_name = {i.name: i for i in new.inputs}
        new._compiled = {}
        new.compile_stats = []
        return new

    @property
    def opsets(self) -> Mapping[str, int]:
        return dict(self._graph.opsets)

    @property
    def op_types(self) -> set[tuple[str, str]]:
        """The (domain, op type) pairs of the nodes of the graph, outside subgraphs."""
        return {(n.domain or "", n.op_type) for n in self._graph.proto.node}

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, jax.Array]:
        """Runs the graph.

        Args:
            inputs: one array per graph input, by name.

        Returns:
            The outputs by name, as JAX arrays.
        """
        dynamic, static = self._prepare(inputs)
        return self.compiled(dynamic, static)(self.params, dynamic)

    def compiled(self, dynamic: Mapping[str, Any], static: Mapping[str, np.ndarray]):
        """The compiled function ``(params, dynamic) -> outputs`` for this input signature."""
        key = tuple((n, tuple(v.shape), str(v.dtype)) for n, v in sorted(dynamic.items()))
        key += tuple((n, v.tobytes()) for n, v in sorted(static.items()))
        key += trace_environment()
        fn = self._compiled.get(key)
        if fn is None:
            start = time.perf_counter()
            function = partial(self.trace, dict(static))
            lowered = jax.jit(function, **jit_options()).lower(self.params, dynamic)
            traced = time.perf_counter()
            fn = lowered.compile()
            self.compile_stats.append(
                CompileStat(key, traced - start, time.perf_counter() - traced)
            )
            self._compiled[key] = fn
        return fn

    @property
    def fingerprint(self) -> str:
        """A digest of what the graph computes: its nodes, constants, opsets, inputs and the
        shapes and dtypes of its weights (not their values, which the programs take as arguments).
        """
        known = self.__dict__.get("_fingerprint")
        if known is not None:
            return known
        digest = hashlib.sha256()
        digest.update(self._graph.proto.SerializeToString(deterministic=True))
        for name, value in sorted(self._graph.constants.items()):
            value = np.asarray(value)
            digest.update(f"{name}{value.dtype}{value.shape}".encode() + value.tobytes())
        for name, value in sorted(self.params.items()):
            digest.update(f"{name}{value.dtype}{value.shape}".encode())
        extra = (sorted(self._graph.opsets.items()), self.inputs, self.outputs, self.static_inputs)
        digest.update(repr(extra).encode())
        self._fingerprint = digest.hexdigest()
        return self._fingerprint

    @property
    def compiled_count(self) -> int:
        """How many input signatures have been compiled."""
        return len(self._compiled)

    def trace(
        self, static: Mapping[str, np.ndarray], params: Mapping[str, jax.Array], inputs
    ) -> dict[str, jax.Array]:
        """The graph as a function, to call inside a JAX transformation (jit, vmap, scan).

        Args:
            static: the values of the :attr:`static_inputs`, numpy arrays.
            params: the weights, as :attr:`params` or arrays of the same shapes and dtypes.
            inputs: the other graph inputs by name, in their device dtypes (int64 as int32).

        Returns:
            The outputs by name.
        """
        scope = self._scope(static, params, inputs)
        run_nodes(self._graph, scope)
        return {o.name: jnp.asarray(scope[o.name]) for o in self.outputs}

    # The generation package's name for :meth:`trace` until it moves to the public seam.
    _function = trace

    def _scope(self, static, params, inputs) -> ChainMap:
        """The values the graph's nodes start from: constants, weights and inputs."""
        return ChainMap({**self._graph.constants, **params, **static, **inputs})

    def _prepare(self, inputs: Mapping[str, Any]) -> tuple[dict, dict]:
        if not isinstance(inputs, Mapping):
            raise InputError(f"inputs must be a mapping of name to array, not {type(inputs)}")
        unknown = sorted(set(inputs) - set(self._by_name))
        if unknown:
            names = [i.name for i in self.inputs]
            raise InputError(f"{self.path!r} has no inputs {unknown}; its inputs are {names}")
        dynamic, static = {}, {}
        for info in self.inputs:
            if info.name not in inputs:
                raise InputError(
                    f"missing input {info.name!r} of {self.path!r}: "
                    f"expected {info.dtype} of shape {_shape_text(info.shape)}"
                )
            value = _check_input(info, inputs[info.name], self.path)
            if info.name in self.static_inputs:
                static[info.name] = np.asarray(value)
            else:
                dynamic[info.name] = value
        return dynamic, static


def _shape_text(shape) -> str:
    if shape is None:
        return "(any)"
    return "(" + ", ".join(str(d) if d is not None else "?" for d in shape) + ")"


_KINDS = {"b": "bool", "i": "integer", "u": "integer", "f": "float", "c": "complex"}


def _check_input(info: ValueInfo, value: Any, path: str):
    """``value`` as an array of the device dtype of ``info``, or an InputError naming it."""
    array = value if isinstance(value, jax.Array) else np.asarray(value)
    expected = np.dtype(info.dtype) if info.dtype != "unknown" else array.dtype
    want, got = _KINDS.get(expected.kind, expected.kind), _KINDS.get(array.dtype.kind)
    compatible = array.dtype == expected or want == got or (want == "integer" and got == "bool")
    if not compatible and not (want == "bool" and got == "integer"):
        raise InputError(
            f"input {info.name!r} of {path!r} must be {info.dtype} of shape "
            f"{_shape_text(info.shape)}, got {array.dtype}"
        )
    if info.shape is not None:
        dims_ok = len(info.shape) == array.ndim and all(
            not isinstance(d, int) or d == n for d, n in zip(info.shape, array.shape, strict=True)
        )
        if not dims_ok:
            raise InputError(
                f"input {info.name!r} of {path!r} must have shape {_shape_text(info.shape)}, "
                f"got {tuple(array.shape)}"
            )
    target = device_dtype(expected)
    if array.dtype != target:
        if isinstance(array, np.ndarray) and not fits_device(array.astype(expected)):
            raise InputError(f"input {info.name!r} of {path!r} has values that overflow {target}")
        array = array.astype(target)
    return array
