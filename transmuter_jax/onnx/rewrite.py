"""Lets a decoder that reads positions from its cache length run on a padded cache.

Some decoders (optimum's Whisper, Marian and Gemma 3 exports) take no position_ids: they compute
the positions of the new tokens from the length of the past keys (Shape -> Gather), so every
cache length is a new input shape and compiles its own program. :func:`pad_past` rewrites such a
graph to run on a past of any fixed length whose first ``pad`` rows are padding, where ``pad`` is
a new input: one number per row ([B], so rows of different lengths share one cache) where every
self-attention's scores have the batch first and the keys last, else one for every row:

- The padding comes first, so the graph's own view of the sequence (indices into the past plus
  the new tokens) is the true one shifted by ``pad``. Relative quantities (causal and sliding
  window masks, which compare query positions with key indices) stay right; where a position is
  used as an absolute value (an embedding row, a rotary angle), ``pad`` is subtracted.
- Before each self-attention Softmax the padding keys get -inf, so they have weight exactly 0.

The rewrite is found, not named: the graph is traced twice (abstractly) with two past lengths,
and the values that change tell what depends on the cache length. Positions are the values made
by a Range that grow by exactly the change in length; the padding rows are followed from the past
inputs through the attention. Anything else that the length or the padding rows reach (a use this
module does not understand) refuses the rewrite with a reason, and the caller keeps the graph.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import ChainMap
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from onnx import GraphProto, NodeProto, TensorProto, helper

from . import fuse
from .model import Model, ValueInfo
from .registry import canonical_domain
from .trace import Graph, is_static, run_nodes, static_dependencies

PAD_INPUT = "transmuter_jax::past_padding"
PROBES = (7, 19)  # the two past lengths of the abstract traces

# Ops whose output only depends on the input's shape.
_SHAPE_ONLY = {"Shape", "Size"}
# Comparisons and differences: a position against another value in the graph's own coordinates.
_RELATIVE = {"Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Equal", "Sub"}
# Ops that move a tensor's elements (or cast them) without mixing rows.
_LAYOUT = {
    "Cast",
    "Identity",
    "Unsqueeze",
    "Squeeze",
    "Reshape",
    "Expand",
    "Tile",
    "Transpose",
    "Concat",
}
_ELEMENTWISE = {
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Where",
    "Cast",
    "Identity",
    "Neg",
    "Tanh",
    "Max",
    "Min",
    "And",
    "Or",
    "Not",
    "Equal",
    "Less",
    "LessOrEqual",
    "Greater",
    "GreaterOrEqual",
}
# Ops with index inputs (input number) into a data input (0).
_INDEXING = {"Gather": (1,), "GatherElements": (1,), "GatherND": (1,), "ScatterND": (1, 2)}
# Ops that keep exact zeros where the attention weights of padding keys are 0.
_KEEPS_ZERO = {"Cast", "Identity", "Dropout", "Mul", "Div"}


class NotPaddable(Exception):
    """The graph uses the cache length in a way the rewrite does not understand."""


@dataclasses.dataclass(frozen=True)
class PaddedPast:
    """A decoder rewritten to take a past whose first ``pad`` rows are padding.

    Attributes:
        model: the rewritten decoder; it shares the original's weights.
        input: the name of the new int64 input, the number of padding rows: [B], each row's own
            (``per_row``), else a scalar for every row.
        shifted: the values used as absolute positions, from which ``pad`` is subtracted.
        masked: the Softmax nodes whose padding keys are masked.
        per_row: whether each row has padding of its own (rows of other lengths share a cache).
        shared: why rows share one padding ("" when ``per_row``).
    """

    model: Model
    input: str
    shifted: tuple[str, ...]
    masked: tuple[str, ...]
    per_row: bool = False
    shared: str = ""


@dataclasses.dataclass
class Run:
    """What one abstract trace saw: each node in order and each value."""

    nodes: list[tuple[tuple, int, NodeProto]]  # (graph path, index, node)
    values: dict[str, Any]  # numpy arrays (known at trace time), else jax.ShapeDtypeStruct
    opsets: Mapping[str, int]


def probe(model: Model, inputs: Mapping[str, Any]) -> Run:
    """Traces ``model`` abstractly; an If with a known condition runs its branch inline."""
    static = {k: v for k, v in inputs.items() if isinstance(v, np.ndarray)}
    dynamic = {k: v for k, v in inputs.items() if k not in static}
    run = Run([], {}, model.graph.opsets)

    def record(scope: Mapping[str, Any]) -> None:
        for name, value in scope.items():
            if is_static(value):
                run.values[name] = value
            elif hasattr(value, "shape") and hasattr(value, "dtype"):
                run.values[name] = jax.ShapeDtypeStruct(tuple(value.shape), value.dtype)

    def walk(graph: Graph, path: tuple, scope: ChainMap) -> None:
        for index, node in enumerate(graph.proto.node):
            cond = scope.get(node.input[0]) if node.input else None
            if node.op_type == "If" and canonical_domain(node.domain) == "" and is_static(cond):
                name = "then_branch" if bool(np.asarray(cond).reshape(-1)[0]) else "else_branch"
                proto = next(a.g for a in node.attribute if a.name == name)
                sub = graph.sub(proto)
                child = scope.new_child(dict(sub.constants))
                walk(sub, (*path, (index, name)), child)
                record(child.maps[0])
                for out, value in zip(node.output, proto.output, strict=True):
                    scope[out] = child[value.name]
                run.nodes.append((path, index, node))
                continue
            one = Graph(GraphProto(node=[node]), graph.opsets, graph.file, {})
            run_nodes(one, scope)
            run.nodes.append((path, index, node))

    def function(params, values):
        graph = model.graph
        scope = ChainMap({**graph.constants, **params, **static, **values})
        walk(graph, (), scope)
        record(scope.maps[0])
        return 0

    jax.eval_shape(function, model.params, dynamic)
    return run


def _kind(a: Any, b: Any, change: int) -> str:
    """How a value changes between the two traces: same, affine (grows by ``change``), other
    (known at trace time), padded (its shape changes) or dynamic."""
    if is_static(a) != is_static(b):
        raise NotPaddable("a value is known at trace time for one cache length only")
    if not is_static(a):
        return "dynamic" if a.shape == b.shape else "padded"
    if a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b):
        return "same"
    if a.shape == b.shape and a.dtype.kind in "iuf" and np.all(b - a == change):
        return "affine"
    return "other"


def _negative_axes(a: Any, b: Any) -> list[int]:
    """The axes (counted from the end) where the shapes of ``a`` and ``b`` differ."""
    if len(a.shape) != len(b.shape):
        raise NotPaddable("a tensor's rank depends on the cache length")
    rank = len(a.shape)
    return [i - rank for i, (x, y) in enumerate(zip(a.shape, b.shape, strict=True)) if x != y]


@dataclasses.dataclass
class _Plan:
    # (path, node index, input, value, dtype, rank)
    shifts: list[tuple[tuple, int, int, str, np.dtype, int]]
    # (path, node index, axis, dtype, the scores' shape in the first trace)
    masks: list[tuple[tuple, int, int, np.dtype, tuple]]


def _label(node: NodeProto) -> str:
    return f"{node.name or '<unnamed>'} ({node.op_type})"


def _analyse(model: Model, first: Run, second: Run, past: Sequence[str], change: int) -> _Plan:
    """Where positions are used as absolute values and where padding rows meet a Softmax."""
    kinds: dict[str, str] = {}
    for name, a in first.values.items():
        if name in second.values:
            kinds[name] = _kind(a, second.values[name], change)
    positions: set[str] = set()  # affine values made by a Range, and values moved from them
    corrected: set[str] = set()  # values computed from shifted positions
    taint: dict[str, tuple[str, int]] = {p: ("rows", -2) for p in past}  # padding rows: axis
    plan = _Plan([], [])
    specs = _Specs(model)
    for path, index, node in first.nodes:
        op = node.op_type
        spec = specs.get(path, node)
        inputs = list(node.input)
        outputs = [o for o in node.output if o]
        out_kinds = [kinds.get(o, "dynamic") for o in outputs]
        if any(n in corrected for n in inputs):
            corrected.update(outputs)
        # 1. Positions: moved along, compared in the graph's coordinates, or used as values.
        if op == "Range" and out_kinds == ["affine"]:
            positions.add(outputs[0])
            continue
        for i, name in enumerate(inputs):
            if name not in positions or op in _SHAPE_ONLY or i in spec.static:
                continue
            if out_kinds and all(k == "affine" for k in out_kinds):
                positions.update(outputs)
                continue
            others = [n for j, n in enumerate(inputs) if j != i and n]
            if op in _RELATIVE and others and all(_coordinate(n, kinds, positions) for n in others):
                continue
            value = first.values[name]
            plan.shifts.append((path, index, i, name, np.dtype(value.dtype), len(value.shape)))
            corrected.update(outputs)
        # 2. Other values of the cache length: shapes, indices, or masks over the padded keys.
        for i, name in enumerate(inputs):
            if kinds.get(name) not in ("affine", "other") or name in positions | corrected:
                continue
            if op in _SHAPE_ONLY or i in spec.static or all(map(_is_static_kind, out_kinds)):
                continue
            if op in _INDEXING and i in _INDEXING[op] and kinds.get(inputs[0]) == "padded":
                continue  # an index into a tensor in the graph's own coordinates
            if (op in _ELEMENTWISE or op == "ScatterND") and "padded" in out_kinds:
                continue  # a mask combined with scores (or written into a mask) over the keys
            raise NotPaddable(f"node {_label(node)} uses a value of the cache length")
        # 3. Padding rows.
        tainted = [(i, taint[n]) for i, n in enumerate(inputs) if n in taint]
        if tainted and op not in _SHAPE_ONLY:
            _follow(node, tainted, outputs, first, second, taint, plan, path, index)
    return plan


def _coordinate(name: str, kinds: Mapping[str, str], positions: set[str]) -> bool:
    """Whether a value is in the graph's own coordinates (it depends on the cache length)."""
    return name in positions or kinds.get(name) in ("affine", "other", "padded")


