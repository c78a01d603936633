"""`transmuter-jax caption`, `generate --image` and `chat --image` on the tiny vision fixtures:
the tokens and text of transformers' references (tests/fixtures/make_vision.py), the same as the
pipelines give, and clear errors."""

from __future__ import annotations

import io
import json
import pathlib

import pytest

pytest.importorskip("PIL")

from transmuter_jax import cli, vision  # noqa: E402
from transmuter_jax.cli import inputs  # noqa: E402

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
CAPTION = FIXTURES / "vitgpt2-optimum"
VLM = FIXTURES / "smolvlm-community"
TEXT_ONLY = str(FIXTURES / "llama-genai-fp32")
CAPTION_REF = json.loads((CAPTION / "reference.json").read_text())
VLM_REF = json.loads((VLM / "vlm.json").read_text())
QUESTION = "What is in the picture?"


def _caption_case(name: str) -> dict:
    return next(c for c in CAPTION_REF["images"] if c["file"] == name)


def _vlm_case(name: str, split: bool) -> dict:
    return next(
        c
        for c in VLM_REF["cases"]
        if c["files"] == [[name]] and c["do_image_splitting"] == split and not c.get("batch")
    )


def _run(capsys, *args: str) -> str:
    assert cli.main(list(args)) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def _error(capsys, *args: str) -> str:
    assert cli.main(list(args)) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("transmuter-jax: error: "), err
    return err


def test_caption_streams_a_line_per_image_and_json_has_the_references(capsys):
    names = ["grace_hopper.jpg", "gray.png"]
    files = [str(CAPTION / n) for n in names]
    n = str(CAPTION_REF["max_new_tokens"])
    out = _run(capsys, "caption", str(CAPTION), files[0], "--json", "--max-new-tokens", n)
    record = json.loads(out)
    assert record["file"] == files[0]
    assert record["token_ids"] == _caption_case(names[0])["tokens"]
    assert record["text"] == _caption_case(names[0])["text"]
    assert len(record["logprobs"]) == len(record["token_ids"])
    assert record["finish_reason"] in ("eos", "length")
    plain = _run(capsys, "caption", str(CAPTION), *files, "--max-new-tokens", n)
    assert plain == "".join(_caption_case(name)["text"] + "\n" for name in names)


@pytest.mark.slow
def test_caption_json_of_a_batch_has_the_references(capsys):
    names = ["grace_hopper.jpg", "gray.png"]
    files = [str(CAPTION / n) for n in names]
    n = str(CAPTION_REF["max_new_tokens"])
    lines = _run(capsys, "caption", str(CAPTION), *files, "--json", "--max-new-tokens", n)
    records = [json.loads(line) for line in lines.splitlines()]
    assert [r["file"] for r in records] == files
    assert [r["token_ids"] for r in records] == [_caption_case(n)["tokens"] for n in names]


@pytest.mark.slow
def test_caption_text_is_the_pipelines_with_generation_options(capsys):
    pipe = vision.image_to_text(CAPTION)
    photo = str(CAPTION / "grace_hopper.jpg")
    expected = pipe.generate([photo], max_new_tokens=8, num_beams=2)[0]
    out = _run(capsys, "caption", str(CAPTION), photo, "--max-new-tokens", "8", "--num-beams", "2")
    assert out == expected.text + "\n"


@pytest.mark.parametrize("split", [False, True], ids=["global", "split"])
def test_generate_with_an_image_gives_transformers_tokens(split, capsys):
    case = _vlm_case("wide.png", split)
    image = str(VLM / "wide.png")
    args = ["generate", str(VLM), "--image", image, QUESTION, "--max-new-tokens", "8"]
    args += [] if split else ["--no-image-splitting"]
    record = json.loads(_run(capsys, *args, "--json"))
    assert record["token_ids"] == case["tokens"][0]
    assert record["prompt"] == QUESTION and record["images"] == [image]
    assert _run(capsys, *args) == record["text"] + "\n"


@pytest.mark.slow
def test_generate_with_two_images_is_the_pipelines(capsys):
    pipe = vision.image_text_to_text(VLM)
    files = [str(VLM / "wide.png"), str(VLM / "gradient.png")]
    content = [{"type": "image", "image": f} for f in files] + [{"type": "text", "text": "Both?"}]
    options = dict(max_new_tokens=6, do_image_splitting=False)
    expected = pipe.generate([[{"role": "user", "content": content}]], **options)[0]
    args = ["generate", str(VLM), "Both?", "--image", files[0], "--image", files[1], "--json"]
    record = json.loads(_run(capsys, *args, "--max-new-tokens", "6", "--no-image-splitting"))
    assert record["token_ids"] == expected.token_ids and record["text"] == expected.text


