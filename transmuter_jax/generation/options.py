"""The generation options: a frozen, validated dataclass with transformers' names and defaults."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import GenerationError

TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
DECODE_STEPS = 16  # new tokens per dispatch of the decode program (see docs/generation.md)
# transformers 4.57 GenerationConfig fields that change the tokens and that this engine does not
# run, with the values that leave generation unchanged.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "max_time": (None,),
    "token_healing": (None, False),
    "guidance_scale": (None, 1, 1.0),
    "watermarking_config": (None,),
    "penalty_alpha": (None, 0, 0.0),
    "dola_layers": (None,),
    "diversity_penalty": (None, 0, 0.0),
    "num_beam_groups": (None, 1),
    "constraints": (None,),
    "force_words_ids": (None,),
}


MAX_SEQUENCES = 1024
"""The most num_beams, num_return_sequences and top_logprobs allowed."""

MAX_DRAFT = 32
"""The most prompt_lookup_num_tokens (a verification step feeds that many tokens and one)."""
MAX_NGRAM = 16
"""The most max_matching_ngram_size."""
NGRAM_DEFAULT = 2
"""The n-gram size prompt lookup matches when max_matching_ngram_size is None (transformers')."""


def plain(value: Any) -> Any:
    """``value`` with numpy scalars (and 0-d arrays) as the Python numbers they hold, inside
    lists, tuples and dicts too, so that they count as those numbers everywhere."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list | tuple):
        return type(value)(plain(v) for v in value)
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    return value


def seed_value(seed: Any) -> int:
    """``seed`` as a Python int: an int of any size or a numpy integer; GenerationError for
    anything else (a float, a string, a bool), which is never truncated."""
    seed = plain(seed)
    if not _is_int(seed):
        raise GenerationError(f"seed must be an integer, got {seed!r}")
    return seed


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ids(name: str, value: Any) -> tuple[int, ...] | None:
    """A token id or a list of them as a tuple (None stays None)."""
    if value is None:
        return None
    if _is_int(value):
        return (value,)
    if isinstance(value, list | tuple) and all(_is_int(v) and v >= 0 for v in value):
        return tuple(value)
    raise GenerationError(f"{name} must be a token id or a list of token ids, got {value!r}")


# The kinds of the scalar options (None is allowed where the default is None).
_INTS = ("max_length", "max_new_tokens", "min_length", "min_new_tokens", "num_beams",
         "num_return_sequences", "top_k", "no_repeat_ngram_size", "forced_bos_token_id",
         "bos_token_id", "pad_token_id", "decoder_start_token_id", "top_logprobs",
         "decode_steps", "encoder_no_repeat_ngram_size", "prompt_lookup_num_tokens",
         "max_matching_ngram_size", "num_assistant_tokens")  # fmt: skip
_FLOATS = ("length_penalty", "temperature", "top_p", "repetition_penalty", "min_p", "typical_p",
           "epsilon_cutoff", "eta_cutoff", "encoder_repetition_penalty")  # fmt: skip
_BOOLS = ("do_sample", "renormalize_logits", "remove_invalid_values", "token_logprobs")


def _check_kinds(options: Options) -> None:
    """Raises GenerationError for a scalar option of the wrong kind (a bool for a number, ...)."""
    for name in _INTS + _FLOATS + _BOOLS:
        value = getattr(options, name)
        if value is None and name not in _BOOLS:
            continue
        if name in _INTS:
            ok = _is_int(value)
        elif name in _FLOATS:
            ok = (_is_int(value) or isinstance(value, float)) and math.isfinite(value)
        else:
            ok = isinstance(value, bool)
        if not ok:
            kind = "a bool"
            if name in _INTS or name in _FLOATS:
                kind = "an integer" if name in _INTS else "a finite number"
            raise GenerationError(f"{name} must be {kind}, got {value!r}")


def _sequence_bias(value: Any) -> tuple[tuple[tuple[int, ...], float], ...]:
    """sequence_bias as transformers takes it ({(ids...): bias} or [[ids, bias], ...]) as a
    tuple of (ids, bias) pairs in the given order."""
    if not isinstance(value, Mapping | list | tuple):
        raise GenerationError(f"sequence_bias must be [[ids, bias], ...], got {value!r}")
    pairs = value.items() if isinstance(value, Mapping) else value
    out = []
    for pair in pairs:
        try:
            ids, bias = pair
            ids = (int(ids),) if isinstance(ids, int) else tuple(int(t) for t in ids)
            bias = float(bias)
        except (TypeError, ValueError):
            raise GenerationError(
                f"sequence_bias entries are [token ids, bias], got {pair!r}"
            ) from None
        if not ids or min(ids) < 0 or math.isnan(bias):
            raise GenerationError(
                f"sequence_bias entry {pair!r}: ids must be non-negative, bias a number"
            )
        out.append((ids, bias))
    if not out:
        raise GenerationError("sequence_bias must not be empty")
    return tuple(out)


def _stop_strings(value: Any) -> tuple[str, ...]:
    """stop_strings as transformers takes it (a string or a list of them) as a tuple."""
    strings = (value,) if isinstance(value, str) else value
    try:
        strings = tuple(strings)
    except TypeError:
        raise GenerationError(
            f"stop_strings must be a string or a list of strings, got {value!r}"
        ) from None
    for s in strings:
        if not isinstance(s, str) or not s:
            raise GenerationError(f"stop_strings entries must be non-empty strings, got {s!r}")
    if not strings:
        raise GenerationError("stop_strings must not be empty (None: no stop strings)")
    return strings


def _constraint_options(options: Options, fix) -> None:
    """Checks the structured-output options (one constraint at most) and stores a schema as
    JSON text and the choices as a tuple."""
    given = [n for n in ("json_schema", "regex", "grammar", "choice") if getattr(options, n)]
    given += ["json_object"] if options.json_object is True else []
    if len(given) > 1:
        raise GenerationError(f"give one constraint, not {' and '.join(given)}")
    for name in ("json_object", "json_whitespace"):
        if not isinstance(getattr(options, name), bool):
            raise GenerationError(f"{name} must be a bool, got {getattr(options, name)!r}")
    schema = options.json_schema
    if schema is not None:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as error:
                raise GenerationError(f"json_schema is not valid JSON: {error}") from None
        if not isinstance(schema, Mapping | bool):
            raise GenerationError(f"json_schema must be a JSON object (a dict), got {schema!r:.80}")
        try:
            fix("json_schema", json.dumps(schema, ensure_ascii=False))
        except (TypeError, ValueError) as error:
            raise GenerationError(f"json_schema is not JSON data: {error}") from None
    for name in ("regex", "grammar"):
        value = getattr(options, name)
        if value is not None and (not isinstance(value, str) or not value):
            raise GenerationError(f"{name} must be a non-empty string, got {value!r}")
    choice = options.choice
    if choice is not None:
        if isinstance(choice, str) or not isinstance(choice, list | tuple) or not choice:
            raise GenerationError(f"choice must be a non-empty list of strings, got {choice!r}")
        if not all(isinstance(c, str) and c for c in choice):
            raise GenerationError(f"choice entries must be non-empty strings, got {choice!r}")
        fix("choice", tuple(choice))


@dataclasses.dataclass(frozen=True)
class Options:
    """What generation reads of transformers 4.57 ``GenerationConfig``, with its defaults, and
    this engine's own options (``token_logprobs``, ``top_logprobs``, ``decode_steps``, and the
    structured-output constraints ``json_schema``, ``json_object``, ``regex``, ``grammar``,
    ``choice`` with ``json_whitespace``).

    Lists are stored as tuples (eos_token_id always a tuple, empty for none), so an Options is
    hashable and its repr is stable across processes.
    """

    max_length: int | None = 20
    max_new_tokens: int | None = None
    min_length: int = 0
    min_new_tokens: int | None = None
    do_sample: bool = False
    num_beams: int = 1
    early_stopping: bool | str = False
    length_penalty: float = 1.0
    num_return_sequences: int = 1
    temperature: float | None = 1.0
    top_k: int | None = 50
    top_p: float | None = 1.0
    repetition_penalty: float | None = 1.0
    encoder_repetition_penalty: float | None = 1.0
    no_repeat_ngram_size: int = 0
    encoder_no_repeat_ngram_size: int = 0
    bad_words_ids: tuple[tuple[int, ...], ...] | None = None
    forced_bos_token_id: int | None = None
    forced_eos_token_id: tuple[int, ...] | None = None
    suppress_tokens: tuple[int, ...] | None = None
    begin_suppress_tokens: tuple[int, ...] | None = None
    renormalize_logits: bool = False
    min_p: float | None = None
    typical_p: float | None = 1.0
    epsilon_cutoff: float | None = 0.0
    eta_cutoff: float | None = 0.0
    sequence_bias: tuple[tuple[tuple[int, ...], float], ...] | None = None
    exponential_decay_length_penalty: tuple[int, float] | None = None
    remove_invalid_values: bool = False
    stop_strings: tuple[str, ...] | None = None
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    decoder_start_token_id: int | None = None
    token_logprobs: bool = False
    top_logprobs: int = 0
    decode_steps: int = DECODE_STEPS
    # speculative decoding (docs/speculative.md): prompt lookup drafts this many tokens
    prompt_lookup_num_tokens: int | None = None
    max_matching_ngram_size: int | None = None
    num_assistant_tokens: int = 20  # with an assistant model (context(assistant=))
    num_assistant_tokens_schedule: str = "constant"
    # structured output (docs/structured-output.md): at most one of the five constraints
    json_schema: str | None = None  # a dict or JSON text, stored as JSON text
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None
    json_whitespace: bool = False

    def __post_init__(self):
        fix = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        _check_kinds(self)
        fix("eos_token_id", _ids("eos_token_id", self.eos_token_id) or ())
        for name in ("forced_eos_token_id", "suppress_tokens", "begin_suppress_tokens"):
            fix(name, _ids(name, getattr(self, name)))
        if self.bad_words_ids is not None:
            words = self.bad_words_ids
            if not isinstance(words, list | tuple) or not words:
                raise GenerationError(f"bad_words_ids must be a list of id lists, got {words!r}")
            fix("bad_words_ids", tuple(_ids("bad_words_ids", w) or () for w in words))
        if self.sequence_bias is not None:
            fix("sequence_bias", _sequence_bias(self.sequence_bias))
        if self.stop_strings is not None:
            fix("stop_strings", _stop_strings(self.stop_strings))
        decay = self.exponential_decay_length_penalty
        if decay is not None:
            ok = isinstance(decay, list | tuple) and len(decay) == 2 and _is_int(decay[0])
            if not ok or not isinstance(decay[1], int | float) or isinstance(decay[1], bool):
                raise GenerationError(
                    "exponential_decay_length_penalty must be (start index, decay factor), "
                    f"got {decay!r}"
                )
            fix("exponential_decay_length_penalty", (decay[0], float(decay[1])))
        _constraint_options(self, fix)
        self._validate()

    def _validate(self) -> None:
        def positive_int(name: str, value: Any, zero: bool = False) -> None:
            low = 0 if zero else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                kind = "a non-negative" if zero else "a positive"
                raise GenerationError(f"{name} must be {kind} integer, got {value!r}")

        for name in ("num_beams", "num_return_sequences", "top_logprobs"):
            if _is_int(getattr(self, name)) and getattr(self, name) > MAX_SEQUENCES:
                raise GenerationError(
                    f"{name} is {getattr(self, name)}, more than the limit of {MAX_SEQUENCES}"
                )
        positive_int("num_beams", self.num_beams)
        positive_int("decode_steps", self.decode_steps)
        positive_int("top_logprobs", self.top_logprobs, zero=True)
        positive_int("num_return_sequences", self.num_return_sequences)
        positive_int("no_repeat_ngram_size", self.no_repeat_ngram_size, zero=True)
        positive_int("encoder_no_repeat_ngram_size", self.encoder_no_repeat_ngram_size or 0, True)
        positive_int("min_length", self.min_length, zero=True)
        for name in ("max_new_tokens", "min_new_tokens", "max_length"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name), zero=True)
        penalty = self.repetition_penalty
        if penalty is not None and not (isinstance(penalty, int | float) and penalty > 0):
            raise GenerationError(f"repetition_penalty must be a positive number, got {penalty!r}")
        encoder = self.encoder_repetition_penalty
        if encoder is not None and not encoder > 0:
            raise GenerationError(
                f"encoder_repetition_penalty must be a positive number, got {encoder!r}"
            )
        expand = max(self.num_beams, self.num_return_sequences)
        if encoder not in (None, 1.0) and expand > 1:
            # transformers 4.57 penalizes only the first rows of the expanded batch then (its
            # encoder ids are not expanded): not a rule to reproduce
            raise GenerationError(
                "encoder_repetition_penalty with num_beams or num_return_sequences above 1 is "
                "not supported (transformers 4.57 applies it to the wrong rows then)"
            )
        if not isinstance(self.length_penalty, int | float) or math.isnan(self.length_penalty):
            raise GenerationError(f"length_penalty must be a number, got {self.length_penalty!r}")
        if self.early_stopping not in (True, False, "never"):
            raise GenerationError(
                f"early_stopping must be True, False or 'never', got {self.early_stopping!r}"
            )
        if self.num_return_sequences > 1 and self.num_beams == 1 and not self.do_sample:
            raise GenerationError(
                f"num_return_sequences {self.num_return_sequences} needs sampling (do_sample=True) "
                "or beam search (num_beams > 1): greedy decoding gives one sequence"
            )
        self._validate_speculation()
        if self.num_beams > 1 and self.num_return_sequences > self.num_beams:
            raise GenerationError(
                f"num_return_sequences {self.num_return_sequences} is more than num_beams "
                f"{self.num_beams}"
            )
        for words in self.bad_words_ids or ():
            if not words or min(words) < 0:
                raise GenerationError(
                    f"bad_words_ids entries must be non-empty lists of ids: {words}"
                )
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise GenerationError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.typical_p is not None and not 0 < self.typical_p <= 1:
            raise GenerationError(f"typical_p must be in (0, 1], got {self.typical_p!r}")
        for name in ("epsilon_cutoff", "eta_cutoff"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 1:
                raise GenerationError(f"{name} must be in [0, 1), got {value!r}")
        if self.do_sample:
            t = self.temperature
            if t is not None and not (isinstance(t, int | float) and t > 0):
                raise GenerationError(f"temperature must be positive when sampling, got {t!r}")
            p = self.top_p
            if p is not None and not (isinstance(p, int | float) and 0 < p <= 1):
                raise GenerationError(f"top_p must be in (0, 1], got {p!r}")
            if self.top_k is not None:
                positive_int("top_k", self.top_k, zero=True)

    def _validate_speculation(self) -> None:
        draft, ngram = self.prompt_lookup_num_tokens, self.max_matching_ngram_size
        for name, value, limit in (
            ("prompt_lookup_num_tokens", draft, MAX_DRAFT),
            ("max_matching_ngram_size", ngram, MAX_NGRAM),
            ("num_assistant_tokens", self.num_assistant_tokens, MAX_DRAFT),
        ):
            if value is not None and not 1 <= value <= limit:
                raise GenerationError(f"{name} must be in [1, {limit}] (or None), got {value!r}")
        schedules = ("constant", "heuristic")
        if self.num_assistant_tokens_schedule not in schedules:
            raise GenerationError(
                f"num_assistant_tokens_schedule must be one of {schedules}, got "
                f"{self.num_assistant_tokens_schedule!r}"
            )
        if draft is None:
            return
        if self.num_beams > 1:
            raise GenerationError(
                "prompt_lookup_num_tokens (speculative decoding) does not run with beam search "
                f"(num_beams={self.num_beams}), as in transformers: set one of them"
            )
        if self.num_return_sequences > 1:
            raise GenerationError(
                "prompt_lookup_num_tokens (speculative decoding) gives one sequence per prompt: "
                "set num_return_sequences to 1"
            )

    @property
    def speculative(self) -> bool:
        """Whether generation drafts tokens and verifies them (prompt_lookup_num_tokens)."""
        return self.prompt_lookup_num_tokens is not None

    def check_supported(self, vocab: int | None) -> None:
        """Raises ValueError for what generation cannot do: options this engine does not
        support, and token ids outside a vocabulary of ``vocab`` tokens."""
        if vocab is None:
            return
        if self.num_beams > vocab:
            raise GenerationError(
                f"num_beams {self.num_beams} is more than the vocabulary of {vocab}"
            )
        if self.top_logprobs > vocab:
            raise GenerationError(
                f"top_logprobs {self.top_logprobs} is more than the vocabulary of {vocab}"
            )
        for words in self.bad_words_ids or ():
            if max(words) >= vocab:
                raise GenerationError(
                    f"bad_words_ids entry {list(words)} is outside the vocabulary of {vocab}"
                )
        for ids, _ in self.sequence_bias or ():
            if max(ids) >= vocab:
                raise GenerationError(
                    f"sequence_bias entry {list(ids)} is outside the vocabulary of {vocab}"
                )
        for name in ("suppress_tokens", "begin_suppress_tokens", "forced_eos_token_id"):
            for token in getattr(self, name) or ():
                if not 0 <= token < vocab:
                    raise GenerationError(
                        f"{name} entry {token} is outside the vocabulary of {vocab}"
                    )
        for name in ("forced_bos_token_id", "decoder_start_token_id"):
            token = getattr(self, name)
            if token is not None and not 0 <= token < vocab:
                raise GenerationError(f"{name} {token} is outside the vocabulary of {vocab}")

    @property
    def encoder_ids(self) -> bool:
        """Whether a processor reads the encoder's input ids (encoder_repetition_penalty,
        encoder_no_repeat_ngram_size)."""
        penalty = self.encoder_repetition_penalty not in (None, 1.0)
        return penalty or (self.encoder_no_repeat_ngram_size or 0) > 0

    @property
    def logprobs(self) -> bool:
        """Whether each new token carries its log-probability (token_logprobs or top_logprobs)."""
        return bool(self.token_logprobs) or self.top_logprobs > 0

    @functools.cached_property
    def program_key(self) -> str:
        """What the compiled programs depend on: the options but the stop strings (checked on the
        host), as a stable string (made once: each decode chunk looks its program up by it)."""
        return repr(dataclasses.replace(self, stop_strings=None))

    def as_dict(self) -> dict[str, Any]:
        """The options by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> Options:
        """A copy with ``changes`` (checked as the constructor checks them)."""
        check_names(changes)
        return dataclasses.replace(self, **changes)


