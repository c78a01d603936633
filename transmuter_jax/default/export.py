"""Export the default model from its GGUF file: run in the preparation environment (and loaded
by export_speech.py), not imported by the package.

Usage: python export.py STEP GGUF_FILE OUT_FOLDER

Steps (each writes OUT_FOLDER/<step>/ and nothing else):
    hf          the GGUF loaded by transformers, saved as a transformers folder (fp32 safetensors),
                with a rebuilt byte-level BPE tokenizer, and reference.json: transformers' greedy
                tokens on a few chat prompts.
    genai-fp32  the onnxruntime-genai builder's fp32 CPU export of hf/ (GroupQueryAttention).
    genai-int4  the same in int4 (MatMulNBits).
    optimum     optimum's text-generation-with-past export of hf/ (position_ids, concat cache).

Needs torch, transformers 4.57.6 (with gguf and accelerate), onnxruntime-genai and optimum-onnx.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

# Chat prompts whose transformers greedy tokens the tests compare with.
REFERENCE_PROMPTS = [
    "What is the capital of France?",
    "Write a short sentence in French about coffee.",
    "How do I reverse a list in Python?",
]
REFERENCE_NEW_TOKENS = 48
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def _byte_level_tokenizer(gguf_tokenizer):
    """The GGUF's vocabulary and merges as the GPT-2 style byte-level BPE SmolLM2 was trained with.

    transformers converts this GGUF as a llama (sentencepiece-style) tokenizer: byte fallback,
    a "▁" decoder, bos prepended on every encode, eos <|im_start|>. The vocabulary is byte-level.
    """
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers import GPT2TokenizerFast

    state = json.loads(gguf_tokenizer.backend_tokenizer.to_str())
    vocab = state["model"]["vocab"]
    merges = [
        tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["model"]["merges"]
    ]
    tok = Tokenizer(BPE(vocab, merges, byte_fallback=False, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [t["content"] for t in state["added_tokens"] if t["special"]]
    tok.add_special_tokens(special)
    return GPT2TokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=[s for s in special if s not in ("<|im_start|>", "<|im_end|>")],
        add_bos_token=False,
        add_prefix_space=False,
        clean_up_tokenization_spaces=False,
        model_max_length=8192,
        chat_template=gguf_tokenizer.chat_template,
    )


def export_hf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    torch.manual_seed(0)
    tok = _byte_level_tokenizer(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name))
    sample = "Hello world 2024, café ☕ — ok"
    ids = tok(sample).input_ids
    if tok.decode(ids) != sample or ids[0] == tok.bos_token_id:
        raise RuntimeError(f"rebuilt tokenizer does not round-trip: {ids}")
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32
    )
    model.eval()
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = 1, 2, 2
    model.config._name_or_path = "SmolLM2-135M-Instruct"
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    cases = []
    for prompt in REFERENCE_PROMPTS:
        text = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        prompt_ids = tok(text).input_ids
        with torch.no_grad():
            result = model.generate(
                torch.tensor([prompt_ids]),
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                max_new_tokens=REFERENCE_NEW_TOKENS,
                do_sample=False,
            )
        new = result[0, len(prompt_ids) :].tolist()
        cases.append(
            {
                "prompt": prompt,
                "chat_text": text,
                "prompt_ids": prompt_ids,
                "tokens": new,
                "text": tok.decode(new, skip_special_tokens=True),
            }
        )
        print(f"reference: {prompt!r} -> {cases[-1]['text']!r}", flush=True)
    with open(out / "reference.json", "w") as f:
        json.dump({"generator": "transformers.generate greedy", "cases": cases}, f, indent=1)


def _run(cmd: list) -> None:
    print("$ " + " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True)


def _copy_tokenizer(hf: Path, out: Path) -> None:
    for name in (*TOKENIZER_FILES, "config.json", "generation_config.json"):
        if (hf / name).exists():
            shutil.copy(hf / name, out / name)


def _builder():
    """default/genai_builder.py, loaded by its path (this script runs outside the package)."""
    import importlib.util

    path = Path(__file__).with_name("genai_builder.py")
    spec = importlib.util.spec_from_file_location("genai_builder", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def export_genai(hf: Path, out: Path, precision: str) -> None:
    raw = out.parent / (out.name + ".raw")
    shutil.rmtree(raw, ignore_errors=True)
    _run(_builder().command(hf, raw, precision, out.parent / "genai-cache"))
    out.mkdir(parents=True, exist_ok=True)
    for name in ("model.onnx", "model.onnx.data", "genai_config.json"):
        shutil.move(raw / name, out / name)
    shutil.rmtree(raw)
    _copy_tokenizer(hf, out)


def optimum_export(hf: Path, out: Path, task: str, names: tuple[str, ...]) -> None:
    """optimum's ``task`` export of hf/, unvalidated on the CPU; the files whose names start
    with one of ``names`` go to out/."""
    from optimum.exporters.onnx import main_export

    raw = out.parent / (out.name + ".raw")
    shutil.rmtree(raw, ignore_errors=True)
    main_export(str(hf), str(raw), task=task, do_validation=False, device="cpu")
    out.mkdir(parents=True, exist_ok=True)
    for path in raw.iterdir():
        if path.name.startswith(names):
            shutil.move(path, out / path.name)
    shutil.rmtree(raw)


def export_optimum(hf: Path, out: Path) -> None:
    optimum_export(hf, out, "text-generation-with-past", ("model.onnx",))
    _copy_tokenizer(hf, out)


def run_step(step: str, root: str, steps: dict[str, Callable[[Path], None]]) -> None:
    """Runs ``steps[step]`` on the new folder root/<step>.partial (HF_HUB_OFFLINE=1 unless set),
    then renames it root/<step>, replacing that."""
    if step not in steps:
        raise SystemExit(f"unknown step {step!r}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out, tmp = Path(root) / step, Path(root) / (step + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    steps[step](tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def main(step: str, gguf: str, root: str) -> None:
    hf = Path(root) / "hf"
    steps = {
        "hf": lambda out: export_hf(Path(gguf), out),
        "genai-fp32": lambda out: export_genai(hf, out, "fp32"),
        "genai-int4": lambda out: export_genai(hf, out, "int4"),
        "optimum": lambda out: export_optimum(hf, out),
    }
    run_step(step, root, steps)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
