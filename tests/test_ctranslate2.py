"""The CTranslate2 model.bin reader and its Whisper converter, on small files written here."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from transmuter_jax.default import ctranslate2 as ct2
from transmuter_jax.onnx.errors import TransmuterError


def _name(text: str) -> bytes:
    raw = text.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def _tensor(name: str, value: np.ndarray, code: int) -> bytes:
    data = value.tobytes()
    dims = b"".join(struct.pack("<I", d) for d in value.shape)
    return (
        _name(name)
        + struct.pack("<B", value.ndim)
        + dims
        + struct.pack("<BI", code, len(data))
        + data
    )


def _file(tensors: list[bytes], aliases: list[tuple[str, str]], version: int = 6) -> bytes:
    """A model.bin laid out byte by byte as the format says (not with ct2.write)."""
    head = struct.pack("<I", version) + _name("TestSpec") + struct.pack("<II", 3, len(tensors))
    tail = struct.pack("<I", len(aliases)) + b"".join(_name(a) + _name(t) for a, t in aliases)
    return head + b"".join(tensors) + tail


WEIGHT = np.arange(6, dtype=np.float16).reshape(2, 3) / 4
HEADS = np.array(6, np.int16)


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "model.bin"
    tensors = [
        _tensor("decoder/embeddings/weight", WEIGHT, 4),
        _tensor("decoder/num_heads", HEADS, 2),
        _tensor("decoder/pre_norm", np.array(1, np.int8), 1),
        _tensor("encoder/conv1/bias", np.array([1.5, -2.0], np.float32), 0),
        _tensor("encoder/ids", np.array([[7, 8, 9]], np.int32), 3),
    ]
    path.write_bytes(_file(tensors, [("decoder/projection/weight", "decoder/embeddings/weight")]))
    return path


def test_reads_names_dims_dtypes_and_aliases(small):
    model = ct2.read(small)
    assert (model.version, model.spec, model.revision) == (6, "TestSpec", 3)
    assert list(model.variables) == [
        "decoder/embeddings/weight",
        "decoder/num_heads",
        "decoder/pre_norm",
        "encoder/conv1/bias",
        "encoder/ids",
    ]
    weight = model.variables["decoder/embeddings/weight"]
    assert weight.dtype == np.float16 and weight.shape == (2, 3)
    np.testing.assert_array_equal(weight, WEIGHT)
    assert model.scalar("decoder/num_heads") == 6
    assert model.variables["decoder/num_heads"].dtype == np.int16
    assert model.variables["decoder/pre_norm"].dtype == np.int8
    np.testing.assert_array_equal(model.variables["encoder/conv1/bias"], [1.5, -2.0])
    assert model.variables["encoder/ids"].dtype == np.int32
    assert model.aliases == {"decoder/projection/weight": "decoder/embeddings/weight"}
    np.testing.assert_array_equal(model.get("decoder/projection/weight"), WEIGHT)


def test_write_then_read_gives_the_same_bytes_and_values(small, tmp_path):
    model = ct2.read(small)
    again = tmp_path / "again.bin"
    ct2.write(again, model)
    assert again.read_bytes() == small.read_bytes()
    back = ct2.read(again)
    assert back.aliases == model.aliases
    for name, value in model.variables.items():
        assert back.variables[name].dtype == value.dtype
        np.testing.assert_array_equal(back.variables[name], value)


def test_bfloat16_round_trips(tmp_path):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    value = np.array([1.0, -0.5, 3.0], ml_dtypes.bfloat16)
    model = ct2.CTranslate2Model("TestSpec", 1, {"w": value})
    ct2.write(tmp_path / "m.bin", model)
    back = ct2.read(tmp_path / "m.bin").variables["w"]
    assert back.dtype == value.dtype
    np.testing.assert_array_equal(back.astype(np.float32), [1.0, -0.5, 3.0])


def test_another_version_is_refused(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(_file([_tensor("w", WEIGHT, 4)], [], version=5))
    with pytest.raises(ct2.FormatError, match="version 5; this reader reads version 6"):
        ct2.read(path)


@pytest.mark.parametrize("cut", [3, 20, 60, -5, -1])
def test_a_truncated_file_is_refused_naming_what_is_missing(small, tmp_path, cut):
    path = tmp_path / "cut.bin"
    path.write_bytes(small.read_bytes()[:cut])
    with pytest.raises(ct2.FormatError, match="is truncated: .* needs"):
        ct2.read(path)


def test_format_errors_are_transmuter_errors(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(_file([_tensor("w", WEIGHT, 9)], []))
    with pytest.raises(TransmuterError, match="'w' has dtype code 9"):
        ct2.read(path)


def test_a_byte_count_that_disagrees_with_the_dims_is_refused(tmp_path):
    bad = bytearray(_tensor("w", WEIGHT, 4))
    struct.pack_into("<I", bad, len(bad) - WEIGHT.nbytes - 4, WEIGHT.nbytes - 2)
    path = tmp_path / "model.bin"
    path.write_bytes(_file([bytes(bad)], []))
    with pytest.raises(ct2.FormatError, match=r"'w' \[2, 3\] float16 has 10 bytes, not 12"):
        ct2.read(path)


def test_an_alias_to_a_missing_tensor_is_refused(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(_file([_tensor("w", WEIGHT, 4)], [("a", "nothing")]))
    with pytest.raises(ct2.FormatError, match="alias 'a' names 'nothing'"):
        ct2.read(path)


# --- Whisper -------------------------------------------------------------------------------

D, HEADS_N, FFN, VOCAB, MELS = 4, 2, 8, 11, 3


def _whisper(rng: np.random.Generator) -> ct2.CTranslate2Model:
    """A WhisperSpec model with one encoder and one decoder layer; the k biases are zero."""
    v: dict[str, np.ndarray] = {}

    def r(*shape):
        return rng.standard_normal(shape).astype(np.float16)

    def norm(prefix):
        v[f"{prefix}/gamma"], v[f"{prefix}/beta"] = r(D), r(D)

    def linear(prefix, rows, cols=D, zero=None):
        v[f"{prefix}/weight"], v[f"{prefix}/bias"] = r(rows, cols), r(rows)
        if zero is not None:
            v[f"{prefix}/bias"][zero] = 0

    for side in ("encoder", "decoder"):
        v[f"{side}/num_heads"] = np.array(HEADS_N, np.int16)
        p = f"{side}/layer_0"
        norm(f"{p}/self_attention/layer_norm")
        linear(f"{p}/self_attention/linear_0", 3 * D, zero=slice(D, 2 * D))
        linear(f"{p}/self_attention/linear_1", D)
        if side == "decoder":
            norm(f"{p}/attention/layer_norm")
            linear(f"{p}/attention/linear_0", D)
            linear(f"{p}/attention/linear_1", 2 * D, zero=slice(0, D))
            linear(f"{p}/attention/linear_2", D)
        norm(f"{p}/ffn/layer_norm")
        linear(f"{p}/ffn/linear_0", FFN)
        linear(f"{p}/ffn/linear_1", D, FFN)
        norm(f"{side}/layer_norm")
    v["encoder/conv1/weight"], v["encoder/conv1/bias"] = r(D, MELS, 3), r(D)
    v["encoder/conv2/weight"], v["encoder/conv2/bias"] = r(D, D, 3), r(D)
    v["encoder/position_encodings/encodings"] = r(10, D)
    v["decoder/position_encodings/encodings"] = r(6, D)
    v["decoder/embeddings/weight"] = r(VOCAB, D)
    v["decoder/scale_embeddings"] = np.array(0, np.int8)
    aliases = {"decoder/projection/weight": "decoder/embeddings/weight"}
    return ct2.CTranslate2Model("WhisperSpec", 3, v, aliases)


def test_whisper_shape_is_read_from_the_weights():
    shape = ct2.whisper_shape(_whisper(np.random.default_rng(0)))
    assert shape == ct2.WhisperShape(
        vocab_size=VOCAB, d_model=D, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=HEADS_N, decoder_attention_heads=HEADS_N,
        encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, num_mel_bins=MELS,
        max_source_positions=10, max_target_positions=6,
    )  # fmt: skip


def test_whisper_weights_split_the_fused_projections():
    model = _whisper(np.random.default_rng(0))
    w = ct2.whisper_weights(model)
    qkv = model.variables["decoder/layer_0/self_attention/linear_0/weight"].astype(np.float32)
    attn = "model.decoder.layers.0.self_attn"
    np.testing.assert_array_equal(w[f"{attn}.q_proj.weight"], qkv[:D])
    np.testing.assert_array_equal(w[f"{attn}.k_proj.weight"], qkv[D : 2 * D])
    np.testing.assert_array_equal(w[f"{attn}.v_proj.weight"], qkv[2 * D :])
    assert f"{attn}.k_proj.bias" not in w and f"{attn}.q_proj.bias" in w
    kv = model.variables["decoder/layer_0/attention/linear_1/bias"].astype(np.float32)
    cross = "model.decoder.layers.0.encoder_attn"
    np.testing.assert_array_equal(w[f"{cross}.v_proj.bias"], kv[D:])
    assert f"{cross}.k_proj.bias" not in w
    assert "proj_out.weight" not in w  # tied to model.decoder.embed_tokens.weight
    assert all(a.dtype == np.float32 for a in w.values())
    # transformers' names: 15 per encoder layer, 24 per decoder layer, 11 others
    assert len(w) == 15 + 24 + 11


def test_whisper_refuses_another_activation():
    model = _whisper(np.random.default_rng(0))
    model.variables["decoder/activation"] = np.array(1, np.int8)
    with pytest.raises(ct2.FormatError, match="decoder/activation is 1; Whisper has 3"):
        ct2.whisper_weights(model)


def test_whisper_refuses_another_spec_and_quantized_weights(small):
    with pytest.raises(ct2.FormatError, match="spec is 'TestSpec', not 'WhisperSpec'"):
        ct2.whisper_weights(ct2.read(small))
    model = _whisper(np.random.default_rng(0))
    model.variables["decoder/layer_0/ffn/linear_0/weight_scale"] = np.ones(FFN, np.float32)
    with pytest.raises(ct2.FormatError, match="quantized"):
        ct2.whisper_weights(model)


def test_safetensors_file_is_laid_out_as_the_format_says(tmp_path):
    tensors = {"b": np.ones((2, 2), np.float16), "a": np.arange(3, dtype=np.float32)}
    path = tmp_path / "model.safetensors"
    ct2.save_safetensors(path, tensors)
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    assert size % 8 == 0 and header["__metadata__"] == {"format": "pt"}
    assert header["a"] == {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}
    assert header["b"] == {"dtype": "F32", "shape": [2, 2], "data_offsets": [12, 28]}
    data = raw[8 + size :]
    np.testing.assert_array_equal(np.frombuffer(data[:12], "<f4"), [0, 1, 2])
    np.testing.assert_array_equal(np.frombuffer(data[12:], "<f4"), np.ones(4))
