"""Signal and sampling ops against onnxruntime CPU."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_cases import check_op

rng = np.random.default_rng(0)


@pytest.mark.parametrize("onesided", [0, 1])
@pytest.mark.parametrize("inverse", [0, 1])
def test_dft(onesided, inverse):
    width = 1 if onesided and not inverse else 2  # real in, or one-sided spectrum in
    length = 9 if onesided and inverse else 16
    x = rng.standard_normal((2, length, width)).astype(np.float32)
    inputs = {"x": x, "dft_length": np.asarray(16, np.int64), "axis": np.asarray(1, np.int64)}
    check_op(
        "DFT",
        inputs,
        constants=("dft_length", "axis"),
        opset=20,
        onesided=onesided,
        inverse=inverse,
        atol=1e-4,
    )


def test_stft_hann_window():
    signal = rng.standard_normal((1, 64, 1)).astype(np.float32)
    window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(16) / 16)).astype(np.float32)
    inputs = {
        "signal": signal,
        "frame_step": np.asarray(4, np.int64),
        "window": window,
        "frame_length": np.asarray(16, np.int64),
    }
    check_op("STFT", inputs, constants=("frame_step", "frame_length"), opset=17, atol=1e-4)


@pytest.mark.parametrize("op_type", ["HannWindow", "HammingWindow", "BlackmanWindow"])
@pytest.mark.parametrize("periodic", [0, 1])
def test_windows(op_type, periodic):
    inputs = {"size": np.asarray(10, np.int64)}
    check_op(op_type, inputs, constants=("size",), opset=17, periodic=periodic, atol=1e-6)


def test_mel_weight_matrix():
    inputs = {
        "num_mel_bins": np.asarray(8, np.int64),
        "dft_length": np.asarray(64, np.int64),
        "sample_rate": np.asarray(16000, np.int64),
        "lower_edge_hertz": np.asarray(0.0, np.float32),
        "upper_edge_hertz": np.asarray(8000.0, np.float32),
    }
    check_op("MelWeightMatrix", inputs, constants=tuple(inputs), opset=17, atol=1e-6)


@pytest.mark.parametrize("mode", ["linear", "nearest", "cubic"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align_corners", [0, 1])
def test_grid_sample(mode, padding_mode, align_corners):
    inputs = {
        "X": rng.standard_normal((2, 3, 5, 6)).astype(np.float32),
        "grid": rng.uniform(-1.3, 1.3, (2, 4, 7, 2)).astype(np.float32),
    }
    check_op(
        "GridSample",
        inputs,
        opset=20,
        mode=mode,
        padding_mode=padding_mode,
        align_corners=align_corners,
        atol=1e-4,
    )
