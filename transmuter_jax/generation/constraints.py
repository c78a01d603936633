"""Structured output: json_schema, json_object, regex, grammar and choice constraints.

llguidance compiles a constraint against the tokenizer's vocabulary (its Hugging Face
``tokenizer.json`` path) and gives each step's allowed tokens as an int32 bitmask
[ceil(vocab / 32)] (bit j of word w: token 32 w + j). Two paths apply it
(docs/structured-output.md):

- host: a :class:`HostMatcher` per constraint, a task processor (``(state, process)``, see
  :mod:`.processors`) whose state is the row's bitmask and whose process is :func:`apply_mask`;
- device: where the constraint is a finite automaton (regex, choice, schemas without $ref), a
  :class:`TokenTable` (outlines-core's index of the same pattern as arrays) that a compiled step
  reads with :func:`table_bitmask` and :func:`next_state`, with no host round trip.

Eos is allowed only where the constraint may end; once it is complete only eos is.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .errors import GenerationError

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
LOWEST = float(np.finfo(np.float32).min)  # as processors.LOWEST: removed tokens' score
TABLE_LIMIT = 1 << 26  # most states x vocab entries of a device table (256 MiB of int32)
KEEP_MATCHERS = 1024  # matchers a HostMatcher keeps, by (prompt, new tokens)


@dataclasses.dataclass(frozen=True)
class Constraint:
    """One constraint of the options, as text.

    Attributes:
        kind: "json_schema", "regex", "grammar" or "choice" (json_object is the schema
            ``{"type": "object"}``).
        text: the schema as JSON, the regex, the Lark grammar, or the choices as a JSON list.
        whitespace: JSON with flexible whitespace (json_whitespace=True); else compact JSON.
    """

    kind: str
    text: str
    whitespace: bool = False

    @property
    def finite(self) -> bool:
        """Whether the constraint is a finite automaton (regex, choice, a schema without $ref),
        which :func:`token_table` can put on the device."""
        if self.kind in ("regex", "choice"):
            return True
        return self.kind == "json_schema" and '"$ref"' not in self.text and not _open(self.text)


def _open(schema: str) -> bool:
    """Whether a schema allows documents of unbounded nesting (an object or array without
    properties or items, such as json_object's, or a subschema that allows anything)."""

    def walk(node: Any) -> bool:
        if not isinstance(node, dict):
            return node is True
        if not any(k in node for k in ("type", "enum", "const", "anyOf", "oneOf", "allOf")):
            return True
        kinds = node.get("type")
        kinds = kinds if isinstance(kinds, list) else [kinds]
        if "object" in kinds and "properties" not in node:
            return True
        if "array" in kinds and "items" not in node and "prefixItems" not in node:
            return True
        subs = list(node.get("properties", {}).values()) + list(node.get("prefixItems", []))
        subs += [node[k] for k in ("items",) if isinstance(node.get(k), dict)]
        for key in ("anyOf", "oneOf", "allOf"):
            subs += list(node.get(key, []))
        extra = node.get("additionalProperties")
        if "object" in kinds and extra not in (None, False):
            return True
        return any(walk(sub) for sub in subs)

    return walk(json.loads(schema))


def from_options(options: Any) -> Constraint | None:
    """The constraint ``options`` (an :class:`~.options.Options`) set, or None."""
    if options.json_schema is not None:
        return Constraint("json_schema", options.json_schema, options.json_whitespace)
    if options.json_object:
        return Constraint("json_schema", '{"type": "object"}', options.json_whitespace)
    if options.regex is not None:
        return Constraint("regex", options.regex)
    if options.grammar is not None:
        return Constraint("grammar", options.grammar)
    if options.choice is not None:
        return Constraint("choice", json.dumps(list(options.choice)))
    return None


def _llg():
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a declared dependency
        raise GenerationError(
            "structured output needs llguidance: pip install 'transmuter_jax[structured]'"
        ) from None
    return llguidance


def grammar_of(constraint: Constraint) -> str:
    """The llguidance grammar of ``constraint`` (not yet checked)."""
    llg = _llg()
    if constraint.kind == "json_schema":
        if constraint.whitespace:
            overrides = {"whitespace_flexible": True}
        else:
            overrides = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
        return llg.LLMatcher.grammar_from_json_schema(constraint.text, overrides=overrides)
    if constraint.kind == "regex":
        return llg.grammar_from("regex", constraint.text)
    if constraint.kind == "grammar":
        return llg.grammar_from("lark", constraint.text)
    return llg.grammar_from("choice", constraint.text)


@functools.lru_cache(maxsize=8)
def tokenizer(path: str, vocab: int, eos: tuple[int, ...]) -> Any:
    """The llguidance tokenizer of the ``tokenizer.json`` at ``path`` for logits of ``vocab``
    tokens and the eos ids ``eos`` (cached: about 0.4 s for a 49k vocabulary)."""
    if not os.path.isfile(path):
        raise GenerationError(f"structured output needs the model's tokenizer.json: {path!r}")
    return _llg().LLTokenizer(path, n_vocab=vocab, eos_token=list(eos))


@functools.lru_cache(maxsize=64)
def _checked(constraint: Constraint, path: str, vocab: int, eos: tuple[int, ...]) -> Any:
    """A fresh matcher of ``constraint`` (cached by its text and the vocabulary)."""
    what = {"json_schema": "JSON schema", "regex": "regex", "grammar": "grammar"}
    what = what.get(constraint.kind, "choice list")
    try:
        grammar = grammar_of(constraint)
    except (ValueError, TypeError) as error:
        raise GenerationError(f"invalid {what}: {error}") from None
    llg = _llg()
    tok = tokenizer(path, vocab, eos)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tok)
    if is_error:
        raise GenerationError(f"invalid {what}: {messages[0]}")
    matcher = llg.LLMatcher(tok, grammar, log_level=0)
    if matcher.is_error():
        raise GenerationError(f"invalid {what}: {matcher.get_error()}")
    return matcher


