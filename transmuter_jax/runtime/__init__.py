"""The lowest floor: the error base, jit options, the compile cache, stored programs, the CPU
kernels' switch and the user's cache folder. It imports nothing else of transmuter_jax."""

from .errors import GenerationError, ModelFileError, TransmuterError

__all__ = ["GenerationError", "ModelFileError", "TransmuterError"]
