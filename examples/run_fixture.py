"""Load a fixture decoder, run a prompt step and a decode step, and compare with onnxruntime.

Usage: python examples/run_fixture.py [PATH.onnx]   (needs pip install 'transmuter_jax[ort]')
"""

from __future__ import annotations

import os
import sys

import numpy as np

import transmuter_jax as tj
from transmuter_jax.testing import compare_with_onnxruntime, example_inputs

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = os.path.join(HERE, "..", "tests", "fixtures", "llama-genai-fp32", "model.onnx")


def main(path: str) -> None:
    try:
        import onnxruntime  # noqa: F401
    except ModuleNotFoundError:
        sys.exit(
            "examples/run_fixture.py compares with onnxruntime, which is not installed: "
            "pip install 'transmuter_jax[ort]' (in a checkout: pip install -e '.[ort]')"
        )
    model = tj.load(path)
    print(f"loaded {os.path.relpath(path)}: {len(model.params)} weight arrays")
    for info in model.inputs[:4]:
        print(f"  input  {info.name:<28} {info.dtype:<8} {info.shape}")
    for info in model.outputs[:2]:
        print(f"  output {info.name:<28} {info.dtype:<8} {info.shape}")
    prompt = example_inputs(model, batch=1, length=8)
    logits = np.asarray(model(prompt)["logits"])
    print(f"prompt of 8 tokens -> next token {int(logits[0, -1].argmax())}")
    for label, inputs in (("prompt", prompt), ("decode", example_inputs(model, length=1, past=8))):
        diffs = compare_with_onnxruntime(model, inputs)
        print(f"{label} step vs onnxruntime: max abs difference {max(diffs.values()):.2e}")
    for stat in model.compile_stats:
        print(f"compiled a shape: trace {stat.trace_s:.2f} s, compile {stat.compile_s:.2f} s")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else DEFAULT)
