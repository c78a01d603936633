"""Load-time fusions of small op patterns into one internal op that a CPU kernel runs.

- ``(a * Sigmoid(a)) * b`` (SwiGLU's gate, in any operand order) becomes ``SiluMul(a, b)`` of
  the domain :data:`~.prepack.DOMAIN`: one vectorized pass on the kernels' pool, where XLA runs
  the three ops as one fusion on one thread (:func:`transmuter_jax.kernels.silu_mul`).

A pattern is fused only where its inner values are read by the pattern alone: no other node, no
nested graph and no graph output reads them. The fused op computes the same function.
"""

from __future__ import annotations

from collections import Counter

from onnx import GraphProto, NodeProto, helper

from .prepack import DOMAIN
from .trace import outer_names, subgraphs


def silu_mul(graph: GraphProto) -> int:
    """Fuses every ``(a * Sigmoid(a)) * b`` of ``graph`` and its nested graphs (in place);
    returns how many were fused."""
    count = sum(silu_mul(sub) for node in graph.node for sub in subgraphs(node))
    reads: Counter[str] = Counter(o.name for o in graph.output)
    for node in graph.node:
        reads.update(n for n in node.input if n)
        for sub in subgraphs(node):
            reads.update(outer_names(sub))
    producer = {o: node for node in graph.node for o in node.output if o}
    removed: set[int] = set()
    fused: dict[int, NodeProto] = {}
    for node in graph.node:
        if not _plain(node, "Mul", 2):
            continue
        found = _gate(node, producer, reads, removed)
        if found is None:
            continue
        gate, up, inner = found
        removed.update(id(n) for n in inner)
        fused[id(node)] = helper.make_node(
            "SiluMul", [gate, up], list(node.output), name=node.name, domain=DOMAIN
        )
    if not fused:
        return count
    nodes = [fused.get(id(n), n) for n in graph.node if id(n) not in removed]
    del graph.node[:]
    graph.node.extend(nodes)
    return count + len(fused)


def _plain(node: NodeProto, op_type: str, inputs: int) -> bool:
    """Whether ``node`` is the default domain's ``op_type`` with ``inputs`` inputs and no
    attributes (a legacy Mul's broadcast attributes are not fused)."""
    return (
        node.op_type == op_type
        and node.domain in ("", "ai.onnx")
        and len(node.input) == inputs
        and all(node.input)
        and not node.attribute
    )


def _gate(outer: NodeProto, producer, reads, removed) -> tuple[str, str, list] | None:
    """(a, b, the inner Mul and Sigmoid) when ``outer`` is ``(a * Sigmoid(a)) * b``."""
    for product, up in (outer.input, reversed(outer.input)):
        inner = producer.get(product)
        if inner is None or id(inner) in removed or reads[product] != 1:
            continue
        if not _plain(inner, "Mul", 2):
            continue
        for gate, sig in (inner.input, reversed(inner.input)):
            sigmoid = producer.get(sig)
            if sigmoid is None or id(sigmoid) in removed or reads[sig] != 1:
                continue
            if _plain(sigmoid, "Sigmoid", 1) and sigmoid.input[0] == gate:
                return gate, up, [inner, sigmoid]
    return None
