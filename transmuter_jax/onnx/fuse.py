"""Load-time fusions of small op patterns into one internal op of the domain
:data:`~.prepack.DOMAIN`, for XLA:CPU.

- ``(a * Sigmoid(a)) * b`` (SwiGLU's gate, in any operand order) becomes ``SiluMul(a, b)``: one
  vectorized pass on the kernels' pool, where XLA runs the three ops as one fusion on one thread
  (:func:`transmuter_jax.kernels.silu_mul`).
- ``SiluMul(PackedMatMulNBits(a, gate), PackedMatMulNBits(a, up))`` (after the one above and
  the int4 weights' prepacking) becomes ``PackedGateUpNBits(a, gate, up)``: both products and the
  gated activation in one kernel call, ``a`` quantized once
  (:func:`transmuter_jax.kernels.matmul_nbits_gate_up`); ``SiluMul(PackedMatMul(a, gate),
  PackedMatMul(a, up))`` (float32 weights packed in strips) becomes ``PackedGateUp(a, gate, up)``
  likewise (:func:`transmuter_jax.kernels.matmul_gate_up`).
- ``SkipSimplifiedLayerNormalization(PackedMatMulNBits(a, w), skip, gamma)`` (an int4 product
  that the next residual norm reads alone) becomes ``PackedNBitsSkipNorm(a, w, skip, gamma)``:
  the product, the sum and its norm in one kernel call, where two were
  (:func:`transmuter_jax.kernels.matmul_nbits_skip_norm`); a ``PackedMatMul`` (float32 weights
  in strips) likewise becomes ``PackedSkipNorm`` (:func:`transmuter_jax.kernels.matmul_skip_norm`).
- ``MatMul(Transpose(a), Transpose(b) [* c])`` (either operand, any permutation; ``c`` a constant
  scalar) becomes ``TransposedMatMul(a, b[, c], perm_a, perm_b)``: attention's scores over a
  cache's keys ``K^T`` (times the scale, as Whisper's exports write it) without the transposed
  copy of the whole cache that XLA:CPU makes for its dot every step
  (:func:`transmuter_jax.kernels.matmul_nt`), or one ``dot_general`` of the arrays as they are.
- ``MatMul(Softmax(S [* c or / c], axis=-1), v)``, S a MatMul or a fused ``TransposedMatMul``, v
  possibly transposed, ``c`` a constant scalar (attention without a mask, as encoders write it),
  becomes ``SoftmaxAttention(a, b, v, S's scale, c, perm_a, perm_b, perm_b_v, divide)``:
  self-attention runs as one pass of the attention kernel over blocks of queries, where XLA:CPU
  writes and reads the whole [heads, queries, keys] array of scores three times
  (:func:`transmuter_jax.kernels.attention`);
  other shapes compute S as its op would.

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


def gate_up(graph: GraphProto) -> int:
    """Fuses every ``SiluMul(PackedMatMulNBits(a, gate...), PackedMatMulNBits(a, up...))`` of
    ``graph`` and its nested graphs (in place; the two products alike but for their weights,
    without bias or g_idx, read by the SiluMul alone) into ``PackedGateUpNBits(a, gate's b,
    scales, zero points, up's b, scales, zero points)``, and every ``SiluMul(PackedMatMul(a,
    gate), PackedMatMul(a, up))`` (alike but for their weights) into ``PackedGateUp(a, gate,
    up)``; returns how many were fused."""
    count = sum(gate_up(sub) for node in graph.node for sub in subgraphs(node))
    reads, producer = _reads(graph), _producers(graph)
    removed: set[int] = set()
    fused: dict[int, NodeProto] = {}
    for node in graph.node:
        if node.op_type != "SiluMul" or node.domain != DOMAIN or len(node.input) != 2:
            continue
        pair = [producer.get(name) for name in node.input]
        if any(
            p is None or id(p) in removed or reads[n] != 1
            for p, n in zip(pair, node.input, strict=True)
        ):
            continue
        if len({p.input[0] for p in pair}) != 1:
            continue
        if len({tuple(sorted(a.SerializeToString() for a in p.attribute)) for p in pair}) != 1:
            continue
        gate, up = pair
        if all(_packed_product(p) for p in pair):
            removed.update(id(p) for p in pair)
            fused[id(node)] = helper.make_node(
                "PackedGateUp", [gate.input[0], gate.input[1], up.input[1]], list(node.output),
                name=node.name, domain=DOMAIN,
            )  # fmt: skip
            fused[id(node)].attribute.extend(gate.attribute)
            continue
        if not all(_nbits_product(p) for p in pair):
            continue
        weights = [*gate.input[1:4], "", ""][:3] + [*up.input[1:4], "", ""][:3]
        removed.update(id(p) for p in pair)
        fused[id(node)] = helper.make_node(
            "PackedGateUpNBits", [gate.input[0], *weights], list(node.output), name=node.name,
            domain=DOMAIN,
        )  # fmt: skip
        fused[id(node)].attribute.extend(gate.attribute)
    _replace(graph, fused, removed)
    return count + len(fused)


def skip_norm(graph: GraphProto) -> int:
    """Fuses every ``SkipSimplifiedLayerNormalization(PackedMatMulNBits(a, ...), skip, gamma)``
    of ``graph`` and its nested graphs (in place; the product, without bias or g_idx, either of
    the norm's first two inputs and read by it alone; no bias; the norm's mean and inv_std read
    by none) into ``PackedNBitsSkipNorm(a, b, scales, zero points, skip, gamma)`` with the norm's
    outputs, and every such norm of a ``PackedMatMul(a, w)`` (float32 weights in strips) into
    ``PackedSkipNorm(a, w, skip, gamma)``; returns how many were fused."""
    count = sum(skip_norm(sub) for node in graph.node for sub in subgraphs(node))
    reads, producer = _reads(graph), _producers(graph)
    removed: set[int] = set()
    fused: dict[int, NodeProto] = {}
    for node in graph.node:
        if (
            node.op_type != "SkipSimplifiedLayerNormalization"
            or node.domain != "com.microsoft"
            or len(node.input) != 3
            or not all(node.input)
            or any(o and reads[o] for o in node.output[1:3])
        ):
            continue
        for i in (0, 1):
            product = producer.get(node.input[i])
            if product is None or id(product) in removed or reads[node.input[i]] != 1:
                continue
            if _nbits_product(product):
                kind, weights = "PackedNBitsSkipNorm", [*product.input[1:4], ""][:3]
            elif _packed_product(product):
                kind, weights = "PackedSkipNorm", [product.input[1]]
            else:
                continue
            removed.add(id(product))
            fused[id(node)] = helper.make_node(
                kind, [product.input[0], *weights, node.input[1 - i], node.input[2]],
                list(node.output), name=node.name, domain=DOMAIN,
            )  # fmt: skip
            fused[id(node)].attribute.extend(product.attribute)
            fused[id(node)].attribute.extend(a for a in node.attribute if a.name == "epsilon")
            break
    _replace(graph, fused, removed)
    return count + len(fused)


def _packed_product(node: NodeProto) -> bool:
    """Whether ``node`` is a PackedMatMul (float32 weights in strips)."""
    return (
        node.op_type == "PackedMatMul"
        and node.domain == DOMAIN
        and len(node.input) == 2
        and all(node.input)
    )


def _nbits_product(node: NodeProto) -> bool:
    """Whether ``node`` is a packed MatMulNBits without bias or g_idx."""
    return (
        node.op_type == "PackedMatMulNBits"
        and node.domain == DOMAIN
        and 3 <= len(node.input) <= 4
        and all(node.input[:3])
    )


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


def softmax_attention(graph: GraphProto, scalar: Callable[[str], bool], opset: int) -> int:
    """Fuses every ``MatMul(Softmax(S [* c or / c]), v)`` of ``graph`` and its nested graphs over
    the last axis, S a MatMul or a TransposedMatMul (``scalar`` says whether a value is a
    constant scalar; ``opset`` is the default domain's, which sets Softmax's default axis), into
    a ``SoftmaxAttention`` (in place; after :func:`transposed_products`); returns how many were
    fused."""
    count = sum(
        softmax_attention(sub, scalar, opset) for node in graph.node for sub in subgraphs(node)
    )
    reads, producer = _reads(graph), _producers(graph)
    removed: set[int] = set()
    fused: dict[int, NodeProto] = {}
    for node in graph.node:
        perms = {attr.name: list(attr.ints) for attr in node.attribute}
        if not _product(node) or len(node.input) != 2 or "perm_a" in perms:
            continue  # v @ probabilities as they are (v possibly transposed)
        found = _attention(node.input[0], producer, reads, removed, scalar, opset)
        if found is None:
            continue
        scores, scale, divide, inner = found
        removed.update(id(n) for n in inner)
        a, b, *within = scores.input
        perms = {f"{attr.name}_v": list(attr.ints) for attr in node.attribute}  # perm_b_v
        perms.update({attr.name: list(attr.ints) for attr in scores.attribute})
        fused[id(node)] = helper.make_node(
            "SoftmaxAttention",
            [a, b, node.input[1], within[0] if within else "", scale],
            list(node.output),
            name=node.name,
            domain=DOMAIN,
            divide=divide,
            **perms,
        )
    _replace(graph, fused, removed)
    return count + len(fused)


def split_softmax_attention(graph: GraphProto) -> int:
    """Puts back the ops of every ``SoftmaxAttention`` of ``graph`` and its nested graphs (in
    place; a fused scores product stays a ``TransposedMatMul``), for an analysis that follows the
    ops one by one (:func:`transmuter_jax.onnx.rewrite.pad_past` masks the Softmax); returns how
    many were split."""
    count = sum(split_softmax_attention(sub) for node in graph.node for sub in subgraphs(node))
    nodes: list[NodeProto] = []
    for node in graph.node:
        if node.op_type != "SoftmaxAttention" or node.domain != DOMAIN:
            nodes.append(node)
            continue
        count += 1
        a, b, v, within, scale = list(node.input) + [""] * (5 - len(node.input))
        attrs = {attr.name: list(attr.ints) for attr in node.attribute if attr.ints}
        divide = next((attr.i for attr in node.attribute if attr.name == "divide"), 0)
        out = node.output[0]
        scores, probs = f"{out}/scores", f"{out}/probs"
        perms = {k: attrs[k] for k in ("perm_a", "perm_b") if k in attrs}
        if perms or within:
            inputs = [a, b, within] if within else [a, b]
            nodes.append(
                helper.make_node("TransposedMatMul", inputs, [scores], domain=DOMAIN, **perms)
            )
        else:
            nodes.append(helper.make_node("MatMul", [a, b], [scores]))
        if scale:
            scaled = f"{out}/scaled"
            nodes.append(helper.make_node("Div" if divide else "Mul", [scores, scale], [scaled]))
            scores = scaled
        nodes.append(helper.make_node("Softmax", [scores], [probs], axis=-1, name=node.name))
        if "perm_b_v" in attrs:
            nodes.append(
                helper.make_node(
                    "TransposedMatMul", [probs, v], [out], domain=DOMAIN, perm_b=attrs["perm_b_v"]
                )
            )
        else:
            nodes.append(helper.make_node("MatMul", [probs, v], [out]))
    if count:
        del graph.node[:]
        graph.node.extend(nodes)
    return count


def _attention(probs: str, producer, reads, removed, scalar, opset) -> tuple | None:
    """(the scores' product node, c or "", divide, the nodes only the product reads) when
    ``probs`` is ``Softmax(S [* c or / c])`` over the last axis, S a MatMul or TransposedMatMul."""
    softmax = producer.get(probs)
    if softmax is None or reads[probs] != 1 or softmax.op_type != "Softmax":
        return None
    if softmax.domain not in DEFAULT_DOMAINS or len(softmax.input) != 1:
        return None
    axes = [a.i for a in softmax.attribute if a.name == "axis"]
    if (axes or [-1 if opset >= 13 else 1]) != [-1] or len(softmax.attribute) > len(axes):
        return None  # another axis, or one known only with the rank
    scores = softmax.input[0]
    inner = producer.get(scores)
    if inner is None or reads[scores] != 1:
        return None
    nodes, scale, divide = [softmax], "", 0
    if _plain(inner, "Mul", 2) or _plain(inner, "Div", 2):
        pairs = [inner.input] if inner.op_type == "Div" else [inner.input, inner.input[::-1]]
        for product, c in pairs:
            source = producer.get(product)
            if source is not None and _product(source) and reads[product] == 1 and scalar(c):
                nodes.append(inner)
                scale, divide, inner = c, int(inner.op_type == "Div"), source
                break
        else:
            return None
    if not _product(inner) or any(id(n) in removed for n in [*nodes, inner]):
        return None
    return inner, scale, divide, [*nodes, inner]


def _product(node: NodeProto) -> bool:
    """Whether ``node`` is a plain MatMul or a fused TransposedMatMul."""
    return _plain(node, "MatMul", 2) or (
        node.op_type == "TransposedMatMul" and node.domain == DOMAIN
    )


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
