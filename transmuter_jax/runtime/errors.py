"""The base of every error of transmuter_jax, and the error of unreadable model files."""

from __future__ import annotations


class TransmuterError(Exception):
    """Base class of the errors of transmuter_jax."""


class ModelFileError(TransmuterError, ValueError):
    """A model file or folder cannot be read or is not allowed."""


class GenerationError(TransmuterError, ValueError):
    """A generation option, prompt, input or mesh that generation refuses, named with what is
    wrong (raised before any cache is allocated or program compiled). Defined here, below the
    sharding floor that raises it too; :mod:`transmuter_jax.generation` exports it."""
