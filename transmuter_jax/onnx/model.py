"""load(): an ONNX file as a Model that runs the whole graph as one jitted JAX function."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import math
import os
import time
import warnings
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
from ..runtime import compile_cache, switch
from ..runtime.jit import jit_options
from ..runtime.switch import TRACE_ENVIRONMENT, trace_environment  # noqa: F401
from . import (
    fuse,
    inline,
    ops,  # noqa: F401  (registers the op implementations)
    packed_store,
    prepack,
    product_rows,
)
from .dtypes import device_dtype, fits_device, np_dtype, to_device_dtype
from .errors import (
    DynamicShapeError,
    GraphError,
    InputError,
    ModelFileError,
    TransmuterError,
    UnsupportedOpError,
)
from .registry import DEFAULT_DOMAINS, canonical_domain, registered
from .trace import (
    Graph,
    HostSplit,
    check_produced,
    check_supported,
    host_split,
    prune,
    run_nodes,
    static_dependencies,
    subgraphs,
)

# Initializers at most this large (elements) stay numpy constants when integer or bool, so shape
# arithmetic on them folds at trace time; larger ones, and floats above STATIC_FLOAT, are weights.
STATIC_INT = 4096
STATIC_FLOAT = 16
# A graph input can be part of the compile key (like use_cache_branch) when it is this small.
STATIC_INPUT = 8
# Files at least this large have their inline initializers read in place, not parsed.
INLINE_FILE_BYTES = 16 << 20
# No tensor has more elements (2**48: 1 PiB of bytes); more is a corrupt file.
MAX_ELEMENTS = 1 << 48
# Ops whose output holds the values of their first input, as an index flows through them.
_SAME_VALUES = {"Cast", "Identity", "Reshape", "Unsqueeze", "Squeeze", "Flatten"}


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
    if os.path.getsize(path) == 0:
        raise ModelFileError(f"{path!r} is empty (0 bytes), not an ONNX model; download it again")
    if os.path.getsize(path) >= INLINE_FILE_BYTES:
        try:
            found = inline.read(path)
        except (DecodeError, OSError):
            found = None
        if found is not None:
            return found.proto, found.arrays
    try:
        proto = onnx.load(path, load_external_data=False)
    except (DecodeError, ValueError, RuntimeError, OSError) as error:
        raise ModelFileError(f"{path!r} is not a readable ONNX model: {error}") from error
    if not proto.graph.output:
        raise ModelFileError(f"{path!r} is not an ONNX model: its graph has no outputs")
    return proto, {}


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
    shape = _dims(tensor, path)
    count = math.prod(shape)
    offset = _byte_field(info, "offset", 0, tensor, path)
    length = _byte_field(info, "length", count * dtype.itemsize, tensor, path)
    if length != count * dtype.itemsize or offset + length > os.path.getsize(file):
        raise ModelFileError(
            f"external data {location!r} of tensor {tensor.name!r} is truncated or corrupt "
            f"(needs bytes {offset}..{offset + length}, file has {os.path.getsize(file)})"
        )
    if count == 0:
        return np.zeros(shape, dtype)
    return np.memmap(file, dtype=dtype, mode="r", offset=offset, shape=shape)


def _dims(tensor: TensorProto, path: str) -> tuple[int, ...]:
    """The shape of ``tensor``, refused when a dim is negative or the size is absurd."""
    shape = tuple(int(d) for d in tensor.dims)
    if any(d < 0 for d in shape) or math.prod(shape) > MAX_ELEMENTS:
        raise ModelFileError(
            f"tensor {tensor.name!r} of {path!r} has dims {list(shape)}, which give no valid size "
            f"(negative, or more than {MAX_ELEMENTS:,} elements): the file is corrupt"
        )
    return shape


def _byte_field(info: dict, name: str, default: int, tensor: TensorProto, path: str) -> int:
    """The external-data field ``name`` (offset or length): a non-negative integer."""
    text = info.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ModelFileError(
            f"external data of tensor {tensor.name!r} of {path!r} has {name} {text!r}; it must "
            "be a non-negative integer (bytes): the file is corrupt"
        )
    return value


def _tensor_array(tensor: TensorProto, folder: str, path: str) -> np.ndarray:
    if tensor.data_location == TensorProto.EXTERNAL:
        return _external_array(tensor, folder, path)
    _dims(tensor, path)
    try:
        return numpy_helper.to_array(tensor)
    except Exception as error:  # noqa: BLE001 - any decoding failure is a corrupt file
        raise ModelFileError(f"tensor {tensor.name!r} of {path!r} is corrupt: {error}") from error


def _is_weight(array: np.ndarray) -> bool:
    limit = STATIC_INT if array.dtype.kind in "biu" else STATIC_FLOAT
    return array.size > limit and fits_device(array)


def load(onnx_file: str | os.PathLike, *, outputs: Sequence[str] | None = None) -> Model:
    """Loads an ONNX model as a :class:`Model` (``transmuter_jax.load`` also takes a mesh).

    Args:
        onnx_file: path of the ``.onnx`` file; external data must lie in its folder.
        outputs: names of the graph outputs to compute; the graph is pruned to what they need.

    Returns:
        The model, whose weights are on the default JAX device.
    """
    compile_cache.configure()
    path = os.fspath(onnx_file)
    with graph_errors(path, "load"):
        return Model(path, outputs=outputs)


class Model:
    """An ONNX graph run as one jitted JAX function, compiled once per input signature.

    Attributes:
        inputs: the graph inputs the caller gives.
        outputs: the graph outputs computed.
        static_inputs: inputs whose values select the program (such as ``use_cache_branch``):
            each distinct value compiles once.
        params: the weights, a dict of JAX arrays passed to the compiled function (with
            ``host=True``, numpy arrays in their device dtypes, until they are placed).
        compile_stats: trace and compile time of each compiled signature.
    """

    def __init__(self, path: str, *, outputs: Sequence[str] | None = None, host: bool = False):
        self.path = path
        proto, in_place = _read_onnx(path)
        if proto.functions:
            proto = onnx.inliner.inline_local_functions(proto)
        folder = os.path.dirname(os.path.abspath(path))
        opsets = {}
        for entry in proto.opset_import:
            domain = canonical_domain(entry.domain)
            opsets[domain] = entry.version
        graph = proto.graph
        available = [o.name for o in graph.output]
        if outputs is not None:
            unknown = [o for o in outputs if o not in available]
            if unknown:
                raise InputError(f"{path!r} has no outputs {unknown}; it has {available}")
            kept = [o for o in graph.output if o.name in set(outputs)]
            del graph.output[:]
            graph.output.extend(kept)
            nodes = prune(graph, [o.name for o in kept])
            del graph.node[:]
            graph.node.extend(nodes)

        limits = _index_limits(graph)
        constants: dict[str, np.ndarray] = {}
        params: dict[str, Any] = {}
        packed: list[packed_store.Item] = []
        # On CPU with the kernels, matrix-product weights are packed once, in place of the original
        # (not for weights kept on the host to be split over a mesh: packed strips do not split).
        packings, nbits = {}, {}
        if kernels.enabled() and not host:
            least = product_rows.least(proto)
            wide = frozenset(n for n, r in least.items() if r > kernels.MATMUL_MAX_ROWS)
            packings = prepack.plan(graph, wide=wide)
            nbits = prepack.plan_nbits(graph)
        packings = {**packings, **nbits}
        for tensor in graph.initializer:
            array = in_place.pop(tensor.name, None)
            if array is None:
                array = _tensor_array(tensor, folder, path)
            if tensor.name in packings:
                packed.append(packed_store.Item(tensor.name, packings[tensor.name], tensor, array))
                params[tensor.name] = None  # placed below, in the graph's order
            elif _is_weight(array):
                array = to_device_dtype(np.asarray(array))  # a view of a memmap when it fits
                params[tensor.name] = array if host else jax.device_put(array)
            else:
                constants[tensor.name] = np.array(array)
        # device_put keeps each packed array where it lies, without copying it (CPU, aligned).
        for name, array in packed_store.packed(packed, path).items():
            params[name] = jax.device_put(array)
        del packed
        # Weights now live on the device (or in params on the host): drop them from the graph.
        del graph.initializer[:]
        prepack.rewrite(graph, {k: v for k, v in packings.items() if k not in nbits})
        prepack.rewrite_nbits(graph, nbits)
        prepack.mark_tokens(graph)
        if kernels.enabled() and not host:  # XLA:CPU's (see onnx.fuse)
            scalar = fuse.scalars(graph, constants)
            fuse.silu_mul(graph)
            fuse.gate_up(graph)
            fuse.skip_norm(graph)
            fuse.transposed_products(graph, scalar)
            fuse.softmax_attention(graph, scalar, opsets.get("", 1))

        initialized = set(constants) | set(params)
        self.inputs = [_value_info(i) for i in graph.input if i.name not in initialized]
        self.outputs = [_value_info(o) for o in graph.output]
        self.params = params
        self._graph = Graph(graph, opsets, path, constants)
        check_supported(self._graph)
        check_produced(self._graph, set(params))
        _check_opsets(opsets, path)
        self._index_limits = {n: v for n, v in limits.items() if n in {i.name for i in self.inputs}}
        small = {
            i.name
            for i in self.inputs
            if i.shape is not None
            and all(isinstance(d, int) for d in i.shape)
            and int(np.prod(i.shape)) <= STATIC_INPUT
        }
        static = static_dependencies(self._graph) & small
        self.static_inputs = tuple(i.name for i in self.inputs if i.name in static)
        self._split: HostSplit | None = host_split(self._graph, self.static_inputs)
        self._by_name = {i.name: i for i in self.inputs}
        self._compiled: dict[tuple, Any] = {}
        self.compile_stats: list[CompileStat] = []

    def __repr__(self) -> str:
        return f"Model({self.path!r}, inputs={len(self.inputs)}, outputs={len(self.outputs)})"

    @property
    def graph(self) -> Graph:
        """The graph this model traces (without its weights, which are :attr:`params`)."""
        return self._graph

    def with_graph(
        self,
        proto: GraphProto,
        *,
        inputs: Sequence[ValueInfo] | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> Model:
        """A model that runs ``proto`` in place of this graph, sharing this model's weights.

        Args:
            proto: the new main graph; it keeps this graph's opsets, file and constants.
            inputs: the graph inputs the caller gives (default: this model's).
            params: the weights ``proto`` reads, when they are not this model's (a rewrite
                that cut some of them).

        Returns:
            A new Model with its own, empty, compile cache and stats.
        """
        new = copy.copy(self)
        new.__dict__.pop("_fingerprint", None)
        new.__dict__.pop("_host_needed", None)
        graph = self._graph
        new._graph = Graph(proto, graph.opsets, graph.file, graph.constants)
        new._split = host_split(new._graph, new.static_inputs)
        if inputs is not None:
            new.inputs = list(inputs)
        if params is not None:
            new.params = dict(params)
        new._by_name = {i.name: i for i in new.inputs}
        new._compiled = {}
        new.compile_stats = []
        return new

    def with_params(self, params: Mapping[str, jax.Array]) -> Model:
        """A model of this graph that runs with ``params`` (the same names, shapes and dtypes,
        placed elsewhere: sharded over a mesh), with its own, empty, compile cache and stats."""
        if set(params) != set(self.params):
            raise InputError(f"params must hold the weights {sorted(self.params)} of {self.path!r}")
        new = copy.copy(self)
        new.params = dict(params)
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

    @property
    def all_op_types(self) -> frozenset[tuple[str, str]]:
        """The (domain, op type) pairs of the nodes of the graph and of its subgraphs."""
        found, graphs = set(), [self._graph.proto]
        while graphs:
            for node in graphs.pop().node:
                found.add((node.domain or "", node.op_type))
                graphs.extend(subgraphs(node))
        return frozenset(found)

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, jax.Array]:
        """Runs the graph.

        Args:
            inputs: one array per graph input, by name.

        Returns:
            The outputs by name, as JAX arrays.
        """
        dynamic, static = self._prepare(inputs)
        if self._split is not None and not self.__dict__.get("_host_needed"):
            # The analysis over-approximates: a graph that traces without its host part runs
            # whole; one that does not runs its host part from then on.
            try:
                return self.compiled(dynamic, static)(self.params, dynamic)
            except DynamicShapeError:
                self._host_needed = True
        if self._split is not None:
            self._run_host(dynamic, static)
        return self.compiled(dynamic, static)(self.params, dynamic)

    @property
    def host_split(self) -> HostSplit | None:
        """The nodes run on the host because their values decide shapes (None: none)."""
        return self._split

    def _run_host(self, dynamic: dict, static: dict) -> None:
        """Runs the host part of the graph on the concrete inputs and adds its values: to
        ``static`` those the program needs at trace time, to ``dynamic`` the others."""
        split = self._split
        values = {n: np.asarray(v) for n, v in dynamic.items()}
        scope = self._scope(static, self.params, values)
        with graph_errors(self.path, "run the value-dependent part of"):
            run_nodes(self._graph, scope, nodes=split.nodes, host=True)
        for name in split.static:
            static[name] = np.asarray(scope[name])
            dynamic.pop(name, None)  # a graph input read at trace time
        for name in split.dynamic:
            dynamic[name] = to_device_dtype(np.asarray(scope[name]))

    def compiled(self, dynamic: Mapping[str, Any], static: Mapping[str, np.ndarray]):
        """The compiled function ``(params, dynamic) -> outputs`` for this input signature."""
        key = tuple((n, tuple(v.shape), str(v.dtype)) for n, v in sorted(dynamic.items()))
        key += tuple((n, v.tobytes()) for n, v in sorted(static.items()))
        key += trace_environment()
        fn = self._compiled.get(key)
        if fn is None:
            start = time.perf_counter()
            function = partial(self.trace, dict(static))
            off = switch.off_over_mesh(self.params)  # no kernels over a mesh
            with compile_cache.scope(), graph_errors(self.path, "trace"), off:
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
        given = frozenset()
        if self._split is not None and all(n in scope for n in self._split.names):
            given = self._split.names
        try:
            run_nodes(self._graph, scope, given=given)
        except DynamicShapeError as error:
            if self._split is None or given:
                raise
            raise DynamicShapeError(
                f"{error}. {self._split.label} gives a shape that depends on the values of the "
                "inputs: such nodes run on the host before each call of the model, which a "
                "program compiled around it (a loop over tokens) cannot do, as it would "
                "retrace every step"
            ) from error
        return {o.name: jnp.asarray(scope[o.name]) for o in self.outputs}

    def trace_last(
        self,
        static: Mapping[str, np.ndarray],
        params: Mapping[str, jax.Array],
        inputs,
        last: jax.Array,
        output: str = "logits",
        live: jax.Array | None = None,
    ) -> dict[str, jax.Array]:
        """:meth:`trace`, with ``output`` [B, S, V] computed for one position of each row only:
        [B, 1, V] at ``last`` [B] (or P positions: [B, P, V] at ``last`` [B, P]). Where
        ``output`` comes from a hidden state [B, S, H] through a matrix product by weights and
        element-wise nodes (an LM head), the head runs on those rows alone; elsewhere the whole
        output is computed and the rows taken from it.

        With ``last`` [B], the tokens after each row's ``last`` are padding: the products over
        the tokens skip them (:func:`transmuter_jax.kernels.token_rows`), so the other outputs'
        rows past ``last`` (a cache's present) hold values nothing may read.

        ``live`` [B] bool: the rows whose outputs are read; the products over the tokens
        compute those rows only (:func:`transmuter_jax.kernels.live_rows`), so the others'
        outputs hold values nothing may read."""
        found = self.head(output)
        rows_live = contextlib.nullcontext() if live is None else kernels.live_rows(live)
        with rows_live:
            with self._token_rows(inputs, last):
                if found is None:
                    outputs = self.trace(static, params, inputs)
                    outputs[output] = _at(outputs[output], last)
                    return outputs
                hidden, tail = found
                skip = {id(n) for n in tail}
                body = [n for n in self._graph.proto.node if id(n) not in skip]
                scope = self._scope(static, params, inputs)
                given = frozenset()
                if self._split is not None and all(n in scope for n in self._split.names):
                    given = self._split.names
                run_nodes(self._graph, scope, nodes=body, given=given)
            rows = scope[hidden]  # [B, S, H]
            scope = scope.new_child({hidden: _at(rows, last)})
            run_nodes(self._graph, scope, nodes=tail)
        return {o.name: jnp.asarray(scope[o.name]) for o in self.outputs}

    @staticmethod
    def _token_rows(inputs, last):
        """:func:`kernels.token_rows` for a step whose rows end at ``last`` [B], else nothing."""
        tokens = next((inputs[n] for n in prepack.TOKEN_INPUTS if n in inputs), None)
        if tokens is None or jnp.ndim(last) != 1 or jnp.ndim(tokens) < 2:
            return contextlib.nullcontext()
        return kernels.token_rows(jnp.asarray(last, jnp.int32) + 1, int(tokens.shape[1]))

    def head(self, output: str) -> tuple[str, list] | None:
        """The hidden state's name and the nodes that make ``output`` from it row by row (a
        matrix product by weights, then element-wise nodes with weight-only other inputs), or
        None."""
        if not hasattr(self, "_heads"):
            self._heads: dict[str, Any] = {}
        if output in self._heads:
            return self._heads[output]
        nodes = list(self._graph.proto.node)
        producer = {o: n for n in nodes for o in n.output}
        fixed = set(self._graph.constants) | set(self.params) | {""}
        for node in nodes:  # values computed from weights alone
            if all(i in fixed for i in node.input):  # Constant nodes too
                fixed.update(node.output)
        users: dict[str, int] = {}
        for node in nodes:
            for i in node.input:
                users[i] = users.get(i, 0) + 1
        outputs = {o.name for o in self.outputs}
        tail, name, found = [], output, None
        while name in producer and len(tail) < 8:
            node = producer[name]
            used = users.get(name, 0) != (0 if name == output else 1)
            if len(node.output) != 1 or used or (name != output and name in outputs):
                break
            moving = [i for i in node.input if i not in fixed]
            if len(moving) != 1:
                break
            tail.insert(0, node)
            if node.op_type in _PRODUCTS and node.input[0] == moving[0]:
                found = (moving[0], tail)
                break
            if node.op_type not in _ELEMENTWISE or node.domain not in DEFAULT_DOMAINS:
                break
            name = moving[0]
        if self._split is not None:
            found = None  # a graph split for the host: the whole graph runs as it is
        self._heads[output] = found
        return found

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
        missing = [i for i in self.inputs if i.name not in inputs]
        if missing:
            names = ", ".join(repr(i.name) for i in missing)
            expected = "; ".join(f"{i.dtype} of shape {_shape_text(i.shape)}" for i in missing)
            plural = "s" if len(missing) > 1 else ""
            raise InputError(f"missing input{plural} {names} of {self.path!r}: expected {expected}")
        dynamic, static = {}, {}
        for info in self.inputs:
            value = _check_input(info, inputs[info.name], self.path)
            if info.name in self.static_inputs:
                static[info.name] = np.asarray(value)
            else:
                dynamic[info.name] = value
        _check_together(self, {**dynamic, **static})
        return dynamic, static


# The nodes of an LM head (see Model.trace_last): matrix products by weights whose rows are
# the hidden state's positions, then element-wise nodes (softcapping, a cast).
def _at(values: jax.Array, last: jax.Array) -> jax.Array:
    """values [B, S, ...] at each row's positions ``last``: [B] gives [B, 1, ...], [B, P] gives
    [B, P, ...]. With one position (a decoding step) every index is 0 (gathers clamp): no gather,
    which XLA:CPU runs one element at a time."""
    if values.shape[1] == 1:
        positions = jnp.shape(last)[1] if jnp.ndim(last) == 2 else 1
        return jnp.broadcast_to(values, (values.shape[0], positions, *values.shape[2:]))
    if jnp.ndim(last) == 1:
        return values[jnp.arange(values.shape[0]), last][:, None]
    return values[jnp.arange(values.shape[0])[:, None], last]


_PRODUCTS = ("MatMul", "PackedMatMul", "MatMulNBits", "PackedMatMulNBits")
_ELEMENTWISE = ("Add", "Sub", "Mul", "Div", "Tanh", "Cast", "Identity")


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


def _index_limits(graph: onnx.GraphProto) -> dict[str, tuple[int, str]]:
    """For each graph input that indexes a table initializer through Gather (the token ids of an
    embedding), the number of rows of the table and its name."""
    dims = {t.name: tuple(t.dims) for t in graph.initializer}
    sources = {i.name: i.name for i in graph.input if i.name not in dims}
    limits: dict[str, tuple[int, str]] = {}
    _find_indexing(graph, dims, sources, limits)
    return limits


def _find_indexing(
    graph: onnx.GraphProto,
    dims: dict[str, tuple[int, ...]],
    sources: dict[str, str],
    limits: dict[str, tuple[int, str]],
) -> None:
    """Adds to ``limits`` the tables that the values of ``sources`` index in ``graph``."""
    for node in graph.node:
        for sub in subgraphs(node):  # If branches and Loop bodies read the outer values too
            shadowed = {i.name for i in sub.input} | {t.name for t in sub.initializer}
            inner = {k: v for k, v in sources.items() if k not in shadowed}
            inner_dims = {**dims, **{t.name: tuple(t.dims) for t in sub.initializer}}
            _find_indexing(sub, inner_dims, inner, limits)
        domain = canonical_domain(node.domain)
        if domain == "" and node.op_type in _SAME_VALUES and node.input:
            source = sources.get(node.input[0])
            if source is not None:
                sources[node.output[0]] = source
            continue
        gather = domain == "" and node.op_type == "Gather"
        quantized = domain == "com.microsoft" and node.op_type == "GatherBlockQuantized"
        if not (gather or quantized) or len(node.input) < 2:
            continue
        source, shape = sources.get(node.input[1]), dims.get(node.input[0])
        if source is None or not shape:
            continue
        names = {"axis"} if gather else {"gather_axis"}
        axis = next((a.i for a in node.attribute if a.name in names), 0)
        if -len(shape) <= axis < len(shape):
            found = (shape[axis], node.input[0])
            limits[source] = min(limits.get(source, found), found)


def _check_opsets(opsets: Mapping[str, int], path: str) -> None:
    """Warns about an opset newer than every implementation of its domain."""
    newest: dict[str, int] = {}
    for spec in registered():
        newest[spec.domain] = max(newest.get(spec.domain, 0), spec.since)
    for domain, version in sorted(opsets.items()):
        if domain in newest and version > newest[domain]:
            warnings.warn(
                f"{path!r} imports opset {version} of {domain or 'ai.onnx'}, newer than any this "
                f"library implements ({newest[domain]}): ops that changed since then run as they "
                "were then, which may compute something else",
                RuntimeWarning,
                stacklevel=4,
            )


def _check_together(model: Model, values: Mapping[str, Any]) -> None:
    """Checks what the inputs must agree on: the batch, the mask's length, the token ids."""
    path = model.path
    main = next((n for n in ("input_ids", "inputs_embeds") if n in values), None)
    shapes = {n: tuple(np.shape(v)) for n, v in values.items()}
    declared = {i.name: i.shape for i in model.inputs}
    if main is not None and shapes[main] and isinstance((declared[main] or (0,))[0], str):
        batch_name, batch = declared[main][0], shapes[main][0]
        for name, shape in shapes.items():
            dims = declared.get(name) or ()
            if dims and dims[0] == batch_name and shape and shape[0] != batch:
                raise InputError(
                    f"input {name!r} of {path!r} has batch {shape[0]}, but {main!r} has batch "
                    f"{batch}: give every input the same batch (dim 0)"
                )
    past = next(
        (
            shapes[n]
            for n in sorted(shapes)
            if n.startswith(("past_key_values.", "past."))
            and ".encoder." not in n
            and len(shapes[n]) == 4
        ),
        None,
    )
    mask = shapes.get("attention_mask")
    if main is not None and past is not None and mask is not None and len(mask) == 2:
        total = shapes[main][1] + past[2]
        if mask[1] > total:
            raise InputError(
                f"input 'attention_mask' of {path!r} has {mask[1]} columns, more than the "
                f"sequence ({shapes[main][1]}) plus the past ({past[2]}) = {total}: it must cover "
                "the past and the new tokens, no more"
            )
    for name, (rows, table) in getattr(model, "_index_limits", {}).items():
        value = values.get(name)
        if value is None or isinstance(value, jax.Array) or np.size(value) == 0:
            continue  # values on the device are not read back to check them
        # Gather counts negative indices from the end; a negative token id is a mistake.
        first = 0 if "input_ids" in name else -rows
        low, high = int(np.min(value)), int(np.max(value))
        if low < first or high >= rows:
            bad = high if high >= rows else low
            raise InputError(
                f"input {name!r} of {path!r} holds {bad}, outside the {rows} rows of the table "
                f"{table!r} it indexes (the vocabulary, for token ids): its values must lie in "
                f"[{first}, {rows})"
            )


@contextlib.contextmanager
def graph_errors(path: str, doing: str):
    """Raises what goes wrong inside as this package's errors (GraphError, UnsupportedOpError)."""
    try:
        yield
    except TransmuterError:
        raise
    except NotImplementedError as error:
        raise UnsupportedOpError(f"cannot {doing} {path!r}: {_describe(error)}") from error
    except (ValueError, TypeError, LookupError, AttributeError, ArithmeticError) as error:
        raise GraphError(
            f"cannot {doing} {path!r}: the graph is malformed or an op gets inputs it cannot "
            f"take: {_describe(error)}"
        ) from error


def _describe(error: BaseException) -> str:
    notes = "; ".join(getattr(error, "__notes__", ()))
    text = f"{type(error).__name__}: {error}"
    return f"{text} ({notes})" if notes else text
