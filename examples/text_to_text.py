"""Text to text with an encoder-decoder model (Marian-style translation).

Usage: python examples/text_to_text.py [MODEL] [TEXT ...]
(MODEL: a folder or hub id with encoder_model.onnx and decoder_model_merged.onnx, such as an
optimum or transformers.js export of opus-mt; default: the tiny random Marian test fixture,
whose output is gibberish but shows the calls.)
"""

from __future__ import annotations

import os
import sys

from transmuter_jax import text

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "..", "tests", "fixtures", "marian-optimum")


def main(model: str, texts: list[str]) -> None:
    pipe = text.text_to_text(model, max_new_tokens=24)
    for source, output in zip(texts, pipe(texts), strict=True):
        print(f"{source!r} -> {output!r}")
    print("beam search:", pipe(texts[0], num_beams=3))
    print("streamed:", "|".join(pipe.stream(texts[0])))


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0] if args else FIXTURE, args[1:] or ["The quiet river crosses the old bridge."])
