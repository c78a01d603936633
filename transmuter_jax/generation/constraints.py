"""Structured output: json_schema, json_object, regex, grammar and choice constraints.

llguidance compiles a constraint against the tokenizer's vocabulary (its Hugging Face
``tokenizer.json`` path) and gives each step's allowed tokens as an int32 bitmask
[ceil(vocab / 32)] (bit j of word w: token 32 w + j). Two paths apply it
(docs/structured-output.md):

- host: a :class:`HostMatcher` per constraint, a task processor (``(state, process)``, see
  :mod:`.processors`) whose state is the row's bitmask and whose process is :func:`apply_mask`;
- device: where the constraint is a finite automaton written exactly as a regex (a regex, a
  choice, a closed schema: :mod:`.json_regex`), a :class:`TokenTable` (outlines-core's index
  of the pattern as arrays) that a compiled step reads with :func:`table_bitmask` and
  :func:`next_state`, with no host round trip.
- host rows inside the device loop (:class:`HostMask`): a row whose state is a handle (-2 - h)
  of a live llguidance matcher; the compiled step calls back to the host for its mask and
  hands it each new token, whose next mask a host thread computes while the device runs the
  model's next step.

Eos is allowed only where the constraint may end; once it is complete only eos is.
"""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import functools
import itertools
import json
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.experimental
import jax.numpy as jnp
import numpy as np

from . import json_regex
from .errors import GenerationError

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
LOWEST = float(np.finfo(np.float32).min)  # as processors.LOWEST: removed tokens' score
TABLE_LIMIT = 1 << 26  # most states x vocab entries a table is built of (256 MiB on the host)
ESTIMATE_LIMIT = 16  # a pattern's text may suggest this many times TABLE_LIMIT's states
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
        """Whether the constraint is a finite automaton (a regex, a choice, a schema without
        recursive $refs or open objects and arrays)."""
        if self.kind in ("regex", "choice"):
            return True
        return self.kind == "json_schema" and _finite_schema(self.text)


@functools.lru_cache(maxsize=64)
def _finite_schema(text: str) -> bool:
    """:attr:`Constraint.finite` of a schema (cached: every request's constraint asks)."""
    try:
        return not _open(json_regex.inline(json.loads(text)))
    except (json_regex.Recursive, RecursionError):
        return False


def _open(schema: Any) -> bool:
    """Whether a schema (its $refs inlined) allows documents of unbounded nesting (an object
    or array without properties or items, such as json_object's, or a subschema that allows
    anything)."""

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

    return walk(schema)


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


def of(value: Any) -> Constraint | None:
    """A request's constraint: a :class:`Constraint`, or a mapping of one structured-output
    option (``{"regex": "[0-9]+"}``, ``{"choice": [...]}``, ``{"json_schema": {...}}``, with
    ``json_whitespace`` if wanted), checked as the options check it; None: none.

    Raises:
        GenerationError: naming what is wrong.
    """
    if value is None or isinstance(value, Constraint):
        return value
    if not isinstance(value, collections.abc.Mapping):
        raise GenerationError(
            f"a constraint is a Constraint or a mapping such as {{'regex': ...}}, got {value!r:.80}"
        )
    from .options import Options

    wrong = set(value) - {*KINDS, "json_whitespace"}
    if wrong:
        raise GenerationError(f"not a constraint option: {', '.join(sorted(wrong))}")
    return from_options(Options().replace(**value))


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


# -- the device path -----------------------------------------------------------------------

