"""Text tasks on fixtures: text and token parity with transformers' generate, streaming, errors."""

from __future__ import annotations

import pathlib

import pytest
from generation_cases import case

from transmuter_jax import text

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def marian():
    return text.text_to_text(FIXTURES / "marian-optimum")


@pytest.fixture(scope="module")
def llama():
    return text.generation(FIXTURES / "llama-optimum")


@pytest.mark.parametrize("name", ["text", "text_beam"])
def test_text_to_text_equals_transformers_on_marian(marian, name):
    the_case = case("marian-optimum", name)
    for source, ids in zip(the_case["texts"], the_case["input_ids"], strict=True):
        assert marian.tokenizer.encode(source) == ids
    options = {k: v for k, v in the_case["options"].items() if k != "num_return_sequences"}
    for i, source in enumerate(the_case["texts"]):  # one at a time, as transformers ran them
        result = marian.generate([source], **options)[0]
        assert result.token_ids == the_case["tokens"][i], (name, i)
        assert result.text == the_case["decoded"][i]
        assert result.finish_reason == ("eos" if the_case["stopped_at_eos"][i] else "length")


def test_text_to_text_batch_and_single_calls_agree(marian):
    the_case = case("marian-optimum", "text")
    texts = the_case["texts"]
    assert marian(texts, max_new_tokens=16) == the_case["decoded"]
    assert marian(texts[0], max_new_tokens=16) == the_case["decoded"][0]


@pytest.mark.parametrize("name", ["text", "text_beam"])
def test_text_generation_equals_transformers_on_llama(llama, name):
    the_case = case("llama-optimum", name)
    options = {k: v for k, v in the_case["options"].items() if k != "num_return_sequences"}
    for i, prompt in enumerate(the_case["texts"]):
        assert llama.prompt_ids(prompt) == the_case["input_ids"][i]
        result = llama.generate([prompt], **options)[0]
        assert result.token_ids == the_case["tokens"][i], (name, i)
        assert result.text == the_case["decoded"][i]


def test_a_batch_of_prompts_of_different_lengths(llama):
    the_case = case("llama-optimum", "text")
    assert llama(the_case["texts"], max_new_tokens=16) == the_case["decoded"]


@pytest.mark.parametrize("pipe_name", ["llama", "marian"])
def test_stream_pieces_join_to_the_text(request, pipe_name):
    pipe = request.getfixturevalue(pipe_name)
    fixture = "llama-optimum" if pipe_name == "llama" else "marian-optimum"
    the_case = case(fixture, "text")
    for i, source in enumerate(the_case["texts"]):
        pieces = list(pipe.stream(source, max_new_tokens=16))
        assert "".join(pieces) == the_case["decoded"][i]
        # a piece never ends inside a multi-byte character, except what the text itself has
        assert all(not p.endswith("\ufffd") for p in pieces[:-1])


def test_closing_a_stream_stops_generation(llama):
    stream = llama.stream("The quiet river", max_new_tokens=200)
    first = next(stream)
    stream.close()
    assert isinstance(first, str)
    assert llama("The quiet river", max_new_tokens=4)  # the pipeline still works


def test_token_logprobs_and_finish_reason(llama):
    result = llama.generate(["The quiet river"], max_new_tokens=5, token_logprobs=True)[0]
    assert len(result.token_ids) == len(result.logprobs) == 5
    assert all(p <= 0 for p in result.logprobs)
    assert result.finish_reason == "length"


def test_sampling_is_reproducible_with_a_seed(llama):
    options = dict(do_sample=True, top_k=20, max_new_tokens=8)
    first = llama("The quiet river", seed=7, **options)
    assert first == llama("The quiet river", seed=7, **options)


def test_bad_prompts_and_models_are_named(llama, marian):
    with pytest.raises(TypeError, match="a prompt is a string or a list of chat messages"):
        llama([3, 4])
    with pytest.raises(ValueError, match="no chat template"):
        llama("hi", chat=True)
    with pytest.raises(ValueError, match="unknown generation option"):
        llama("hi", max_new_token=3)
    with pytest.raises(ValueError, match="encoder-decoder"):
        text.generation(FIXTURES / "marian-optimum")
    with pytest.raises(ValueError, match="has no encoder"):
        text.text_to_text(FIXTURES / "llama-optimum")
    with pytest.raises(TypeError, match="list of strings"):
        marian([1, 2])


@pytest.mark.parametrize("num_beams", [2, 3, 4])
@pytest.mark.parametrize("pipe_name", ["llama", "marian"])
def test_beam_search_streams_the_text_it_returns(request, pipe_name, num_beams):
    pipe = request.getfixturevalue(pipe_name)
    fixture = "llama-optimum" if pipe_name == "llama" else "marian-optimum"
    for source in case(fixture, "text")["texts"]:
        whole = pipe(source, num_beams=num_beams, max_new_tokens=12)
        assert "".join(pipe.stream(source, num_beams=num_beams, max_new_tokens=12)) == whole


CHATML = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def test_an_image_given_to_a_text_only_model(llama):
    image = FIXTURES / "smolvlm-community" / "wide.png"
    content = [{"type": "image", "image": str(image)}, {"type": "text", "text": "What is it?"}]
    with pytest.raises(ValueError, match="text-only model: it takes no images"):
        llama.generate([[{"role": "user", "content": content}]])


def test_a_string_goes_through_the_chat_template_when_there_is_one(llama):
    templated = text.generation(FIXTURES / "llama-optimum", chat_template=CHATML)
    as_message = templated.prompt_ids([{"role": "user", "content": "The quiet river"}])
    assert templated.prompt_ids("The quiet river") == as_message
    assert templated.prompt_ids("The quiet river", chat=True) == as_message
    plain = llama.tokenizer.encode("The quiet river", add_special_tokens=True)
    assert templated.prompt_ids("The quiet river", chat=False) == plain != as_message
    assert llama.prompt_ids("The quiet river") == plain  # no template: the text as it is
    assert templated("The quiet river", max_new_tokens=4) == templated(
        [{"role": "user", "content": "The quiet river"}], max_new_tokens=4
    )


@pytest.mark.default_model
@pytest.mark.parametrize("export", ["genai-fp32"])
def test_the_default_models_first_call_answers(default_model, export):
    pipe = text.generation(default_model / export)
    assert pipe.has_chat_template
    answer = pipe("What is the capital of France?")
    assert answer == pipe("What is the capital of France?", chat=True)
    assert "Paris" in answer
    whole = pipe("Name a fruit.", num_beams=4, max_new_tokens=16)
    assert "".join(pipe.stream("Name a fruit.", num_beams=4, max_new_tokens=16)) == whole
