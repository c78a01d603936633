"""Weights and KV cache over a JAX mesh: tensor parallelism on "model", batch rows on "data".

The rules come from the graph's structure. A *linear* node is a MatMul, Gemm or MatMulNBits
whose weight is an initializer. Walking back from a linear node's activation input (through
every op but Shape/Size, whose outputs carry no values) finds the linear nodes that feed it:

- a node reached without passing a normalization (a norm of each head alone, such as Gemma 3's
  q/k norms with a scale of head_size values, does not count) is *row-parallel* (its input
  features split on "model": attention's output projection, the MLP's down projection), and the
  linear nodes it reaches are its *column-parallel* partners (attention's q/k/v, the MLP's gate
  and up);
- a group whose walk passes attention (Softmax, GroupQueryAttention, MultiHeadAttention,
  Attention) is split by heads: every projection's outputs must hold whole heads on each
  device; a fused q/k/v projection (its output split, or packed into GroupQueryAttention) is
  first rewritten as one product each (:mod:`.qkv`, by :func:`place_model` and compile), and
  one left fused (its weight a constant of the program) keeps its group replicated;
- an embedding (Gather along axis 0 of an initializer) and the LM head (a linear node whose
  output reaches the logits through no other linear node) are split on the vocabulary when
  they hold at least ``small`` elements, else replicated;
- MatMulNBits splits its N rows (column-parallel) or whole blocks of K (row-parallel).

A group whose sizes the axis does not divide, and linear weights in no group, stay replicated
with one warning naming them. Norm weights, the rotary caches and biases added after the
product are replicated (a Gemm's bias follows its columns). The
``overrides`` table, by initializer name, wins over the rules.

The KV cache is [batch, heads, rows, head_size]: rows on "data", heads on "model" when the
axis divides them. Everything stays replicated over "data".
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .. import kernels
from ..onnx import prepack
from ..onnx.model import Model
from ..onnx.products import attr, linear
from ..onnx.trace import subgraphs
from ..runtime.errors import GenerationError

MODEL, DATA = "model", "data"
AXES = (DATA, MODEL)
SMALL = 1 << 16  # embeddings and LM heads with fewer elements stay replicated
_ATTENTION = {"Softmax", "GroupQueryAttention", "MultiHeadAttention", "Attention"}
_NORMS = {
    "LayerNormalization",
    "SimplifiedLayerNormalization",
    "SkipLayerNormalization",
    "SkipSimplifiedLayerNormalization",
    "RMSNormalization",
    "ReduceMean",
}
_SHAPE_ONLY = {"Shape", "Size"}
# The replicated weights each placed model was warned about (compile does not repeat it).
_WARNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PASS = {"Reshape", "Add", "Cast", "Identity", "Squeeze", "Unsqueeze"}  # before the heads


def make_mesh(
    devices: Sequence[jax.Device] | None = None, *, model: int | None = None, data: int = 1
) -> Mesh:
    """A mesh of axes ("data", "model") over ``devices`` (default: all of them).

    Args:
        devices: the devices, in order.
        model: the size of "model" (default: the devices over ``data``).
        data: the size of "data".
    """
    devices = list(jax.devices() if devices is None else devices)
    model = len(devices) // data if model is None else model
    if model < 1 or data < 1 or model * data != len(devices):
        raise GenerationError(
            f"a mesh of data {data} x model {model} needs {data * model} devices, "
            f"got {len(devices)}"
        )
    return Mesh(np.array(devices, dtype=object).reshape(data, model), AXES)


def axis_size(mesh: Mesh, name: str) -> int:
    """The size of the mesh axis ``name`` (1 when the mesh has none)."""
    return int(mesh.shape[name]) if name in mesh.axis_names else 1


@dataclasses.dataclass
class _Scope:
    """One graph (the main graph or an If / Loop body) of the flattened nodes."""

    producer: dict[str, int]  # value -> index of the node that makes it here
    outputs: list[str]
    parent: int | None = None  # the enclosing scope
    owner: int | None = None  # the node that holds this graph


def _flatten(graph, nodes: list, scopes: list, parent=None, owner=None) -> int:
    """Appends the nodes of ``graph`` and its subgraphs; returns the index of its scope."""
    at = len(scopes)
    scopes.append(_Scope({}, [o.name for o in graph.output], parent, owner))
    for node in graph.node:
        index = len(nodes)
        nodes.append((node, at, []))
        for o in node.output:
            if o:
                scopes[at].producer[o] = index
        for sub in subgraphs(node):
            nodes[index][2].append(_flatten(sub, nodes, scopes, at, index))
    return at


@dataclasses.dataclass
class Rules:
    """The partition spec of each weight, and what stays replicated and why."""

    specs: dict[str, PartitionSpec]
    replicated: dict[str, str]  # initializer -> why it is replicated against the rules' wish
    groups: list[tuple[list[str], str, str]]  # (column weights, row weight, "attention"/"mlp")


def find_rules(
    model: Model,
    mesh: Mesh,
    *,
    head_size: int | None = None,
    small: int = SMALL,
    overrides: Mapping[str, PartitionSpec | None] | None = None,
) -> Rules:
    """The partition specs of ``model``'s weights on ``mesh`` (see the module's docstring).

    Args:
        model: the graph and its weights.
        mesh: a mesh with axes "model" and/or "data".
        head_size: the attention head size (attention projections split by whole heads).
        small: embeddings and LM heads with fewer elements stay replicated.
        overrides: partition specs by initializer name, applied last (None: replicated).
    """
    n = axis_size(mesh, MODEL)
    # Shapes of the weights and of the graph's constants (a small int4 weight is a constant:
    # its node still tells the structure, but only weights are placed).
    shapes = {k: tuple(np.shape(v)) for k, v in model.graph.constants.items()}
    shapes |= {k: tuple(v.shape) for k, v in model.params.items()}
    specs: dict[str, PartitionSpec] = {}
    replicated: dict[str, str] = {}
    groups: list[tuple[list[str], str, str]] = []
    nodes: list = []  # (node, its scope, the scopes of its subgraphs)
    scopes: list[_Scope] = []
    _flatten(model.graph.proto, nodes, scopes)

    def resolve(scope: int | None, name: str) -> tuple[int | None, int]:
        """The node making ``name`` as seen from ``scope``, and the scope that defines it."""
        start = scope
        while scope is not None:
            if name in scopes[scope].producer:
                return scopes[scope].producer[name], scope
            scope = scopes[scope].parent
        return None, 0 if start is None else start

    consumers: dict[tuple[int, str], list[int]] = defaultdict(list)
    for index, (node, scope, _) in enumerate(nodes):
        for name in dict.fromkeys(node.input):
            if name:
                consumers[(resolve(scope, name)[1], name)].append(index)
    linears = {i: lin for i, (nd, _, _) in enumerate(nodes) if (lin := linear(nd, shapes))}
    outputs = {o.name for o in model.outputs}
    logits = {"logits"} & outputs or outputs

    def per_head(node) -> bool:
        """Whether ``node`` normalizes each attention head alone (a normalization whose scale
        holds ``head_size`` values), so that a walk passes it."""
        if node.op_type not in _NORMS or node.op_type == "ReduceMean" or head_size is None:
            return False
        return len(node.input) > 1 and shapes.get(node.input[1]) == (head_size,)

    def back(index: int) -> tuple[set[int], bool, bool]:
        """The linear nodes feeding the activation of node ``index``; whether a normalization
        and attention were passed."""
        node, scope, _ = nodes[index]
        seen, found, norm, attention = set(), set(), False, False
        stack = [(scope, node.input[0])]
        while stack:
            at, where = resolve(*stack.pop())
            if at is None or at in seen:
                continue
            seen.add(at)
            node, scope, inner = nodes[at]
            if at in linears:
                found.add(at)
                continue
            if node.op_type in _SHAPE_ONLY:
                continue
            if per_head(node):  # q/k norms of each head (Gemma 3, Qwen 3) stay within heads
                stack.append((scope, node.input[0]))
                continue
            norm |= node.op_type in _NORMS
            attention |= node.op_type in _ATTENTION
            if node.op_type in _NORMS:
                continue
            stack.extend((scope, i) for i in node.input if i)
            for sub in inner:  # a branch's outputs are the node's
                stack.extend((sub, o) for o in scopes[sub].outputs)
        return found, norm, attention

    def forward(index: int) -> list[tuple[int, str]]:
        """The values node ``index`` makes, with their scope."""
        node, scope, _ = nodes[index]
        return [(scope, o) for o in node.output if o]

    def owner_outputs(scope: int, name: str) -> list[tuple[int, str]]:
        s = scopes[scope]
        if s.owner is None or name not in s.outputs:
            return []
        owner = nodes[s.owner][0]
        j = s.outputs.index(name)
        return [(s.parent, owner.output[j])] if j < len(owner.output) else []

    def fused(index: int) -> bool:
        """Whether the output of a linear node is split into q/k/v: a Split or Slice before
        any Transpose (a Slice after the heads' Transpose is rotary's), or packed into a
        GroupQueryAttention."""
        frontier = forward(index)
        for _ in range(4):
            nxt = []
            for scope, name in frontier:
                for c in consumers[(scope, name)]:
                    node = nodes[c][0]
                    if node.op_type in ("Split", "Slice"):
                        return True
                    packed = node.op_type == "GroupQueryAttention" and len(node.input) > 1
                    if packed and node.input[0] == name and not node.input[1]:
                        return True
                    if node.op_type in _PASS:
                        nxt.extend(forward(c))
            frontier = nxt
        return False

    def reaches_logits(index: int) -> bool:
        """Whether the output of a linear node reaches the logits through no other one."""
        stack, seen = forward(index), set()
        while stack:
            scope, name = stack.pop()
            if scope == 0 and name in logits:
                return True
            stack.extend(owner_outputs(scope, name))
            for c in consumers[(scope, name)]:
                if c not in seen and c not in linears:
                    seen.add(c)
                    stack.extend(forward(c))
        return False

    def put(name: str, axis: int, mesh_axis: str = MODEL) -> None:
        if name not in model.params:
            return
        spec = [None] * len(shapes[name])
        spec[axis] = mesh_axis
        specs[name] = PartitionSpec(*spec)

    grouped: set[str] = set()
    for index, lin in linears.items():
        sources, norm, attention = back(index)
        if norm or not sources:
            continue
        cols = [linears[s] for s in sorted(sources)]
        kind = "attention" if attention else "mlp"
        names = [c.weight for c in cols]
        grouped |= set(names) | {lin.weight}
        groups.append((names, lin.weight, kind))
        unit = head_size if attention and head_size else 1
        why = ""
        if attention and any(fused(s) for s in sources):
            why = "a fused q/k/v projection cannot be split by heads"
        elif any(c.n % (n * unit) for c in cols) or lin.k % (n * unit):
            what = "heads" if attention and head_size else "features"
            why = f"its {what} do not divide by the 'model' axis of {n}"
        elif lin.blocks and lin.blocks % n:
            why = f"its {lin.blocks} blocks of K do not divide by the 'model' axis of {n}"
        if why:
            held = [w for c in cols for w in c.column] + list(lin.row)
            for name in held:
                if name in model.params and len(shapes[name]) > 1:  # not the biases
                    replicated[name] = why
            continue
        if n == 1:
            continue
        for c in cols:
            for name, axis in c.column.items():
                put(name, axis)
        for name, axis in lin.row.items():
            put(name, axis)

    for index, lin in linears.items():
        if lin.weight in grouped or lin.weight in specs:
            continue
        if not reaches_logits(index):
            if lin.weight in model.params:
                replicated.setdefault(lin.weight, "the rules do not recognise its MatMul")
            continue
        grouped.add(lin.weight)
        if n > 1 and lin.n % n == 0 and int(np.prod(shapes[lin.weight])) >= small:
            for name, axis in lin.column.items():
                put(name, axis)
    for node, _, _ in nodes:
        table = node.input[0] if node.input else ""
        gather = node.op_type in ("Gather", "GatherBlockQuantized")
        if not gather or table not in shapes or table in specs:
            continue
        axis = attr(node, "gather_axis" if node.op_type != "Gather" else "axis", 0)
        big = int(np.prod(shapes[table])) >= small
        if n > 1 and axis == 0 and shapes[table][0] % n == 0 and big:
            put(table, 0)
    for name in replicated:  # a weight shared by two groups stays replicated if one says so
        specs.pop(name, None)
    for name, spec in (overrides or {}).items():
        if name not in model.params:
            raise GenerationError(f"override for {name!r}: the model has no such weight")
        spec = PartitionSpec() if spec is None else PartitionSpec(*spec)
        _check_spec(name, shapes[name], spec, mesh)
        specs[name] = spec
        replicated.pop(name, None)
    return Rules(specs, replicated, groups)


def _check_spec(name: str, shape: tuple, spec: PartitionSpec, mesh: Mesh) -> None:
    if len(spec) > len(shape):
        raise GenerationError(f"override for {name!r}: spec {spec} has more axes than {shape}")
    for dim, axes in zip(shape, spec, strict=False):
        for axis in (axes,) if isinstance(axes, str) else axes or ():
            if axis not in mesh.axis_names:
                raise GenerationError(f"override for {name!r}: the mesh has no axis {axis!r}")
            if dim % axis_size(mesh, axis):
                raise GenerationError(
                    f"override for {name!r}: dimension {dim} of {shape} does not divide by "
                    f"the mesh axis {axis!r} of {axis_size(mesh, axis)}"
                )


@dataclasses.dataclass
class Placement:
    """Where a compiled context's arrays live on its mesh.

    Attributes:
        mesh: the mesh.
        rules: the weights' partition specs (and those left replicated).
        cache: the partition spec of each cache array, by input name.
    """

    mesh: Mesh
    rules: Rules
    cache: dict[str, PartitionSpec]

    def sharding(self, spec: PartitionSpec) -> NamedSharding:
        """``spec`` on the mesh."""
        return NamedSharding(self.mesh, spec)

    def place_params(self, params: Mapping[str, Any]) -> dict[str, jax.Array]:
        """The weights, each put on the mesh by its spec (replicated without one)."""
        specs = self.rules.specs
        return {
            k: place(v, self.sharding(specs.get(k, PartitionSpec()))) for k, v in params.items()
        }

    def place_cache(self, arrays: Mapping[str, Any]) -> dict[str, jax.Array]:
        """The cache arrays put on the mesh."""
        return {k: place(v, self.sharding(self.cache[k])) for k, v in arrays.items()}

    @property
    def processes(self) -> int:
        """How many processes the mesh's devices belong to."""
        return len({d.process_index for d in self.mesh.devices.flat})

    def readable(self, x: jax.Array) -> jax.Array:
        """``x``, traced, replicated when the mesh spans processes (so that every process can
        read the value the host loop reads); else as it is."""
        if self.processes == 1:
            return x
        return jax.lax.with_sharding_constraint(x, self.sharding(PartitionSpec()))

    def constrain_cache(self, arrays: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """The cache arrays, traced, held to their shardings (so that donation keeps them)."""
        return {
            k: jax.lax.with_sharding_constraint(v, self.sharding(self.cache[k]))
            for k, v in arrays.items()
        }


def warn_replicated(rules: Rules, path: str) -> None:
    """One warning, one line, naming the linear weights left replicated on "model" and why."""
    if not rules.replicated:
        return
    reasons = defaultdict(list)
    for name, why in rules.replicated.items():
        reasons[why].append(name)
    text = "; ".join(f"{why}: {', '.join(sorted(names))}" for why, names in reasons.items())
    warnings.warn(f"replicated on 'model' ({path}): {text}", stacklevel=4)


def place(value: Any, sharding: NamedSharding) -> jax.Array:
    """``value`` (the same on every process) on ``sharding``: each addressable device gets its
    own slice, read from the host copy, so no device ever holds more than its shard. An array
    already placed so is returned as it is."""
    if isinstance(value, jax.Array) and _placed(value, sharding):
        return value
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _placed(value: jax.Array, sharding: NamedSharding) -> bool:
    held = value.sharding
    return held.device_set == sharding.device_set and held.is_equivalent_to(sharding, value.ndim)


def spans_devices(arrays: Any) -> bool:
    """Whether any array of ``arrays`` (a pytree) lies on more than one device."""
    return any(
        isinstance(x, jax.Array) and len(x.sharding.device_set) > 1 for x in jax.tree.leaves(arrays)
    )


def head_size(model: Model) -> int | None:
    """The attention head size the graph says: the last dimension of its past_key_values.*
    inputs, else a GroupQueryAttention's query width over its heads (None: neither says)."""
    sizes = {
        i.shape[3]
        for i in model.inputs
        if i.name.startswith(("past_key_values.", "past."))
        and i.shape is not None
        and len(i.shape) == 4
        and isinstance(i.shape[3], int)
    }
    if len(sizes) == 1:
        return sizes.pop()
    shapes = {k: tuple(np.shape(v)) for k, v in model.params.items()}
    producer = {o: node for node in model.graph.proto.node for o in node.output}
    for node in model.graph.proto.node:
        if node.op_type != "GroupQueryAttention":
            continue
        heads, kv = int(attr(node, "num_heads", 0)), int(attr(node, "kv_num_heads", 0))
        packed = len(node.input) < 2 or not node.input[1]
        source = producer.get(node.input[0])
        for _ in range(4):  # through a bias Add or a Reshape
            if source is None or source.op_type not in _PASS:
                break
            source = producer.get(source.input[0])
        lin = linear(source, shapes) if source is not None else None
        parts = heads + 2 * kv if packed else heads
        if lin is not None and parts and lin.n % parts == 0:
            return lin.n // parts
    return None


def place_model(
    model: Model,
    mesh: Mesh,
    *,
    small: int = SMALL,
    overrides: Mapping[str, PartitionSpec | None] | None = None,
) -> Model:
    """``model`` with its weights on ``mesh`` by the rules (:func:`find_rules`, the head size
    from :func:`head_size`): each device gets its shards from the host copy of the weights
    (``Model(..., host=True)`` keeps them there), so no device holds a whole split weight.
    Warns once, in one line, naming the linear weights that stay replicated."""
    unknown = [a for a in mesh.axis_names if a not in AXES]
    if unknown:
        raise GenerationError(f"mesh axes {unknown} are not 'model' or 'data'")
    if axis_size(mesh, MODEL) > 1:  # fused q/k/v products as one each (see .qkv)
        from ..onnx.qkv import split_qkv  # it reads this module's view of the products

        model = split_qkv(model)
    rules = find_rules(model, mesh, head_size=head_size(model), small=small, overrides=overrides)
    warn_replicated(rules, model.path)
    specs = rules.specs
    placed = model.with_params(
        {
            k: place(v, NamedSharding(mesh, specs.get(k, PartitionSpec())))
            for k, v in model.params.items()
        }
    )
    _WARNED[placed] = dict(rules.replicated)  # compile does not repeat the same warning
    return placed


def padded_batch(mesh: Mesh, batch_size: int) -> int:
    """``batch_size`` rounded up to a multiple of the mesh's "data" axis: the rows past the
    caller's are padding rows (empty prompts), so any batch runs on any data axis."""
    data = axis_size(mesh, DATA)
    return -(-batch_size // data) * data


def placement(
    ctx: Any,
    mesh: Mesh,
    batch_size: int,
    *,
    small: int = SMALL,
    overrides: Mapping[str, PartitionSpec | None] | None = None,
    warn: bool = True,
) -> Placement:
    """The placement of a context's weights and cache on ``mesh``; warns once, in one line
    (unless ``warn`` is False), naming the linear weights that stay replicated against the
    rules."""
    unknown = [a for a in mesh.axis_names if a not in AXES]
    if unknown:
        raise GenerationError(f"mesh axes {unknown} are not 'model' or 'data'")
    data, n = axis_size(mesh, DATA), axis_size(mesh, MODEL)
    if batch_size % data:
        raise GenerationError(
            f"the mesh axis 'data' of size {data} does not divide the batch of {batch_size}"
        )
    sizes = {e.head_size for e in ctx.cache.entries}
    head = sizes.pop() if len(sizes) == 1 else None
    rules = find_rules(ctx.model, mesh, head_size=head, small=small, overrides=overrides)
    if warn:
        warn_replicated(rules, ctx.model.path)
    cache = {
        e.input: PartitionSpec(
            DATA if data > 1 else None, MODEL if n > 1 and e.heads % n == 0 else None
        )
        for e in ctx.cache.entries
    }
    return Placement(mesh, rules, cache)


def memory(arrays: Any) -> dict[str, int]:
    """Bytes of ``arrays`` (any pytree of jax arrays) on each addressable device, from their
    addressable shards."""
    total: dict[str, int] = defaultdict(int)
    for leaf in jax.tree.leaves(arrays):
        if isinstance(leaf, jax.Array):
            for shard in leaf.addressable_shards:
                total[str(shard.device)] += shard.data.nbytes
    return dict(total)


def apply(
    ctx: Any,
    mesh: Mesh,
    batch_size: int,
    *,
    small: int = SMALL,
    overrides: Mapping[str, PartitionSpec | None] | None = None,
) -> Any:
    """``ctx`` with its weights (and its embedding model's) placed on ``mesh`` and its
    :class:`Placement` set; the models are copies, the caller's keep their weights. Weights that
    ``transmuter_jax.load(..., mesh=)`` placed as the rules say are kept as they are (and its
    warning is not repeated); others are read back to the host and put on their shards.

    On CPU, the kernels are off in the programs of a mesh of more than one device (their custom
    calls are not partitioned): one warning says so."""
    where = placement(ctx, mesh, batch_size, small=small, overrides=overrides, warn=False)
    params = where.place_params(ctx.model.params)
    moved = any(params[k] is not v for k, v in ctx.model.params.items())
    if _WARNED.get(ctx.model) != where.rules.replicated:
        warn_replicated(where.rules, ctx.model.path)
    model = ctx.model
    if moved:
        model = model.with_params(params)
        _WARNED[model] = dict(where.rules.replicated)
    embed = ctx.embed
    if embed is not None:
        rules = find_rules(embed, mesh, small=small)
        placed = {
            k: place(v, where.sharding(rules.specs.get(k, PartitionSpec())))
            for k, v in embed.params.items()
        }
        if any(placed[k] is not v for k, v in embed.params.items()):
            embed = embed.with_params(placed)
    if mesh.devices.size > 1:
        _warn_kernels(model)
    return dataclasses.replace(ctx, model=model, embed=embed, placement=where)


def _warn_kernels(model: Model) -> None:
    """One warning, once per process, that the sharded programs run without the CPU kernels."""
    global _KERNELS_WARNED
    if _KERNELS_WARNED or not kernels.enabled():
        return
    _KERNELS_WARNED = True
    packed = any(n.domain == prepack.DOMAIN for n in model.graph.proto.node)
    extra = (
        f"; {model.path!r} was loaded with its weights packed for them, which stay replicated: "
        "load it with transmuter_jax.load(..., mesh=) to split them"
        if packed
        else ""
    )
    warnings.warn(
        "transmuter_jax: programs over a mesh run without the CPU kernels, whose custom calls "
        f"XLA does not partition{extra}",
        stacklevel=4,
    )


_KERNELS_WARNED = False
