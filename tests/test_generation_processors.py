"""Greedy generation with processor settings, and log-probabilities, equal transformers 4.57.6.

References: generate() with the case's options, and compute_transition_scores(...,
normalize_logits=True) for the log-probabilities (one per new token, and one for the eos that
stopped a row).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from generation_cases import FIXTURES, context, encoder_inputs, reference, tiered

from transmuter_jax import generation

# and every fixture of issue 29's architectures (tests/fixtures/make_archs.py)
NAMES = ["llama-optimum", "whisper-optimum", "marian-optimum"] + sorted(
    p.parent.name
    for p in FIXTURES.glob("*/reference.json")
    if p.parent.name not in ("llama-optimum", "whisper-optimum", "marian-optimum")
    and any(c.get("name") == "processors_all" for c in json.loads(p.read_text()).get("cases", []))
)


# The quick tier runs one case of each family (a different one from family to family, so every
# case runs on several families), and every case of the families named here; the rest is slow.
EVERY_CASE: tuple[str, ...] = ()


def _cases():
    params = []
    for i, name in enumerate(NAMES):
        cases = reference(name)[0]["cases"]
        cases = [c for c in cases if c["name"].startswith(("processors_", "logprobs"))]
        for j, case in enumerate(cases):
            quick = name in EVERY_CASE or j == i % len(cases)
            params.append(tiered(name, case, id=f"{name}/{case['name']}", quick=quick))
    return params


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("generation-processors")


@pytest.mark.parametrize(("name", "case"), _cases())
def test_tokens_and_logprobs_equal_transformers(name, case, workdir):
    prompts = case["prompts"]
    given, inputs = encoder_inputs(name, case, list(range(len(prompts))))
    options = {k: v for k, v in case["options"].items() if k not in ("num_beams",)}
    ctx = context(name, workdir, given=given, token_logprobs=True, **options)
    ctx = generation.compile(ctx, len(prompts))
    events = []
    out = generation.generate(ctx, prompts, [0] * len(prompts), inputs, on_token=events.append)
    for row, (pairs, tokens, logprobs, stopped) in enumerate(
        zip(out, case["tokens"], case["logprobs"], case["stopped_at_eos"], strict=True)
    ):
        assert [t for t, _ in pairs] == tokens, f"row {row}"
        np.testing.assert_allclose([lp for _, lp in pairs], logprobs[: len(tokens)], atol=1e-4)
        if stopped:  # the eos that stopped the row carries the last log-probability
            last = [e["logprob"][row] for e in events if e["token"][row] >= 0][-1]
            np.testing.assert_allclose(last, logprobs[-1], atol=1e-4)
