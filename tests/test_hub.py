"""hub.files: the ONNX files of genai, optimum and transformers.js layouts, local and cached."""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from pathlib import Path

import pytest

import transmuter_jax
from transmuter_jax import ModelFileError, hub

FIXTURES = Path(__file__).parent / "fixtures"
TEXT = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def make(root: Path, names: list[str], sources: dict[str, Path] | None = None) -> Path:
    """A folder of ``names``: copies of ``sources`` where given, else small placeholder files."""
    sources = sources or {}
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name in sources:
            shutil.copy(sources[name], path)
        else:
            path.write_text("{}" if name.endswith(".json") else "x")
    return root


def genai_config(decoder: str = "model.onnx", **sections: str) -> str:
    model = {"decoder": {"filename": decoder}, "type": "llama"}
    model.update({name: {"filename": filename} for name, filename in sections.items()})
    return json.dumps({"model": model})


def write_genai(root: Path, folder: str, decoder: str = "model.onnx", **sections: str) -> None:
    make(
        root, [f"{folder}/{n}" for n in TEXT] + [f"{folder}/{decoder}", f"{folder}/{decoder}.data"]
    )
    for filename in sections.values():
        make(root, [f"{folder}/{filename}"])
    (root / folder / "genai_config.json").write_text(genai_config(decoder, **sections))


def check(found: hub.Files, root: Path, family: str, decoder: str, dtype: str, **others) -> None:
    assert found.family == family
    assert found.decoder == str((root / decoder).absolute())
    assert found.dtype == dtype
    for name in ("encoder", "embed"):
        expected = others.get(name)
        assert getattr(found, name) == (str((root / expected).absolute()) if expected else None)
    assert found.folder == str((root / others.get("folder", "")).absolute()).rstrip("/")


# Local folders: genai.


def test_a_genai_fixture_is_its_config_s_decoder():
    root = FIXTURES / "llama-genai-int4"
    check(hub.files(root), root, "genai", "model.onnx", "default")
    check(hub.files(str(root), dtype="default"), root, "genai", "model.onnx", "default")
    with pytest.raises(ModelFileError, match=r"llama-genai-int4.*'int4'.*default \(model\.onnx\)"):
        hub.files(root, dtype="int4")


def test_a_genai_config_names_the_decoder_encoder_and_embeddings(tmp_path):
    write_genai(tmp_path, ".", "decoder.onnx", embedding="embeds.onnx", encoder="audio.onnx")
    found = hub.files(tmp_path)
    others = dict(encoder="audio.onnx", embed="embeds.onnx")
    check(found, tmp_path, "genai", "decoder.onnx", "default", **others)
    (tmp_path / "embeds.onnx").unlink()
    with pytest.raises(ModelFileError, match=r"lacks embeds\.onnx of its genai layout"):
        hub.files(tmp_path)


def test_genai_subfolders_are_chosen_by_the_precision_their_names_tell(tmp_path):
    int4 = "cpu_and_mobile/cpu-int4-rtn-block-32-acc-level-4"
    write_genai(tmp_path, int4)
    write_genai(tmp_path, "cuda/cuda-fp16", "phi3-mini-cuda-fp16.onnx")
    found = hub.files(tmp_path, dtype="int4")
    check(found, tmp_path, "genai", f"{int4}/model.onnx", "int4", folder=int4)
    decoder = "cuda/cuda-fp16/phi3-mini-cuda-fp16.onnx"
    check(
        hub.files(tmp_path, dtype="fp16"),
        tmp_path,
        "genai",
        decoder,
        "fp16",
        folder="cuda/cuda-fp16",
    )
    with pytest.raises(ModelFileError, match=r"no fp32 decoder.*int4 \(cpu_and_mobile/.*fp16 \("):
        hub.files(tmp_path)
    write_genai(tmp_path, "cuda/cuda-int4-awq")
    with pytest.raises(ModelFileError, match=r"several decoders of dtype 'int4'.*pass file="):
        hub.files(tmp_path, dtype="int4")
    found = hub.files(tmp_path, file="cuda/cuda-int4-awq/model.onnx")
    check(
        found,
        tmp_path,
        "genai",
        "cuda/cuda-int4-awq/model.onnx",
        "int4",
        folder="cuda/cuda-int4-awq",
    )