def test_chat_with_an_image_keeps_it_in_the_first_user_message(capsys, monkeypatch):
    pipe = vision.image_text_to_text(VLM)
    image = str(VLM / "wide.png")
    turns = [QUESTION, "And then?"]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(turns) + "\n"))
    args = ["chat", str(VLM), "--image", image, "--max-new-tokens", "8", "--no-image-splitting"]
    lines = _run(capsys, *args).splitlines()
    assert len(lines) == 2
    first = _vlm_case("wide.png", False)
    history = [{"role": "user", "content": [{"type": "image", "image": image},
                                            {"type": "text", "text": QUESTION}]}]  # fmt: skip
    answer = pipe.generate([history], max_new_tokens=8, do_image_splitting=False)[0]
    assert answer.token_ids == first["tokens"][0]
    assert lines[0] == answer.text
    history += [
        {"role": "assistant", "content": [{"type": "text", "text": answer.text}]},
        {"role": "user", "content": [{"type": "text", "text": turns[1]}]},
    ]
    second = pipe.generate([history], max_new_tokens=8, do_image_splitting=False)[0]
    assert lines[1] == second.text


def test_model_and_images_are_told_apart():
    photo = str(CAPTION / "grace_hopper.jpg")
    assert inputs.model_and_inputs([str(CAPTION), photo], inputs.IMAGE_SUFFIXES, (), "IMAGE") == (
        str(CAPTION),
        [photo],
    )
    assert inputs.model_and_inputs([photo], inputs.IMAGE_SUFFIXES, (), "IMAGE") == (None, [photo])
    hub_id = ["Xenova/vit-gpt2-image-captioning", "cat.jpg"]
    assert inputs.model_and_inputs(hub_id, inputs.IMAGE_SUFFIXES, (), "IMAGE") == (
        hub_id[0],
        ["cat.jpg"],
    )


def test_caption_without_a_model_says_none_ships(capsys):
    err = _error(capsys, "caption", str(CAPTION / "grace_hopper.jpg"))
    assert "no default captioning model ships" in err
    assert "transmuter-jax caption MODEL IMAGE" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["caption", str(CAPTION)], "no IMAGE file after MODEL"),
        (["caption", str(CAPTION), "/no/such/image.png"], "no image file '/no/such/image.png'"),
        (["caption", str(VLM), str(VLM / "wide.png")], "use 'transmuter-jax generate MODEL --im"),
        (["caption", TEXT_ONLY, str(VLM / "wide.png")], "use 'transmuter-jax generate MODEL PR"),
        (["generate", TEXT_ONLY, "hi", "--image", str(VLM / "wide.png")], "is a text-only model"),
        (["chat", TEXT_ONLY, "--image", str(VLM / "wide.png")], "is a text-only model"),
        (["generate", "hi", "--image", str(VLM / "wide.png")], "--image needs MODEL"),
        (
            ["generate", str(CAPTION), "hi", "--image", str(VLM / "wide.png")],
            "use 'transmuter-jax caption MODEL IMAGE'",
        ),  # fmt: skip
        (["generate", str(VLM), "hi", "--image", "/no/such.png"], "no image file '/no/such.png'"),
        (["generate", TEXT_ONLY, "hi", "--no-image-splitting"], "--no-image-splitting goes with"),
        (
            ["generate", str(VLM), "hi", "--image", str(VLM / "wide.png"), "--no-chat-template"],
            "does not go with --no-chat-template",
        ),  # fmt: skip
    ],
)
def test_errors_are_one_clear_line(args, message, capsys):
    assert message in _error(capsys, *args)


def test_an_unreadable_image_is_named(tmp_path, capsys):
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"not an image at all")
    err = _error(capsys, "caption", str(CAPTION), str(bad))
    assert f"{str(bad)!r} is not a readable image file" in err
    err = _error(capsys, "generate", str(VLM), "--image", str(bad), "hi")
    assert f"{str(bad)!r} is not a readable image file" in err
