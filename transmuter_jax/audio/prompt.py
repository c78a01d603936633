"""Whisper's forced decoder prompt: start token, language, task, no-timestamps."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

TASKS = ("transcribe", "translate")

# Whisper's languages: code, then its English name(s); the first name is the language's own.
_LANGUAGES = """
en english|zh chinese,mandarin|de german|es spanish,castilian|ru russian|ko korean|fr french|
ja japanese|pt portuguese|tr turkish|pl polish|ca catalan,valencian|nl dutch,flemish|ar arabic|
sv swedish|it italian|id indonesian|hi hindi|fi finnish|vi vietnamese|he hebrew|uk ukrainian|
el greek|ms malay|cs czech|ro romanian,moldavian,moldovan|da danish|hu hungarian|ta tamil|
no norwegian|th thai|ur urdu|hr croatian|bg bulgarian|lt lithuanian|la latin|mi maori|
ml malayalam|cy welsh|sk slovak|te telugu|fa persian|lv latvian|bn bengali|sr serbian|
az azerbaijani|sl slovenian|kn kannada|et estonian|mk macedonian|br breton|eu basque|
is icelandic|hy armenian|ne nepali|mn mongolian|bs bosnian|kk kazakh|sq albanian|sw swahili|
gl galician|mr marathi|pa punjabi,panjabi|si sinhala,sinhalese|km khmer|sn shona|yo yoruba|
so somali|af afrikaans|oc occitan|ka georgian|be belarusian|tg tajik|sd sindhi|gu gujarati|
am amharic|yi yiddish|lo lao|uz uzbek|fo faroese|ht haitian creole,haitian|ps pashto,pushto|
tk turkmen|nn nynorsk|mt maltese|sa sanskrit|lb luxembourgish,letzeburgesch|my myanmar,burmese|
bo tibetan|tl tagalog|mg malagasy|as assamese|tt tatar|haw hawaiian|ln lingala|ha hausa|
ba bashkir|jw javanese|su sundanese|yue cantonese
"""
CODES: dict[str, str] = {}  # English name -> code
for _entry in _LANGUAGES.replace("\n", "").split("|"):
    _code, _names = _entry.strip().split(" ", 1)
    for _name in _names.split(","):
        CODES[_name] = _code


def language_id(language: str, lang_to_id: Mapping[str, int]) -> int:
    """The token id of ``language``: a token ("<|de|>"), a code ("de") or a name ("german")."""
    key = language.lower()
    if key in lang_to_id:
        token = key
    elif key in CODES:
        token = f"<|{CODES[key]}|>"
    elif key in CODES.values():
        token = f"<|{key}|>"
    else:
        raise ValueError(f"unknown language {language!r}: give a code such as 'en' or a name")
    if token not in lang_to_id:
        raise ValueError(f"the model has no language {token} (see lang_to_id)")
    return int(lang_to_id[token])


def check(config: Mapping[str, Any], language: Any, task: str | None) -> None:
    """Raises ValueError for a language or task the model of ``config`` (generation_config.json)
    cannot take."""
    if (language is not None or task is not None) and config.get("is_multilingual") is False:
        raise ValueError("an English-only model takes no language= or task=")
    if language is not None and "lang_to_id" not in config:
        raise ValueError("the model's generation_config.json has no lang_to_id: give no language")
    if task is not None:
        if task not in TASKS:
            raise ValueError(f"task is one of {TASKS}, got {task!r}")
        if "task_to_id" not in config:
            raise ValueError("the model's generation_config.json has no task_to_id: give no task")


def needs_language(config: Mapping[str, Any], language: str | None, task: str | None) -> bool:
    """Whether the prompt's language is detected (transformers: no language given, none forced,
    and the model has lang_to_id)."""
    return language is None and "lang_to_id" in config and _start(config, language, task)[1] is None


def _start(config: Mapping[str, Any], language: str | None, task: str | None) -> list[Any]:
    """The start token and the tokens that forced_decoder_ids put after it (when neither
    language nor task is given); None where the language goes but is not fixed."""
    tokens: list[Any] = [config.get("decoder_start_token_id")]
    forced = config.get("forced_decoder_ids") if task is None and language is None else None
    for index, token in forced or ():
        if index != len(tokens):
            break
        tokens.append(token)
    if len(tokens) == 1:
        tokens.append(None)
    return tokens


def forced_prompt(
    config: Mapping[str, Any],
    *,
    language: str | None = None,
    task: str | None = None,
    detected: int | None = None,
    timestamps: bool = False,
) -> list[int]:
    """The forced prompt of one input, as transformers 4.57's Whisper generate builds it.

    Args:
        config: generation_config.json.
        language: the language given, or None.
        task: "transcribe", "translate" or None.
        detected: the id of the detected language token (see :func:`needs_language`).
        timestamps: whether timestamps are predicted (no <|notimestamps|>).
    """
    tokens = _start(config, language, task)
    if language is not None:
        tokens[1] = language_id(language, config["lang_to_id"])
    elif detected is not None:
        tokens[1] = detected
    tasks = set((config.get("task_to_id") or {}).values())
    if task is not None:
        task_id = config["task_to_id"][task]
        tokens = [t for t in tokens if t not in tasks] + [task_id]
    elif language is not None and tasks and not tasks & set(tokens):
        tokens.append(config["task_to_id"]["transcribe"])
    no_stamps = config.get("no_timestamps_token_id")
    if not timestamps and no_stamps is not None and tokens[-1] != no_stamps:
        tokens.append(no_stamps)
    elif timestamps and tokens[-1] == no_stamps:
        tokens.pop()
    return [int(t) for t in tokens if t is not None]


# openai-whisper's default first timestamp limit, 1 s in steps of 0.02 s (the value of every
# Whisper checkpoint's generation_config.json)
MAX_INITIAL_TIMESTAMP_INDEX = 50


def from_tokens(token_id: Callable[[str], int | None]) -> dict[str, Any]:
    """What a Whisper generation_config.json says of the prompt, from the special tokens of the
    tokenizer (``token_id``: text -> id or None), for a folder without one (the onnxruntime-genai
    builder writes none).

    The start token (<|startoftranscript|>), the language tokens (<|en|>, ... of the languages
    above that the tokenizer has), <|transcribe|> and <|translate|>, <|notimestamps|>, and, for a
    multilingual model, the checkpoints' forced prompt: the language detected, then
    <|transcribe|>. The suppressed tokens are not in the tokenizer: none are suppressed (as
    onnxruntime-genai does).
    """
    found = {
        "decoder_start_token_id": token_id("<|startoftranscript|>"),
        "no_timestamps_token_id": token_id("<|notimestamps|>"),
    }
    config: dict[str, Any] = {k: int(v) for k, v in found.items() if v is not None}
    codes = dict.fromkeys(CODES.values())
    langs = {f"<|{c}|>": token_id(f"<|{c}|>") for c in codes}
    langs = {k: int(v) for k, v in langs.items() if v is not None}
    tasks = {t: token_id(f"<|{t}|>") for t in TASKS}
    tasks = {k: int(v) for k, v in tasks.items() if v is not None}
    config["is_multilingual"] = bool(langs)
    if langs:
        config["lang_to_id"] = langs
    if tasks:
        config["task_to_id"] = tasks
    if langs and "transcribe" in tasks:
        config["forced_decoder_ids"] = [[1, None], [2, tasks["transcribe"]]]
    if "no_timestamps_token_id" in config:
        config["max_initial_timestamp_index"] = MAX_INITIAL_TIMESTAMP_INDEX
    return config
