"""Exports a random-weight decoder with whisper-tiny's architecture (optimum, merged decoder).

No real Whisper is available offline. Compile and run times depend on the graph and the tensor
sizes, not on the weights' values, so a random model of the same configuration measures them.
Runs in the fixtures' interpreter (torch, transformers 4.57.6, optimum), offline::

    .venv-fixtures/bin/python compiled_shapes/make_whisper_tiny.py [OUT]

OUT defaults to ~/.cache/transmuter_jax/study/whisper-tiny-random.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    import torch
    from optimum.exporters.onnx import main_export
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    default = pathlib.Path.home() / ".cache/transmuter_jax/study/whisper-tiny-random"
    out = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else default
    torch.manual_seed(0)
    config = WhisperConfig(  # openai/whisper-tiny's architecture (WhisperConfig's defaults)
        vocab_size=51865,
        num_mel_bins=80,
        encoder_layers=4,
        decoder_layers=4,
        encoder_attention_heads=6,
        decoder_attention_heads=6,
        d_model=384,
        encoder_ffn_dim=1536,
        decoder_ffn_dim=1536,
        max_source_positions=1500,
        max_target_positions=448,
        decoder_start_token_id=50258,
        eos_token_id=50257,
        pad_token_id=50257,
        bos_token_id=50257,
        begin_suppress_tokens=None,
        suppress_tokens=None,
        forced_decoder_ids=None,
        architectures=["WhisperForConditionalGeneration"],
    )
    model = WhisperForConditionalGeneration(config).eval()
    with tempfile.TemporaryDirectory() as work:
        hf = pathlib.Path(work) / "hf"
        model.save_pretrained(hf)
        raw = pathlib.Path(work) / "onnx"
        main_export(
            str(hf),
            str(raw),
            task="automatic-speech-recognition-with-past",
            do_validation=False,
            device="cpu",
        )
        out.mkdir(parents=True, exist_ok=True)
        for name in sorted(os.listdir(raw)):
            if name.startswith(("encoder_model.onnx", "decoder_model_merged.onnx")) or name in (
                "config.json",
                "generation_config.json",
            ):
                shutil.copy(raw / name, out / name)
        for name in ("config.json", "generation_config.json"):
            if not (out / name).exists() and (hf / name).exists():
                shutil.copy(hf / name, out / name)
    print("wrote", sorted(p.name for p in out.iterdir()))


if __name__ == "__main__":
    main()
