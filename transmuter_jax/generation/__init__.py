"""Generation with a KV cache: a frozen specification (context), a frozen engine (compile),
generate.

A step takes new tokens and the cache and gives the logits of each row's last token and the next
cache; a prompt runs in one step padded to a bucket (or in power-of-two parts with
``prefill="pow2"``, or at its own length with ``prefill="exact"``), new tokens in chunks of
``decode_steps`` on the device (or one at a time).
See docs/generation.md and docs/engine.md.
"""

from ..parallel import sharding  # documented here before it moved to transmuter_jax.parallel
from .cache import CacheEntry, CacheLayout, Mode
from .context import (
    PREFILLS,
    WHOLE_TENSOR_OPS,
    Context,
    cache_mode,
    context,
    max_new_tokens,
    outputs,
)
from .engine import Compiled, Engine
from .errors import GenerationError
from .loop import compile, generate, new_tokens, on_device, return_seed
from .options import Options
from .processors import Rows
from .prompt import prompt_inputs
from .select import from_bits, to_bits
from .slots import DecodeRows as DecodeState
from .slots import Prefix, Request, SlotState, Token

__all__ = [
    "CacheEntry",
    "CacheLayout",
    "Compiled",
    "Context",
    "Engine",
    "PREFILLS",
    "Prefix",
    "Request",
    "SlotState",
    "Token",
    "Spec",
    "WHOLE_TENSOR_OPS",
    "DecodeState",
    "GenerationError",
    "Mode",
    "Options",
    "cache_mode",
    "Rows",
    "compile",
    "from_bits",
    "context",
    "generate",
    "max_new_tokens",
    "new_tokens",
    "on_device",
    "outputs",
    "prompt_inputs",
    "return_seed",
    "sharding",
    "to_bits",
]

Spec = Context  # the frozen specification of generation
