"""Shape ops against onnxruntime, over the opsets where they changed."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_cases import check_op, node_model, run_jax, run_ort

INT64_MAX = np.iinfo(np.int64).max
INT64_MIN = np.iinfo(np.int64).min
rng = np.random.default_rng(0)


def rand(*shape, dtype=np.float32):
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-50, 50, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def i64(*values):
    return np.asarray(values, np.int64)


@pytest.mark.parametrize("opset", [13, 15, 21])
@pytest.mark.parametrize("bounds", [{}, {"start": 1}, {"end": -1}, {"start": -2, "end": 10}])
def test_shape(opset, bounds):
    if bounds and opset < 15:
        pytest.skip("start/end from opset 15")
    check_op("Shape", {"x": rand(2, 3, 4)}, opset=opset, **bounds)


@pytest.mark.parametrize("opset", [13, 21])
def test_size(opset):
    check_op("Size", {"x": rand(2, 3, 4)}, opset=opset)


@pytest.mark.parametrize("opset", [13, 14, 21])
@pytest.mark.parametrize("shape", [(4, -1), (0, 0, -1, 1), (-1,), (0, 8)])
def test_reshape(opset, shape):
    check_op("Reshape", {"x": rand(3, 4, 2), "s": i64(*shape)}, opset=opset, constants=["s"])


def test_reshape_allowzero():
    x = np.zeros((0, 3), np.float32)
    check_op("Reshape", {"x": x, "s": i64(3, 0)}, opset=14, constants=["s"], allowzero=1)


@pytest.mark.parametrize("opset", [9, 13, 21])
@pytest.mark.parametrize("axis", [0, 2, 3, -1, -3])
def test_flatten(opset, axis):
    if axis < 0 and opset < 11:
        pytest.skip("negative axis from opset 11")
    check_op("Flatten", {"x": rand(2, 3, 4)}, opset=opset, axis=axis)


@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("axis", [0, -1])
def test_concat(opset, axis):
    check_op(
        "Concat",
        {"a": rand(2, 3, dtype=np.int64), "b": rand(2, 3, dtype=np.int64)},
        opset=opset,
        axis=axis,
    )


def test_concat_folded_shape():
    """Concat of constants folds in int64 numpy."""
    check_op(
        "Concat", {"a": i64(1, 2), "b": i64(INT64_MAX)}, opset=13, constants=["a", "b"], axis=0
    )


@pytest.mark.parametrize("opset", [11, 13, 21])
@pytest.mark.parametrize("axes", [(0,), (-1,), (1, 3), (-1, 0)])
def test_unsqueeze(opset, axes):
    x = rand(2, 3)
    if opset < 13:
        check_op("Unsqueeze", {"x": x}, opset=opset, axes=list(axes))
    else:
        check_op("Unsqueeze", {"x": x, "axes": i64(*axes)}, opset=opset, constants=["axes"])


@pytest.mark.parametrize("opset", [11, 13, 21])
@pytest.mark.parametrize("axes", [None, (0,), (-1, 2)])
def test_squeeze(opset, axes):
    x = rand(1, 3, 1, 1)
    if axes is None:
        check_op("Squeeze", {"x": x}, opset=opset)
    elif opset < 13:
        check_op("Squeeze", {"x": x}, opset=opset, axes=list(axes))
    else:
        check_op("Squeeze", {"x": x, "axes": i64(*axes)}, opset=opset, constants=["axes"])


@pytest.mark.parametrize("opset", [1, 13, 21])
@pytest.mark.parametrize("perm", [None, (2, 0, 1)])
def test_transpose(opset, perm):
    kwargs = {} if perm is None else {"perm": list(perm)}
    check_op("Transpose", {"x": rand(2, 3, 4)}, opset=opset, **kwargs)


@pytest.mark.parametrize("opset", [8, 13])
@pytest.mark.parametrize(
    ("xshape", "shape"), [((3, 1), (2, 1, 6)), ((3, 4), (1, 1)), ((1,), (2, 3)), ((2, 1), (2, 4))]
)
def test_expand(opset, xshape, shape):
    x = rand(*xshape, dtype=np.int64)
    check_op("Expand", {"x": x, "s": i64(*shape)}, opset=opset, constants=["s"])


@pytest.mark.parametrize("opset", [6, 13])
def test_tile(opset):
    check_op("Tile", {"x": rand(2, 3), "r": i64(2, 3)}, opset=opset, constants=["r"])


@pytest.mark.parametrize("opset", [11, 13, 18])
def test_split_sizes(opset):
    x = rand(2, 7)
    out = ("a", "b", "c")
    if opset < 13:
        check_op("Split", {"x": x}, out, opset=opset, axis=1, split=[2, 4, 1])
    else:
        check_op("Split", {"x": x, "s": i64(2, 4, 1)}, out, opset=opset, axis=-1, constants=["s"])


@pytest.mark.parametrize("opset", [11, 13, 18])
def test_split_equal(opset):
    check_op(
        "Split",
        {"x": rand(6, 2)},
        ("a", "b", "c"),
        opset=opset,
        axis=0,
        **({"num_outputs": 3} if opset >= 18 else {}),
    )


def test_split_num_outputs_uneven():
    check_op("Split", {"x": rand(2, 7)}, ("a", "b", "c"), opset=18, axis=1, num_outputs=3)


SLICES = [
    ((1,), (INT64_MAX,), (1,), None),  # INT64_MAX end: to the end
    ((0, 1), (-1, 1000), (0, 1), None),  # out-of-range end clamps
    ((-1,), (INT64_MIN,), (1,), (-1,)),  # reversed, to the start
    ((10,), (-100,), (0,), (-2,)),  # start past the end with a negative step
    ((-2, 1), (0, INT64_MAX), (-1, 0), (-1, 2)),  # negative axes
    ((3,), (1,), (1,), (1,)),  # empty
]


@pytest.mark.parametrize("opset", [10, 11, 13])
@pytest.mark.parametrize(("starts", "ends", "axes", "steps"), SLICES)
def test_slice(opset, starts, ends, axes, steps):
    if opset < 11 and any(a < 0 for a in axes):
        pytest.skip("negative axes from opset 11")
    inputs = {
        "x": rand(4, 5, 3, dtype=np.int64),
        "s": i64(*starts),
        "e": i64(*ends),
        "a": i64(*axes),
        "st": None if steps is None else i64(*steps),
    }
    check_op("Slice", inputs, opset=opset, constants=["s", "e", "a", "st"])


def test_slice_attributes():
    check_op("Slice", {"x": rand(4, 5)}, opset=9, starts=[1, -3], ends=[INT64_MAX, -1], axes=[0, 1])


@pytest.mark.parametrize("opset", [2, 11, 13, 18, 19, 21])
@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
def test_pad(opset, mode):
    if mode == "wrap" and opset < 19:
        pytest.skip("wrap from opset 19")
    x = rand(3, 4)
    pads = [1, 0, 2, 3]
    if opset < 11:
        check_op("Pad", {"x": x}, opset=opset, pads=pads, mode=mode, value=1.5)
    else:
        inputs = {
            "x": x,
            "p": i64(*pads),
            "v": np.array(1.5, np.float32) if mode == "constant" else None,
        }
        check_op("Pad", inputs, opset=opset, mode=mode, constants=["p"])


def test_pad_axes_and_negative():
    inputs = {"x": rand(3, 4, 5), "p": i64(2, -1, 1, 0), "v": None, "a": i64(-1, 0)}
    check_op("Pad", inputs, opset=18, constants=["p", "a"])


def test_pad_traced_constant_int():
    inputs = {"x": rand(3, 4, dtype=np.int32), "p": i64(1, 1, 1, 1), "v": np.array(7, np.int32)}
    check_op("Pad", inputs, opset=13, constants=["p"])


@pytest.mark.parametrize("opset", [9, 20, 21])
@pytest.mark.parametrize("value", [None, np.array([7], np.int64), np.array([0.5], np.float32)])
def test_constant_of_shape(opset, value):
    from onnx import numpy_helper

    kwargs = {} if value is None else {"value": numpy_helper.from_array(value)}
    check_op("ConstantOfShape", {"s": i64(2, 3)}, opset=opset, constants=["s"], **kwargs)


@pytest.mark.parametrize(
    ("start", "limit", "delta"),
    [
        (np.int64(1), np.int64(10), np.int64(3)),
        (np.float32(1), np.float32(-2), np.float32(-0.5)),
        (np.int32(5), np.int32(1), np.int32(2)),
    ],
)
def test_range(start, limit, delta):
    check_op("Range", {"a": start, "b": limit, "c": delta}, opset=11, constants=["a", "b", "c"])


def test_range_from_graph_input():
    """A scalar graph input feeding Range becomes a compile-time input."""
    a, b, c = (np.array(v, np.int64) for v in (0, 5, 1))
    check_op("Range", {"a": a, "b": b, "c": c}, opset=11, constants=["a", "c"])


@pytest.mark.parametrize("opset", [9, 22])
@pytest.mark.parametrize(("k", "dtype"), [(0, None), (1, 7), (-2, 1)])
def test_eye_like(opset, k, dtype):
    kwargs = {} if dtype is None else {"dtype": dtype}
    check_op("EyeLike", {"x": rand(3, 4)}, opset=opset, k=k, **kwargs)


@pytest.mark.parametrize("upper", [0, 1])
@pytest.mark.parametrize("k", [None, -1, 2])
def test_trilu(upper, k):
    inputs = {"x": rand(2, 4, 5), "k": None if k is None else i64(k)}
    check_op("Trilu", inputs, opset=14, upper=upper, constants=["k"])


@pytest.mark.parametrize("opset", [1, 11, 13])
@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space(opset, mode):
    if opset < 11 and mode == "CRD":
        pytest.skip("mode from opset 11")
    kwargs = {"mode": mode} if opset >= 11 else {}
    check_op("DepthToSpace", {"x": rand(2, 8, 3, 2)}, opset=opset, blocksize=2, **kwargs)


@pytest.mark.parametrize("opset", [1, 13])
def test_space_to_depth(opset):
    check_op("SpaceToDepth", {"x": rand(2, 2, 6, 4)}, opset=opset, blocksize=2)


def test_center_crop_pad():
    check_op(
        "CenterCropPad",
        {"x": rand(5, 4, 3), "s": i64(2, 7)},
        opset=18,
        constants=["s"],
        axes=[0, -1],
    )


def scales(*values):
    return np.asarray(values, np.float32)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize("factors", [(1, 1, 2, 3), (1, 1, 0.5, 0.75), (1, 1, 1.5, 2.5)])
def test_resize_opset10(mode, factors):
    check_op(
        "Resize",
        {"x": rand(1, 2, 4, 6), "s": scales(*factors)},
        opset=10,
        constants=["s"],
        mode=mode,
    )


@pytest.mark.parametrize("opset", [11, 13, 19])
@pytest.mark.parametrize(
    "coords", ["half_pixel", "align_corners", "asymmetric", "pytorch_half_pixel"]
)
@pytest.mark.parametrize("nearest", ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"])
def test_resize_nearest(opset, coords, nearest):
    inputs = {"x": rand(1, 2, 4, 6), "roi": np.zeros(0, np.float32), "s": scales(1, 1, 1.5, 0.5)}
    check_op(
        "Resize",
        inputs,
        opset=opset,
        constants=["roi", "s"],
        mode="nearest",
        coordinate_transformation_mode=coords,
        nearest_mode=nearest,
    )


@pytest.mark.parametrize("opset", [11, 13, 19])
@pytest.mark.parametrize("mode", ["linear", "cubic"])
@pytest.mark.parametrize(
    "coords", ["half_pixel", "align_corners", "asymmetric", "pytorch_half_pixel"]
)
@pytest.mark.parametrize("factors", [(1, 1, 2, 3), (1, 1, 0.5, 0.8)])
def test_resize_filter(opset, mode, coords, factors):
    inputs = {"x": rand(1, 2, 4, 5), "roi": np.zeros(0, np.float32), "s": scales(*factors)}
    check_op(
        "Resize",
        inputs,
        opset=opset,
        constants=["roi", "s"],
        mode=mode,
        coordinate_transformation_mode=coords,
        atol=1e-4,
    )


def test_resize_cubic_exclude_outside():
    inputs = {"x": rand(1, 1, 4, 4), "roi": None, "s": scales(1, 1, 0.8, 1.7)}
    check_op(
        "Resize",
        inputs,
        opset=13,
        constants=["s"],
        mode="cubic",
        cubic_coeff_a=-0.5,
        exclude_outside=1,
        atol=1e-4,
    )


@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize("policy", ["stretch", "not_larger", "not_smaller"])
def test_resize_sizes_axes(mode, policy):
    inputs = {"x": rand(2, 3, 4, 6), "roi": None, "s": None, "size": i64(7, 3)}
    check_op(
        "Resize",
        inputs,
        opset=18,
        constants=["size"],
        mode=mode,
        axes=[3, 2],
        keep_aspect_ratio_policy=policy,
        atol=1e-4,
    )


@pytest.mark.parametrize("mode", ["linear", "cubic"])
def test_resize_antialias(mode):
    inputs = {"x": rand(1, 1, 8, 9), "roi": None, "s": scales(1, 1, 0.5, 0.6)}
    check_op("Resize", inputs, opset=18, constants=["s"], mode=mode, antialias=1, atol=1e-4)


def test_resize_half_pixel_symmetric():
    inputs = {"x": rand(1, 1, 4, 4), "roi": None, "s": scales(1, 1, 2.5, 0.6)}
    check_op(
        "Resize",
        inputs,
        opset=19,
        constants=["s"],
        mode="linear",
        coordinate_transformation_mode="half_pixel_symmetric",
        atol=1e-4,
    )


def test_resize_tf_crop_and_resize():
    inputs = {
        "x": rand(1, 1, 4, 4),
        "roi": scales(0, 0, 0.2, 0.4, 1, 1, 1.2, 0.8),
        "s": None,
        "size": i64(1, 1, 3, 3),
    }
    check_op(
        "Resize",
        inputs,
        opset=13,
        constants=["roi", "size"],
        mode="linear",
        coordinate_transformation_mode="tf_crop_and_resize",
        extrapolation_value=10.0,
    )


def test_resize_uint8_linear():
    """Integers truncate like onnxruntime; its float rounding may differ by one."""
    x = rng.integers(0, 255, (1, 1, 3, 4)).astype(np.uint8)
    model = node_model(
        "Resize",
        {"x": x, "roi": None, "s": scales(1, 1, 2, 1.5)},
        opset=13,
        constants=["s"],
        mode="linear",
    )
    want, got = run_ort(model, {"x": x})["y"], run_jax(model, {"x": x})["y"]
    assert got.dtype == np.uint8 and got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_upsample(mode):
    inputs = {"x": rand(1, 2, 3, 4), "s": scales(1, 1, 2, 3)}
    check_op("Upsample", inputs, opset=9, constants=["s"], mode=mode)
