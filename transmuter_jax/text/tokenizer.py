"""A Hugging Face fast tokenizer loaded from a folder, encoding and decoding as transformers 4.57.

`Tokenizer.from_folder` reads `tokenizer.json` with the `tokenizers` package and applies the
settings of `tokenizer_config.json` and `special_tokens_map.json` that transformers'
`AutoTokenizer.from_pretrained` applies when it loads a fast tokenizer:

* the special tokens (`bos_token`, `eos_token`, ..., `additional_special_tokens`,
  `extra_special_tokens`), with the defaults of the tokenizer class, are added to the vocabulary
  as special tokens when they are not added tokens already, and so are the entries of
  `added_tokens_decoder`;
* `add_prefix_space` rewrites a top-level pre-tokenizer that has that option (e.g. `ByteLevel`);
* the Llama, Gemma and GPT-NeoX classes replace the post-processor with a template that adds
  `bos_token` and/or `eos_token` (`add_bos_token`, `add_eos_token`);
* `split_special_tokens` and `clean_up_tokenization_spaces` (default `False` in 4.57).

Other tokenizer classes (Whisper, T5, CodeLlama, Cohere, ...) are loaded as a plain
`PreTrainedTokenizerFast`; their class-specific behaviour is not reproduced.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, pre_tokenizers, processors

from .. import hub
from ..runtime.errors import ModelFileError
from . import chat
from .stream import TextStream

__all__ = ["Tokenizer", "clean_up_tokenization"]

# The single-token attributes of transformers' SpecialTokensMixin, in its order.
_SPECIAL_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# Constructor defaults of the fast tokenizer classes whose __init__ changes what is encoded.
# "post_processor": (add_bos_token, add_eos_token) defaults of the classes that rewrite the
# post-processor; "add_prefix_space": the default that is compared with the pre-tokenizer's.
_CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "PreTrainedTokenizer": {},
    "GPT2Tokenizer": {
        "unk_token": "<|endoftext|>",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
    },
    "Qwen2Tokenizer": {
        "unk_token": "<|endoftext|>",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        # Qwen2TokenizerFast turns these str tokens into AddedTokens.
        "as_added_tokens": ("unk_token", "bos_token", "eos_token", "pad_token"),
    },
    "LlamaTokenizer": {
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "post_processor": (True, False),
        "add_prefix_space": None,
    },
    "GemmaTokenizer": {
        "unk_token": "<unk>",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "post_processor": (True, False),
    },
    "GPTNeoXTokenizer": {
        "unk_token": "<|endoftext|>",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "pad_token": None,
        "post_processor": (False, False),
    },
}

# AutoTokenizer's class for a config.json model_type, used when tokenizer_config.json names none.
_MODEL_TYPE_CLASSES = {
    **dict.fromkeys(("llama", "mistral", "mixtral", "phi3", "idefics3"), "LlamaTokenizer"),
    **dict.fromkeys(("gemma", "gemma2", "gemma3", "gemma3_text"), "GemmaTokenizer"),
    **dict.fromkeys(("gpt2", "starcoder2", "opt"), "GPT2Tokenizer"),
    **dict.fromkeys(("gpt_neox", "olmo"), "GPTNeoXTokenizer"),
    **dict.fromkeys(("qwen2", "qwen2_vl", "qwen2_5_vl", "qwen3", "qwen3_moe"), "Qwen2Tokenizer"),
}

# transformers' `clean_up_tokenization` replacements, applied in this order.
_CLEAN_UP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


def clean_up_tokenization(text: str) -> str:
    """Remove the spaces before punctuation and English contractions, as transformers does."""
    for old, new in _CLEAN_UP:
        text = text.replace(old, new)
    return text


def check_text(text: str, name: str) -> None:
    """Raises ValueError when ``text`` is not valid Unicode: a lone surrogate (as Python makes
    of bytes that are not UTF-8 with surrogateescape, or as "\\ud800" writes it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"{name} is not valid Unicode text: it holds a lone surrogate "
            f"U+{ord(text[error.start]):04X} at character {error.start} (bytes that are not "
            "UTF-8?); give UTF-8 text"
        ) from None


def _read_text(path: pathlib.Path, folder: pathlib.Path | None = None) -> str:
    """A UTF-8 text file of the folder (a chat template), read with hub's bounds."""
    try:
        return hub.read_file(path, folder=None if folder is None else str(folder)).decode("utf-8")
    except UnicodeDecodeError as error:
        raise ModelFileError(f"{str(path)!r} is not UTF-8 text: {error}") from error


