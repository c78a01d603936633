"""Load-time repacking of float32 matrix-product weights for the CPU kernels.

A 2-D float32 initializer is packed (see :func:`transmuter_jax.kernels.pack`) when every use of
it is a matrix product or an embedding lookup: MatMul or Gemm reading it (or its Transpose) as the
right operand, and Gather along axis 0 of it (or of its Transpose). Those nodes become the
internal ops PackedMatMul, PackedGemm and PackedGather of the domain :data:`DOMAIN`, reading the
packed array under the initializer's name, and the Transpose nodes go: the weight is held once.
A weight whose every product has, as far as the graph's input sizes fix it, more rows than the
kernel takes is left as stored (``plan``'s ``wide``).

The 4-bit weights of MatMulNBits nodes that quantize their input to int8 (accuracy_level 4,
blocks of 32, integer zero points or none) are rearranged into the layout the int4 kernel reads
(:func:`transmuter_jax.kernels.nbits_pack`, same shape and size), their float32 scales and zero
points into tiles of 16 columns (``nbits_pack_scales``, ``nbits_pack_zero_points``), and those
nodes become PackedMatMulNBits: only where every reader of those initializers is such a node.

:func:`mark_tokens` then marks the products whose left operand depends on the graph's token
inputs (``tokens=1``): their rows are a step's tokens, whose padding a decoder step may skip
(:func:`transmuter_jax.kernels.token_rows`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from onnx import GraphProto, NodeProto, TensorProto, helper, numpy_helper

from ..runtime import switch
from .registry import DEFAULT_DOMAINS
from .trace import node_inputs, outer_names, subgraphs

DOMAIN = "transmuter_jax"
MS = "com.microsoft"
# Every matrix a product reads is packed, the smallest too: the kernel computes each row of a
# product the same way at any batch, where XLA's dot tiles the rows of a small product and sums
# the last tile's rows in another order (on AVX2, rows 6 and 7 of a batch of 8), so a slot's
# tokens would depend on where it runs. The kernel's call costs microseconds.
PACK_MIN = 1


@dataclass(frozen=True)
class Packing:
    """How one initializer is packed: ``w [K, N]`` is the initializer, or its transpose."""

    name: str
    transposed: bool
    k: int
    n: int
    dtype = np.float32

    def pack(self, array: np.ndarray) -> np.ndarray:
        from ..kernels import pack

        return pack(np.asarray(array).T if self.transposed else array)

    def packed_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the packed array (strips of the kernels' width)."""
        from ..kernels import STRIP

        return (-(-self.n // STRIP), self.k, STRIP)


@dataclass(frozen=True)
class NBitsPacking:
    """A MatMulNBits weight ``uint8 [N, blocks, 16]`` rearranged for the int4 kernel."""

    name: str
    dtype = np.uint8

    def pack(self, array: np.ndarray) -> np.ndarray:
        from ..kernels import nbits_pack

        return nbits_pack(array)

    def packed_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the packed array: the stored one."""
        return tuple(shape)


@dataclass(frozen=True)
class NBitsScalesPacking:
    """MatMulNBits scales (float32, ``n`` columns of ``blocks``) in tiles of 16 columns."""

    name: str
    n: int
    blocks: int
    dtype = np.float32

    def pack(self, array: np.ndarray) -> np.ndarray:
        from ..kernels import nbits_pack_scales

        return nbits_pack_scales(array, self.n, self.blocks)

    def packed_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the tiles: [ceil(n / 16), blocks, 16]."""
        from ..kernels import NBITS_TILE

        return (-(-self.n // NBITS_TILE), self.blocks, NBITS_TILE)


@dataclass(frozen=True)
class NBitsZeroPointsPacking(NBitsScalesPacking):
    """MatMulNBits 4-bit zero points as one byte each, in the tiles of the scales."""

    dtype = np.uint8

    def pack(self, array: np.ndarray) -> np.ndarray:
        from ..kernels import nbits_pack_zero_points

        return nbits_pack_zero_points(array, self.n, self.blocks)


@dataclass(frozen=True)
class _Use:
    node: NodeProto
    value: str  # what the node reads: the initializer or its Transpose's output
    through_transpose: bool


def _attr(node: NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _consumers(graph: GraphProto) -> dict[str, list[NodeProto]]:
    found: dict[str, list[NodeProto]] = defaultdict(list)
    for node in graph.node:
        for name in dict.fromkeys(node.input):
            if name:
                found[name].append(node)
    return found


def _graphs(graph: GraphProto) -> list[GraphProto]:
    """``graph`` and every graph nested in its nodes (If branches, Loop bodies), outer first."""
    found = [graph]
    for node in graph.node:
        for sub in subgraphs(node):
            found += _graphs(sub)
    return found


def _nested_consumers(graph: GraphProto) -> dict[str, list[NodeProto]]:
    """The readers of each value in ``graph`` and in its nested graphs."""
    found: dict[str, list[NodeProto]] = defaultdict(list)
    for each in _graphs(graph):
        for name, nodes in _consumers(each).items():
            found[name] += nodes
    return found


def _fixed(graph: GraphProto) -> set[str]:
    """Values a packing must leave alone: the graph's inputs and outputs, the outputs of nested
    graphs, names a nested graph defines again (they hide the outer value) and names produced
    by different nodes (the same node in two branches, such as a Transpose of one weight in
    both branches of a merged decoder, gives one value)."""
    fixed = {i.name for i in graph.input} | {o.name for o in graph.output}
    producers: dict[str, set[bytes]] = defaultdict(set)
    for each in _graphs(graph):
        for node in each.node:
            same = NodeProto()
            same.CopyFrom(node)
            same.name = ""
            for name in node.output:
                producers[name].add(same.SerializeToString(deterministic=True))
        if each is not graph:
            fixed |= {o.name for o in each.output} | {i.name for i in each.input}
            fixed |= {t.name for t in each.initializer}
    return fixed | {name for name, kinds in producers.items() if len(kinds) > 1}


def _default_domain(node: NodeProto) -> bool:
    return node.domain in DEFAULT_DOMAINS


def _w_transposed(use: _Use) -> bool | None:
    """For a product reading the value as its right operand, whether w [K, N] is the
    initializer's transpose; None for any other use."""
    node = use.node
    if not _default_domain(node) or len(node.input) < 2 or node.input[1] != use.value:
        return None
    if node.input[0] == use.value or use.value in node.input[2:]:
        return None
    if node.op_type == "MatMul":
        return use.through_transpose
    if node.op_type == "Gemm" and not _attr(node, "broadcast", 0):
        return use.through_transpose != bool(_attr(node, "transB", 0))
    return None


def _is_lookup(use: _Use) -> bool:
    """Whether the use is a Gather of rows of the value (axis 0)."""
    node = use.node
    return (
        node.op_type == "Gather"
        and _default_domain(node)
        and node.input[0] == use.value
        and use.value not in node.input[1:]
        and _attr(node, "axis", 0) == 0
    )


def _uses(name: str, consumers, fixed: set[str]) -> list[_Use] | None:
    """The uses of initializer ``name``, through at most one Transpose; None if one is of
    another kind."""
    uses = []
    for node in consumers.get(name, ()):
        if node.op_type == "Transpose" and _default_domain(node):
            perm = _attr(node, "perm", None)
            out = node.output[0]
            if (perm is not None and list(perm) != [1, 0]) or out in fixed:
                return None
            uses.extend(_Use(inner, out, True) for inner in consumers.get(out, ()))
        else:
            uses.append(_Use(node, name, False))
    if not uses or not all(_w_transposed(u) is not None or _is_lookup(u) for u in uses):
        return None
    return uses


def plan(
    graph: GraphProto, minimum: int | None = None, wide: frozenset[str] = frozenset()
) -> dict[str, Packing]:
    """The initializers of ``graph`` worth packing, by name (from their metadata only).

    ``wide``: values known to have more rows than the kernel takes (:mod:`.product_rows`); a weight
    whose every use is a product of such a value is left as stored: XLA's dot reads it, which
    would otherwise unpack it on every call.
    """
    minimum = PACK_MIN if minimum is None else minimum
    consumers = _nested_consumers(graph)  # products in If branches too (merged decoders)
    fixed = _fixed(graph)
    plans = {}
    for tensor in graph.initializer:
        dims = tuple(tensor.dims)
        if (
            tensor.data_type != TensorProto.FLOAT
            or len(dims) != 2
            or dims[0] * dims[1] < minimum
            or tensor.name in fixed
        ):
            continue
        uses = _uses(tensor.name, consumers, fixed)
        orientations = {_w_transposed(u) for u in uses or ()} - {None}
        if len(orientations) != 1:  # no product, or products of both orientations
            continue
        if all(_w_transposed(u) is not None and u.node.input[0] in wide for u in uses):
            continue
        transposed = orientations.pop()
        k, n = (dims[1], dims[0]) if transposed else dims
        plans[tensor.name] = Packing(tensor.name, transposed, k, n)
    return plans


def _int8_nbits(node: NodeProto, initializers: dict[str, TensorProto]) -> bool:
    """Whether ``node`` is a MatMulNBits that the int4 kernel runs with int8 input on weights,
    scales and zero points in its own layouts: all three initializers of the expected types."""
    inputs = list(node.input) + [""] * (5 - len(node.input))
    b, scales, zp = (initializers.get(name) for name in inputs[1:4])
    k, n = _attr(node, "K", 0), _attr(node, "N", 0)
    blocks = -(-k // 32)
    return (
        node.op_type == "MatMulNBits"
        and node.domain == MS
        and _attr(node, "bits", 4) == 4
        and _attr(node, "block_size", 0) == 32
        and not _attr(node, "weight_prepacked", 0)
        and switch.int8_activations(_attr(node, "accuracy_level", 0))
        and n > 0
        and b is not None
        and b.data_type == TensorProto.UINT8
        and tuple(b.dims) == (n, blocks, 16)
        and scales is not None
        and scales.data_type == TensorProto.FLOAT
        and int(np.prod(scales.dims)) == n * blocks
        and (not inputs[3] or (zp is not None and zp.data_type == TensorProto.UINT8))
        and (zp is None or int(np.prod(zp.dims)) == n * -(-blocks // 2))
        and not inputs[4]
        and len(set(inputs[1:4]) - {""}) == (3 if inputs[3] else 2)
        and inputs[0] not in inputs[1:4]
    )


def _constant(graph: GraphProto, name: str) -> np.ndarray | None:
    """The value of ``name`` when an initializer or a Constant node of ``graph`` gives it."""
    for tensor in graph.initializer:
        if tensor.name == name:
            return numpy_helper.to_array(tensor)
    for node in graph.node:
        if node.op_type == "Constant" and list(node.output) == [name]:
            value = _attr(node, "value", None)
            return None if value is None else numpy_helper.to_array(value)
    return None


def _tied_gathers(
    graph: GraphProto, node: NodeProto, consumers: dict[str, list[NodeProto]], fixed: set[str]
) -> list[NodeProto] | None:
    """The readers of a MatMulNBits weight beside ``node`` when they are only Reshapes of it to
    ``[N, K / 2]`` read only by GatherBlockQuantized rows of the same scales and zero points (an
    embedding tied to the output product, as the onnxruntime-genai builder writes it): those
    Reshapes and gathers, else None."""
    inputs = list(node.input) + [""] * 4
    n, blocks = _attr(node, "N", 0), -(-_attr(node, "K", 0) // 32)
    found = []
    for reshape in consumers.get(inputs[1], ()):
        if reshape is node:
            continue
        if reshape.op_type != "Reshape" or reshape.domain not in DEFAULT_DOMAINS:
            return None
        shape = _constant(graph, reshape.input[1]) if len(reshape.input) > 1 else None
        if shape is None or [int(d) for d in shape.reshape(-1)] != [n, blocks * 16]:
            return None
        if reshape.output[0] in fixed or list(reshape.input).index(inputs[1]) != 0:
            return None
        for gather in consumers.get(reshape.output[0], ()):
            args = list(gather.input) + [""] * 4
            if (
                gather.op_type != "GatherBlockQuantized"
                or gather.domain != MS
                or args[0] != reshape.output[0]
                or reshape.output[0] in args[1:]
                or args[2:4] != inputs[2:4]
                or _attr(gather, "bits", 4) != 4
                or _attr(gather, "block_size", 128) != 32
                or _attr(gather, "gather_axis", 0) % 2 != 0
                or _attr(gather, "quantize_axis", 1) % 2 != 1
            ):
                return None
            found.append(gather)
        found.append(reshape)
    return found


def plan_nbits(graph: GraphProto) -> dict[str, NBitsPacking | NBitsScalesPacking]:
    """The MatMulNBits weights, scales and zero points of ``graph`` to rearrange for the int4
    kernel, by name: those of the nodes whose every such initializer is read only by such nodes
    in the same place, or by the gathers of an embedding tied to them (:func:`_tied_gathers`)."""
    consumers = _consumers(graph)
    fixed = {i.name for i in graph.input} | {o.name for o in graph.output}
    for node in graph.node:
        for sub in subgraphs(node):
            fixed |= outer_names(sub)
    initializers = {t.name: t for t in graph.initializer}
    nodes = [n for n in graph.node if _int8_nbits(n, initializers)]
    tied = {id(n): _tied_gathers(graph, n, consumers, fixed) or [] for n in nodes}
    while True:  # drop nodes sharing an initializer with a reader that is not packed alike
        kept = {id(n) for n in nodes} | {id(g) for n in nodes for g in tied[id(n)]}
        roles = {n.input[i]: i for n in nodes for i in (1, 2, 3) if i < len(n.input)}
        left = [
            n
            for n in nodes
            if all(
                name not in fixed
                and all(
                    id(user) in kept
                    and (
                        user.op_type in ("Reshape", "GatherBlockQuantized")
                        or list(user.input).index(name) == i
                    )
                    for user in consumers.get(name, ())
                )
                and roles[name] == i
                for i, name in enumerate(n.input[1:4], start=1)
                if name
            )
        ]
        if len(left) == len(nodes):
            break
        nodes = left
    plans: dict[str, NBitsPacking | NBitsScalesPacking] = {}
    for node in nodes:
        n, blocks = _attr(node, "N", 0), -(-_attr(node, "K", 0) // 32)
        inputs = list(node.input) + [""] * 4
        plans[inputs[1]] = NBitsPacking(inputs[1])
        plans[inputs[2]] = NBitsScalesPacking(inputs[2], n, blocks)
        if inputs[3]:
            plans[inputs[3]] = NBitsZeroPointsPacking(inputs[3], n, blocks)
    return plans


def rewrite_nbits(graph: GraphProto, plans: dict[str, NBitsPacking | NBitsScalesPacking]) -> None:
    """MatMulNBits nodes reading a rearranged weight become PackedMatMulNBits, and the gathers of
    an embedding tied to one (through a Reshape of the weight) PackedGatherBlockQuantized reading
    it directly (in place)."""
    if not plans:
        return
    reshapes = {
        node.output[0]: node
        for node in graph.node
        if node.op_type == "Reshape" and isinstance(plans.get(node.input[0]), NBitsPacking)
    }
    for node in graph.node:
        if node.op_type == "MatMulNBits" and node.domain == MS and node.input[1] in plans:
            node.op_type = "PackedMatMulNBits"
            node.domain = DOMAIN
        elif node.op_type == "GatherBlockQuantized" and node.input[0] in reshapes:
            weight = reshapes[node.input[0]].input[0]
            scales = plans[node.input[2]]
            node.input[0] = weight
            node.op_type = "PackedGatherBlockQuantized"
            node.domain = DOMAIN
            node.attribute.append(helper.make_attribute("n", scales.n))
    kept = [n for n in graph.node if not (n.op_type == "Reshape" and n.output[0] in reshapes)]
    del graph.node[:]
    graph.node.extend(kept)


def rewrite(graph: GraphProto, plans: dict[str, Packing]) -> None:
    """Replaces the uses of the packed initializers by the internal ops (in place)."""
    if not plans:
        return
    consumers = _nested_consumers(graph)
    source = {}  # value name -> (packing, whether it is the initializer's transpose)
    for name, packing in plans.items():
        source[name] = (packing, False)
        for node in consumers.get(name, ()):
            if node.op_type == "Transpose":
                source[node.output[0]] = (packing, True)
    _rewrite_graph(graph, source)


def _rewrite_graph(graph: GraphProto, source) -> None:
    """Rewrites ``graph``'s nodes, its nested graphs first (their nodes are copied with it)."""
    for node in graph.node:
        for sub in subgraphs(node):
            _rewrite_graph(sub, source)
    nodes = []
    for node in graph.node:
        if node.op_type == "Transpose" and source.get(node.output[0], (None, False))[1]:
            continue  # its readers now read the packed weight
        nodes.append(_replace(node, source))
    del graph.node[:]
    graph.node.extend(nodes)


def _replace(node: NodeProto, source) -> NodeProto:
    if node.op_type == "Gather" and node.input[0] in source:
        packing, via = source[node.input[0]]
        reads_w = via == packing.transposed  # rows of w; else rows of w^T, columns of w
        return helper.make_node(
            "PackedGather",
            [packing.name, node.input[1]],
            list(node.output),
            name=node.name,
            domain=DOMAIN,
            n=packing.n,
            columns=int(not reads_w),
        )
    if node.op_type in ("MatMul", "Gemm") and len(node.input) > 1 and node.input[1] in source:
        packing, _ = source[node.input[1]]
        if node.op_type == "MatMul":
            return helper.make_node(
                "PackedMatMul",
                [node.input[0], packing.name],
                list(node.output),
                name=node.name,
                domain=DOMAIN,
                n=packing.n,
            )
        return helper.make_node(
            "PackedGemm",
            [node.input[0], packing.name, *node.input[2:3]],
            list(node.output),
            name=node.name,
            domain=DOMAIN,
            n=packing.n,
            alpha=float(_attr(node, "alpha", 1.0)),
            beta=float(_attr(node, "beta", 1.0)),
            transA=int(_attr(node, "transA", 0)),
        )
    return node


# The graph inputs whose rows are a step's tokens.
TOKEN_INPUTS = ("input_ids", "inputs_embeds")


def mark_tokens(graph: GraphProto) -> None:
    """Marks ``tokens=1`` on the PackedMatMul and PackedGemm nodes (transA=0) of the main graph
    whose left operand depends on a token input (in place). A product over another input alone
    (pixel values, an encoder's states) keeps every row."""
    tainted = {i.name for i in graph.input if i.name in TOKEN_INPUTS}
    if not tainted:
        return
    for node in graph.node:
        if not node_inputs(node) & tainted:
            continue
        tainted.update(o for o in node.output if o)
        if node.domain != DOMAIN or node.op_type not in ("PackedMatMul", "PackedGemm"):
            continue
        if node.input[0] in tainted and not _attr(node, "transA", 0):
            node.attribute.append(helper.make_attribute("tokens", 1))
