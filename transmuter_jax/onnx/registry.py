"""Registry of operator implementations, keyed by (domain, op type, since-version).

An implementation is a plain function: ONNX inputs are positional arguments (``None`` for an
omitted optional input) and ONNX attributes are keyword arguments with the spec's defaults. It
returns one array or a tuple of arrays. A function that needs the node itself (its outputs, its
subgraphs' scope) declares a keyword-only parameter ``ctx`` and receives a
:class:`~transmuter_jax.onnx.trace.NodeContext`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_DOMAINS = ("", "ai.onnx")


def canonical_domain(domain: str) -> str:
    """The registry's name of a domain: the default domain is ``""``."""
    return "" if domain in DEFAULT_DOMAINS else domain


@dataclass(frozen=True)
class OpSpec:
    """One registered implementation.

    Attributes:
        fn: the implementation.
        name: the ONNX op type.
        domain: "" for the default domain, else e.g. "com.microsoft".
        since: the first opset version it implements.
        static: indices of inputs whose values must be known at trace time (shapes, axes, ...).
        prefer_static: indices of inputs that are better known at trace time (an If condition):
            graph inputs flowing into them become part of the compile key when they are small.
        fold: whether the op may be evaluated at trace time when all its inputs are known.
        takes_ctx: whether ``fn`` takes the keyword argument ``ctx``.
    """

    fn: Callable
    name: str
    domain: str
    since: int
    static: tuple[int, ...]
    prefer_static: tuple[int, ...]
    fold: bool
    takes_ctx: bool


_REGISTRY: dict[tuple[str, str], list[OpSpec]] = {}


def op(
    name: str,
    *,
    domain: str = "",
    since: int = 1,
    static: tuple[int, ...] = (),
    prefer_static: tuple[int, ...] = (),
    fold: bool = True,
) -> Callable[[Callable], Callable]:
    """Registers the decorated function as the implementation of ``name`` from opset ``since``."""

    def register(fn: Callable) -> Callable:
        key = (canonical_domain(domain), name)
        specs = _REGISTRY.setdefault(key, [])
        if any(s.since == since for s in specs):
            raise ValueError(f"{domain or 'ai.onnx'}::{name} since {since} is registered twice")
        takes_ctx = "ctx" in inspect.signature(fn).parameters
        specs.append(
            OpSpec(fn, name, key[0], since, tuple(static), tuple(prefer_static), fold, takes_ctx)
        )
        specs.sort(key=lambda s: s.since)
        return fn

    return register


def lookup(domain: str, name: str, opset: int) -> OpSpec | None:
    """The newest implementation of ``domain::name`` whose since-version is at most ``opset``."""
    found = None
    for spec in _REGISTRY.get((canonical_domain(domain), name), ()):
        if spec.since <= opset:
            found = spec
    return found


def registered() -> list[OpSpec]:
    """All registered implementations."""
    return [s for specs in _REGISTRY.values() for s in specs]
