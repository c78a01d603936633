"""Exports a random decoder of the size of SmolLM2-135M for the benchmarks (not committed).

Run with the fixture environment (torch, transformers, the exporters):
    bash tests/fixtures/make.sh --python-only   # or any Python with tests/fixtures/requirements.txt
    .venv-fixtures/bin/python benchmarks/make_model.py [--exporter genai-fp32|genai-int4|optimum]

Writes benchmarks/models/smollm2-shape-<exporter>/ (model.onnx and its data).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
# The shape of SmolLM2-135M: llama, 30 layers, hidden 576, 9 heads, 3 KV heads.
CONFIG = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    initializer_range=0.02,
)


def _builder():
    """transmuter_jax/default/genai_builder.py, loaded by its path (run in the tools' env)."""
    import importlib.util

    path = os.path.join(HERE, "..", "transmuter_jax", "default", "genai_builder.py")
    spec = importlib.util.spec_from_file_location("genai_builder", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--exporter", default="genai-fp32", choices=["genai-fp32", "genai-int4", "optimum"]
    )
    args = parser.parse_args()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = os.path.join(HERE, "models", f"smollm2-shape-{args.exporter}")
    if os.path.exists(os.path.join(out, "model.onnx")):
        print(f"{out} exists")
        return
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as work:
        hf = os.path.join(work, "hf")
        LlamaForCausalLM(LlamaConfig(**CONFIG)).eval().save_pretrained(hf)
        # The exporters also save a tokenizer: lend them the fixtures' one.
        tokenizer = os.path.join(HERE, "..", "tests", "fixtures", "llama-optimum")
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(os.path.join(tokenizer, name), hf)
        raw = os.path.join(work, "out")
        if args.exporter.startswith("genai"):
            precision = args.exporter.split("-")[1]
            cache = os.path.join(work, "cache")
            cmd = _builder().command(hf, raw, precision, cache, extra_options=())
        else:
            code = (
                "import sys; from optimum.exporters.onnx import main_export; "
                "main_export(sys.argv[1], sys.argv[2], task='text-generation-with-past', "
                "do_validation=False, device='cpu')"
            )
            cmd = [sys.executable, "-c", code, hf, raw]
        subprocess.run(cmd, check=True)
        os.makedirs(out, exist_ok=True)
        for name in os.listdir(raw):
            if name.startswith("model.onnx") or name.endswith(".json"):
                shutil.move(os.path.join(raw, name), os.path.join(out, name))
        for name in ("config.json", "generation_config.json"):  # the builder writes neither
            if not os.path.exists(os.path.join(out, name)):
                shutil.copy(os.path.join(hf, name), out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