def test_a_single_genai_subfolder_is_chosen_without_dtype(tmp_path):
    write_genai(tmp_path, "gpu/gpu-int4-rtn-block-32")
    found = hub.files(tmp_path)
    assert found.dtype == "int4" and found.folder == str(tmp_path / "gpu/gpu-int4-rtn-block-32")


# Local folders: optimum.


@pytest.mark.parametrize(
    ("fixture", "decoder", "encoder", "embed"),
    [
        ("llama-optimum", "model.onnx", None, None),
        ("marian-optimum", "decoder_model_merged.onnx", "encoder_model.onnx", None),
        ("whisper-optimum", "decoder_model_merged.onnx", "encoder_model.onnx", None),
        ("smolvlm-torch", "model.onnx", None, "embed_tokens.onnx"),
    ],
)
def test_optimum_fixtures(fixture, decoder, encoder, embed):
    root = FIXTURES / fixture
    check(hub.files(root), root, "optimum", decoder, "fp32", encoder=encoder, embed=embed)


def test_optimum_quantized_variants(tmp_path):
    make(tmp_path, [*TEXT, "model.onnx", "model.onnx_data", "model_quantized.onnx"])
    check(hub.files(tmp_path), tmp_path, "optimum", "model.onnx", "fp32")
    for dtype in ("quantized", "q8"):
        found = hub.files(tmp_path, dtype=dtype)
        check(found, tmp_path, "optimum", "model_quantized.onnx", "quantized")


def test_the_merged_decoder_is_chosen_over_the_split_one(tmp_path):
    split = ["decoder_model.onnx", "decoder_with_past_model.onnx", "encoder_model.onnx"]
    make(tmp_path, [*TEXT, *split, "decoder_model_merged.onnx"])
    found = hub.files(tmp_path)
    check(
        found,
        tmp_path,
        "optimum",
        "decoder_model_merged.onnx",
        "fp32",
        encoder="encoder_model.onnx",
    )


@pytest.mark.parametrize("folder", ["", "onnx/"])
def test_a_split_decoder_without_the_merged_one_is_refused(tmp_path, folder):
    names = ["encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx"]
    make(tmp_path, [*TEXT, *(folder + n for n in names)])
    pattern = rf"{tmp_path.name}.*decoder_with_past_model\.onnx.*no merged decoder.*re-export"
    with pytest.raises(ModelFileError, match=pattern):
        hub.files(tmp_path)


def test_a_decoder_without_a_cache_is_refused_as_such(tmp_path):
    """optimum exports BERT and RoBERTa decoders of image-to-text models without past."""
    make(tmp_path, [*TEXT, "encoder_model.onnx", "decoder_model.onnx"])
    with pytest.raises(ModelFileError, match=r"without a KV cache \(decoder_model\.onnx\).*BERT"):
        hub.files(tmp_path)


def test_a_folder_without_a_decoder_says_what_it_has(tmp_path):
    make(tmp_path, [*TEXT, "vision_encoder.onnx"])
    with pytest.raises(
        ModelFileError, match=r"no decoder: looked for genai_config.*vision_encoder"
    ):
        hub.files(tmp_path)
    with pytest.raises(ValueError, match="is a file"):
        hub.files(tmp_path / "config.json")


# Local folders: transformers.js.

JS_DTYPES = {"fp32": "", "fp16": "_fp16", "q4": "_q4", "q4f16": "_q4f16", "int8": "_int8"}
JS_DTYPES |= {"uint8": "_uint8", "quantized": "_quantized", "bnb4": "_bnb4"}


