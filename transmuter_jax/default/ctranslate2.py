"""Read CTranslate2 ``model.bin`` files and turn a Whisper one into transformers' weights.

Pure numpy (no ctranslate2, no torch): the default speech model is prepared from such a file.

The binary format (little-endian), version 6:

- uint32 version, then the spec name and a uint32 revision, then a uint32 tensor count;
- each tensor: its name, a uint8 rank, one uint32 per dim, a uint8 dtype, a uint32 byte count,
  the raw bytes;
- a uint32 alias count, then pairs of names (alias, target).

A name (and the spec name) is a uint16 byte count and that many bytes, ending in NUL.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

try:
    from ..runtime.errors import ModelFileError as _Error
except ImportError:  # loaded by its path in the preparation environment, outside the package
    _Error = ValueError  # type: ignore[assignment,misc]

VERSION = 6
# CTranslate2's DataType enum; bfloat16 is read as ml_dtypes.bfloat16.
DTYPES: dict[int, str] = {
    0: "float32",
    1: "int8",
    2: "int16",
    3: "int32",
    4: "float16",
    5: "bfloat16",
}


class FormatError(_Error):
    """A file that is not a CTranslate2 model this reader knows."""


@dataclass
class CTranslate2Model:
    """The contents of a CTranslate2 ``model.bin``."""

    spec: str
    revision: int
    variables: dict[str, np.ndarray]
    aliases: dict[str, str] = field(default_factory=dict)
    version: int = VERSION

    def get(self, name: str) -> np.ndarray:
        """The variable ``name``, following an alias."""
        name = self.aliases.get(name, name)
        if name not in self.variables:
            raise FormatError(f"the {self.spec} model has no variable {name!r}")
        return self.variables[name]

    def scalar(self, name: str) -> int:
        """The integer value of a rank-0 variable."""
        return int(self.get(name).reshape(()))


def _numpy_dtype(code: int, name: str) -> np.dtype:
    if code not in DTYPES:
        raise FormatError(f"tensor {name!r} has dtype code {code}; known codes: {sorted(DTYPES)}")
    if DTYPES[code] == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(DTYPES[code]).newbyteorder("<")


def _code(dtype: np.dtype) -> int:
    for code, name in DTYPES.items():
        if dtype.name == name:
            return code
    raise ValueError(f"CTranslate2 stores no {dtype} tensors; known: {list(DTYPES.values())}")


class _Reader:
    def __init__(self, data: bytes | memoryview, path: str):
        self.data, self.offset, self.path = memoryview(data), 0, path

    def take(self, size: int, what: str) -> memoryview:
        end = self.offset + size
        if end > len(self.data):
            raise FormatError(
                f"{self.path} is truncated: {what} needs {size} bytes at offset {self.offset}, "
                f"the file has {len(self.data)}"
            )
        chunk, self.offset = self.data[self.offset : end], end
        return chunk

    def unpack(self, fmt: str, what: str) -> int:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt), what))[0]

    def name(self, what: str) -> str:
        raw = bytes(self.take(self.unpack("H", f"the length of {what}"), what))
        if not raw.endswith(b"\0"):
            raise FormatError(f"{self.path}: {what} at offset {self.offset} does not end in NUL")
        return raw[:-1].decode("utf-8")


def read(path: str | Path) -> CTranslate2Model:
    """Reads a CTranslate2 ``model.bin`` (version 6).

    Args:
        path: the file.
    Returns:
        its spec name, revision, variables (numpy arrays, the file's dtypes) and aliases.
    Raises:
        FormatError: another version, a truncated file, or an unknown dtype.
    """
    path = Path(path)
    r = _Reader(path.read_bytes(), str(path))
    version = r.unpack("I", "the version")
    if version != VERSION:
        raise FormatError(
            f"{path} is CTranslate2 format version {version}; this reader reads version {VERSION}"
        )
    spec = r.name("the spec name")
    revision = r.unpack("I", "the revision")
    variables: dict[str, np.ndarray] = {}
    for index in range(r.unpack("I", "the tensor count")):
        name = r.name(f"the name of tensor {index}")
        dims = [r.unpack("I", f"a dim of {name!r}") for _ in range(r.unpack("B", f"{name!r} rank"))]
        dtype = _numpy_dtype(r.unpack("B", f"the dtype of {name!r}"), name)
        size = r.unpack("I", f"the byte count of {name!r}")
        want = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
        if size != want:
            raise FormatError(f"tensor {name!r} {dims} {dtype} has {size} bytes, not {want}")
        raw = r.take(size, f"the data of {name!r}")
        variables[name] = np.frombuffer(raw, dtype=dtype).reshape(dims).copy()
    aliases: dict[str, str] = {}
    for index in range(r.unpack("I", "the alias count")):
        alias = r.name(f"alias {index}")
        aliases[alias] = r.name(f"the target of alias {alias!r}")
    for alias, target in aliases.items():
        if target not in variables:
            raise FormatError(f"alias {alias!r} names {target!r}, which is not in {path}")
    if r.offset != len(r.data):
        raise FormatError(f"{path} has {len(r.data) - r.offset} bytes after the aliases")
    return CTranslate2Model(spec, revision, variables, aliases, version)


def _name(text: str) -> bytes:
    raw = text.encode("utf-8") + b"\0"
    return struct.pack("<H", len(raw)) + raw


def write(path: str | Path, model: CTranslate2Model) -> None:
    """Writes ``model`` in the format :func:`read` reads (for tests and tools)."""
    parts = [struct.pack("<I", model.version), _name(model.spec), struct.pack("<I", model.revision)]
    parts.append(struct.pack("<I", len(model.variables)))
    for name, value in model.variables.items():
        value = np.asarray(value, order="C")
        parts += [_name(name), struct.pack("<B", value.ndim)]
        parts += [struct.pack("<I", d) for d in value.shape]
        data = value.astype(value.dtype.newbyteorder("<"), copy=False).tobytes()
        parts += [struct.pack("<BI", _code(value.dtype), len(data)), data]
    parts.append(struct.pack("<I", len(model.aliases)))
    for alias, target in model.aliases.items():
        parts += [_name(alias), _name(target)]
    Path(path).write_bytes(b"".join(parts))


# --- Whisper -------------------------------------------------------------------------------


@dataclass(frozen=True)
class WhisperShape:
    """The hyperparameters of a Whisper model, read from its weights."""

    vocab_size: int
    d_model: int
    encoder_layers: int
    decoder_layers: int
    encoder_attention_heads: int
    decoder_attention_heads: int
    encoder_ffn_dim: int
    decoder_ffn_dim: int
    num_mel_bins: int
    max_source_positions: int
    max_target_positions: int


def _layers(model: CTranslate2Model, prefix: str) -> int:
    count = 0
    while any(n.startswith(f"{prefix}/layer_{count}/") for n in model.variables):
        count += 1
    if count == 0:
        raise FormatError(f"the {model.spec} model has no {prefix} layers")
    return count


def whisper_shape(model: CTranslate2Model) -> WhisperShape:
    """The hyperparameters of a CTranslate2 ``WhisperSpec`` model."""
    if model.spec != "WhisperSpec":
        raise FormatError(f"the model's spec is {model.spec!r}, not 'WhisperSpec'")
    vocab, d_model = model.get("decoder/embeddings/weight").shape
    return WhisperShape(
        vocab_size=vocab,
        d_model=d_model,
        encoder_layers=_layers(model, "encoder"),
        decoder_layers=_layers(model, "decoder"),
        encoder_attention_heads=model.scalar("encoder/num_heads"),
        decoder_attention_heads=model.scalar("decoder/num_heads"),
        encoder_ffn_dim=model.get("encoder/layer_0/ffn/linear_0/weight").shape[0],
        decoder_ffn_dim=model.get("decoder/layer_0/ffn/linear_0/weight").shape[0],
        num_mel_bins=model.get("encoder/conv1/weight").shape[1],
        max_source_positions=model.get("encoder/position_encodings/encodings").shape[0],
        max_target_positions=model.get("decoder/position_encodings/encodings").shape[0],
    )


def whisper_weights(model: CTranslate2Model) -> dict[str, np.ndarray]:
    """transformers' ``WhisperForConditionalGeneration`` state dict (float32) of a Whisper model.

    Splits the fused q/k/v (``linear_0`` of self-attention) and k/v (``linear_1`` of
    cross-attention). transformers' k projections have no bias; CTranslate2 stores zeros there (a
    bias on the keys adds the same q.b to every score of a query, so it never changes attention).
    ``proj_out`` is tied to the token embeddings and not written.
    """
    shape = whisper_shape(model)
    flags = {  # the decoder's settings that transformers' Whisper has (activation 3: GELU)
        "decoder/activation": 3,
        "decoder/alibi": 0,
        "decoder/pre_norm": 1,
        "decoder/scale_embeddings": 0,
        "decoder/start_from_zero_embedding": 0,
    }
    for name, want in flags.items():
        if name in model.variables and model.scalar(name) != want:
            raise FormatError(f"{name} is {model.scalar(name)}; Whisper has {want}")
    quantized = [n for n in model.variables if n.endswith("weight_scale")]
    if quantized:
        raise FormatError(f"the model is quantized ({quantized[0]}); only float weights convert")
    d = shape.d_model
    out: dict[str, np.ndarray] = {}

    def put(name: str, value: np.ndarray) -> None:
        out[name] = np.asarray(value, dtype=np.float32, order="C")

    def norm(hf: str, ct2: str) -> None:
        put(f"{hf}.weight", model.get(f"{ct2}/gamma"))
        put(f"{hf}.bias", model.get(f"{ct2}/beta"))

    def linear(hf: str, ct2: str, rows: slice = slice(None), bias: bool = True) -> None:
        put(f"{hf}.weight", model.get(f"{ct2}/weight")[rows])
        if bias:
            put(f"{hf}.bias", model.get(f"{ct2}/bias")[rows])

    def fused(hf: str, ct2: str, names: tuple[str, ...]) -> None:
        weight = model.get(f"{ct2}/weight")
        if weight.shape[0] != d * len(names):
            raise FormatError(f"{ct2}/weight is {weight.shape}; expected {len(names)} x {d} rows")
        for index, proj in enumerate(names):
            linear(f"{hf}.{proj}", ct2, slice(index * d, (index + 1) * d), bias=proj != "k_proj")

    for side in ("encoder", "decoder"):
        layers = shape.encoder_layers if side == "encoder" else shape.decoder_layers
        for i in range(layers):
            hf, ct2 = f"model.{side}.layers.{i}", f"{side}/layer_{i}"
            norm(f"{hf}.self_attn_layer_norm", f"{ct2}/self_attention/layer_norm")
            fused(
                f"{hf}.self_attn", f"{ct2}/self_attention/linear_0", ("q_proj", "k_proj", "v_proj")
            )
            linear(f"{hf}.self_attn.out_proj", f"{ct2}/self_attention/linear_1")
            if side == "decoder":
                norm(f"{hf}.encoder_attn_layer_norm", f"{ct2}/attention/layer_norm")
                linear(f"{hf}.encoder_attn.q_proj", f"{ct2}/attention/linear_0")
                fused(f"{hf}.encoder_attn", f"{ct2}/attention/linear_1", ("k_proj", "v_proj"))
                linear(f"{hf}.encoder_attn.out_proj", f"{ct2}/attention/linear_2")
            norm(f"{hf}.final_layer_norm", f"{ct2}/ffn/layer_norm")
            linear(f"{hf}.fc1", f"{ct2}/ffn/linear_0")
            linear(f"{hf}.fc2", f"{ct2}/ffn/linear_1")
        put(
            f"model.{side}.embed_positions.weight",
            model.get(f"{side}/position_encodings/encodings"),
        )
        norm(f"model.{side}.layer_norm", f"{side}/layer_norm")
    for conv in ("conv1", "conv2"):
        linear(f"model.encoder.{conv}", f"encoder/{conv}")
    put("model.decoder.embed_tokens.weight", model.get("decoder/embeddings/weight"))
    if (
        "decoder/projection/weight" in model.aliases
        or "decoder/projection/weight" in model.variables
    ):
        projection = model.get("decoder/projection/weight")
        if not np.array_equal(projection, model.get("decoder/embeddings/weight")):
            raise FormatError("decoder/projection/weight differs from the token embeddings")
    return out


def save_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray]) -> None:
    """Writes float32 tensors as a safetensors file (metadata format "pt", as transformers
    writes)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset, blobs = 0, []
    for name in sorted(tensors):
        value = np.asarray(tensors[name], dtype="<f4", order="C")
        blob = value.tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(value.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)
