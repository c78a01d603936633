"""transmuter_jax.text: Tokenizer, chat templates and TextStream against transformers 4.57.6.

The parity vectors (tests/fixtures/text/cases.json) are written by tests/fixtures/make_text.py
with transformers' AutoTokenizer; nothing here is typed from memory. A "variant" is a fixture's
tokenizer.json with the config files stored in cases.json; the tests rebuild its folder.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import shutil

import jinja2
import pytest
import tokenizers
from jinja2.exceptions import SecurityError
from tokenizers import decoders, models, normalizers, pre_tokenizers

from transmuter_jax.onnx.errors import ModelFileError
from transmuter_jax.text import chat
from transmuter_jax.text.chat import ChatTemplateError
from transmuter_jax.text.stream import TextStream
from transmuter_jax.text.tokenizer import Tokenizer, clean_up_tokenization

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
CASES = json.loads((FIXTURES / "text" / "cases.json").read_text(encoding="utf-8"))
NAMES = sorted(CASES["tokenizers"])
STREAM_TEXT = "café ☕ 日本語 😀"


@pytest.fixture(scope="session")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """The folder of every tokenizer of cases.json (variants are rebuilt in a temporary folder)."""
    root = tmp_path_factory.mktemp("text_variants")
    result = {}
    for name, case in CASES["tokenizers"].items():
        if case["files"] is None:
            result[name] = FIXTURES / name
            continue
        folder = root / name
        folder.mkdir()
        shutil.copy(FIXTURES / case["base"] / "tokenizer.json", folder / "tokenizer.json")
        for file_name, text in case["files"].items():
            (folder / file_name).write_text(text, encoding="utf-8")
        result[name] = folder
    return result


@pytest.fixture(scope="session")
def loaded(folders: dict[str, pathlib.Path]) -> dict[str, Tokenizer]:
    return {name: Tokenizer.from_folder(folder) for name, folder in folders.items()}


def test_cases_cover_the_fixtures_and_the_classes() -> None:
    classes = {case["class"] for case in CASES["tokenizers"].values()}
    assert {
        "LlamaTokenizerFast",
        "GemmaTokenizerFast",
        "GPT2TokenizerFast",
        "Qwen2TokenizerFast",
    } <= classes
    assert {"gpt2-optimum", "llama-genai-fp32", "marian-optimum"} <= set(NAMES)
    assert "transformers 4.57.6" in CASES["generator"]


# --------------------------------------------------------------------------------------------
# Encoding, decoding, special tokens
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_encode_matches_transformers(loaded: dict[str, Tokenizer], name: str) -> None:
    tok = loaded[name]
    rows = CASES["tokenizers"][name]["encode"]
    for row in rows:
        assert tok.encode(row["text"]) == row["with_special"], row["text"]
        assert tok.encode(row["text"], add_special_tokens=False) == row["without_special"], row[
            "text"
        ]
    texts = [row["text"] for row in rows]
    assert tok.encode_batch(texts) == [row["with_special"] for row in rows]
    assert tok.encode_batch(texts, add_special_tokens=False) == [
        row["without_special"] for row in rows
    ]


def test_variants_change_the_encoding() -> None:
    """The variants are discriminating: their ids differ from the base fixture's."""
    tokenizers_ = CASES["tokenizers"]
    for name in (
        "llama-class",
        "llama-eos",
        "gemma-class",
        "neox-class",
        "prefix-space",
        "legacy-map",
    ):
        base = tokenizers_[tokenizers_[name]["base"]]["encode"]
        assert tokenizers_[name]["encode"] != base, name


@pytest.mark.parametrize("name", NAMES)
def test_decode_matches_transformers(loaded: dict[str, Tokenizer], name: str) -> None:
    tok = loaded[name]
    for row in CASES["tokenizers"][name]["decode"]:
        assert tok.decode(row["ids"], skip_special_tokens=True) == row["skip"], row["ids"]
        assert tok.decode(row["ids"], skip_special_tokens=False) == row["keep"], row["ids"]
    assert tok.decode([]) == ""