def test_transformers_js_decoder_variants(tmp_path):
    onnx = [f"onnx/model{suffix}.onnx" for suffix in JS_DTYPES.values()]
    data = ["onnx/model.onnx_data", "onnx/model.onnx_data_1", "onnx/model_fp16.onnx.data"]
    make(tmp_path, [*TEXT, *onnx, *data])
    check(hub.files(tmp_path), tmp_path, "transformers.js", "onnx/model.onnx", "fp32")
    for dtype, suffix in JS_DTYPES.items():
        found = hub.files(tmp_path, dtype=dtype)
        check(found, tmp_path, "transformers.js", f"onnx/model{suffix}.onnx", dtype)
    assert hub.files(tmp_path, dtype="q8").decoder.endswith("onnx/model_quantized.onnx")
    with pytest.raises(ModelFileError, match=r"'int3'.*fp32 \(onnx/model\.onnx\), bnb4 \("):
        hub.files(tmp_path, dtype="int3")


def test_transformers_js_without_fp32_lists_its_variants(tmp_path):
    make(tmp_path, [*TEXT, "onnx/model_q4.onnx", "onnx/model_fp16.onnx"])
    with pytest.raises(ModelFileError, match=r"no fp32 decoder.*fp16 \(onnx/model_fp16.onnx\), q4"):
        hub.files(tmp_path)


def test_transformers_js_encoder_decoder(tmp_path):
    names = [
        f"onnx/{k}{s}.onnx" for k in ("encoder_model", "decoder_model_merged") for s in ("", "_q4")
    ]
    names += ["onnx/decoder_model_merged_fp16.onnx", "onnx/decoder_model.onnx"]
    make(tmp_path, [*TEXT, *names])
    found = hub.files(tmp_path)
    encoder = "onnx/encoder_model.onnx"
    check(
        found,
        tmp_path,
        "transformers.js",
        "onnx/decoder_model_merged.onnx",
        "fp32",
        encoder=encoder,
    )
    found = hub.files(tmp_path, dtype="q4")
    encoder = "onnx/encoder_model_q4.onnx"
    check(
        found,
        tmp_path,
        "transformers.js",
        "onnx/decoder_model_merged_q4.onnx",
        "q4",
        encoder=encoder,
    )
    with pytest.raises(
        ModelFileError, match=r"'fp16'.*incomplete: fp16 \(onnx/decoder_model_merged"
    ):
        hub.files(tmp_path, dtype="fp16")


def test_transformers_js_decoder_of_embeddings(tmp_path):
    kinds = ("decoder_model_merged", "embed_tokens", "vision_encoder")
    make(tmp_path, [*TEXT, *(f"onnx/{k}{s}.onnx" for k in kinds for s in ("", "_q4f16"))])
    found = hub.files(tmp_path, dtype="q4f16")
    decoder, embed = "onnx/decoder_model_merged_q4f16.onnx", "onnx/embed_tokens_q4f16.onnx"
    check(found, tmp_path, "transformers.js", decoder, "q4f16", embed=embed)


def test_file_names_the_decoder_and_dtype_its_companions(tmp_path):
    kinds = ("encoder_model", "decoder_model_merged")
    make(tmp_path, [*TEXT, *(f"onnx/{k}{s}.onnx" for k in kinds for s in ("", "_q4"))])
    decoder = "onnx/decoder_model_merged_q4.onnx"
    found = hub.files(tmp_path, file=decoder)
    check(found, tmp_path, "transformers.js", decoder, "q4", encoder="onnx/encoder_model_q4.onnx")
    found = hub.files(tmp_path, file=decoder, dtype="fp32")
    check(found, tmp_path, "transformers.js", decoder, "q4", encoder="onnx/encoder_model.onnx")
    with pytest.raises(ModelFileError, match=r"needs encoder_model_fp16\.onnx.*fp32 \(onnx/enc"):
        hub.files(tmp_path, file=decoder, dtype="fp16")
    with pytest.raises(ModelFileError, match=r"no file 'onnx/model\.onnx'.*decoder_model_merged"):
        hub.files(tmp_path, file="onnx/model.onnx")
    with pytest.raises(ValueError, match="inside"):
        hub.files(tmp_path, file="../model.onnx")
    with pytest.raises(ValueError, match="dtype must be"):
        hub.files(tmp_path, dtype="")


