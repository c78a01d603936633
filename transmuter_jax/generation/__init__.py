"""Generation with a KV cache: context, compile, generate.

A step takes new tokens and the cache and gives the logits of each row's last token and the next
cache; prompts run in power-of-two steps, new tokens in chunks of ``decode_steps`` on the device
(or one at a time). See docs/generation.md.
"""

from ..parallel import sharding  # documented here before it moved to transmuter_jax.parallel
from .cache import CacheEntry, CacheLayout, Mode
from .context import Context, cache_mode, context, max_new_tokens, outputs
from .decode import DecodeState
from .errors import GenerationError
from .loop import compile, generate, new_tokens, on_device, return_seed
from .options import Options
from .processors import Rows
from .prompt import prompt_inputs
from .select import from_bits, to_bits

__all__ = [
    "CacheEntry",
    "CacheLayout",
    "Context",
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