NAMES = tuple(f.name for f in dataclasses.fields(Options))
DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(Options)}


def _harmless(name: str, value: Any) -> bool:
    """Whether an unsupported option's value leaves generation unchanged."""
    return value is None or any(value == v for v in UNSUPPORTED[name])


def _check_file(values: Mapping[str, Any], name: str) -> None:
    """Raises GenerationError naming ``name`` for a value of the file of the wrong type."""
    for key, value in values.items():
        if value is None:
            continue
        try:
            Options(**{key: value})
        except GenerationError as error:
            if "must be" in str(error) and key in str(error):
                raise GenerationError(f"{name}: {error}; fix or delete it") from error
        except TypeError as error:
            raise GenerationError(f"{name}: {key} is {value!r}: {error}") from error


def check_names(options: Mapping[str, Any]) -> None:
    """Raises ValueError naming each unknown option and the nearest valid name."""
    for name in options:
        if name in UNSUPPORTED:
            if not _harmless(name, options[name]):
                raise GenerationError(f"the generation option {name!r} is not supported")
            continue
        if name not in NAMES:
            near = difflib.get_close_matches(name, NAMES, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise GenerationError(f"unknown generation option {name!r}{hint}")


def merge(repo_config: Mapping, file: Mapping, options: Mapping[str, Any]) -> Options:
    """transformers' defaults, then generation_config.json, then ``options``.

    As GenerationConfig.update: an option given as None replaces the file's value. Without a
    generation_config.json, the token ids come from config.json (from_model_config). Fields of
    the file that generation does not read are ignored.
    """
    check_names(options)
    options = {k: plain(v) for k, v in options.items()}
    file = {k: plain(v) for k, v in file.items()}
    for name in UNSUPPORTED:
        if name in file and name not in options and not _harmless(name, file[name]):
            raise GenerationError(
                f"generation_config.json sets {name}={file[name]!r}, which is not supported; "
                f"pass {name}=None to generate without it"
            )
    options = {k: v for k, v in options.items() if k not in UNSUPPORTED}
    given = bool(file)
    if not file:
        text = repo_config.get("text_config", {})
        text = text if isinstance(text, Mapping) else {}
        file = {k: repo_config.get(k, text.get(k)) for k in TOKEN_IDS}
    merged = {k: v for k, v in file.items() if k in NAMES and k != "decode_steps"}
    _check_file(merged, "generation_config.json" if given else "config.json")
    merged.update(options)
    if merged.get("eos_token_id") is None:
        merged["eos_token_id"] = ()
    return Options(**merged)