SENTINEL = "\x00"  # ends the pattern in outlines-core's index: where it may follow, eos may
MIN_STATES = 16  # a device table's states are padded to a power of two, at least this
MIN_CLASSES = 256  # and its token classes, at least this (few shapes: few programs)
CHECK_WALKS = 16  # random token walks that check a table against llguidance when it is built
CHECK_STEPS = 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenTable:
    """A finite constraint's token-level automaton, as device arrays (state 0 is the start;
    states past the automaton's, up to a power of two, allow nothing). Tokens that every
    state treats alike share a class: ``next`` has a column per class, not per token.

    Attributes:
        mask: [S, ceil(V / 32)] int32 the tokens each state allows (eos where it may end).
        next: [S, C] int32 the state after a token of each class (-1: not allowed; eos keeps
            the state).
        classes: [V] int32 each token's class (its column of ``next``).
        host: whether rows may hold host matchers (states -2 - h, see :class:`HostMask`):
            a step that reads the table then calls back to the host for those rows.
    """

    mask: jax.Array
    next: jax.Array
    classes: jax.Array
    host: bool = dataclasses.field(default=False, metadata={"static": True})

    @property
    def states(self) -> int:
        """The table's states (padded)."""
        return int(self.next.shape[0])


@dataclasses.dataclass(frozen=True)
class HostTable:
    """A table on the host, unpadded: ``next`` [S, C] int32, ``classes`` [V] int32 and
    ``masks`` [S, ceil(V / 32)] int32 (each state's allowed tokens) as in :class:`TokenTable`."""

    next: np.ndarray
    classes: np.ndarray
    masks: np.ndarray

    def after(self, state: int, token: int) -> int:
        """The state after ``token`` from ``state`` (-1: not allowed)."""
        return int(self.next[state, self.classes[token]])


def _padded(n: int, least: int = MIN_STATES) -> int:
    """``n`` up to a power of two, at least ``least`` (a table's states or classes)."""
    return max(least, 1 << (int(n) - 1).bit_length())


def join(tables: Sequence[TokenTable]) -> tuple[TokenTable, list[int]]:
    """One table holding ``tables`` side by side, and where each one's states start in it
    (their states move by that much; token classes are split where any table tells tokens
    apart). Built on the host: tables are small but for their masks."""
    sizes = [t.states for t in tables]
    starts = [sum(sizes[:i]) for i in range(len(tables))]
    size = _padded(sum(sizes))
    classes = np.stack([np.asarray(t.classes) for t in tables])  # [T, V]
    columns, inverse = np.unique(classes, axis=1, return_inverse=True)
    nexts = np.full((size, _padded(columns.shape[1], MIN_CLASSES)), -1, np.int32)
    for t, start, column in zip(tables, starts, columns, strict=True):
        moved = np.asarray(t.next)[:, column]
        nexts[start : start + t.states, : len(column)] = np.where(moved >= 0, moved + start, -1)
    masks = [t.mask for t in tables]
    if size > sum(sizes):
        masks.append(jnp.zeros((size - sum(sizes), tables[0].mask.shape[1]), jnp.int32))
    table = TokenTable(
        jnp.concatenate(masks),
        jnp.asarray(nexts),
        jnp.asarray(inverse.reshape(-1).astype(np.int32)),
        host=any(t.host for t in tables),
    )
    return table, starts


