"""Sharding as its own floor: meshes, the sharding rules read from a graph, and the placement of
weights and caches over a mesh (:mod:`.sharding`); :func:`load` puts a model onto a mesh."""

from . import sharding
from .loading import load

__all__ = ["load", "sharding"]
