"""Qwen2.5-VL in the onnxruntime-genai layout (tests/fixtures/make_qwen2vl_genai.py,
qwen25vl-genai-vlm: qwen25vl-community's model, its decoder by the genai builder, its vision
and embedding graphs named by genai_config.json) against qwen25vl-community's transformers
references."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest

pytest.importorskip("PIL")

from transmuter_jax import vision  # noqa: E402
from transmuter_jax.onnx.errors import ModelFileError  # noqa: E402

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
GENAI = FIXTURES / "qwen25vl-genai-vlm"
IMAGES = FIXTURES / "qwen25vl-community"
REF = json.loads((IMAGES / "qwen2vl.json").read_text())
SINGLE = [c for c in REF["generate"] if not c.get("batch")]
BATCH = [c for c in REF["generate"] if c.get("batch")]


@pytest.fixture(scope="module")
def pipe():
    return vision.image_text_to_text(GENAI, max_new_tokens=REF["max_new_tokens"])


def _conversations(case) -> list[list[dict]]:
    return [
        [{"role": "user", "content": [*({"type": "image", "image": str(IMAGES / f)} for f in fs),
                                      {"type": "text", "text": q}]}]
        for fs, q in zip(case["files"], case["question"], strict=True)
    ]  # fmt: skip


def test_the_files_are_the_ones_genai_config_names(pipe):
    assert pipe.files.family == "genai"
    assert pathlib.Path(pipe.files.decoder).name == "decoder.onnx"
    assert pathlib.Path(pipe.files.embed).name == "embedding.onnx"
    assert pathlib.Path(pipe.vision_encoder).name == "vision.onnx"
    assert pipe.grid_input == "image_grid_thw"


@pytest.mark.parametrize(
    "case",
    [SINGLE[0], *(pytest.param(c, marks=pytest.mark.slow) for c in SINGLE[1:])],
    ids=lambda c: c["files"][0][0],
)
def test_tokens_equal_transformers(pipe, case):
    out = pipe.generate(_conversations(case))
    assert [r.token_ids for r in out] == case["tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("case", BATCH, ids=lambda c: "+".join(str(len(f)) for f in c["files"]))
def test_left_padded_batch_equals_transformers(pipe, case):
    out = pipe.generate(_conversations(case))
    assert [r.token_ids for r in out] == case["tokens"]


def _edit_config(folder: pathlib.Path, edit) -> None:
    path = folder / "genai_config.json"
    config = json.loads(path.read_text())
    edit(config["model"])
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("section", ["vision", "embedding"])
def test_a_missing_section_is_refused_naming_the_key(tmp_path, section):
    folder = tmp_path / "model"
    shutil.copytree(GENAI, folder)
    _edit_config(folder, lambda m: m.pop(section))
    with pytest.raises(ModelFileError, match=rf"genai_config\.json.*model\.{section}\.filename"):
        vision.image_text_to_text(folder)


def test_a_missing_vision_file_is_refused_naming_it(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(GENAI, folder)
    (folder / "vision.onnx").unlink()
    with pytest.raises(ModelFileError, match=r"model\.vision\.filename names 'vision\.onnx'"):
        vision.image_text_to_text(folder)


def test_embedding_names_other_than_the_graphs_are_refused(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(GENAI, folder)
    _edit_config(folder, lambda m: m["embedding"]["inputs"].update(image_features="features"))
    with pytest.raises(ModelFileError, match=r"embedding\.onnx.*'features'.*model\.embedding"):
        vision.image_text_to_text(folder)
