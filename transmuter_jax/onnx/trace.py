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


def run_nodes(graph: Graph, scope: Scope) -> None:
    """Runs the nodes of ``graph`` in order, writing their outputs into ``scope``."""
    for node in graph.proto.node:
        spec = graph.spec(node)
        args = [scope[name] if name else None for name in node.input]
        for i in spec.static:
            if i < len(args) and args[i] is not None and not is_static(args[i]):
                raise DynamicShapeError(
                    f"{node_label(node)} of {graph.file} needs input {i} "
                    f"({node.input[i]!r}) at trace time, but its value depends on the values "
                    "of the graph's inputs, so the shape of the result is not static"
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
                if _largest(out) > FOLD_LIMIT:
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
            if name:
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