def test_clean_up_vectors_are_discriminating(loaded: dict[str, Tokenizer]) -> None:
    """The clean-up variant decodes differently from its base, and so does our Tokenizer."""
    case = CASES["tokenizers"]["clean-up"]
    assert json.loads(case["files"]["tokenizer_config.json"])["clean_up_tokenization_spaces"]
    base = {tuple(r["ids"]): r["keep"] for r in CASES["tokenizers"][case["base"]]["decode"]}
    changed = [r for r in case["decode"] if base[tuple(r["ids"])] != r["keep"]]
    assert changed
    tok = loaded["clean-up"]
    for row in changed:
        assert (
            tok.decode(row["ids"], False, clean_up_tokenization_spaces=False)
            == base[tuple(row["ids"])]
        )
        assert clean_up_tokenization(base[tuple(row["ids"])]) == row["keep"]


@pytest.mark.parametrize("name", NAMES)
def test_special_tokens_match_transformers(loaded: dict[str, Tokenizer], name: str) -> None:
    tok = loaded[name]
    case = CASES["tokenizers"][name]
    assert tok.template_variables == case["special_tokens_map"]
    for token, index in case["special_token_ids"].items():
        assert tok.token_id(token) == index, token
    assert tok.backend.get_vocab_size(with_added_tokens=True) == case["vocab_size"]
    assert tok.token_id("no such token, surely") is None


@pytest.mark.parametrize("name", NAMES)
def test_chat_template_is_loaded(loaded: dict[str, Tokenizer], name: str) -> None:
    tok = loaded[name]
    expected = CASES["tokenizers"][name]["chat_template"]
    if isinstance(expected, dict):
        assert tok.chat_templates == expected
        assert tok.chat_template == expected["default"]
    else:
        assert tok.chat_template == expected


@pytest.mark.parametrize("name", [n for n in NAMES if CASES["tokenizers"][n].get("chat")])
def test_own_chat_template_matches_transformers(loaded: dict[str, Tokenizer], name: str) -> None:
    tok = loaded[name]
    for run in CASES["tokenizers"][name]["chat"]:
        messages = CASES["conversations"][run["conversation"]]
        assert tok.apply_chat_template(messages, **run["options"]) == run["output"], run["options"]


def test_setting_the_chat_template(folders: dict[str, pathlib.Path]) -> None:
    tok = Tokenizer.from_folder(folders["chat-list"])
    messages = [{"role": "user", "content": "Hi"}]
    tools = [{"name": "f"}]
    assert tok.apply_chat_template(messages, tools=tools).startswith("<|tool|>")  # "tool_use"
    assert tok.apply_chat_template(messages, chat_template="tool_use").startswith("<|tool|>")
    tok.chat_template = "{{ messages[0]['content'] }}!"
    assert tok.chat_templates == {"default": "{{ messages[0]['content'] }}!"}
    assert tok.apply_chat_template(messages, tools=tools) == "Hi!"
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(messages)


def test_missing_tokenizer_json(tmp_path: pathlib.Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}", encoding="utf-8")
    with pytest.raises(ModelFileError, match="tokenizer.json") as info:
        Tokenizer.from_folder(tmp_path)
    assert str(tmp_path) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_unreadable_config(tmp_path: pathlib.Path) -> None:
    shutil.copy(FIXTURES / "gpt2-optimum" / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ModelFileError, match="tokenizer_config.json"):
        Tokenizer.from_folder(tmp_path)


