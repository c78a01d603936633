"""A folder as the onnxruntime-genai builder writes it (genai_config.json, no config.json or
generation_config.json) loads and generates as the full folder does: the cache dimensions, token
ids, context length and search defaults come from genai_config.json."""

from __future__ import annotations

import json
import shutil

import pytest
from generation_cases import FIXTURES, case, decoder, embed, tiered

from transmuter_jax import generation, hub, text

# Every genai fixture with a decoder and references; the speech and vision-language ones below.
GENAI = sorted(p.name for p in FIXTURES.glob("*-genai-*") if (p / "reference.json").exists())
SPEECH = ("whisper-genai-fp32", "whisper-speech-genai")
VLM = ("qwen25vl-genai-vlm",)
TRANSFORMERS_FILES = ("config.json", "generation_config.json")


def raw_copy(name: str, tmp_path):
    """The fixture's folder as the builder writes it: without its transformers files (and its
    references); a Whisper folder also without preprocessor_config.json (the builder writes
    audio_processor_config.json)."""
    folder = tmp_path / name
    speech = (FIXTURES / name / "audio_processor_config.json").exists()
    drop = (*TRANSFORMERS_FILES, "reference.*", *(["preprocessor_config.json"] * speech))
    shutil.copytree(FIXTURES / name, folder, ignore=shutil.ignore_patterns(*drop))
    return folder


def test_the_fixtures_are_there():
    assert len(GENAI) >= 8, GENAI
    every = {p.name for p in FIXTURES.glob("*-genai*") if (p / "genai_config.json").exists()}
    assert every == {*GENAI, *SPEECH, *VLM}  # each genai fixture is tested as a raw folder


@pytest.mark.parametrize("name", GENAI)
def test_raw_folder_generates_the_full_folders_tokens(name, tmp_path):
    raw = raw_copy(name, tmp_path)
    model, embeds = decoder(name), embed(name, tmp_path)
    full = generation.context(FIXTURES / name, model, embed=embeds, max_new_tokens=8)
    bare = generation.context(raw, model, embed=embeds, max_new_tokens=8)
    assert bare.cache == full.cache
    assert bare.eos == full.eos and bare.eos
    assert bare.options.pad_token_id == full.options.pad_token_id
    assert bare.options.bos_token_id == full.options.bos_token_id
    assert bare.position_limit == full.position_limit
    prompts = case(name, "batch")["prompts"]
    seeds = list(range(len(prompts)))
    want = generation.generate(generation.compile(full, len(prompts)), prompts, seeds)
    got = generation.generate(generation.compile(bare, len(prompts)), prompts, seeds)
    assert got == want and any(want)


# the pipeline on a raw folder in the quick tier (every folder's generation is checked above)
FEW_PIPELINES = {"llama-genai-fp32", "qwen2-genai-int4", "gemma3-genai-fp32"}


@pytest.mark.parametrize(
    "name",
    [tiered(n, id=n, quick=n in FEW_PIPELINES) for n in GENAI if not n.startswith("qwen25vl")],
)
def test_text_generation_of_a_raw_folder(name, tmp_path):
    """text.generation on the folder as it is (the README's genai layout)."""
    raw = raw_copy(name, tmp_path)
    want = text.generation(str(FIXTURES / name))("The quiet river", max_new_tokens=6)
    assert text.generation(str(raw))("The quiet river", max_new_tokens=6) == want


def test_search_options_are_generation_defaults(tmp_path):
    raw = raw_copy("llama-genai-fp32", tmp_path)
    config = json.loads((raw / "genai_config.json").read_text())
    config["search"] |= {"do_sample": True, "top_k": 7, "temperature": 0.5, "max_length": 40}
    (raw / "genai_config.json").write_text(json.dumps(config))
    options = generation.context(raw, decoder("llama-genai-fp32")).options
    assert (options.do_sample, options.top_k, options.temperature) == (True, 7, 0.5)
    assert options.max_length == 40
    assert hub.read_json(raw, "config.json")["max_position_embeddings"] == 256
    # A folder with the transformers files reads them, not genai_config.json.
    assert hub.read_json(FIXTURES / "llama-genai-fp32", "generation_config.json") == json.loads(
        (FIXTURES / "llama-genai-fp32" / "generation_config.json").read_text()
    )


def test_a_folder_without_either_reads_nothing(tmp_path):
    assert hub.read_json(tmp_path, "config.json") == {}
    assert hub.read_json(tmp_path, "generation_config.json") == {}


# --- Whisper: the prompt's token ids from the tokenizer, the features from
# audio_processor_config.json, the rest from genai_config.json.

SPEECH_REF = json.loads((FIXTURES / "whisper-speech-optimum" / "speech.json").read_text())
SPEECH_CASES = SPEECH_REF["cases"]
FULL_GENERATION = json.loads(
    (FIXTURES / "whisper-speech-genai" / "generation_config.json").read_text()
)
# generation_config.json's suppressed tokens, which no file of a builder's folder holds
SUPPRESS = {k: FULL_GENERATION[k] for k in ("suppress_tokens", "begin_suppress_tokens")}
FEW_SPEECH = {"en", "detect", "timestamps_translate"}  # the rest with -m slow


@pytest.fixture(scope="module")
def raw_speech(tmp_path_factory):
    from transmuter_jax import audio

    raw = raw_copy("whisper-speech-genai", tmp_path_factory.mktemp("raw"))
    return audio.speech_to_text(raw, num_beams=1)  # the references are greedy


@pytest.fixture(scope="module")
def clips():
    import numpy as np

    with np.load(FIXTURES / "whisper-speech-optimum" / "speech.npz") as data:
        return {k.split("/", 1)[1]: data[k] for k in data.files if k.startswith("clip/")}