def _read_json(path: pathlib.Path) -> Any:
    """A JSON object file, or None when there is none; ModelFileError when it is not one (or
    not a bounded regular file inside its folder, see :func:`hub.parse_json`)."""
    if not os.path.lexists(path):
        return None
    return hub.parse_json(path)


def _added_token(value: Mapping[str, Any], *, special: bool | None = None) -> AddedToken:
    fields = {k: v for k, v in value.items() if k != "__type"}
    if special is not None:
        fields["special"] = special
    return AddedToken(**fields)


def _token_value(value: Any) -> Any:
    """A special-token value of the config as a str or an AddedToken (dicts become AddedTokens)."""
    if isinstance(value, Mapping):
        return _added_token(value)
    if isinstance(value, list | tuple):
        return [_token_value(v) for v in value]
    return value


def _class_name(config: Mapping[str, Any], folder: pathlib.Path) -> str:
    name = config.get("tokenizer_class")
    if not name:
        model_config = _read_json(folder / "config.json") or {}
        name = model_config.get("tokenizer_class") or _MODEL_TYPE_CLASSES.get(
            str(model_config.get("model_type")), "PreTrainedTokenizer"
        )
    return name.removesuffix("Fast")


def _load_chat_templates(folder: pathlib.Path, config: Mapping[str, Any]) -> dict[str, str]:
    templates: dict[str, str] = {}
    default = folder / "chat_template.jinja"
    if os.path.lexists(default):
        templates["default"] = _read_text(default)
    extra = folder / "chat_templates"
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            templates[path.stem] = _read_text(path, folder)
    if templates:
        return templates
    value = config.get("chat_template")
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list | tuple):
        return {str(item["name"]): str(item["template"]) for item in value}
    return {}


