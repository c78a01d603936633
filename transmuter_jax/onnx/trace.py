"""Turns an ONNX graph into a pure function of (params, inputs) that JAX can trace.

Values are numpy arrays while they are known at trace time (constants, shapes and what is computed
from them only) and JAX arrays otherwise. An op whose inputs are all numpy runs at trace time, so
shape arithmetic folds away and the traced program has static shapes.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from onnx import AttributeProto, GraphProto, NodeProto, helper, numpy_helper

from . import provenance
from .errors import DynamicShapeError, ModelFileError, UnsupportedOpError
from .fold import in_program
from .registry import OpSpec, canonical_domain, lookup

Scope = ChainMap

# A value folded at trace time that is larger than this (elements) is computed in the program
# instead, so the compiled program embeds no large constants (a causal mask, say).
FOLD_LIMIT = 1 << 16


def is_static(value: Any) -> bool:
    """Whether ``value`` is known at trace time (a numpy array)."""
    return isinstance(value, np.ndarray)


def node_label(node: NodeProto) -> str:
    domain = canonical_domain(node.domain)
    op_type = f"{domain}::{node.op_type}" if domain else node.op_type
    return f"node {node.name or '<unnamed>'!r} ({op_type})"


def attribute_value(attr: AttributeProto) -> Any:
    """An attribute as a Python value: str, tuple, numpy array or GraphProto."""
    if attr.type == AttributeProto.TENSOR:
        return numpy_helper.to_array(attr.t)
    if attr.type == AttributeProto.SPARSE_TENSOR:
        raise NotImplementedError("sparse tensor attributes are not supported")
    value = helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, list):
        return tuple(v.decode("utf-8") if isinstance(v, bytes) else v for v in value)
    return value


def subgraphs(node: NodeProto) -> list[GraphProto]:
    """The graphs held by the attributes of ``node`` (If branches, Loop body)."""
    graphs = []
    for attr in node.attribute:
        if attr.type == AttributeProto.GRAPH:
            graphs.append(attr.g)
        elif attr.type == AttributeProto.GRAPHS:
            graphs.extend(attr.graphs)
    return graphs


@dataclass
class Graph:
    """A graph with what tracing it needs: the opsets, its file, and its known values."""

    proto: GraphProto
    opsets: Mapping[str, int]
    file: str
    constants: Mapping[str, np.ndarray]

    def spec(self, node: NodeProto) -> OpSpec:
        domain = canonical_domain(node.domain)
        version = self.opsets.get(domain, 1)
        spec = lookup(domain, node.op_type, version)
        if spec is None:
            raise UnsupportedOpError(
                f"unsupported operator {node.op_type!r} of domain {domain or 'ai.onnx'!r} "
                f"(opset {version}) in {node_label(node)} of {self.file}"
            )
        return spec

    def sub(self, proto: GraphProto) -> Graph:
        consts = {t.name: numpy_helper.to_array(t) for t in proto.initializer}
        return Graph(proto, self.opsets, self.file, consts)


class NodeContext:
    """What an op implementation may need beyond its inputs and attributes."""

    def __init__(self, graph: Graph, node: NodeProto, scope: Scope):
        self.graph = graph
        self.node = node
        self.scope = scope

    @property
    def num_outputs(self) -> int:
        return len(self.node.output)

    @property
    def label(self) -> str:
        return f"{node_label(self.node)} of {self.graph.file}"

    def run(self, proto: GraphProto, inputs: Sequence[Any] = ()) -> list[Any]:
        """Runs the subgraph ``proto`` with this node's scope as its outer scope."""
        sub = self.graph.sub(proto)
        local = dict(sub.constants)
        for info, value in zip(proto.input, inputs, strict=False):
            local[info.name] = value
        scope = self.scope.new_child(local)
        run_nodes(sub, scope)
        return [scope[o.name] for o in proto.output]


def check_supported(graph: Graph) -> None:
    """Raises UnsupportedOpError for the first node of ``graph`` without an implementation."""
    for node in graph.proto.node:
        graph.spec(node)
        for proto in subgraphs(node):
            check_supported(graph.sub(proto))