def _is_static_kind(kind: str) -> bool:
    """Whether a value of this kind is known at trace time."""
    return kind in ("same", "affine", "other")


class _Specs:
    """Op specs of the nodes of a graph and its subgraphs, by graph path."""

    def __init__(self, model: Model):
        self.root = model.graph
        self.graphs: dict[tuple, Graph] = {(): self.root}

    def graph(self, path: tuple) -> Graph:
        if path not in self.graphs:
            parent = self.graph(path[:-1])
            index, name = path[-1]
            proto = next(a.g for a in parent.proto.node[index].attribute if a.name == name)
            self.graphs[path] = parent.sub(proto)
        return self.graphs[path]

    def get(self, path: tuple, node: NodeProto):
        return self.graph(path).spec(node)


def _follow(node, tainted, outputs, first, second, taint, plan, path, index) -> None:
    """Carries the padding rows of the cache through ``node``, or refuses."""
    op = node.op_type
    refuse = NotPaddable(f"padding rows of the cache reach node {_label(node)}")
    states = {state for _, (state, _) in tainted}
    if len(outputs) != 1:
        raise refuse
    out = outputs[0]
    out_a, out_b = first.values.get(out), second.values.get(out)
    if out_a is None or out_b is None or is_static(out_a):
        raise refuse
    axes = _negative_axes(out_a, out_b)
    if op == "TransposedMatMul":  # MatMul of its operands transposed (onnx.fuse)
        perms = {a.name: list(a.ints) for a in node.attribute}
        moved = []
        for j, (s, ax) in tainted:
            rank = len(first.values[node.input[j]].shape)
            perm = perms.get("perm_a" if j == 0 else "perm_b") or list(range(rank))
            moved.append((j, (s, perm.index(ax + rank) - rank)))
        tainted, op = moved, "MatMul"
    (i, (state, axis)), *rest = tainted
    if op == "MatMul":
        if states == {"rows"} and i == 1 and not rest and axis == -1 and axes == [-1]:
            taint[out] = ("rows", -1)  # scores over the keys
            return
        if len(tainted) == 2 and tainted[0][1] == ("zero", -1) and tainted[1][1] == ("rows", -2):
            return  # weights that are 0 on the padding keys times the cache's values
        raise refuse
    if len(states) == 1 and op == "Transpose":
        rank = len(out_a.shape)
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        moved = (perm or list(reversed(range(rank)))).index(axis + rank) - rank
        if axes != [moved]:
            raise refuse
        taint[out] = (state, moved)
        return
    if states == {"rows"}:
        if op == "Softmax":
            rank = len(out_a.shape)
            default = -1 if _opset(node, first) >= 13 else 1
            along = next((a.i for a in node.attribute if a.name == "axis"), default)
            along = along - rank if along >= 0 else along
            if along != axis or axes != [axis] or (default == 1 and along != -1):
                raise NotPaddable(f"Softmax {_label(node)} is not over the padded keys")
            scores = first.values[node.input[0]].shape
            plan.masks.append((path, index, axis, np.dtype(out_a.dtype), tuple(scores)))
            taint[out] = ("zero", axis)
            return
        if op == "Concat":
            along = next(a.i for a in node.attribute if a.name == "axis")
            if (along if along < 0 else along - len(out_a.shape)) != axis or axes != [axis]:
                raise NotPaddable(f"node {_label(node)} concatenates across padding rows")
            taint[out] = ("rows", axis)
            return
        if op in _LAYOUT or op in _ELEMENTWISE:
            source = first.values[node.input[i]]
            if axes != [axis] or not _same_rows(source.shape, out_a.shape, axis):
                raise refuse
            taint[out] = ("rows", axis)
            return
    if states == {"zero"}:
        if op in ("IsNaN", "IsInf"):
            return  # false on the padding keys, whose weights are 0
        if op in _LAYOUT and op != "Concat" and not rest:  # zeros moved, the keys' axis kept
            source = first.values[node.input[i]]
            if axes != [axis] or not _same_rows(source.shape, out_a.shape, axis):
                raise refuse
            taint[out] = ("zero", axis)
            return
        if op in _KEEPS_ZERO or op == "Where" and _zero_where(node, first, tainted):
            taint[out] = ("zero", axis)
            return
    raise refuse