class Tokenizer:
    """A fast tokenizer with transformers' encoding, decoding and chat-template rules.

    Attributes:
        backend: the `tokenizers.Tokenizer`, with the config's settings applied.
        special_tokens: the named special tokens as strings (`bos_token`, `eos_token`, ...).
        additional_special_tokens: the config's `additional_special_tokens`, as strings.
        chat_template: the default chat template, or None; setting it replaces `chat_templates`.
        chat_templates: every named chat template (the default one is named "default").
        clean_up_tokenization_spaces: whether `decode` removes spaces before punctuation.
        special_ids: the ids that `decode(..., skip_special_tokens=True)` leaves out.
        name: where the tokenizer was loaded from, for messages.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        additional_special_tokens: Sequence[str] = (),
        chat_templates: Mapping[str, str] | None = None,
        clean_up_tokenization_spaces: bool = False,
        name: str = "tokenizer",
    ) -> None:
        """Wrap `backend` as is; `from_folder` applies a folder's config first."""
        self.backend = backend
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.additional_special_tokens: list[str] = list(additional_special_tokens)
        self.chat_templates: dict[str, str] = dict(chat_templates or {})
        self.clean_up_tokenization_spaces = bool(clean_up_tokenization_spaces)
        self.name = name
        self.special_ids: frozenset[int] = frozenset(
            index for index, token in backend.get_added_tokens_decoder().items() if token.special
        )

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> Tokenizer:
        """Load `tokenizer.json` and the tokenizer configs of a model folder.

        Raises:
            ModelFileError: `tokenizer.json` is missing or a file cannot be read.
        """
        path = pathlib.Path(folder)
        tokenizer_file = path / "tokenizer.json"
        if not os.path.lexists(tokenizer_file):
            raise ModelFileError(
                f"{path} has no tokenizer.json; only fast tokenizers (tokenizer.json) are supported"
            )
        data = hub.read_file(tokenizer_file, hub.MAX_TOKENIZER_BYTES)
        try:
            backend = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
        except Exception as error:
            raise ModelFileError(f"cannot load {tokenizer_file}: {error}") from error
        config = _read_json(path / "tokenizer_config.json")
        special_map = _read_json(path / "special_tokens_map.json")
        settings = dict(config) if isinstance(config, Mapping) else {}
        class_name = _class_name(settings, path)
        defaults = _CLASS_DEFAULTS.get(class_name, {})

        # Without `added_tokens_decoder` (legacy configs, or no config), transformers lets
        # special_tokens_map.json override the config.
        if "added_tokens_decoder" not in settings and isinstance(special_map, Mapping):
            for key, value in special_map.items():
                if key == "additional_special_tokens" and isinstance(value, list):
                    merged = list(_token_value(settings.get(key)) or [])
                    for token in value:
                        token = (
                            _added_token(token, special=True)
                            if isinstance(token, Mapping)
                            else token
                        )
                        if token not in merged:
                            merged.append(token)
                    settings[key] = merged
                elif isinstance(value, Mapping):
                    settings[key] = _added_token(value, special=True)
                else:
                    settings[key] = value

        # The added tokens transformers passes to the class: the config's added_tokens_decoder,
        # else (legacy) those of tokenizer.json. A special token named in the config becomes the
        # added token with its text, flags included.
        decoder = settings.get("added_tokens_decoder")
        if isinstance(decoder, Mapping):
            added = {int(index): _added_token(token) for index, token in decoder.items()}
        else:
            added = backend.get_added_tokens_decoder()
        added_by_text = {token.content: token for token in added.values()}

        values: dict[str, Any] = {}
        for key in _SPECIAL_KEYS:
            if key in settings:
                value = _token_value(settings[key])
                if value is not None:
                    value = added_by_text.get(str(value), value)
            else:
                value = defaults.get(key)
            if isinstance(value, str) and key in defaults.get("as_added_tokens", ()):
                value = AddedToken(
                    value, lstrip=False, rstrip=False, special=True, normalized=False
                )
            values[key] = value
        values["additional_special_tokens"] = list(
            _token_value(settings.get("additional_special_tokens")) or []
        )
        extra = settings.get("extra_special_tokens")
        if isinstance(extra, Mapping):
            values.update({key: _token_value(value) for key, value in extra.items()})

        _add_tokens(backend, [added[index] for index in sorted(added)], values)
        _set_prefix_space(
            backend, settings.get("add_prefix_space", defaults.get("add_prefix_space", False))
        )
        if "post_processor" in defaults:
            add_bos, add_eos = defaults["post_processor"]
            _set_post_processor(
                backend,
                values,
                bool(settings.get("add_bos_token", add_bos)),
                bool(settings.get("add_eos_token", add_eos)),
            )
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = bool(settings.get("split_special_tokens", False))

        special_tokens = {
            key: str(value)
            for key, value in values.items()
            if key != "additional_special_tokens" and value
        }
        additional = [str(token) for token in values["additional_special_tokens"]]
        return cls(
            backend,
            special_tokens=special_tokens,
            additional_special_tokens=additional,
            chat_templates=_load_chat_templates(path, settings),
            clean_up_tokenization_spaces=bool(settings.get("clean_up_tokenization_spaces", False)),
            name=str(path),
        )

    clean_up_tokenization = staticmethod(clean_up_tokenization)

    @property
    def chat_template(self) -> str | None:
        """The default chat template, or None."""
        return self.chat_templates.get("default")

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        # As in transformers, setting one template replaces all the named ones.
        self.chat_templates = {} if template is None else {"default": template}

    @functools.cached_property
    def token_texts(self) -> tuple[str | None, ...]:
        """The text of each token id as transformers' ``StopStringCriteria`` reads it (None for
        ids outside the vocabulary); computed once."""
        from ..generation.stops import token_texts

        return token_texts(self.backend)

    def token_id(self, token: str) -> int | None:
        """The id of `token` in the vocabulary (added tokens included), or None."""
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`, as transformers' `tokenizer(text).input_ids`."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        check_text(text, "text")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(
        self, texts: Iterable[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """The ids of each text, without padding."""
        texts = list(texts)
        for index, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"texts[{index}] must be a str, got {type(text).__name__}")
            check_text(text, f"texts[{index}]")
        encodings = self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [encoding.ids for encoding in encodings]

    def decode(
        self,
        ids: Iterable[int],
        skip_special_tokens: bool = True,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str:
        """The text of `ids`, as transformers' `tokenizer.decode`.

        `clean_up_tokenization_spaces` defaults to the config's value.
        """
        text = self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        if clean_up_tokenization_spaces is None:
            clean_up_tokenization_spaces = self.clean_up_tokenization_spaces
        return clean_up_tokenization(text) if clean_up_tokenization_spaces else text

    @property
    def template_variables(self) -> dict[str, Any]:
        """The special tokens as chat-template variables (transformers' `special_tokens_map`)."""
        variables: dict[str, Any] = dict(self.special_tokens)
        if self.additional_special_tokens:
            variables["additional_special_tokens"] = list(self.additional_special_tokens)
        return variables

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` with the chat template, as transformers' `apply_chat_template(...,
        tokenize=False)`.

        `kwargs` may hold `documents`, `continue_final_message`, `chat_template` (a template or
        the name of one of `chat_templates`) and any variable the template reads.

        Raises:
            ValueError: the tokenizer has no chat template, or the messages are malformed.
        """
        template = self._select_template(kwargs.pop("chat_template", None), tools)
        return chat.render(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.template_variables,
            tools=tools,
            **kwargs,
        )

    def _select_template(self, chosen: str | None, tools: object) -> str:
        if chosen is not None:
            return self.chat_templates.get(chosen, chosen)
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if self.chat_template is not None:
            return self.chat_template
        if self.chat_templates:
            raise ValueError(
                f"{self.name} has several chat templates and none is named 'default'; pass "
                f"chat_template= one of {sorted(self.chat_templates)}"
            )
        raise ValueError(
            f"{self.name} has no chat template (no chat_template.jinja and no 'chat_template' in "
            "tokenizer_config.json); pass chat_template= or format the prompt yourself"
        )

    def streamer(self, skip_special_tokens: bool = True) -> TextStream:
        """A `TextStream` that turns generated ids into text pieces."""
        return TextStream(self, skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.name!r}, vocab={self.backend.get_vocab_size(with_added_tokens=True)})"
        )


def _add_tokens(
    backend: tokenizers.Tokenizer, added: list[AddedToken], values: Mapping[str, Any]
) -> None:
    """Add `added` and the missing special tokens, as PreTrainedTokenizerFast.__init__ does.

    transformers re-adds every token of `added` (its "already there" test compares ids with
    tokens), so their flags replace those of tokenizer.json.
    """
    to_add: list[Any] = list(added)
    known = [token.content for _, token in sorted(backend.get_added_tokens_decoder().items())]
    known += [str(token) for token in to_add]

    special: list[Any] = []
    seen: set[str] = set()
    for value in values.values():
        for token in value if isinstance(value, list) else [value]:
            if token and str(token) not in seen:
                seen.add(str(token))
                special.append(token)
    # A str token is added only when missing; an AddedToken never equals a str, so it always is.
    to_add += [token for token in special if token not in known and token not in to_add]

    special_names = {str(token) for token in special}
    tokens = []
    for token in to_add:
        if isinstance(token, AddedToken):
            token.special = token.special or str(token) in special_names
        else:
            token = AddedToken(token, special=token in special_names)
        tokens.append(token)
    if tokens:
        backend.add_tokens(tokens)


def _set_prefix_space(backend: tokenizers.Tokenizer, add_prefix_space: Any) -> None:
    """Rebuild a top-level pre-tokenizer whose `add_prefix_space` differs from the config's."""
    if add_prefix_space is None or backend.pre_tokenizer is None:
        return
    try:
        state = json.loads(backend.pre_tokenizer.__getstate__())
        if state.get("add_prefix_space", add_prefix_space) != add_prefix_space:
            kind = getattr(pre_tokenizers, state.pop("type"))
            state["add_prefix_space"] = add_prefix_space
            backend.pre_tokenizer = kind(**state)
    except Exception:  # transformers ignores pre-tokenizers it cannot rebuild
        pass


def _set_post_processor(
    backend: tokenizers.Tokenizer, values: Mapping[str, Any], add_bos: bool, add_eos: bool
) -> None:
    """Replace the post-processor with `[bos] $A [eos]`, as LlamaTokenizerFast does."""
    parts: dict[str, tuple[str, int]] = {}
    for key, wanted in (("bos_token", add_bos), ("eos_token", add_eos)):
        if not wanted:
            continue
        token = values.get(key)
        if not token:
            raise ValueError(f"add_{key.split('_')[0]}_token is true but {key} is not set")
        index = backend.token_to_id(str(token))
        if index is None:
            index = backend.token_to_id(str(values.get("unk_token")))
        parts[key] = (str(token), index)
    bos = f"{parts['bos_token'][0]}:0 " if "bos_token" in parts else ""
    eos = f" {parts['eos_token'][0]}:0" if "eos_token" in parts else ""
    bos_b = f" {parts['bos_token'][0]}:1" if "bos_token" in parts else ""
    eos_b = f" {parts['eos_token'][0]}:1" if "eos_token" in parts else ""
    single = f"{bos}$A:0{eos}"
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=f"{single}{bos_b} $B:1{eos_b}", special_tokens=list(parts.values())
    )