def check_produced(graph: Graph, outer: Iterable[str] = ()) -> None:
    """Raises ModelFileError for the first value that a node (or the graph's outputs) reads
    and that no input, initializer or earlier node produces; ``outer``: names known around it."""
    known = set(outer) | set(graph.constants)
    known |= {i.name for i in graph.proto.input} | {t.name for t in graph.proto.initializer}
    for node in graph.proto.node:
        missing = [name for name in node.input if name and name not in known]
        if missing:
            raise ModelFileError(
                f"{node_label(node)} of {graph.file} reads {', '.join(map(repr, missing))}, which "
                "no input, initializer or earlier node of the graph produces: the file is damaged "
                "or its graph is not in order (re-export it)"
            )
        for proto in subgraphs(node):
            check_produced(graph.sub(proto), known)
        known.update(name for name in node.output if name)
    missing = [o.name for o in graph.proto.output if o.name not in known]
    if missing:
        raise ModelFileError(
            f"the graph outputs {', '.join(map(repr, missing))} of {graph.file} are produced by "
            "no node, input or initializer: the file is damaged (re-export it)"
        )


def run_nodes(
    graph: Graph,
    scope: Scope,
    *,
    nodes: Iterable[NodeProto] | None = None,
    given: frozenset[str] = frozenset(),
    host: bool = False,
) -> None:
    """Runs the nodes of ``graph`` in order, writing their outputs into ``scope``.

    Args:
        nodes: the nodes to run (default: all of the graph's).
        given: values already in ``scope`` (computed on the host): a node whose outputs are all
            given is not run, and no node overwrites them.
        host: run on concrete values, as numpy (the host part of a split graph).
    """
    with provenance.scope():  # how values were made (onnx.provenance)
        _run(graph, scope, graph.proto.node if nodes is None else nodes, given, host)


def _run(
    graph: Graph, scope: Scope, nodes: Iterable[NodeProto], given: frozenset[str], host: bool
) -> None:
    for node in nodes:
        if given and all(o in given for o in node.output if o):
            continue
        spec = graph.spec(node)
        args = [scope[name] if name else None for name in node.input]
        if host:
            args = [np.asarray(a) if isinstance(a, jax.Array) else a for a in args]
        for i in spec.static:
            if i < len(args) and args[i] is not None and not is_static(args[i]):
                raise DynamicShapeError(
                    f"{node_label(node)} of {graph.file} needs input {i} "
                    f"({node.input[i]!r}) at trace time, but its value depends on the values "
                    "of the graph's inputs inside a Loop, Scan or If body (or a program compiled "
                    "around the model), where the shape of the result is not static: only the "
                    "main graph's value-dependent nodes run on the host (see docs/tracer.md)"
                )
        attrs = {a.name: attribute_value(a) for a in node.attribute}
        if spec.takes_ctx:
            attrs["ctx"] = NodeContext(graph, node, scope)
        fold = spec.fold and all(a is None or is_static(a) for a in args)
        try:
            if fold:
                with jax.ensure_compile_time_eval():
                    out = spec.fn(*args, **attrs)
                out = _to_numpy(out)
                if _largest(out) > FOLD_LIMIT and not host:
                    # Too large to embed in the program: compute it in the program instead.
                    with in_program():
                        out = spec.fn(*args, **attrs)
            else:
                out = spec.fn(*args, **attrs)
        except Exception as error:
            error.add_note(f"while tracing {node_label(node)} of {graph.file}")
            raise
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for name, value in zip(node.output, outs, strict=False):
            if host and isinstance(value, jax.Array):
                value = np.asarray(value)
            if name and name not in given:
                scope[name] = (
                    np.asarray(value)
                    if isinstance(value, (np.generic, int, float, bool))
                    else value
                )


def _largest(out: Any) -> int:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return max((o.size for o in outs if isinstance(o, np.ndarray)), default=0)


def _to_numpy(out: Any) -> Any:
    if isinstance(out, (tuple, list)):
        return type(out)(_to_numpy(o) for o in out)
    if out is None:
        return None
    return np.asarray(out)


def outer_names(proto: GraphProto) -> set[str]:
    """Names that ``proto`` (or its subgraphs) reads from an enclosing scope."""
    defined = {i.name for i in proto.input} | {t.name for t in proto.initializer}
    used: set[str] = set()
    for node in proto.node:
        used.update(n for n in node.input if n)
        for sub in subgraphs(node):
            used |= outer_names(sub)
        defined.update(node.output)
    return used - defined


