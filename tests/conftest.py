"""Shared fixtures: the default model, prepared once (cached in the user's cache folder)."""

from __future__ import annotations

import json
import pathlib

import pytest


@pytest.fixture(scope="session")
def default_model() -> pathlib.Path:
    """The folder of the default model's exports (prepared on first use: a few minutes)."""
    from transmuter_jax import default

    return default.prepare()


@pytest.fixture(scope="session")
def default_reference(default_model) -> dict:
    """transformers' greedy tokens on chat prompts, written when the model was prepared."""
    return json.loads((default_model / "hf" / "reference.json").read_text())
