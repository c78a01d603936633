"""The ONNX package's own node test cases, for every op transmuter_jax implements.

A case runs when every op of its graph has an implementation. The cases that cannot pass are
listed in ``tests/backend_excludes/*.txt``, one per line with the reason after ``#``.
"""

from __future__ import annotations

import pathlib
import warnings

import ml_dtypes
import numpy as np
import onnx
import pytest

import transmuter_jax as tj
from transmuter_jax.onnx.registry import canonical_domain, lookup
from transmuter_jax.onnx.trace import subgraphs

EXCLUDES = pathlib.Path(__file__).parent / "backend_excludes"


def _excludes() -> dict[str, str]:
    found = {}
    for file in sorted(EXCLUDES.glob("*.txt")):
        for line in file.read_text().splitlines():
            name, _, reason = line.partition("#")
            if name.strip():
                assert reason.strip(), f"{file.name}: exclusion {name.strip()!r} gives no reason"
                found[name.strip()] = reason.strip()
    return found


def _implemented(graph: onnx.GraphProto, opsets: dict[str, int]) -> bool:
    for node in graph.node:
        domain = canonical_domain(node.domain)
        if lookup(domain, node.op_type, opsets.get(domain, 1)) is None:
            return False
        if not all(_implemented(g, opsets) for g in subgraphs(node)):
            return False
    return True


def _cases():
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = collect_testcases(None)
    excluded = _excludes()
    params = []
    seen: dict[tuple, int] = {}
    for case in sorted(cases, key=lambda c: c.name):
        opsets = {canonical_domain(o.domain): o.version for o in case.model.opset_import}
        if case.model.functions or not _implemented(case.model.graph, opsets):
            continue
        marks = []
        if case.name in excluded:
            marks.append(pytest.mark.skip(reason=excluded[case.name]))
        key = _family(case)
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > QUICK_PER_FAMILY:
            marks.append(pytest.mark.slow)
        params.append(pytest.param(case, id=case.name, marks=marks))
    return params


# The quick tier runs the first cases (by name) of each op, and of each op that heads an expanded
# function body; every case is in the slow sweep.
QUICK_PER_FAMILY = 2


def _family(case) -> tuple:
    ops = sorted({n.op_type for n in case.model.graph.node})
    if len(ops) == 1:
        return (ops[0],)
    return ("expanded" if "expanded" in case.name else "several", ops[0])


CASES = _cases()


def _small_float_eps(dtype: np.dtype) -> float:
    """The epsilon of an ml_dtypes float (bfloat16, float8, float4), else 0."""
    if dtype.kind != "V":
        return 0.0
    try:
        return float(ml_dtypes.finfo(dtype).eps)
    except (ValueError, TypeError):
        return 0.0


def _defined(case, feeds: dict, expected: np.ndarray) -> np.ndarray | None:
    """Which output elements ONNX defines, for a graph of one Cast or CastLike from a float to an
    integer type: the spec leaves an out-of-range value undefined (the reference's numbers then
    depend on the ml_dtypes version). None when every element is defined."""
    nodes = case.model.graph.node
    if len(nodes) != 1 or nodes[0].op_type not in ("Cast", "CastLike"):
        return None
    source = np.asarray(feeds[nodes[0].input[0]])
    if source.dtype.kind != "f" and not _small_float_eps(source.dtype):
        return None
    try:
        info = ml_dtypes.iinfo(expected.dtype)
    except (ValueError, TypeError):
        return None
    whole = np.trunc(source.astype(np.float64))
    return (whole >= int(info.min)) & (whole <= int(info.max))


def _array(value) -> np.ndarray:
    if isinstance(value, onnx.TensorProto):
        return onnx.numpy_helper.to_array(value)
    return np.asarray(value)


@pytest.mark.parametrize("case", CASES)
def test_backend_node(case, tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(case.model, path)
    model = tj.load(path)
    graph_inputs = [i.name for i in case.model.graph.input]
    for inputs, outputs in case.data_sets:
        feeds = dict(zip(graph_inputs, map(_array, inputs), strict=False))
        got = model(feeds)
        for info, expected in zip(case.model.graph.output, outputs, strict=True):
            actual = np.asarray(got[info.name])
            expected = _array(expected)
            assert actual.shape == expected.shape, (info.name, actual.shape, expected.shape)
            eps = _small_float_eps(expected.dtype)
            if expected.dtype.kind in "fc" or eps:
                wide = expected.dtype if expected.dtype.kind in "fc" else np.float32
                # Two units in the last place of the output dtype: a low-precision result may
                # round differently from the reference's.
                np.testing.assert_allclose(
                    actual.astype(wide),
                    expected.astype(wide),
                    rtol=max(case.rtol, 1e-5, 2 * eps),
                    atol=max(case.atol, 1e-6),
                    err_msg=info.name,
                )
            else:
                defined = _defined(case, feeds, expected)
                if defined is not None:
                    assert defined.any(), "no element of this case is defined"
                    actual, expected = actual[defined], expected[defined]
                np.testing.assert_array_equal(actual, expected.astype(actual.dtype))


# The goal of issue 13: at least this many of the node test cases run and pass.
GOAL = 1800


def test_node_case_count():
    """Prints how many of the onnx package's node test cases run (every op implemented, not
    excluded); each of them passes when the tests above pass."""
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        total = len(collect_testcases(None))
    excluded = sum(1 for p in CASES if any(m.name == "skip" for m in p.marks))
    running = len(CASES) - excluded
    print(f"\nonnx node test cases: {running} of {total} run ({excluded} excluded)")
    assert running >= GOAL