def node_inputs(node: NodeProto) -> set[str]:
    """Every value ``node`` reads, including those its subgraphs read from outer scopes."""
    names = {n for n in node.input if n}
    for sub in subgraphs(node):
        names |= outer_names(sub)
    return names


def prune(proto: GraphProto, outputs: Iterable[str]) -> list[NodeProto]:
    """The nodes of ``proto`` that the values ``outputs`` need, in graph order."""
    needed = set(outputs)
    keep = []
    for node in reversed(proto.node):
        if needed.intersection(node.output):
            keep.append(node)
            needed |= node_inputs(node)
    return keep[::-1]


SHAPE_ONLY = {("", "Shape"), ("", "Size")}


def value_sources(graph: Graph) -> dict[str, frozenset[str]]:
    """For each value of the main graph, the graph inputs whose values flow into it."""
    deps: dict[str, frozenset[str]] = {i.name: frozenset([i.name]) for i in graph.proto.input}
    _walk_dependencies(graph, deps, set())
    return deps


def static_dependencies(graph: Graph) -> set[str]:
    """Names of values of the graph's inputs that some node needs at trace time.

    A value flows from its inputs to the outputs of each node that reads it, except through ops
    that only read a shape (Shape, Size). An input is needed at trace time when it flows into an
    input that an op declares static, or into the condition of an If.
    """
    deps: dict[str, frozenset[str]] = {i.name: frozenset([i.name]) for i in graph.proto.input}
    needed: set[str] = set()
    _walk_dependencies(graph, deps, needed)
    return needed


def _walk_dependencies(graph: Graph, deps: dict[str, frozenset[str]], needed: set[str]) -> None:
    for node in graph.proto.node:
        spec = graph.spec(node)
        key = (spec.domain, spec.name)
        for i in spec.static + spec.prefer_static:
            if i < len(node.input) and node.input[i]:
                needed |= deps.get(node.input[i], frozenset())
        for sub in subgraphs(node):
            inner = dict(deps)
            for info in sub.input:
                inner[info.name] = frozenset()
            _walk_dependencies(graph.sub(sub), inner, needed)
        if key in SHAPE_ONLY:
            flow = frozenset()
        else:
            flow = frozenset().union(*(deps.get(n, frozenset()) for n in node_inputs(node)))
        for name in node.output:
            deps[name] = flow


# Ops whose outputs' shapes depend on the values of their inputs: run whole on the host, their
# outputs enter the program as arguments, so it compiles once per resulting shape.
HOST_SHAPED = {("", "NonZero"), ("", "Unique")}


@dataclass(frozen=True)
class HostSplit:
    """The part of a graph that runs on the host because its values decide shapes.

    Attributes:
        nodes: the main-graph nodes to run on the host, in graph order.
        static: values the program needs at trace time (a Reshape's shape, a TopK's k): each
            distinct value compiles once.
        dynamic: outputs of :data:`HOST_SHAPED` nodes, given to the program as arguments (one
            compile per shape).
        label: the first node whose shape depends on the inputs' values, for messages.
    """

    nodes: tuple[NodeProto, ...]
    static: tuple[str, ...]
    dynamic: tuple[str, ...]
    label: str

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.static + self.dynamic)


def host_split(graph: Graph, static_inputs: Iterable[str] = ()) -> HostSplit | None:
    """The host part of ``graph``: the nodes whose outputs decide shapes and depend on the values
    of graph inputs other than ``static_inputs``; None when there is none."""
    deps = value_sources(graph)
    known = set(static_inputs)
    static: list[str] = []
    dynamic: list[str] = []
    label = None
    for node in graph.proto.node:
        spec = graph.spec(node)
        dependent = [
            node.input[i]
            for i in spec.static
            if i < len(node.input) and node.input[i] and deps.get(node.input[i], set()) - known
        ]
        if not dependent:
            continue
        label = label or f"{node_label(node)} of {graph.file}"
        if (spec.domain, spec.name) in HOST_SHAPED:
            dynamic.extend(o for o in node.output if o and o not in dynamic)
        else:
            static.extend(n for n in dependent if n not in static)
    if label is None:
        return None
    dynamic = [n for n in dynamic if n not in static]
    nodes = tuple(prune(graph.proto, static + dynamic))
    return HostSplit(nodes, tuple(static), tuple(dynamic), label)
