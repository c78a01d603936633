"""Shared fixtures: the default model, prepared once (cached in the user's cache folder)."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

# The tests keep their compiled programs apart from the user's (set before transmuter_jax is
# imported; the subprocesses of the command-line tests inherit it).
if "TRANSMUTER_JAX_COMPILE_CACHE" not in os.environ:
    _base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    os.environ["TRANSMUTER_JAX_COMPILE_CACHE"] = os.path.join(_base, "transmuter_jax", "jax-tests")


@pytest.fixture(scope="session")
def default_model() -> pathlib.Path:
    """The folder of the default model's exports (prepared on first use: a few minutes)."""
    from transmuter_jax import default

    return default.prepare()


@pytest.fixture(scope="session")
def default_reference(default_model) -> dict:
    """transformers' greedy tokens on chat prompts, written when the model was prepared."""
    return json.loads((default_model / "hf" / "reference.json").read_text())
