"""Export the default speech model from its CTranslate2 files: run in the preparation
environment, not imported.

Usage: python export_speech.py STEP CT2_FOLDER AUDIO OUT_FOLDER

CT2_FOLDER holds model.bin, config.json and tokenizer.json; AUDIO is a 16 kHz mono 16-bit wav.

Steps (each writes OUT_FOLDER/<step>/ and nothing else):
    hf       the CTranslate2 weights converted (default/ctranslate2.py) into a transformers
             WhisperForConditionalGeneration folder, with the tokenizer, preprocessor_config.json,
             generation_config.json, and reference.json: transformers' greedy transcript of AUDIO.
    optimum  optimum's automatic-speech-recognition-with-past export of hf/ (encoder_model.onnx,
             decoder_model_merged.onnx), checked: onnxruntime's greedy tokens on AUDIO equal
             reference.json's.

Needs torch, transformers 4.57.6, optimum-onnx and onnxruntime.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import wave
from pathlib import Path

import numpy as np

SAMPLING_RATE = 16000
FILES = (
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "normalizer.json",
    "reference.json",
)


def _sibling(file: str, name: str):
    """default/<file>, loaded by its path (this script runs outside the package)."""
    path = Path(__file__).with_name(file)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _export():
    """default/export.py: the step folders and optimum's export."""
    return _sibling("export.py", "default_export")


def read_wav(path: Path) -> np.ndarray:
    """A 16 kHz mono 16-bit PCM wav as float32 samples in [-1, 1)."""
    with wave.open(str(path), "rb") as f:
        if (f.getframerate(), f.getnchannels(), f.getsampwidth()) != (SAMPLING_RATE, 1, 2):
            raise SystemExit(f"{path}: want 16 kHz mono 16-bit, got {f.getparams()}")
        data = f.readframes(f.getnframes())
    return np.frombuffer(data, "<i2").astype(np.float32) / 32768.0


def _special(tokenizer, text: str) -> int:
    token = tokenizer.convert_tokens_to_ids(text)
    if token is None or token == tokenizer.unk_token_id and text != tokenizer.unk_token:
        raise SystemExit(f"the tokenizer has no {text}")
    return token


def _generation_config(tokenizer, ct2_config: dict, multilingual: bool, max_length: int):
    from transformers import GenerationConfig

    ids = {name: _special(tokenizer, f"<|{name}|>") for name in (
        "endoftext", "startoftranscript", "translate", "transcribe", "startofprev",
        "notimestamps")}  # fmt: skip
    fields = {
        "alignment_heads": ct2_config.get("alignment_heads"),
        "begin_suppress_tokens": ct2_config["suppress_ids_begin"],
        # as on the hub: 50257 for both (<|startoftranscript|> in tiny.en, <|endoftext|> in base)
        "bos_token_id": ids["endoftext"] if multilingual else ids["startoftranscript"],
        "decoder_start_token_id": ids["startoftranscript"],
        "eos_token_id": ids["endoftext"],
        "pad_token_id": ids["endoftext"],
        "is_multilingual": multilingual,
        "max_initial_timestamp_index": 50,
        "max_length": max_length,
        "no_timestamps_token_id": ids["notimestamps"],
        "prev_sot_token_id": ids["startofprev"],
        "return_timestamps": False,
        "suppress_tokens": ct2_config["suppress_ids"],
    }
    if multilingual:
        languages = {tokenizer.convert_ids_to_tokens(i): i for i in ct2_config["lang_ids"]}
        fields["lang_to_id"] = languages
        fields["task_to_id"] = {"transcribe": ids["transcribe"], "translate": ids["translate"]}
        fields["forced_decoder_ids"] = [[1, None], [2, ids["transcribe"]]]
    else:
        fields["forced_decoder_ids"] = [[1, ids["notimestamps"]]]
    return GenerationConfig(**fields)