def pack(allowed_tokens: np.ndarray) -> np.ndarray:
    """[..., ceil(V / 32)] int32 the bitmask of a bool array [..., V]."""
    v = allowed_tokens.shape[-1]
    words = -(-v // 32)
    padded = np.zeros((*allowed_tokens.shape[:-1], words * 32), bool)
    padded[..., :v] = allowed_tokens
    return np.packbits(padded, axis=-1, bitorder="little").view("<i4").astype(np.int32)


def pattern_of(constraint: Constraint) -> str:
    """The regex of a regex or choice constraint, or of a schema :mod:`.json_regex` writes as
    llguidance reads it, for outlines-core's index.

    Raises:
        NotExact: for a schema that module cannot write exactly (it runs on the host).
        GenerationError: for a grammar.
    """
    if constraint.kind == "regex":
        return constraint.text
    if constraint.kind == "choice":
        import re

        return "|".join(f"({re.escape(c)})" for c in json.loads(constraint.text))
    if constraint.kind == "json_schema" and constraint.finite:
        if not _expressible(constraint):
            raise NotExact("no exact regex of this schema (docs/structured-output.md)")
        return _schema_pattern(constraint.text)
    raise GenerationError(f"a {constraint.kind} constraint has no device table: use the host path")


@functools.lru_cache(maxsize=64)
def _schema_pattern(text: str) -> str | None:
    return json_regex.pattern(text)


def _expressible(constraint: Constraint) -> bool:
    """Whether a table may equal llguidance's masks, before building it (a build that fails
    its checks costs up to seconds): a regex, a choice, or a compact schema :mod:`.json_regex`
    writes exactly."""
    if constraint.kind != "json_schema":
        return constraint.finite
    return (
        constraint.finite and not constraint.whitespace and bool(_schema_pattern(constraint.text))
    )


@functools.lru_cache(maxsize=4)
def _texts(path: str, vocab: int, eos: tuple[int, ...]) -> dict[bytes, list[int]]:
    """The byte texts of the vocabulary's ordinary tokens (no eos, special or NUL-holding one),
    as outlines-core's Vocabulary takes them."""
    tok = tokenizer(path, vocab, eos)
    texts: dict[bytes, list[int]] = {}
    for token in range(min(vocab, tok.vocab_size)):
        if token in eos or tok.is_special_token(token):
            continue
        text = tok.decode_bytes([token])
        if text and SENTINEL.encode() not in text:
            texts.setdefault(text, []).append(token)
    return texts


class NotExact(GenerationError):
    """A finite constraint without a device table equal to llguidance's masks on every path
    (or one too large for the device): it runs as host rows."""


@functools.lru_cache(maxsize=32)
def _host_table(constraint: Constraint, path: str, vocab: int, eos: tuple[int, ...]) -> HostTable:
    """The table of ``constraint`` on the host (its token classes: tokens alike in every state).

    outlines-core indexes the pattern followed by a NUL sentinel (its 0.2 index drops the moves
    out of states where the pattern may end; followed by the sentinel, no state of the pattern
    is final): eos is allowed where the sentinel may follow. Then each state keeps only the
    tokens llguidance's mask allows there (llguidance keeps the canonical tokenization of a
    forced continuation: after "pos" of "positive" it allows "it", not "i"), read along one
    path to the state, and random walks check the table against llguidance.

    Raises:
        NotExact: where llguidance allows a token the index does not, or a walk disagrees.
    """
    from outlines_core import Index, Vocabulary

    texts = dict(_texts(path, vocab, eos))
    sentinel = 1 << 30  # a token id past every vocabulary
    texts[SENTINEL.encode()] = [sentinel]
    start_matcher = compile_matcher(constraint, path, vocab, eos)  # llguidance's check first
    pattern = f"(?:{pattern_of(constraint)}){SENTINEL}"
    too_large = NotExact(f"the {constraint.kind} has too many states for a device table")
    if _estimated_states(pattern) * vocab > ESTIMATE_LIMIT * TABLE_LIMIT:
        raise too_large  # before an index whose size grows with states x vocab
    try:
        if len(Index(pattern, _bytes_vocabulary(eos[0])).get_transitions()) * vocab > TABLE_LIMIT:
            raise too_large  # its states, counted over single bytes: at least the index's
        index = Index(pattern, Vocabulary(eos[0], texts))
    except NotExact:
        raise
    except Exception as error:  # noqa: BLE001 - llguidance takes it, outlines-core does not
        raise NotExact(f"outlines-core cannot index it: {error}") from None
    transitions = index.get_transitions()
    start, finals = index.get_initial_state(), set(index.get_final_states())
    seen = dict.fromkeys(  # every state, in the order of the transitions (C loops)
        itertools.chain([start], *((name, *moves.values()) for name, moves in transitions.items()))
    )
    names = {name: i for i, name in enumerate(n for n in seen if n not in finals)}
    if len(names) * vocab > TABLE_LIMIT:
        raise too_large
    dense = np.full(max(max(names), *finals) + 1, -1, np.int64)
    dense[list(names)] = list(names.values())
    table = np.full((len(names), vocab), -1, np.int32)
    eos_ids = np.asarray(eos)
    for name, moves in transitions.items():
        if name in finals:
            continue
        row = names[name]
        tokens = np.fromiter(moves.keys(), np.int64, len(moves))
        after = np.fromiter(moves.values(), np.int64, len(moves))
        keep = (tokens < vocab) & ~np.isin(tokens, eos_ids)
        table[row, tokens[keep]] = dense[after[keep]]
        if sentinel in moves:
            table[row, eos_ids] = row
    masks = _as_llguidance(table, start_matcher, vocab, eos)
    _check_walks(table, masks, start_matcher, vocab, eos)
    first, classes = _columns(table)
    return HostTable(np.ascontiguousarray(table[:, first]), classes, masks)


def _columns(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The classes of equal columns of ``table`` [S, V]: a column of each, [C], and each
    column's class, [V] int32 (a hash of each column, then checked equal)."""
    digest = np.zeros(table.shape[1], np.uint64)
    with np.errstate(over="ignore"):
        for row in table:
            np.multiply(digest, np.uint64(1_000_003), out=digest)
            np.add(digest, row.astype(np.uint64), out=digest)
    _, first, classes = np.unique(digest, return_index=True, return_inverse=True)
    classes = classes.reshape(-1).astype(np.int32)
    if not np.array_equal(table[:, first][:, classes], table):  # a hash collision: exact way
        columns = np.ascontiguousarray(table.T)
        alike = columns.view(np.dtype((np.void, columns.shape[1] * 4))).ravel()
        _, first, classes = np.unique(alike, return_index=True, return_inverse=True)
        classes = classes.reshape(-1).astype(np.int32)
    return first, classes


@functools.lru_cache(maxsize=4)
def _bytes_vocabulary(eos: int) -> Any:
    """outlines-core's Vocabulary of the 255 single bytes but NUL, and the sentinel."""
    from outlines_core import Vocabulary

    texts = {bytes([b]): [(1 << 29) + b] for b in range(1, 256)}  # ids past any vocabulary
    texts[SENTINEL.encode()] = [1 << 30]
    return Vocabulary(eos, texts)


def _estimated_states(pattern: str) -> int:
    """A rough bound of the states of ``pattern``'s automaton, read from its text: atoms count
    one, a group the sum of its parts, a counted repeat multiplies what it repeats by its
    largest count (``(a{0,9}){0,9}``: 81). It keeps a hostile pattern from building an index
    first; the table's real states are counted after."""
    frames, i = [[0, 0]], 0  # per open group: [its total, the size of its last atom]
    while i < len(pattern):
        c = pattern[i]
        atom = 1
        if c == "\\":
            i += 1
            if i + 1 < len(pattern) and pattern[i] in "pPxu" and pattern[i + 1] == "{":
                i = pattern.find("}", i) if "}" in pattern[i:] else len(pattern) - 1
        elif c == "[":
            depth, i = 1, i + 1
            if i < len(pattern) and pattern[i] == "^":
                i += 1
            if i < len(pattern) and pattern[i] == "]":
                i += 1
            while i < len(pattern) and depth:
                if pattern[i] == "\\":
                    i += 1
                elif pattern[i] == "[":
                    depth += 1
                elif pattern[i] == "]":
                    depth -= 1
                i += 1
            i -= 1
        elif c == "(":
            frames.append([0, 0])
            i += 1
            continue
        elif c == ")" and len(frames) > 1:
            atom = frames.pop()[0]
        elif c == "{":
            close = pattern.find("}", i)
            counts = pattern[i + 1 : close].split(",") if close > 0 else []
            if counts and all(n.strip().isdigit() or not n.strip() for n in counts):
                largest = max([int(n) for n in counts if n.strip()] or [1])
                frames[-1][0] += frames[-1][1] * (max(largest, 1) - 1)
                frames[-1][1] *= max(largest, 1)
                i = close + 1
                continue
        elif c in "*+?|":
            i += 1
            continue
        frames[-1][0] += atom
        frames[-1][1] = atom
        i += 1
    return sum(f[0] for f in frames)


def _words_after(start: Any, tokens: list[int], vocab: int) -> np.ndarray:
    """:func:`_words` of ``start`` after ``tokens``."""
    matcher = start.deep_copy()
    matcher.consume_tokens(tokens)
    return _words(matcher, vocab)


def _words(matcher: Any, vocab: int) -> np.ndarray:
    """[ceil(vocab / 32)] int32 llguidance's bitmask, no bit past ``vocab``."""
    words = bitmask(matcher, vocab)
    if vocab % 32:
        words[-1] &= np.int32((1 << (vocab % 32)) - 1)
    return words


def _as_llguidance(table: np.ndarray, start: Any, vocab: int, eos: tuple[int, ...]) -> np.ndarray:
    """Keeps in each state of ``table`` only the tokens llguidance allows after one path to it
    (breadth first from the start), and gives those masks, [S, ceil(V / 32)] int32; raises
    NotExact where llguidance allows more."""
    paths, order = {0: []}, [0]
    ordinary = np.ones(vocab, bool)
    ordinary[list(eos)] = False
    masks = np.zeros((len(table), -(-vocab // 32)), np.int32)
    for state in order:
        masks[state] = _words_after(start, paths[state], vocab)
        want = np.unpackbits(masks[state].view(np.uint8), bitorder="little")[:vocab].view(bool)
        have = table[state] >= 0
        if (want & ~have).any():
            raise NotExact("llguidance allows tokens the automaton does not")
        table[state, ~want] = -1
        tokens = np.flatnonzero(want & ordinary)
        first = np.full(len(table), -1)
        first[table[state, tokens[::-1]]] = tokens[::-1]  # the last write: the lowest token
        for after in np.flatnonzero(first >= 0).tolist():
            if after not in paths:
                paths[after] = [*paths[state], int(first[after])]
                order.append(after)
    return masks


def _check_walks(
    table: np.ndarray, masks: np.ndarray, start: Any, vocab: int, eos: tuple[int, ...]
) -> None:
    """Raises NotExact unless the table's masks equal llguidance's along random walks."""
    rng = np.random.default_rng(0)
    ordinary = np.ones(vocab, bool)
    ordinary[list(eos)] = False
    for _ in range(CHECK_WALKS):
        matcher, state = start.deep_copy(), 0
        for _ in range(CHECK_STEPS):
            if not np.array_equal(_words(matcher, vocab), masks[state]):
                raise NotExact("the table differs from llguidance on a walk")
            ok = np.flatnonzero((table[state] >= 0) & ordinary)
            if not len(ok):
                break
            token = int(ok[rng.integers(len(ok))])
            matcher.consume_token(token)
            state = int(table[state, token])


@functools.lru_cache(maxsize=32)
def _device_table(constraint: Constraint, path: str, vocab: int, eos: tuple[int, ...]):
    host = _host_table(constraint, path, vocab, eos)
    (states, width), words = host.next.shape, -(-vocab // 32)
    nexts = np.full((_padded(states), _padded(width, MIN_CLASSES)), -1, np.int32)
    nexts[:states, :width] = host.next
    masks = np.zeros((_padded(states), words), np.int32)
    masks[:states] = host.masks
    return TokenTable(jnp.asarray(masks), jnp.asarray(nexts), jnp.asarray(host.classes))


def token_table(constraint: Constraint, path: str, vocab: int, eos: Sequence[int]) -> TokenTable:
    """The device table of a finite ``constraint`` (cached by its text and the vocabulary),
    equal to llguidance's masks on every path the build checks.

    Raises:
        NotExact: where the table cannot equal llguidance's masks (use the host path).
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
    return _device_table(constraint, os.fspath(path), int(vocab), eos)


def table_bitmask(table: TokenTable, state: jax.Array) -> jax.Array:
    """[B, ceil(V / 32)] int32 each row's allowed tokens at ``state`` [B] (-1: a free row,
    every token allowed)."""
    rows = table.mask[jnp.maximum(state, 0)]
    return jnp.where((state >= 0)[:, None], rows, jnp.int32(-1))


def next_state(table: TokenTable, state: jax.Array, token: jax.Array) -> jax.Array:
    """[B] the state after ``token`` [B] from ``state`` [B] (free rows, state -1, stay -1)."""
    after = table.next[jnp.maximum(state, 0), table.classes[jnp.maximum(token, 0)]]
    return jnp.where(state >= 0, after, state)


@dataclasses.dataclass(frozen=True)
class DeviceMask:
    """The device path of a finite constraint, as a task processor ``(state, process)`` whose
    device table a decode chunk reads instead of calling ``state`` (equal by value: programs
    of two calls with one constraint are one).

    Attributes:
        constraint: the constraint (:attr:`Constraint.finite`).
        path: the model's tokenizer.json. vocab: the logits' vocabulary. eos: the eos ids.
    """

    constraint: Constraint
    path: str
    vocab: int
    eos: tuple[int, ...]

    @property
    def table(self) -> TokenTable:
        """The device table (cached)."""
        return token_table(self.constraint, self.path, self.vocab, self.eos)

    def walk(self, tokens: Sequence[int]) -> int:
        """The table's state after ``tokens`` (new tokens, in order; -1 off the table)."""
        host = _host_table(self.constraint, self.path, self.vocab, self.eos)
        state = 0
        for token in tokens:
            if state < 0:
                break
            state = host.after(state, int(token))
        return state

    def start(self, rows: Sequence[tuple[Sequence[int], Sequence[int]] | None]) -> np.ndarray:
        """[B] int32 the table's states of rows given as (prompt, new tokens) (None: -1)."""
        return np.array([-1 if r is None else self.walk(r[1]) for r in rows], np.int32)

    def release(self, states: np.ndarray) -> None:
        """Nothing to release (as :meth:`HostMask.release`)."""

    def state(self, row: dict) -> np.ndarray:
        """The bitmask of a row (``{"prompt", "generated" (last first), "vocab"}``), from the
        table on the host (a prompt step's selection)."""
        state = self.walk(list(row["generated"])[::-1])
        masks = _host_table(self.constraint, self.path, self.vocab, self.eos).masks
        return masks[state] if state >= 0 else np.zeros(masks.shape[1], np.int32)

    def __getitem__(self, i: int) -> Any:
        return (self.state, _process)[i]

    def __iter__(self):
        return iter((self.state, _process))

    def __len__(self) -> int:
        return 2


DEVICE_MASK = "constraint table"  # a DeviceMask's name in program keys (its table is an input)
HOST_MASK = "constraint matcher"  # a HostMask's: its programs call back to the host


# -- host rows inside the device loop ------------------------------------------------------

HOST_STATE = -2  # a host row's state is HOST_STATE - its handle


class _Live:
    """A host row: its matcher and its next mask (``pending``: being computed)."""

    __slots__ = ("matcher", "words", "mask", "pending")

    def __init__(self, matcher: Any, vocab: int):
        self.matcher, self.words = matcher, -(-vocab // 32)
        self.mask: np.ndarray | None = None
        self.pending: Future | None = None

    def next_mask(self) -> np.ndarray:
        """Its next mask (waits for the host thread where it is being computed)."""
        if self.pending is not None:
            self.pending.result()
            self.pending = None
        return self.mask


def _advanced(lives: list[_Live], tokens: list[int | None]) -> None:
    """On the host thread: each matcher takes its token (None: none), then llguidance computes
    their masks in parallel."""
    for live, token in zip(lives, tokens, strict=True):
        if token is not None:
            live.matcher.consume_token(token)
    masks = np.empty((len(lives), lives[0].words), np.int32)
    pairs = [(live.matcher, i) for i, live in enumerate(lives)]
    import llguidance.numpy

    llguidance.numpy.fill_next_token_bitmask_par(_executor(), pairs, masks)
    for live, mask in zip(lives, masks, strict=True):
        live.mask = mask


def _submit(lives: list[_Live], tokens: list[int | None]) -> None:
    """Starts advancing ``lives`` by ``tokens`` on the host thread."""
    for live in lives:
        live.next_mask()
    future = _worker().submit(_advanced, lives, tokens)
    for live in lives:
        live.pending = future


@functools.cache
def _executor() -> Any:
    """llguidance's thread pool for masks of several rows at once."""
    return _llg().LLExecutor()


KEEP_LIVE = 4096  # host rows kept live at most (the oldest go: a prefix never inserted)
_live: collections.OrderedDict[int, _Live] = collections.OrderedDict()
_handles = itertools.count()
_lock = threading.Lock()


@functools.cache
def _worker() -> ThreadPoolExecutor:
    """The thread that advances host rows' matchers while the device runs."""
    return ThreadPoolExecutor(1, thread_name_prefix="transmuter-constraints")


def _host_bitmasks(words: int, state: np.ndarray) -> np.ndarray:
    """[B, words] the host rows' masks (a callback of :func:`restrict`; other rows, and rows
    released after they ended, -1)."""
    out = np.full((len(state), words), -1, np.int32)
    for b in np.flatnonzero(state <= HOST_STATE):
        live = _live.get(HOST_STATE - int(state[b]))
        if live is not None:
            out[b] = live.next_mask()
    return out


def _host_consume(state: np.ndarray, token: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """Hands each host row its kept token (a callback of :func:`advance`): the host thread
    consumes them and computes the next masks while the device goes on; returns ``state``."""
    lives, tokens = [], []
    for b in np.flatnonzero((state <= HOST_STATE) & kept):
        live = _live.get(HOST_STATE - int(state[b]))
        if live is not None:
            lives.append(live)
            tokens.append(int(token[b]))
    if lives:
        _submit(lives, tokens)
    return np.asarray(state, np.int32)


@functools.lru_cache(maxsize=32)
def _host_matchers(constraint: Constraint, path: str, vocab: int, eos: tuple[int, ...]):
    return HostMatcher(constraint, path, vocab, eos)


@functools.lru_cache(maxsize=8)
def _matcher_table(vocab: int) -> TokenTable:
    """A table of no device states whose rows may be host rows."""
    words = -(-vocab // 32)
    with jax.ensure_compile_time_eval():  # device arrays, also when first read in a trace
        mask, after = jnp.zeros((1, words), jnp.int32), jnp.full((1, 1), -1, jnp.int32)
        classes = jnp.zeros(vocab, jnp.int32)
    return TokenTable(mask, after, classes, host=True)


@dataclasses.dataclass(frozen=True)
class HostMask:
    """The host path of a constraint inside the device loop, as a task processor
    ``(state, process)`` (its ``state`` serves host steps, such as the prompt's): a decode
    chunk reads :attr:`table` and the rows' handles (:meth:`start`), and calls back to the
    host for each step's masks; each new token goes to a host thread, which computes the next
    mask while the device runs the model (equal by value, as :class:`DeviceMask`).

    Attributes:
        constraint: the constraint. path: the model's tokenizer.json. vocab: the logits'
        vocabulary. eos: the eos ids.
    """

    constraint: Constraint
    path: str
    vocab: int
    eos: tuple[int, ...]

    @property
    def table(self) -> TokenTable:
        """The table a chunk reads: no device states, host rows allowed."""
        return _matcher_table(self.vocab)

    @property
    def matchers(self) -> HostMatcher:
        """The constraint's host matchers (cached by the constraint's text)."""
        return _host_matchers(self.constraint, self.path, self.vocab, self.eos)

    def start(self, rows: Sequence[tuple[Sequence[int], Sequence[int]] | None]) -> np.ndarray:
        """[B] int32 the states of rows given as (prompt, new tokens), each a handle of a live
        matcher after its tokens (None: a row that takes no token, -1); :meth:`release` them."""
        states, lives = np.full(len(rows), -1, np.int32), []
        for b, row in enumerate(rows):
            if row is None:
                continue
            live = _Live(self.matchers.matcher(row[0], row[1]).deep_copy(), self.vocab)
            lives.append(live)
            with _lock:
                handle = next(_handles)
                _live[handle] = live
                while len(_live) > KEEP_LIVE:
                    _live.popitem(last=False)
            states[b] = HOST_STATE - handle
        if lives:
            _submit(lives, [None] * len(lives))
        return states

    def release(self, states: np.ndarray) -> None:
        """Drops the live matchers of ``states`` (from :meth:`start`)."""
        release(states)

    def state(self, row: dict) -> np.ndarray:
        """The bitmask of a row (``{"prompt", "generated" (last first), "vocab"}``)."""
        return self.matchers.state(row)

    def __getitem__(self, i: int) -> Any:
        return (self.state, _process)[i]

    def __iter__(self):
        return iter((self.state, _process))

    def __len__(self) -> int:
        return 2


def release(states: np.ndarray) -> None:
    """Drops the live matchers of the host rows among ``states`` (others: nothing)."""
    for s in np.asarray(states).reshape(-1).tolist():
        if s <= HOST_STATE:
            live = _live.pop(HOST_STATE - s, None)
            if live is not None and live.pending is not None:
                live.pending.result()


def live_rows() -> int:
    """Host rows whose matchers are live (started and not released)."""
    return len(_live)


def device_mask(processors: Sequence[Any]) -> DeviceMask | HostMask | None:
    """The :class:`DeviceMask` or :class:`HostMask` among ``processors``, or None."""
    return next((p for p in processors if isinstance(p, DeviceMask | HostMask)), None)


def program_names(processors: Sequence[Any]) -> tuple[Any, ...]:
    """``processors`` with a DeviceMask as :data:`DEVICE_MASK` and a HostMask as
    :data:`HOST_MASK` (what a program computes does not depend on its table, an input, nor on
    which matcher the host runs)."""
    names = {DeviceMask: DEVICE_MASK, HostMask: HOST_MASK}
    return tuple(names.get(type(p), p) for p in processors)


def processor(
    constraint: Constraint, path: str, vocab: int, eos: Sequence[int]
) -> DeviceMask | HostMask:
    """The processor of ``constraint``: a :class:`DeviceMask` where its table equals
    llguidance's masks (a regex or choice, or a schema whose regex does), else a
    :class:`HostMask` (llguidance's matcher on the host, called from the device loop)."""
    path, eos = os.fspath(path), tuple(int(e) for e in eos)
    compile_matcher(constraint, path, vocab, eos)  # a bad constraint is refused by its name
    if _expressible(constraint):
        try:
            token_table(constraint, path, vocab, eos)
            return DeviceMask(constraint, path, int(vocab), eos)
        except NotExact:
            pass
    return HostMask(constraint, path, int(vocab), eos)


def restrict(scores: jax.Array, table: TokenTable | None, state: jax.Array) -> jax.Array:
    """``scores`` [B, V] with each row's tokens its ``state`` [B] does not allow removed (a free
    row, state -1, keeps all; a host row, state -2 - h, its matcher's mask; no table:
    unchanged)."""
    if table is None:
        return scores
    mask = table_bitmask(table, state)
    if table.host:
        hosted = state <= HOST_STATE
        shape = jax.ShapeDtypeStruct(mask.shape, jnp.int32)
        masks = functools.partial(_host_bitmasks, int(mask.shape[1]))
        from_host = jax.lax.cond(
            jnp.any(hosted),
            lambda s: jax.experimental.io_callback(masks, shape, s),
            lambda s: jnp.full(shape.shape, -1, jnp.int32),
            state,
        )
        mask = jnp.where(hosted[:, None], from_host, mask)
    return apply_mask(scores, mask)


def advance(
    table: TokenTable | None, state: jax.Array, token: jax.Array, kept: jax.Array
) -> jax.Array:
    """[B] the state after each row's ``token`` where ``kept`` [B] (an eos keeps the state; a
    host row keeps its handle, and its matcher takes the token)."""
    if table is None:
        return state
    after = jnp.where(kept, next_state(table, state, token), state)
    if table.host:
        hosted = state <= HOST_STATE
        shape = jax.ShapeDtypeStruct(state.shape, jnp.int32)
        handed = jax.lax.cond(
            jnp.any(hosted & kept),
            lambda a: jax.experimental.io_callback(_host_consume, shape, *a),
            lambda a: a[0],
            (state, token.astype(jnp.int32), kept),
        )
        after = jnp.where(hosted, handed, after)
    return after