def compile_matcher(constraint: Constraint, path: str, vocab: int, eos: Sequence[int]) -> Any:
    """A new llguidance ``LLMatcher`` of ``constraint`` at its start.

    Args:
        constraint: from :func:`from_options`.
        path: the model's tokenizer.json.
        vocab: the logits' vocabulary size.
        eos: the eos token ids (at least one: a constraint ends with eos).

    Raises:
        GenerationError: naming what is wrong with the schema, regex, grammar or choices.
    """
    eos = tuple(int(e) for e in eos)
    if not eos:
        raise GenerationError("structured output needs an eos token (eos_token_id is empty)")
    return _checked(constraint, os.fspath(path), int(vocab), eos).deep_copy()


def bitmask(matcher: Any, vocab: int) -> np.ndarray:
    """[ceil(vocab / 32)] int32 the tokens ``matcher`` allows next (llguidance's bitmask may
    have a word more: it is cut to the vocabulary)."""
    return np.frombuffer(matcher.compute_bitmask(), np.int32)[: -(-vocab // 32)].copy()


def allowed(mask: jax.Array | np.ndarray, vocab: int) -> jax.Array:
    """[..., vocab] bool the tokens of a bitmask [..., ceil(vocab / 32)]."""
    mask = jnp.asarray(mask, jnp.int32)
    bits = jnp.right_shift(mask[..., :, None], jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(*mask.shape[:-1], -1)[..., :vocab].astype(bool)


def apply_mask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """``logits`` [..., V] with the tokens a bitmask [..., ceil(V / 32)] does not allow set to
    the lowest float32 (as the processors remove tokens)."""
    return jnp.where(allowed(mask, logits.shape[-1]), logits, LOWEST)


class HostMatcher:
    """The host path: llguidance matchers for each row, as a task processor.

    ``processor`` is ``(state, process)`` (see :mod:`.processors`): ``state(row)`` advances the
    row's matcher by its new tokens and gives its bitmask; ``process`` applies it.
    """

    def __init__(self, constraint: Constraint, path: str, vocab: int, eos: Sequence[int]):
        self.constraint, self.path, self.vocab = constraint, os.fspath(path), int(vocab)
        self.eos = tuple(int(e) for e in eos)
        self.start = compile_matcher(constraint, self.path, self.vocab, self.eos)
        self._rows: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
        self.processor = (self.state, _process)

    def matcher(self, prompt: Sequence[int], tokens: Sequence[int]) -> Any:
        """The matcher after ``tokens`` (new tokens, in order) of a row of ``prompt``."""
        key = (tuple(prompt), tuple(tokens))
        found = self._rows.get(key)
        if found is not None:
            self._rows.move_to_end(key)
            return found
        parent = self._rows.get((key[0], key[1][:-1])) if tokens else None
        if parent is not None:
            matcher = parent.deep_copy()
            matcher.consume_token(int(tokens[-1]))
        else:
            matcher = self.start.deep_copy()
            if tokens:
                matcher.consume_tokens([int(t) for t in tokens])
        self._rows[key] = matcher
        while len(self._rows) > KEEP_MATCHERS:
            self._rows.popitem(last=False)
        return matcher

    def state(self, row: dict) -> np.ndarray:
        """The bitmask of a row (``{"prompt", "generated" (last first), "vocab"}``)."""
        return bitmask(self.matcher(row["prompt"], list(row["generated"])[::-1]), self.vocab)


def _process(logits: jax.Array, mask: jax.Array) -> jax.Array:
    return apply_mask(logits, mask)


def processor(constraint: Constraint, path: str, vocab: int, eos: Sequence[int]) -> tuple:
    """The host path's task processor ``(state, process)`` of ``constraint``."""
    return HostMatcher(constraint, path, vocab, eos).processor


# -- the device path -----------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenTable:
    """A finite constraint's token-level automaton, as device arrays (state 0 is the start).

    Attributes:
        mask: [S, ceil(V / 32)] int32 the tokens each state allows (eos where it may end).
        next: [S, V] int32 the state after each token (-1: not allowed; eos keeps the state).
    """

    mask: jax.Array
    next: jax.Array

    @property
    def states(self) -> int:
        """The automaton's states."""
        return int(self.next.shape[0])


def pack(allowed_tokens: np.ndarray) -> np.ndarray:
    """[..., ceil(V / 32)] int32 the bitmask of a bool array [..., V]."""
    v = allowed_tokens.shape[-1]
    words = -(-v // 32)
    padded = np.zeros((*allowed_tokens.shape[:-1], words * 32), bool)
    padded[..., :v] = allowed_tokens
    return np.packbits(padded, axis=-1, bitorder="little").view("<i4").astype(np.int32)


def pattern_of(constraint: Constraint) -> str:
    """The regex of a finite constraint, for outlines-core's index."""
    if constraint.kind == "regex":
        return constraint.text
    if constraint.kind == "choice":
        import re

        return "|".join(f"({re.escape(c)})" for c in json.loads(constraint.text))
    if constraint.kind == "json_schema" and constraint.finite:
        from outlines_core.json_schema import build_regex_from_schema

        return build_regex_from_schema(constraint.text, whitespace_pattern="")
    raise GenerationError(f"a {constraint.kind} constraint has no device table: use the host path")


@functools.lru_cache(maxsize=32)
def _table(constraint: Constraint, path: str, vocab: int, eos: tuple[int, ...]) -> TokenTable:
    from outlines_core import Index, Vocabulary

    tok = tokenizer(path, vocab, eos)
    texts: dict[bytes, list[int]] = {}
    for token in range(min(vocab, tok.vocab_size)):
        if token in eos or tok.is_special_token(token):
            continue
        text = tok.decode_bytes([token])
        if text:
            texts.setdefault(text, []).append(token)
    try:
        index = Index(pattern_of(constraint), Vocabulary(eos[0], texts))
    except (ValueError, RuntimeError) as error:
        raise GenerationError(f"invalid {constraint.kind}: {error}") from None
    transitions = index.get_transitions()
    start = index.get_initial_state()
    names = [start, *sorted(set(transitions) - {start})]
    finals = set(index.get_final_states())
    names += sorted(finals - set(names))
    if len(names) * vocab > TABLE_LIMIT:
        raise GenerationError(
            f"the {constraint.kind} has {len(names)} states: too large for a device table"
        )
    dense = {name: i for i, name in enumerate(names)}
    table = np.full((len(names), vocab), -1, np.int32)
    for name, moves in transitions.items():
        for token, after in moves.items():
            if token not in eos and token < vocab:
                table[dense[name], token] = dense[after]
    for name in finals:
        table[dense[name], list(eos)] = dense[name]
    _as_llguidance(table, compile_matcher(constraint, path, vocab, eos), vocab)
    return TokenTable(jnp.asarray(pack(table >= 0)), jnp.asarray(table))


def _as_llguidance(table: np.ndarray, start: Any, vocab: int) -> None:
    """Removes from ``table`` the tokens llguidance's mask leaves out in each state (it keeps
    tokenizations near the canonical one: after "m" of "maybe" it allows "ay", not "a"), so
    that the device path gives the host path's tokens. A state's mask is llguidance's after one
    token path that reaches it (breadth first from the start)."""
    paths, order = {0: []}, [0]
    for state in order:
        matcher = start.deep_copy()
        matcher.consume_tokens(paths[state])
        table[state, ~np.asarray(allowed(bitmask(matcher, vocab), vocab))] = -1
        for token in np.flatnonzero(table[state] >= 0):
            after = int(table[state, token])
            if after not in paths:
                paths[after] = [*paths[state], int(token)]
                order.append(after)


def token_table(constraint: Constraint, path: str, vocab: int, eos: Sequence[int]) -> TokenTable:
    """The device table of a finite ``constraint`` (cached by its text and the vocabulary).

    Raises:
        GenerationError: for a constraint that is not a finite automaton (a grammar, a schema
            with $ref or open objects), or one too large for the device.
    """
    if not constraint.finite:
        raise GenerationError(
            f"a {constraint.kind} constraint has no device table: use the host path"
        )
    eos = tuple(int(e) for e in eos)
    if not eos:
        raise GenerationError("structured output needs an eos token (eos_token_id is empty)")
    return _table(constraint, os.fspath(path), int(vocab), eos)


def table_bitmask(table: TokenTable, state: jax.Array) -> jax.Array:
    """[B, ceil(V / 32)] int32 each row's allowed tokens at ``state`` [B] (-1: a free row,
    every token allowed)."""
    rows = table.mask[jnp.maximum(state, 0)]
    return jnp.where((state >= 0)[:, None], rows, jnp.int32(-1))


def next_state(table: TokenTable, state: jax.Array, token: jax.Array) -> jax.Array:
    """[B] the state after ``token`` [B] from ``state`` [B] (free rows, state -1, stay -1)."""
    after = table.next[jnp.maximum(state, 0), jnp.maximum(token, 0)]
    return jnp.where(state >= 0, after, state)