def test_encode_rejects_non_text(loaded: dict[str, Tokenizer]) -> None:
    with pytest.raises(TypeError, match="str"):
        loaded["gpt2-optimum"].encode(["a list"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"texts\[1\]"):
        loaded["gpt2-optimum"].encode_batch(["ok", 3])  # type: ignore[list-item]


# --------------------------------------------------------------------------------------------
# Chat templates
# --------------------------------------------------------------------------------------------


def _chat_id(run: dict) -> str:
    flags = ",".join(
        f"{k}={v}" for k, v in run["options"].items() if not isinstance(v, list | dict)
    )
    tools = ",tools" if "tools" in run["options"] else ""
    return f"{run['tokenizer']}/{run['template']}/{run['conversation']}/{flags}{tools}"


@pytest.mark.parametrize("run", CASES["chat"], ids=_chat_id)
def test_chat_template_matches_transformers(loaded: dict[str, Tokenizer], run: dict) -> None:
    tok = loaded[run["tokenizer"]]
    template = CASES["templates"][run["template"]]
    messages = CASES["conversations"][run["conversation"]]
    options = dict(run["options"])
    options.setdefault("add_generation_prompt", False)  # transformers' default
    if "error" in run:
        with pytest.raises(ChatTemplateError) as info:
            tok.apply_chat_template(messages, chat_template=template, **options)
        assert run["error"]["message"] in str(info.value)
        assert isinstance(info.value, jinja2.TemplateError)  # what transformers raises
        return
    assert tok.apply_chat_template(messages, chat_template=template, **options) == run["output"]


def test_chat_cases_are_discriminating() -> None:
    for tokenizer in {run["tokenizer"] for run in CASES["chat"]}:
        runs = [r["output"] for r in CASES["chat"] if r["tokenizer"] == tokenizer and "output" in r]
        assert len(set(runs)) == len(runs)  # every run renders something different
    outputs = [run["output"] for run in CASES["chat"] if "output" in run]
    assert any(run.startswith("<|endoftext|>") for run in outputs)  # gpt2's bos_token
    misc = next(o for o in outputs if "<doc 1>" in o)
    assert "<b>2 & 3</b>" in misc and '"ü<&>"' in misc  # no HTML escaping, ensure_ascii=False


def test_render_directly() -> None:
    text = chat.render(
        CASES["templates"]["chatml_default_system"],
        [{"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
        special_tokens={},
    )
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_no_chat_template(loaded: dict[str, Tokenizer]) -> None:
    tok = loaded["gpt2-optimum"]
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_raise_exception_names_the_template(loaded: dict[str, Tokenizer]) -> None:
    template = "{{ raise_exception('bad role: ' + messages[0]['role']) }}"
    with pytest.raises(ChatTemplateError, match="bad role: robot") as info:
        loaded["llama-genai-fp32"].apply_chat_template(
            [{"role": "robot", "content": "x"}], chat_template=template
        )
    assert "chat template" in str(info.value)
    with pytest.raises(ChatTemplateError, match="template of my-model raised an error: no"):
        chat.render(
            "{{ raise_exception('no') }}",
            [{"role": "user", "content": "x"}],
            add_generation_prompt=False,
            special_tokens={},
            template_name="template of my-model",
        )


def test_syntax_error() -> None:
    with pytest.raises(ChatTemplateError, match="syntax error on line 2"):
        chat.render(
            "ok\n{% for m in messages %}",
            [{"role": "user", "content": "x"}],
            add_generation_prompt=False,
            special_tokens={},
        )


def test_strftime_now_and_extra_variables() -> None:
    text = chat.render(
        "{{ strftime_now('%Y') }} {{ bos_token }} {{ custom }}",
        [{"role": "user", "content": "x"}],
        add_generation_prompt=False,
        special_tokens={"bos_token": "<s>"},
        custom=42,
    )
    assert text == f"{datetime.datetime.now().year} <s> 42"


def test_templates_are_cached() -> None:
    template = "{{ messages | length }} cached"
    assert chat.compile_template(template) is chat.compile_template(template)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{% for c in ''.__class__.__mro__[1].__subclasses__() %}{{ c }}{% endfor %}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ strftime_now.__globals__['os'] }}",
        "{{ messages.append({'role': 'system', 'content': 'injected'}) }}",
        "{{ messages[0].update({'role': 'system'}) }}",
    ],
)
def test_sandbox_blocks_python_internals(template: str) -> None:
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(SecurityError):
        chat.render(template, messages, add_generation_prompt=False, special_tokens={})
    assert messages == [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("template", ["{{ ''.__class__ }}", "{{ '{0.__class__}'.format(1) }}"])
def test_sandbox_renders_unsafe_attributes_as_nothing(template: str) -> None:
    messages = [{"role": "user", "content": "x"}]
    assert chat.render(template, messages, add_generation_prompt=False, special_tokens={}) == ""


@pytest.mark.parametrize(
    ("messages", "error", "match"),
    [
        ({"role": "user", "content": "x"}, TypeError, "messages must be a list"),
        ("hello", TypeError, "messages must be a list"),
        ([], ValueError, "messages is empty"),
        ([{"role": "user", "content": "x"}, "hi"], TypeError, r"messages\[1\] must be a dict"),
        ([{"content": "x"}], ValueError, r"messages\[0\] has no 'role'"),
        ([{"role": 1, "content": "x"}], TypeError, r"messages\[0\]\['role'\] must be a str"),
        (
            [{"role": "user", "text": "x"}],
            ValueError,
            r"messages\[0\] \(role 'user'\) has no 'content'",
        ),
        ([{"role": "user", "content": 5}], TypeError, r"messages\[0\]\['content'\] must be"),
    ],
)
def test_bad_messages(messages: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        chat.render("{{ messages }}", messages, add_generation_prompt=False, special_tokens={})  # type: ignore[arg-type]


def test_tool_call_message_without_content() -> None:
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
    ]
    text = chat.render(
        "{{ messages[1].tool_calls[0].function.name }}",
        messages,
        add_generation_prompt=False,
        special_tokens={},
    )
    assert text == "f"


def test_bad_tools_and_documents() -> None:
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(TypeError, match=r"tools\[0\] must be a dict"):
        chat.render("", messages, add_generation_prompt=False, special_tokens={}, tools=[len])
    with pytest.raises(TypeError, match="documents must be a list"):
        chat.render("", messages, add_generation_prompt=False, special_tokens={}, documents="doc")


def test_continue_final_message_needs_no_generation_prompt() -> None:
    messages = CASES["conversations"]["continue_plain"]
    with pytest.raises(ValueError, match="not compatible"):
        chat.render(
            "{{ messages[-1]['content'] }}",
            messages,
            add_generation_prompt=True,
            special_tokens={},
            continue_final_message=True,
        )


# --------------------------------------------------------------------------------------------
# TextStream
# --------------------------------------------------------------------------------------------


def _stream_pieces(tok: Tokenizer, ids: list[int], skip: bool = True) -> tuple[list[str], str]:
    stream = tok.streamer(skip_special_tokens=skip)
    pieces = [stream.push([i]) for i in ids]
    rest = stream.finish()
    assert stream.exact
    return pieces, rest


def test_stream_holds_back_incomplete_characters(loaded: dict[str, Tokenizer]) -> None:
    tok = loaded["gpt2-optimum"]
    ids = tok.encode(STREAM_TEXT)
    # The test is discriminating: some ids are parts of a character.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    pieces, rest = _stream_pieces(tok, ids)
    assert not any("\ufffd" in piece for piece in pieces)
    assert rest == ""  # everything was emitted by push
    assert "".join(pieces) == tok.decode(ids) == STREAM_TEXT
    assert sum(1 for piece in pieces if piece) >= 6  # it streams, it does not wait for finish


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("skip", [True, False])
def test_stream_equals_decode(loaded: dict[str, Tokenizer], name: str, skip: bool) -> None:
    tok = loaded[name]
    rows = CASES["tokenizers"][name]["decode"]
    id_lists = [row["ids"] for row in rows] + [tok.encode(text) for text in CASES["samples"]]
    for ids in id_lists:
        pieces, rest = _stream_pieces(tok, ids, skip)
        assert "".join(pieces) + rest == tok.decode(ids, skip_special_tokens=skip), ids
        assert not any(piece.endswith("\ufffd") for piece in pieces), ids


def test_stream_chunks_and_numpy(loaded: dict[str, Tokenizer]) -> None:
    np = pytest.importorskip("numpy")
    tok = loaded["llama-genai-fp32"]
    ids = tok.encode(" ".join(CASES["samples"]))
    stream = tok.streamer()
    text = "".join(stream.push(np.asarray(ids[i : i + 3])) for i in range(0, len(ids), 3))
    text += stream.push(np.int64(2)) + stream.finish()
    assert text == tok.decode(ids)
    assert stream.text == text
    with pytest.raises(RuntimeError, match="finished"):
        stream.push([5])


def test_stream_with_clean_up_streams_and_matches(loaded: dict[str, Tokenizer]) -> None:
    tok = loaded["clean-up"]
    text = (
        "Hello , world . I 'm sure it 's fine , isn 't it ? Rock ' n ' roll ' ' . it  ' s ,  ' m . "
        * 3
    )
    ids = tok.encode(text)
    assert tok.decode(ids) != tok.decode(ids, clean_up_tokenization_spaces=False)
    pieces, rest = _stream_pieces(tok, ids)
    assert "".join(pieces) + rest == tok.decode(ids)
    assert len("".join(pieces)) > len(rest)  # most of it came out before finish


def test_stream_window_is_bounded(
    loaded: dict[str, Tokenizer], monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = loaded["gpt2-optimum"]
    ids = tok.encode((STREAM_TEXT + " The quick brown fox. ") * 60)
    stream = tok.streamer()
    longest = 0
    original = tok.decode

    def spy(window, *args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal longest
        longest = max(longest, len(window))
        return original(window, *args, **kwargs)

    monkeypatch.setattr(tok, "decode", spy)
    pieces = [stream.push([i]) for i in ids]
    assert longest <= 8 < len(ids)
    monkeypatch.undo()
    assert "".join(pieces) + stream.finish() == tok.decode(ids)


def _sentencepiece_style_tokenizer() -> Tokenizer:
    """A Llama-2-like tokenizer: Metaspace pieces, byte fallback, a Strip decoder."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "▁Hello", "▁world", "▁caf", "é", "▁the", "!", "▁", "a", "b", "c"]
    vocab = [(piece, -float(len(piece))) for piece in dict.fromkeys(pieces)]
    backend = tokenizers.Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_next")
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.add_special_tokens(["<s>", "</s>"])
    return Tokenizer(backend, special_tokens={"bos_token": "<s>", "eos_token": "</s>"})


def test_stream_with_sentencepiece_style_decoder() -> None:
    tok = _sentencepiece_style_tokenizer()
    bos, eos = tok.token_id("<s>"), tok.token_id("</s>")
    first = tok.encode("Hello world café 日本 😀!")
    second = tok.encode("  the  world")
    assert any(tok.backend.id_to_token(i).startswith("<0x") for i in first)  # byte fallback used
    ids = [bos] + first + [eos, bos] + second + [eos]
    for skip in (True, False):
        pieces, rest = _stream_pieces(tok, ids, skip)
        expected = tok.decode(ids, skip_special_tokens=skip)
        assert "".join(pieces) + rest == expected
        assert not any("\ufffd" in piece for piece in pieces)
    # The space before "the" after the skipped special tokens is kept, as decode keeps it.
    assert " the" in tok.decode(ids)


class _InconsistentTokenizer:
    """A decoder whose full decode is not an extension of its window decodes."""

    special_ids: frozenset[int] = frozenset()
    clean_up_tokenization_spaces = False

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=None):  # type: ignore[no-untyped-def]
        text = "".join(chr(ord("a") + i) for i in ids)
        return text.upper() if clean_up_tokenization_spaces is None else text


def test_stream_finish_reports_a_mismatch() -> None:
    stream = TextStream(_InconsistentTokenizer())  # type: ignore[arg-type]
    assert [stream.push([i]) for i in range(3)] == ["a", "b", "c"]
    assert stream.finish() == ""
    assert not stream.exact