def export_hf(ct2: Path, audio: Path, out: Path) -> None:
    import torch
    from transformers import (
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
        WhisperTokenizerFast,
    )

    reader = _sibling("ctranslate2.py", "ctranslate2_reader")
    model_bin = reader.read(ct2 / "model.bin")
    shape = reader.whisper_shape(model_bin)
    reader.save_safetensors(out / "model.safetensors", reader.whisper_weights(model_bin))
    del model_bin
    ct2_config = json.loads((ct2 / "config.json").read_text())
    tokenizer = WhisperTokenizerFast(tokenizer_file=str(ct2 / "tokenizer.json"))
    multilingual = shape.vocab_size >= 51865
    # the tokens of the first language and of the multilingual task, checked against the config
    generation = _generation_config(tokenizer, ct2_config, multilingual, shape.max_target_positions)
    config = WhisperConfig(
        **{k: getattr(shape, k) for k in shape.__dataclass_fields__},
        num_hidden_layers=shape.encoder_layers,
        activation_function="gelu",
        scale_embedding=False,
        bos_token_id=generation.bos_token_id,
        eos_token_id=generation.eos_token_id,
        pad_token_id=generation.pad_token_id,
        decoder_start_token_id=generation.decoder_start_token_id,
        begin_suppress_tokens=generation.begin_suppress_tokens,
        tie_word_embeddings=True,
        architectures=["WhisperForConditionalGeneration"],
    )
    config.save_pretrained(out)
    generation.save_pretrained(out)
    extractor = WhisperFeatureExtractor(feature_size=shape.num_mel_bins)
    WhisperProcessor(feature_extractor=extractor, tokenizer=tokenizer).save_pretrained(out)
    model, info = WhisperForConditionalGeneration.from_pretrained(
        out, torch_dtype=torch.float32, output_loading_info=True
    )
    missing = [k for k in info["missing_keys"] if k != "proj_out.weight"]
    if missing or info["unexpected_keys"] or info["mismatched_keys"]:
        raise SystemExit(f"the converted weights do not load cleanly: {info}")
    model.eval()
    extractor = WhisperFeatureExtractor.from_pretrained(out)
    samples = read_wav(audio)
    features = extractor(samples, sampling_rate=SAMPLING_RATE, return_tensors="pt").input_features
    # transformers' prompt: <|startoftranscript|> (<|lang|> <|transcribe|>) <|notimestamps|>
    prompt = [generation.decoder_start_token_id, generation.no_timestamps_token_id]
    with torch.no_grad():
        if multilingual:
            language = int(model.detect_language(features)[0])
            prompt[1:1] = [language, generation.task_to_id["transcribe"]]
        result = model.generate(features)[0].tolist()
    eos = generation.eos_token_id
    # transformers 4.57 returns the new tokens only; older versions began with the prompt
    tokens = result[len(prompt) :] if result[: len(prompt)] == prompt else result
    tokens = tokens[: tokens.index(eos)] if eos in tokens else tokens
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    print(f"reference: {audio.name} -> {text!r}", flush=True)
    record = {
        "generator": "transformers WhisperForConditionalGeneration.generate greedy",
        "audio": audio.name,
        "prompt_ids": prompt,
        "tokens": tokens,
        "text": text,
    }
    (out / "reference.json").write_text(json.dumps(record, indent=1))


def onnx_greedy(folder: Path, features: np.ndarray, prompt: list[int], generation) -> list[int]:
    """Greedy tokens of the optimum export with onnxruntime: transformers' suppress_tokens and
    begin_suppress_tokens, until eos or max_length."""
    import onnxruntime as ort

    options = {"providers": ["CPUExecutionProvider"]}
    encoder = ort.InferenceSession(str(folder / "encoder_model.onnx"), **options)
    decoder = ort.InferenceSession(str(folder / "decoder_model_merged.onnx"), **options)
    hidden = encoder.run(None, {"input_features": features})[0]
    config = json.loads((folder / "config.json").read_text())
    heads = config["decoder_attention_heads"]
    head_dim = config["d_model"] // heads
    names = [i.name for i in decoder.get_inputs()]
    past = {
        n: np.zeros((1, heads, 0, head_dim), np.float32) for n in names if n.startswith("past_")
    }
    outputs = [o.name for o in decoder.get_outputs()]
    tokens, step_ids, first = list(prompt), np.array([prompt], np.int64), True
    while len(tokens) < generation.max_length:
        feed = {"input_ids": step_ids, "encoder_hidden_states": hidden, **past}
        feed["use_cache_branch"] = np.array([not first])
        result = dict(zip(outputs, decoder.run(outputs, feed), strict=True))
        logits = result["logits"][0, -1].astype(np.float64)
        logits[generation.suppress_tokens] = -np.inf
        if first:
            logits[generation.begin_suppress_tokens] = -np.inf
        token = int(logits.argmax())
        tokens.append(token)
        if token == generation.eos_token_id:
            break
        for name, value in result.items():
            if name.startswith("present") and not (not first and ".encoder." in name):
                past[name.replace("present", "past_key_values")] = value
        step_ids, first = np.array([[token]], np.int64), False
    return tokens


def export_optimum(hf: Path, audio: Path, out: Path) -> None:
    from transformers import GenerationConfig, WhisperFeatureExtractor

    names = ("encoder_model.onnx", "decoder_model_merged.onnx")
    _export().optimum_export(hf, out, "automatic-speech-recognition-with-past", names)
    for name in FILES:
        if (hf / name).exists():
            shutil.copy(hf / name, out / name)
    reference = json.loads((hf / "reference.json").read_text())
    generation = GenerationConfig.from_pretrained(hf)
    extractor = WhisperFeatureExtractor.from_pretrained(hf)
    features = extractor(read_wav(audio), sampling_rate=SAMPLING_RATE, return_tensors="np")
    ids = onnx_greedy(out, features.input_features, reference["prompt_ids"], generation)
    tokens = ids[len(reference["prompt_ids"]) :]
    if tokens and tokens[-1] == generation.eos_token_id:
        tokens = tokens[:-1]
    if tokens != reference["tokens"]:
        raise SystemExit(f"onnxruntime's tokens {tokens} differ from transformers' {reference}")
    print(f"onnxruntime: {len(tokens)} tokens equal transformers'", flush=True)


def main(step: str, ct2: str, audio: str, root: str) -> None:
    steps = {
        "hf": lambda out: export_hf(Path(ct2), Path(audio), out),
        "optimum": lambda out: export_optimum(Path(root) / "hf", Path(audio), out),
    }
    _export().run_step(step, root, steps)


if __name__ == "__main__":
    if len(sys.argv) != 5:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