# Hub ids resolved offline from a cache in tmp_path.


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A function that caches a repo's files in a hub cache in tmp_path, as huggingface_hub does."""
    root = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(root))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)

    def add(repo: str, names: list[str], sources: dict[str, Path] | None = None) -> Path:
        storage = root / f"models--{repo.replace('/', '--')}"
        staging = make(tmp_path / "staging" / repo, names, sources)
        snapshot = storage / "snapshots" / COMMIT
        for path in sorted(p for p in staging.rglob("*") if p.is_file()):
            name = path.relative_to(staging).as_posix()
            blob = storage / "blobs" / name.replace("/", "_")  # unique, as a hash would be
            blob.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(path, blob)
            link = snapshot / name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        (storage / "refs" / "main").write_text(COMMIT)
        return snapshot

    return add


def test_a_cached_optimum_hub_id_resolves_offline_and_loads(cache):
    names = [*TEXT, "model.onnx"]
    snapshot = cache("org/llama", names, {n: FIXTURES / "llama-optimum" / n for n in names})
    found = hub.files("org/llama")
    check(found, snapshot, "optimum", "model.onnx", "fp32")
    model = transmuter_jax.load(found.decoder)
    assert "input_ids" in [i.name for i in model.inputs]
    assert hub.read_json("org/llama", "config.json")["model_type"] == "llama"


def test_a_cached_genai_hub_id_resolves_offline(cache):
    names = [*TEXT, "genai_config.json", "model.onnx", "model.onnx.data"]
    snapshot = cache("org/genai", names, {n: FIXTURES / "llama-genai-fp32" / n for n in names})
    check(hub.files("org/genai"), snapshot, "genai", "model.onnx", "default")


def test_a_cached_decoder_with_external_data_loads(cache):
    """The hub cache links snapshot files to blobs outside the snapshot folder."""
    names = ["config.json", "genai_config.json", "model.onnx", "model.onnx.data"]
    cache("org/genai", names, {n: FIXTURES / "llama-genai-fp32" / n for n in names})
    transmuter_jax.load(hub.files("org/genai").decoder)


def test_cached_transformers_js_hub_ids_resolve_offline(cache):
    kinds = ("encoder_model", "decoder_model_merged")
    names = [*TEXT, *(f"onnx/{k}{s}.onnx" for k in kinds for s in ("", "_q4"))]
    snapshot = cache("org/whisper", [*names, "onnx/decoder_model_merged.onnx_data"])
    found = hub.files("org/whisper", dtype="q4")
    decoder, encoder = "onnx/decoder_model_merged_q4.onnx", "onnx/encoder_model_q4.onnx"
    check(found, snapshot, "transformers.js", decoder, "q4", encoder=encoder)
    # What is not cached is not a choice offline.
    snapshot = cache("org/partial", [*TEXT, "onnx/model_q4.onnx"])
    with pytest.raises(ModelFileError, match=r"org/partial.*no fp32 decoder.*q4"):
        hub.files("org/partial")
    check(
        hub.files("org/partial", dtype="q4"),
        snapshot,
        "transformers.js",
        "onnx/model_q4.onnx",
        "q4",
    )


def test_a_hub_id_that_is_not_cached_offline_is_named(cache):
    with pytest.raises(ValueError, match="org/missing"):
        hub.files("org/missing")


# Hub ids online, with a fake hub.


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """A hub holding ``remote`` files; returns (remote, snapshot folder, download calls)."""
    remote = [*TEXT, "chat_template.jinja", "README.md", ".gitattributes"]
    remote += [f"onnx/{k}{s}.onnx" for k in ("model", "embed_tokens") for s in ("", "_q4", "_fp16")]
    remote += ["onnx/model_q4.onnx_data", "onnx/model_q4.onnx_data_1", "onnx/model.onnx_data"]
    remote += ["onnx/vision_encoder_q4.onnx"]
    snapshot = tmp_path / "snapshots" / COMMIT
    calls: list[tuple[list[str], str | None]] = []

    def snapshot_download(repo_id, *, allow_patterns=None, revision=None, **kwargs):
        assert repo_id == "org/online"
        calls.append((list(allow_patterns), revision))
        wanted = [n for n in remote if any(fnmatch.fnmatch(n, p) for p in allow_patterns)]
        make(snapshot, wanted)
        return str(snapshot)

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    monkeypatch.setattr("huggingface_hub.HfApi.list_repo_files", lambda self, repo, **_: remote)
    return remote, snapshot, calls


