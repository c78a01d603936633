"""Load-time fusions of small op patterns into one internal op of the domain
:data:`~.prepack.DOMAIN`, for XLA:CPU.

- ``(a * Sigmoid(a)) * b`` (SwiGLU's gate, in any operand order) becomes ``SiluMul(a, b)``: one
  vectorized pass on the kernels' pool, where XLA runs the three ops as one fusion on one thread
  (:func:`transmuter_jax.kernels.silu_mul`).
- ``MatMul(Transpose(a), Transpose(b) [* c])`` (either operand, any permutation; ``c`` a constant
  scalar) becomes ``TransposedMatMul(a, b[, c], perm_a, perm_b)``: attention's scores over a
  cache's keys ``K^T`` (times the scale, as Whisper's exports write it) without the transposed
  copy of the whole cache that XLA:CPU makes for its dot every step
  (:func:`transmuter_jax.kernels.matmul_nt`), or one ``dot_general`` of the arrays as they are.

A pattern is fused only where its inner values are read by the pattern alone: no other node, no
nested graph and no graph output reads them (a Transpose that others read stays for them). The
fused op computes the same function.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from onnx import GraphProto, NodeProto, helper

from .prepack import DOMAIN
from .registry import DEFAULT_DOMAINS
from .trace import outer_names, subgraphs


def _reads(graph: GraphProto) -> Counter[str]:
    """How often each value is read in ``graph``: by its nodes, its nested graphs (names from
    this scope) and its outputs."""
    reads: Counter[str] = Counter(o.name for o in graph.output)
    for node in graph.node:
        reads.update(n for n in node.input if n)
        for sub in subgraphs(node):
            reads.update(outer_names(sub))
    return reads


def _producers(graph: GraphProto) -> dict[str, NodeProto]:
    return {o: node for node in graph.node for o in node.output if o}


def silu_mul(graph: GraphProto) -> int:
    """Fuses every ``(a * Sigmoid(a)) * b`` of ``graph`` and its nested graphs (in place);
    returns how many were fused."""
    count = sum(silu_mul(sub) for node in graph.node for sub in subgraphs(node))
    reads, producer = _reads(graph), _producers(graph)
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
    _replace(graph, fused, removed)
    return count + len(fused)


def _replace(graph: GraphProto, fused: dict[int, NodeProto], removed: set[int]) -> None:
    """``graph``'s nodes with each of ``fused`` (by the id of the node it replaces) in place of
    that node, and those of ``removed`` gone."""
    if fused:
        nodes = [fused.get(id(n), n) for n in graph.node if id(n) not in removed]
        del graph.node[:]
        graph.node.extend(nodes)


def _plain(node: NodeProto, op_type: str, inputs: int) -> bool:
    """Whether ``node`` is the default domain's ``op_type`` with ``inputs`` inputs and no
    attributes (a legacy Mul's broadcast attributes are not fused)."""
    return (
        node.op_type == op_type
        and node.domain in DEFAULT_DOMAINS
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


def transposed_products(graph: GraphProto, scalar: Callable[[str], bool]) -> int:
    """Fuses every ``MatMul`` of ``graph`` and its nested graphs whose operands are Transposes
    (the right one possibly times a constant scalar: ``scalar`` says whether a value is one)
    into a ``TransposedMatMul`` (in place); returns how many products were fused."""
    count = sum(transposed_products(sub, scalar) for node in graph.node for sub in subgraphs(node))
    reads, producer = _reads(graph), _producers(graph)
    removed: set[int] = set()
    fused: dict[int, NodeProto] = {}
    for node in graph.node:
        if not _plain(node, "MatMul", 2) or node.input[0] == node.input[1]:
            continue
        operands, perms, scale, inner = list(node.input), [[], []], [], []
        for i, name in enumerate(node.input):
            found = _transposed(name, producer, reads, scalar if i == 1 else None)
            if found is not None:
                operands[i], perms[i], scaled, nodes = found
                scale += scaled
                inner += nodes
        if operands == list(node.input):
            continue
        removed.update(id(n) for n in inner)
        perm = {f"perm_{x}": p for x, p in zip("ab", perms, strict=True) if p}
        fused[id(node)] = helper.make_node(
            "TransposedMatMul",
            operands + scale,
            list(node.output),
            name=node.name,
            domain=DOMAIN,
            **perm,
        )
    _replace(graph, fused, removed)
    return count + len(fused)


def _transposed(name: str, producer, reads, scalar) -> tuple | None:
    """(x, perm, [c] or [], the nodes only the product reads) when ``name`` is
    ``Transpose(x, perm)``, or (with ``scalar``) ``Transpose(x, perm) * c``, c a constant scalar
    and the Transpose read by the Mul alone."""
    source = producer.get(name)
    if source is None:
        return None
    scale, nodes = [], []
    if scalar is not None and _plain(source, "Mul", 2):
        for t, c in (source.input, reversed(source.input)):
            inner = producer.get(t)
            if inner is not None and inner.op_type == "Transpose" and reads[t] == 1 and scalar(c):
                scale, nodes = [c], [source] if reads[name] == 1 else []
                name, source = t, inner
                break
        else:
            return None
        if not nodes:  # the Mul stays for its other readers, and with it the Transpose
            return None
    if source.op_type != "Transpose" or source.domain not in DEFAULT_DOMAINS:
        return None
    perm = [list(a.ints) for a in source.attribute if a.name == "perm"]
    if not perm or len(source.input) != 1:
        return None  # no perm: the rank is not known here
    if reads[name] == 1:
        nodes.append(source)
    return source.input[0], perm[0], scale, nodes


def scalars(graph: GraphProto, constants: dict) -> Callable[[str], bool]:
    """Whether a value of ``graph`` (or of its nested graphs) is a constant of one element: an
    entry of ``constants`` or the output of a Constant node."""
    found = {name for name, value in constants.items() if getattr(value, "size", 0) == 1}

    def visit(g: GraphProto) -> None:
        for node in g.node:
            if node.op_type == "Constant" and node.domain in DEFAULT_DOMAINS and _one(node):
                found.add(node.output[0])
            for sub in subgraphs(node):
                visit(sub)

    visit(graph)
    return found.__contains__


def _one(node: NodeProto) -> bool:
    """Whether a Constant node's value has one element."""
    for attr in node.attribute:
        if attr.name == "value":
            size = 1
            for d in attr.t.dims:
                size *= d
            return size == 1
        if attr.name in ("value_float", "value_int"):
            return True
    return False
