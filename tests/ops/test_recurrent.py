"""RNN, GRU and LSTM against onnxruntime CPU: directions, sequence lengths, layouts."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_cases import check_op

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
T, B, I, H = 5, 3, 4, 6


@pytest.mark.parametrize("op_type", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("layout", [0])  # onnxruntime has no layout 1 (the node tests cover it)
def test_recurrent(op_type, direction, layout):
    rng = np.random.default_rng(0)
    d, g = 2 if direction == "bidirectional" else 1, GATES[op_type]

    def randn(*shape):
        return (rng.standard_normal(shape) * 0.5).astype(np.float32)

    state = (B, d, H) if layout else (d, B, H)
    inputs = {
        "X": randn(B, T, I) if layout else randn(T, B, I),
        "W": randn(d, g * H, I),
        "R": randn(d, g * H, H),
        "B": randn(d, 2 * g * H),
        "sequence_lens": np.asarray([5, 2, 4], np.int32),
        "initial_h": randn(*state),
    }
    outputs = ["Y", "Y_h"]
    if op_type == "LSTM":
        inputs["initial_c"] = randn(*state)
        inputs["P"] = randn(d, 3 * H)
        outputs.append("Y_c")
    attrs = {"linear_before_reset": 1} if op_type == "GRU" else {}
    check_op(
        op_type,
        inputs,
        outputs,
        direction=direction,
        hidden_size=H,
        layout=layout,
        atol=1e-5,
        **attrs,
    )