def test_online_only_the_small_files_and_the_chosen_variant_are_fetched(fake_hub):
    remote, snapshot, calls = fake_hub
    found = hub.files("org/online", dtype="q4")
    check(
        found,
        snapshot,
        "transformers.js",
        "onnx/model_q4.onnx",
        "q4",
        embed="onnx/embed_tokens_q4.onnx",
    )
    assert calls[0] == (list(hub.SMALL_FILES), None)
    patterns = calls[1][0]
    assert calls[1][1] == COMMIT
    assert {"onnx/model_q4.onnx", "onnx/embed_tokens_q4.onnx", "onnx/model_q4.onnx_data*"} <= set(
        patterns
    )
    fetched = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    assert fetched == sorted(
        [*TEXT, "chat_template.jinja", "onnx/embed_tokens_q4.onnx"]
        + ["onnx/model_q4.onnx", "onnx/model_q4.onnx_data", "onnx/model_q4.onnx_data_1"]
    )


def test_online_a_failed_listing_falls_back_to_the_cached_files(fake_hub, monkeypatch):
    remote, snapshot, calls = fake_hub

    def unreachable(self, repo, **_):
        raise ConnectionError("no network")

    make(snapshot, ["onnx/model_fp16.onnx"])  # cached earlier
    monkeypatch.setattr("huggingface_hub.HfApi.list_repo_files", unreachable)
    with pytest.raises(ModelFileError, match=r"no fp32 decoder.*fp16 \(onnx/model_fp16\.onnx\)"):
        hub.files("org/online")


def test_an_incomplete_cached_snapshot_still_lists_its_files(fake_hub, monkeypatch):
    remote, snapshot, calls = fake_hub
    make(snapshot, [*TEXT, "onnx/model.onnx"])

    class IncompleteSnapshotError(Exception):
        snapshot_path = str(snapshot)

    def incomplete(repo_id, *, allow_patterns=None, revision=None, **kwargs):
        calls.append((list(allow_patterns), revision))
        if len(calls) == 1:
            raise IncompleteSnapshotError("some small files are not cached")
        return str(snapshot)

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.snapshot_download", incomplete)
    check(hub.files("org/online"), snapshot, "transformers.js", "onnx/model.onnx", "fp32")


@pytest.mark.parametrize(
    ("fixture", "layout"),
    [
        ("llama-optimum", {"model.onnx": "model.onnx"}),
        ("llama-optimum", {"onnx/model.onnx": "model.onnx"}),  # transformers.js
        (
            "llama-genai-fp32",
            {n: n for n in ("genai_config.json", "model.onnx", "model.onnx.data")},
        ),
    ],
)
def test_text_generation_from_a_cached_hub_id_offline(cache, fixture, layout):
    """Each exporter family's layout, from the hub cache with no network, generates the tokens
    that transformers gave for the same prompt."""
    from generation_cases import case

    from transmuter_jax import text

    sources = {n: FIXTURES / fixture / n for n in TEXT}
    sources.update({name: FIXTURES / fixture / src for name, src in layout.items()})
    cache("org/model", list(sources), sources)
    pipe = text.generation("org/model")
    the_case = case("llama-optimum", "text") if fixture == "llama-optimum" else None
    if the_case is not None:
        result = pipe.generate([the_case["texts"][0]], max_new_tokens=16)[0]
        assert result.token_ids == the_case["tokens"][0]
    else:
        want = case(fixture, "greedy")
        out = pipe.generate_ids(want["prompts"][:1], **want["options"])
        assert out[0].token_ids == want["tokens"][0]