def _same_rows(source: tuple, out: tuple, axis: int) -> bool:
    """Whether the padded axis keeps its length and the axes after it in a layout op."""
    after = len(source) + axis + 1, len(out) + axis + 1
    return source[axis] == out[axis] and source[after[0] :] == out[after[1] :]


def _opset(node: NodeProto, run: Run) -> int:
    return run.opsets.get(canonical_domain(node.domain), 1)


def _zero_where(node: NodeProto, run: Run, tainted) -> bool:
    """Where(c, 0, x) with x zero on the padding keys: still zero there."""
    if [i for i, _ in tainted] != [2]:
        return False
    fill = run.values.get(node.input[1])
    return fill is not None and is_static(fill) and not np.any(fill)


def _subgraph(root: GraphProto, path: tuple) -> GraphProto:
    graph = root
    for index, name in path:
        graph = next(a.g for a in graph.node[index].attribute if a.name == name)
    return graph


def _rewrite(model: Model, plan: _Plan, batch: int | None) -> Model:
    """A copy of ``model`` whose graph subtracts the padding from the planned positions and masks
    the padding keys of the planned Softmax nodes. ``batch``: the probes' batch, where the
    padding input is one number per row ([B]); None: one number for every row."""
    proto = copy.deepcopy(model.graph.proto)
    shape: list = [] if batch is None else ["batch"]
    proto.input.append(helper.make_tensor_value_info(PAD_INPUT, TensorProto.INT64, shape))
    inserts: dict[tuple, dict[int, list[NodeProto]]] = {}
    counter = iter(range(1 << 30))

    def fresh(stem: str) -> str:
        return f"{PAD_INPUT}/{stem}_{next(counter)}"

    def per_row(value: str, rank: int) -> tuple[str, list[NodeProto]]:
        """The padding as [B, 1, ...] of ``rank`` axes (a row's own on its batch index)."""
        shaped, dims = fresh("rows"), fresh("dims")
        dims_value = np.array([-1] + [1] * (rank - 1), np.int64)
        return shaped, [
            _constant(dims, dims_value),
            helper.make_node("Reshape", [value, dims], [shaped], name=shaped),
        ]

    for path, index, i, name, dtype, rank in plan.shifts:
        node = _subgraph(proto, path).node[index]
        cast, shifted = fresh("cast"), fresh("shifted")
        to = helper.np_dtype_to_tensor_dtype(dtype)
        new = [helper.make_node("Cast", [PAD_INPUT], [cast], to=to, name=cast)]
        if batch is not None:  # [S] positions become [B, S]: each row's own
            cast, more = per_row(cast, max(rank, 2))
            new += more
        new.append(helper.make_node("Sub", [name, cast], [shifted], name=shifted))
        node.input[i] = shifted
        inserts.setdefault(path, {}).setdefault(index, []).extend(new)
    for path, index, axis, dtype, scores_shape in plan.masks:
        node = _subgraph(proto, path).node[index]
        scores = node.input[0]
        names = {k: fresh(k) for k in ("shape", "axis", "n", "zero", "one", "keys", "pad", "hide")}
        names |= {k: fresh(k) for k in ("trail", "fill", "masked")}
        new = [
            helper.make_node("Shape", [scores], [names["shape"]]),
            _constant(names["axis"], np.array(axis, np.int64)),
            helper.make_node("Gather", [names["shape"], names["axis"]], [names["n"]], axis=0),
            _constant(names["zero"], np.array(0, np.int64)),
            _constant(names["one"], np.array(1, np.int64)),
            helper.make_node("Range", [names["zero"], names["n"], names["one"]], [names["keys"]]),
            helper.make_node("Cast", [PAD_INPUT], [names["pad"]], to=TensorProto.INT64),
        ]
        pad = names["pad"]
        if batch is not None:  # [B, 1] against the keys: [B, keys], then the scores' axes
            pad, more = per_row(pad, 2)
            new += more
        new.append(helper.make_node("Less", [names["keys"], pad], [names["hide"]]))
        hide = names["hide"]
        rank = len(scores_shape)
        trail = np.arange(1, -axis, dtype=np.int64)  # the axes after the keys'
        if batch is not None:
            trail = np.arange(1, rank - 1, dtype=np.int64)  # the axes between batch and keys
        if trail.size:
            new.append(_constant(names["trail"], trail))
            new.append(helper.make_node("Unsqueeze", [hide, names["trail"]], [fresh("hide")]))
            hide = new[-1].output[0]
        new += [
            _constant(names["fill"], np.array(-np.inf, dtype)),
            helper.make_node("Where", [hide, names["fill"], scores], [names["masked"]]),
        ]
        node.input[0] = names["masked"]
        inserts.setdefault(path, {}).setdefault(index, []).extend(new)
    for path, at in inserts.items():
        graph = _subgraph(proto, path)
        nodes = []
        for index, node in enumerate(graph.node):
            nodes.extend(at.get(index, []))
            nodes.append(node)
        del graph.node[:]
        graph.node.extend(nodes)
    info = ValueInfo(PAD_INPUT, "int64", () if batch is None else ("batch",))
    return model.with_graph(proto, inputs=[*model.inputs, info])


