"""The error of generation's refusals (defined in the runtime floor, which sharding shares)."""

from __future__ import annotations

from ..runtime.errors import GenerationError

__all__ = ["GenerationError"]