def test_a_raw_whisper_folder_reads_the_prompt_ids_and_features_as_the_full_one(raw_speech):
    from transmuter_jax import audio

    full = audio.speech_to_text(FIXTURES / "whisper-speech-genai", num_beams=1)
    assert raw_speech.features == full.features
    assert not hub.stands_in(full.files.folder, "generation_config.json")
    assert hub.stands_in(raw_speech.files.folder, "generation_config.json")
    derived = ("decoder_start_token_id", "lang_to_id", "task_to_id", "no_timestamps_token_id",
               "forced_decoder_ids", "is_multilingual", "max_initial_timestamp_index")  # fmt: skip
    for key in derived:
        assert raw_speech.generation_config[key] == FULL_GENERATION[key], key
    assert raw_speech.timestamp_begin == full.timestamp_begin
    assert raw_speech.defaults["max_length"] == full.defaults["max_length"]


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=() if n in FEW_SPEECH else pytest.mark.slow)
        for n in sorted(SPEECH_CASES)
    ],
)
def test_a_raw_whisper_folder_generates_the_references(raw_speech, clips, name):
    case = SPEECH_CASES[name]
    audio = [clips[c] for c in case["clips"]]
    out = raw_speech.generate(audio, sampling_rate=16000, **case["options"], **SUPPRESS)
    assert [r.token_ids for r in out] == [row["tokens"] for row in case["rows"]]
    for got, want in zip(out, case["rows"], strict=True):
        if "chunks" in want and want["chunks"] is not None:
            assert [c["text"] for c in got.chunks] == [c["text"] for c in want["chunks"]]
            stamps = [t for c in got.chunks for t in c["timestamp"]]
            assert stamps == [pytest.approx(t) for c in want["chunks"] for t in c["timestamp"]]


def test_whisper_genai_fp32_as_the_builder_wrote_it_generates_the_full_folders_tokens(tmp_path):
    """The builder's own Whisper folder (whose encoder takes 64 frames): the raw folder's
    decoder context equals the full folder's and gives its tokens on the encoder's cross cache."""
    import numpy as np

    from transmuter_jax import audio, load

    name = "whisper-genai-fp32"
    raw = raw_copy(name, tmp_path)
    pipe = audio.speech_to_text(raw)  # loads: features of audio_processor_config.json
    assert (pipe.features.bins, pipe.features.hop, pipe.features.n_fft) == (80, 160, 400)
    assert pipe.generation_config["decoder_start_token_id"] == 5
    features = np.random.default_rng(3).standard_normal((2, 80, 64)).astype(np.float32)
    encoded = load(FIXTURES / name / "encoder.onnx")({"audio_features": features})
    cross = {n.replace("present_", "past_", 1): np.asarray(v) for n, v in encoded.items()}
    cross.pop("hidden_states")
    decoder = load(FIXTURES / name / "decoder.onnx")
    contexts = [generation.context(f, decoder, given=sorted(cross), max_new_tokens=6)
                for f in (FIXTURES / name, raw)]  # fmt: skip
    assert contexts[0].cache == contexts[1].cache and contexts[0].eos == contexts[1].eos
    want, got = (generation.generate(generation.compile(c, 2), [[5, 17], [5, 8]], [0, 0], cross)
                 for c in contexts)  # fmt: skip
    assert got == want and sum(map(len, want)) > 3


def test_a_builder_audio_processor_config_gives_the_feature_settings():
    from transmuter_jax.audio.features import FeatureExtractor, builder_settings

    config = json.loads(
        (FIXTURES / "whisper-genai-fp32" / "audio_processor_config.json").read_text()
    )
    assert builder_settings(config) == {
        "feature_size": 80,
        "chunk_length": 30,
        "hop_length": 160,
        "n_fft": 400,
    }
    assert FeatureExtractor.from_config(builder_settings(config)) == FeatureExtractor()
    assert builder_settings({}) == builder_settings({"feature_extraction": 3}) == {}


# --- Qwen2.5-VL in Olive's layout: the token ids and the merge size from genai_config.json.

VL_IMAGES = FIXTURES / "qwen25vl-community"
VL_REF = json.loads((VL_IMAGES / "qwen2vl.json").read_text())
VL_CASES = VL_REF["generate"]


@pytest.fixture(scope="module")
def raw_vlm(tmp_path_factory):
    from transmuter_jax import vision

    raw = raw_copy("qwen25vl-genai-vlm", tmp_path_factory.mktemp("raw"))
    return vision.image_text_to_text(raw, max_new_tokens=VL_REF["max_new_tokens"])


def test_a_raw_vlm_folders_config_equivalent_holds_the_vision_ids(tmp_path):
    raw = raw_copy("qwen25vl-genai-vlm", tmp_path)
    full = json.loads((FIXTURES / "qwen25vl-genai-vlm" / "config.json").read_text())
    config = hub.read_json(raw, "config.json")
    for key in ("model_type", "image_token_id", "video_token_id", "vision_start_token_id"):
        assert config[key] == full[key], key
    assert (
        config["vision_config"]["spatial_merge_size"] == full["vision_config"]["spatial_merge_size"]
    )


@pytest.mark.parametrize(
    "index",
    [pytest.param(i, marks=() if i == 0 else pytest.mark.slow) for i in range(len(VL_CASES))],
)
def test_a_raw_vlm_folder_generates_the_references(raw_vlm, index):
    case = VL_CASES[index]
    conversations = [
        [{"role": "user", "content": [*({"type": "image", "image": str(VL_IMAGES / f)} for f in fs),
                                      {"type": "text", "text": q}]}]
        for fs, q in zip(case["files"], case["question"], strict=True)
    ]  # fmt: skip
    assert [r.token_ids for r in raw_vlm.generate(conversations)] == case["tokens"]