def _rows_apart(plan: _Plan, batch: int) -> bool:
    """Whether each row can have padding of its own: every masked Softmax is over the last axis
    of scores whose first axis is the batch."""
    return all(axis == -1 and shape[:1] == (batch,) for *_, axis, _, shape in plan.masks)


def _constant(name: str, value: np.ndarray) -> NodeProto:
    return helper.make_node(
        "Constant",
        [],
        [name],
        value=helper.make_tensor(
            name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape, value.reshape(-1)
        ),
    )


def pad_past(
    model: Model, inputs: Callable[[int], Mapping[str, Any]], past: Sequence[str]
) -> PaddedPast:
    """``model`` rewritten to take a past whose first rows are padding.

    Args:
        model: a decoder whose positions come from the length of its past.
        inputs: the inputs of one step after a past of the given length: numpy arrays for the
            static inputs (with the values of the branch that reads the past), and
            jax.ShapeDtypeStruct for the others.
        past: the inputs whose axis 2 is the past (self-attention keys and values).

    Raises:
        NotPaddable: the graph uses the past's length or rows in a way this does not understand.
    """
    if not past:
        raise NotPaddable("the decoder has no self-attention cache")
    proto = copy.deepcopy(model.graph.proto)
    if fuse.split_softmax_attention(proto):  # the Softmax that a padding mask goes before
        model = model.with_graph(proto)
    try:
        first, second = (probe(model, inputs(n)) for n in PROBES)
        plan = _analyse(model, first, second, past, PROBES[1] - PROBES[0])
    except NotPaddable:
        raise
    except Exception as error:  # noqa: BLE001 - a graph this cannot follow keeps its lengths
        raise NotPaddable(f"cannot follow the cache through the graph: {error!r}") from error
    if not plan.masks:
        raise NotPaddable("no self-attention Softmax over the cache was found")
    check = dict(inputs(PROBES[0]))
    batch = int(np.shape(check[past[0]])[0])
    padded, why = None, "a self-attention's scores do not have the batch first, the keys last"
    if _rows_apart(plan, batch):  # a padding of each row's own, where the graph allows it
        padded, why = _checked(model, _rewrite(model, plan, batch), check, (batch,), first)
    per_row = padded is not None
    if padded is None:
        padded, error = _checked(model, _rewrite(model, plan, None), check, (), first)
        if padded is None:
            raise NotPaddable(error)
    shifted = tuple(shift[3] for shift in plan.shifts)
    masked = tuple(
        _subgraph(model.graph.proto, path).node[index].name for path, index, *_ in plan.masks
    )
    return PaddedPast(padded, PAD_INPUT, shifted, masked, per_row, why)


def _checked(
    model: Model, padded: Model, check: dict[str, Any], shape: tuple, first: Run
) -> tuple[Model | None, str]:
    """``padded`` if it traces with a padding input of ``shape`` and gives the outputs the
    shapes of ``model``'s, else None and why."""
    if PAD_INPUT in static_dependencies(padded.graph):
        return None, "the padding would be needed at trace time"
    try:
        run = probe(padded, {**check, PAD_INPUT: jax.ShapeDtypeStruct(shape, np.int32)})
    except Exception as error:  # noqa: BLE001 - any failure to trace keeps the original graph
        return None, f"the rewritten graph does not trace: {error}"
    for out in model.graph.proto.output:
        want, got = first.values.get(out.name), run.values.get(out.name)
        if want is not None and (got is None or tuple(got.shape) != tuple(want.shape)):
            return None, f"the rewritten graph's {out.name} has another shape"
    return padded, ""
