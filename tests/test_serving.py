"""The OpenAI-compatible server as a subprocess on 127.0.0.1, on a fixture model: answers equal
the library's, streaming, load, disconnects, bad requests, the API key, the queue bound,
SIGTERM."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from transmuter_jax import text  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests" / "fixtures" / "llama-optimum"
CHATML = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
NAME = "tiny"
KEY = "secret-key"
MESSAGES = [{"role": "user", "content": "The quiet river"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``transmuter-jax serve`` in a subprocess; stops by itself at the end of the module."""

    def __init__(self, tmp: pathlib.Path, *extra: str, model: pathlib.Path = MODEL):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        template = tmp / "chatml.jinja"
        template.write_text(CHATML)
        self.log = tmp / f"server-{self.port}.log"
        env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
        env.pop("TRANSMUTER_JAX_API_KEY", None)
        cmd = [
            sys.executable,
            "-m",
            "transmuter_jax",
            "serve",
            str(model),
            "--port",
            str(self.port),
            "--served-model-name",
            NAME,
            "--chat-template",
            str(template),
            *extra,
        ]
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.25)
        self.stop()
        raise RuntimeError("the server did not answer /health in 600 s (it compiles first)")

    def client(self, key: str = "none", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, **kw)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve"), "--max-batch-size", "8")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A server with an API key, one request per batch and a queue of one."""
    s = Server(
        tmp_path_factory.mktemp("guarded"),
        "--api-key",
        KEY,
        "--max-batch-size",
        "1",
        "--max-queue",
        "1",
        "--prefix-cache-bytes",
        "0",
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def pipe():
    return text.generation(MODEL, chat_template=CHATML)


def _greedy(pipe, prompt, n_tokens, **options):
    return pipe.generate([prompt], do_sample=False, max_new_tokens=n_tokens, **options)[0]


def test_serving_modules_load_neither_jax_nor_the_model_at_import():
    """jax, numpy and the library's tasks load with the model (in serve's run), not before."""
    import ast

    for path in sorted((ROOT / "transmuter_jax" / "serving").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
            for name in names:
                assert not name.startswith(("jax", "numpy", "..")), f"{path.name}: {name}"


def test_the_slots_backend_idles_at_the_smallest_window_after_its_warm_up(pipe):
    """Warming up runs every window of the cache; the idle backend then holds 64 rows a slot."""
    from transmuter_jax.generation import slots
    from transmuter_jax.serving.slots import SlotBackend

    backend = SlotBackend(pipe, 2, max_model_len=256, decode_steps=4)
    try:
        assert slots.held(backend.engine, backend._state) == 64
        assert backend._state.live_slots == [] and backend.chunk_steps in (1, 2, 4)
    finally:
        backend.close()


def test_health_and_models(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    models = server.client().models.list()
    assert [m.id for m in models.data] == [NAME]


def test_chat_equals_the_library_with_logprobs(server, pipe):
    want = _greedy(pipe, MESSAGES, 12, token_logprobs=True, top_logprobs=3)
    got = server.client().chat.completions.create(
        model=NAME,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    choice = got.choices[0]
    assert choice.message.content == want.text
    assert choice.finish_reason == ("length" if want.finish_reason == "length" else "stop")
    content = choice.logprobs.content
    tok = pipe.tokenizer
    assert [c.token for c in content] == [tok.decode([t]) for t in want.token_ids]
    assert [c.logprob for c in content] == pytest.approx(want.logprobs, abs=1e-5)
    for entry, best in zip(content, want.top_logprobs, strict=True):
        assert [t.token for t in entry.top_logprobs] == [tok.decode([i]) for i, _ in best]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            [lp for _, lp in best], abs=1e-5
        )
    prompt = pipe.prompt_ids(MESSAGES)
    assert got.usage.prompt_tokens == len(prompt)
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.total_tokens == len(prompt) + len(want.token_ids)


def test_completions_equal_the_library(server, pipe):
    prompts = ["The quiet river", "Once upon"]
    want = pipe.generate(
        prompts, chat=False, do_sample=False, max_new_tokens=9, token_logprobs=True, top_logprobs=2
    )
    got = server.client().completions.create(
        model=NAME, prompt=prompts, max_tokens=9, temperature=0, logprobs=2
    )
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [w.text for w in want]
    for choice, w in zip(sorted(got.choices, key=lambda c: c.index), want, strict=True):
        assert choice.logprobs.token_logprobs == pytest.approx(w.logprobs, abs=1e-5)
        assert len(choice.logprobs.top_logprobs) == len(w.token_ids)


def test_stream_deltas_join_into_the_answer(server):
    client = server.client()
    args = dict(model=NAME, messages=MESSAGES, max_tokens=20, temperature=0)
    whole = client.chat.completions.create(**args)
    chunks = list(
        client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    text_ = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text_ == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == whole.choices[0].finish_reason and not any(reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == (
        whole.usage.completion_tokens
    )
    pieces = list(
        client.completions.create(
            model=NAME, prompt="Once upon", max_tokens=15, temperature=0, stream=True
        )
    )
    plain = client.completions.create(model=NAME, prompt="Once upon", max_tokens=15, temperature=0)
    assert "".join(p.choices[0].text for p in pieces) == plain.choices[0].text


def test_raw_sse_ends_with_done(server):
    body = {"model": NAME, "prompt": "Once upon", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    json.loads(lines[0][5:])


def test_stop_strings_equal_the_library(server, pipe):
    whole = _greedy(pipe, MESSAGES, 20).text
    stop = whole[6:8]  # a piece of the greedy answer: the answer ends before it
    want = _greedy(pipe, MESSAGES, 20, stop=[stop])
    for stream in (False, True):
        got = server.client().chat.completions.create(
            model=NAME, messages=MESSAGES, max_tokens=20, temperature=0, stop=stop, stream=stream
        )
        if stream:
            chunks = [c for c in got if c.choices]
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            content, reason = got.choices[0].message.content, got.choices[0].finish_reason
        assert content == want.text and stop not in content
        assert reason == "stop"


def test_n_with_a_seed_repeats_and_equals_the_library(server, pipe):
    args = dict(model=NAME, messages=MESSAGES, max_tokens=10, temperature=0.8, seed=7, n=3)
    first = server.client().chat.completions.create(**args)
    again = server.client().chat.completions.create(**args)
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices]
    want = pipe.generate(
        [MESSAGES],
        seed=7,
        do_sample=True,
        temperature=0.8,
        top_k=0,
        top_p=1.0,
        max_new_tokens=10,
        num_return_sequences=3,
    )[0]
    assert texts == [w.text for w in want]
    assert [c.index for c in first.choices] == [0, 1, 2]


def test_logit_bias_forces_a_token(server, pipe):
    token = pipe.tokenizer.encode("river", add_special_tokens=False)[0]
    got = server.client().completions.create(
        model=NAME, prompt="Once upon", max_tokens=5, temperature=0, logit_bias={str(token): 100}
    )
    assert got.choices[0].text == pipe.tokenizer.decode([token] * 5)


def test_concurrent_staggered_requests_equal_their_solo_answers(server, pipe):
    prompts = [[{"role": "user", "content": f"Tell me about the number {i}"}] for i in range(16)]
    want = [_greedy(pipe, p, 8 + i % 5).text for i, p in enumerate(prompts)]
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)

    async def one(i):
        await asyncio.sleep(0.05 * i)
        stream = i % 2 == 1
        out = await client.chat.completions.create(
            model=NAME, messages=prompts[i], max_tokens=8 + i % 5, temperature=0, stream=stream
        )
        if not stream:
            return out.choices[0].message.content
        return "".join([c.choices[0].delta.content or "" async for c in out if c.choices])

    async def main():
        try:
            return await asyncio.gather(*(one(i) for i in range(16)))
        finally:
            await client.close()

    assert asyncio.run(main()) == want


def _gauge(server, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


RUNNING = "transmuter_jax_num_requests_running"


def test_a_disconnected_stream_frees_its_request(server, pipe):
    body = {
        "model": NAME,
        "prompt": "Once upon",
        "max_tokens": 200,
        "temperature": 0.9,
        "stream": True,
        "seed": 1,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 3:
                break
    deadline = time.monotonic() + 60
    while _gauge(server, RUNNING) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gauge(server, RUNNING) == 0
    got = server.client().chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=6, temperature=0
    )
    assert got.choices[0].message.content == _greedy(pipe, MESSAGES, 6).text


LINE = re.compile(
    r"request (?P<id>\S+) (?P<outcome>finished|cancelled|failed|refused): (?P<prompt>\d+) prompt "
    r"tokens, (?P<completion>\d+) completion tokens, first token (?P<first>-|\d+ ms), "
    r"total (?P<total>\d+) ms"
)


def _lines(server) -> list[re.Match]:
    """The server's request log lines so far."""
    return list(LINE.finditer(server.log.read_text()))


def _refusal(server, text: str) -> None:
    """Waits up to 30 s for the log line of a request refused before it reached the
    scheduler, ending in ``text`` (its status and message)."""
    want = f"request POST /v1/chat/completions refused: {text}"
    deadline = time.monotonic() + 30
    while want not in server.log.read_text():
        assert time.monotonic() < deadline, server.log.read_text()[-2000:]
        time.sleep(0.05)


def _line(server, since: int, **want: str) -> re.Match:
    """The first request log line after the first ``since`` ones whose fields equal ``want``,
    waiting up to 30 s for it."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for line in _lines(server)[since:]:
            if all(line[k] == v for k, v in want.items()):
                return line
        time.sleep(0.05)
    raise AssertionError(f"no request line with {want}: {server.log.read_text()[-2000:]}")


LONG = 240  # new tokens of each prompt below (ignore_eos: each runs to the end unless cancelled)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_client_that_leaves_a_completion_of_many_prompts_cancels_every_prompt(
    server, pipe, stream
):
    """48 prompts of 240 tokens: the client leaves mid-way; the request's one log line says
    cancelled, at least two prompts short of their tokens (not only the prompt being read);
    no request runs after; the next request gets the library's answer."""
    prompts = [f"Once upon a time {i}" for i in range(48)]
    body = {"model": NAME, "prompt": prompts, "max_tokens": LONG, "temperature": 0,
            "ignore_eos": True, "stream": stream}  # fmt: skip
    url = f"{server.url}/v1/completions"
    before = len(_lines(server))
    rid = {}
    if stream:
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    rid = {"id": json.loads(line[5:])["id"]}
                    break
    else:

        async def leave() -> None:
            async with httpx.AsyncClient(timeout=60) as client:
                post = asyncio.ensure_future(client.post(url, json=body))
                for _ in range(500):  # until the server runs it: at most 10 s
                    if post.done() or await asyncio.to_thread(_gauge, server, RUNNING):
                        break
                    await asyncio.sleep(0.02)
                post.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await post

        asyncio.run(leave())
    line = _line(server, before, outcome="cancelled", **rid)
    tok = pipe.tokenizer
    assert int(line["prompt"]) == sum(len(tok.encode(p, add_special_tokens=True)) for p in prompts)
    assert int(line["completion"]) <= (len(prompts) - 2) * LONG
    deadline = time.monotonic() + 10
    while _gauge(server, RUNNING) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gauge(server, RUNNING) == 0
    assert [m["outcome"] for m in _lines(server)[before:] if m["id"] == line["id"]] == ["cancelled"]
    got = server.client().chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=6, temperature=0
    )
    assert got.choices[0].message.content == _greedy(pipe, MESSAGES, 6).text


def test_a_finished_and_a_cancelled_request_log_their_line(server):
    """One line each: id, outcome, prompt and completion tokens (the usage's), times."""
    before = len(_lines(server))
    got = server.client().chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    line = _line(server, before, id=got.id)
    assert line["outcome"] == "finished" and line["first"] != "-"
    assert int(line["prompt"]) == got.usage.prompt_tokens
    assert int(line["completion"]) == got.usage.completion_tokens == 7
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data:"))
    rid = json.loads(first[5:])["id"]
    line = _line(server, before, id=rid)
    assert line["outcome"] == "cancelled" and int(line["completion"]) < 200
    assert [m["id"] for m in _lines(server)[before:]].count(rid) == 1


def test_completion_tokens_are_each_choices_own_count(server):
    """n=2 over two prompts, sampled towards eos so that the choices end at other lengths:
    usage (whole and streamed), the log line and the generation counter give the sum of each
    choice's tokens."""
    generated = "transmuter_jax_generation_tokens_total"
    args = dict(model=NAME, prompt=["Once upon", "The quiet river"], max_tokens=12,
                temperature=1.0, seed=0, n=2, logit_bias={"3": 4})  # fmt: skip
    client = server.client()
    before, counted = len(_lines(server)), _gauge(server, generated)
    got = client.completions.create(**args, logprobs=0)
    lengths = [len(c.logprobs.tokens) for c in sorted(got.choices, key=lambda c: c.index)]
    assert len(lengths) == 4 and len(set(lengths)) > 1, lengths  # else the check is weak
    assert got.usage.completion_tokens == sum(lengths)
    assert int(_line(server, before, id=got.id)["completion"]) == sum(lengths)
    assert _gauge(server, generated) - counted == sum(lengths)
    chunks = list(client.completions.create(**args, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[-1].usage.completion_tokens == sum(lengths)
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
             for i in range(4)]  # fmt: skip
    assert texts == [c.text for c in sorted(got.choices, key=lambda c: c.index)]


def test_max_completion_tokens_is_honoured_before_max_tokens(server):
    got = server.client().chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=10, max_completion_tokens=3, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert got.usage.completion_tokens == 3 and got.choices[0].finish_reason == "length"


def test_the_api_key_comes_from_the_flag_else_the_environment(monkeypatch):
    import argparse

    from transmuter_jax.serving import cli

    monkeypatch.setenv(cli.API_KEY_ENV, "from-env")
    assert cli._api_key(argparse.Namespace(api_key=None)) == "from-env"
    assert cli._api_key(argparse.Namespace(api_key="flag")) == "flag"
    monkeypatch.setenv(cli.API_KEY_ENV, "")
    assert cli._api_key(argparse.Namespace(api_key=None)) is None
    monkeypatch.delenv(cli.API_KEY_ENV)
    assert cli._api_key(argparse.Namespace(api_key=None)) is None


BAD = [
    (b"{not json", 400, None),
    ({"model": NAME}, 400, "messages"),
    ({"model": NAME, "messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
    ({"model": NAME, "messages": MESSAGES, "n": 0}, 400, "n"),
    ({"model": NAME, "messages": MESSAGES, "temperature": "hot"}, 400, "temperature"),
    ({"model": NAME, "messages": "hello"}, 400, "messages"),
    ({"model": "other", "messages": MESSAGES}, 404, "model"),
    ({"model": NAME, "messages": [{"role": "user", "content": "word " * 400}]}, 400, "messages"),
    ({"model": NAME, "messages": MESSAGES, "max_tokens": 10_000}, 400, "max_tokens"),
    ({"model": NAME, "messages": MESSAGES, "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"model": NAME, "messages": MESSAGES, "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ({"model": NAME, "messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
]


@pytest.mark.parametrize("body, status, param", BAD)
def test_bad_requests_get_openai_errors(server, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=content,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert httpx.get(f"{server.url}/health").status_code == 200
    # its one log line: the route, the status and the message
    _refusal(server, f"{status} {error['message']}")


def test_a_bounded_load_loses_nothing_and_memory_stays_flat(server):
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)

    def rss() -> int:
        status = pathlib.Path(f"/proc/{server.proc.pid}/status").read_text()
        return int(
            next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]
        )

    async def burst(count: int) -> list[str]:
        gate = asyncio.Semaphore(8)

        async def one(i):
            async with gate:
                out = await client.completions.create(
                    model=NAME, prompt=f"Count {i % 7}", max_tokens=2, temperature=0
                )
                return out.choices[0].finish_reason

        return await asyncio.gather(*(one(i) for i in range(count)))

    async def main():
        try:
            first = await burst(100)  # every batch shape compiles in these
            middle = await burst(100)
            before = rss()
            rest = await burst(100)
            return first + middle + rest, before, rss()
        finally:
            await client.close()

    reasons, before, after = asyncio.run(main())
    assert len(reasons) == 300 and set(reasons) <= {"length", "stop"}
    assert after - before < 16 * 1024, f"RSS grew by {(after - before) // 1024} MiB"


def test_the_api_key_is_required(guarded):
    with pytest.raises(openai.AuthenticationError):
        guarded.client("wrong").models.list()
    r = httpx.post(f"{guarded.url}/v1/completions", json={"model": NAME, "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{guarded.url}/health").status_code == 200
    assert [m.id for m in guarded.client(KEY).models.list().data] == [NAME]


def test_the_prefix_cache_can_be_off(guarded):
    client = guarded.client(KEY)
    for _ in range(2):
        client.chat.completions.create(
            model=NAME, messages=[{"role": "system", "content": SYSTEM}, *MESSAGES], max_tokens=2
        )
    assert _gauge(guarded, "transmuter_jax_prefix_cache_bytes") == 0
    assert _gauge(guarded, "transmuter_jax_prefix_cache_hits") == 0


def test_a_full_queue_gets_429(guarded):
    body = {
        "model": NAME,
        "prompt": "Once upon",
        "max_tokens": 120,
        "temperature": 0,
        "ignore_eos": True,
    }
    headers = {"authorization": f"Bearer {KEY}"}

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(
                *(
                    client.post(f"{guarded.url}/v1/completions", json=body, headers=headers)
                    for _ in range(6)
                )
            )

    statuses = sorted(r.status_code for r in asyncio.run(main()))
    assert set(statuses) <= {200, 429} and 200 in statuses and 429 in statuses
    limited = next(r for r in asyncio.run(main()) if r.status_code == 429)
    assert limited.json()["error"]["type"] == "rate_limit_error"
    refused = [m for m in _lines(guarded) if m["outcome"] == "refused"]
    assert refused and all(m["completion"] == "0" and m["first"] == "-" for m in refused)
    assert "refused: 429" not in guarded.log.read_text()  # the scheduler's line, not a second


def test_more_prompts_than_the_queue_holds_get_400(guarded):
    body = {"model": NAME, "prompt": ["Once upon", "a time"], "max_tokens": 2}
    headers = {"authorization": f"Bearer {KEY}"}
    answer = httpx.post(f"{guarded.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "prompt" and "--max-queue" in error["message"]
    body["prompt"] = ["Once upon"]  # the server goes on
    assert httpx.post(f"{guarded.url}/v1/completions", json=body, headers=headers,
                      timeout=60).status_code == 200  # fmt: skip


def test_sigterm_exits_0(guarded):
    assert guarded.stop() == 0
    assert "stopped" in guarded.log.read_text()


# -- continuous batching, the prefix cache, penalties, structured output ------------------------


def _metric(server, name: str) -> float:
    return _gauge(server, name)


def test_the_server_runs_the_slots_with_the_prefix_cache(server):
    text_ = httpx.get(f"{server.url}/metrics").text
    assert "transmuter_jax_prefix_cache_hit_rate" in text_
    assert "continuous batching in 8 slots" in server.log.read_text()


def test_concurrent_answers_equal_solo_answers_token_for_token_with_logprobs(server):
    """Greedy and seeded requests under load (staggered, mixed options) get the tokens and
    log-probabilities they get alone, exactly."""
    args = [
        dict(temperature=0, max_tokens=10 + i % 4, seed=None) if i % 3 else
        dict(temperature=0.9, top_p=0.9, max_tokens=9, seed=100 + i)
        for i in range(12)
    ]  # fmt: skip
    prompts = [[{"role": "user", "content": f"Story number {i} begins"}] for i in range(12)]

    def ask(client, i):
        return client.chat.completions.create(
            model=NAME, messages=prompts[i], logprobs=True, top_logprobs=2, **args[i]
        )

    solo = [ask(server.client(), i) for i in range(12)]
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)

    async def main():
        async def one(i):
            await asyncio.sleep(0.03 * i)
            return await ask(client, i)

        try:
            return await asyncio.gather(*(one(i) for i in range(12)))
        finally:
            await client.close()

    def seen(r):
        c = r.choices[0]
        return (
            c.message.content,
            c.finish_reason,
            [(t.token, t.logprob, [(b.token, b.logprob) for b in t.top_logprobs])
             for t in c.logprobs.content],
        )  # fmt: skip

    assert [seen(r) for r in asyncio.run(main())] == [seen(r) for r in solo]


SYSTEM = (
    "You are a careful assistant who answers questions about rivers, mountains and the sea, "
    "and who always gives short answers with one example."
)


def test_a_chat_that_continues_hits_the_prefix_cache_and_answers_as_the_library(server, pipe):
    before = _metric(server, "transmuter_jax_prefix_cache_hits")
    client = server.client()
    history = [{"role": "system", "content": SYSTEM}]
    for turn in ("Tell me about rivers.", "And mountains?", "And the sea?"):
        history.append({"role": "user", "content": turn})
        want = _greedy(pipe, history, 8, token_logprobs=True)
        got = client.chat.completions.create(
            model=NAME, messages=history, max_tokens=8, temperature=0, logprobs=True
        )
        assert got.choices[0].message.content == want.text
        assert [c.logprob for c in got.choices[0].logprobs.content] == pytest.approx(
            want.logprobs, abs=1e-5
        )
        history.append({"role": "assistant", "content": got.choices[0].message.content})
    assert _metric(server, "transmuter_jax_prefix_cache_hits") - before >= 2 * 64
    assert 0 < _metric(server, "transmuter_jax_prefix_cache_hit_rate") <= 1


def _onnx_logits(tokens: list[int]):
    """The fixture's next-token logits after ``tokens``, by onnxruntime on the whole sequence."""
    import numpy as np
    import onnxruntime as ort

    session = _onnx_logits.__dict__.setdefault(
        "session",
        ort.InferenceSession(str(MODEL / "model.onnx"), providers=["CPUExecutionProvider"]),
    )
    ids = np.asarray([tokens], np.int64)
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids),
            "position_ids": np.arange(len(tokens), dtype=np.int64)[None]}  # fmt: skip
    for i in session.get_inputs():
        if i.name.startswith("past_key_values"):
            feed[i.name] = np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
    return session.run(["logits"], feed)[0][0, -1].astype(np.float64)


def test_presence_and_frequency_penalties_follow_openais_definition(server, pipe):
    """Against numpy: mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty over the
    generated tokens (OpenAI's published definition), on onnxruntime's logits."""
    import numpy as np

    prompt = pipe.tokenizer.encode("Once upon", add_special_tokens=True)
    for presence, frequency in ((0.0, 1.5), (1.2, 0.0), (0.6, 0.9), (-0.5, -0.8)):
        got = server.client().completions.create(
            model=NAME, prompt="Once upon", max_tokens=10, temperature=0, logprobs=1,
            presence_penalty=presence, frequency_penalty=frequency,
        )  # fmt: skip
        tokens, logprobs, reason = [], [], "length"
        while len(tokens) < 10:
            logits = _onnx_logits(prompt + tokens)
            counts = np.bincount(tokens, minlength=logits.shape[0])[: logits.shape[0]]
            scores = logits - counts * frequency - (counts > 0) * presence
            token = int(np.argmax(scores))
            if token == 3:  # the fixture's eos
                reason = "stop"
                break
            tokens.append(token)
            top = scores.max()
            logprobs.append(scores[token] - top - np.log(np.exp(scores - top).sum()))
        choice = got.choices[0]
        assert choice.text == pipe.tokenizer.decode(tokens, skip_special_tokens=True)
        assert choice.finish_reason == reason
        assert choice.logprobs.token_logprobs == pytest.approx(logprobs, abs=1e-4)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_response_format_json_schema_validates_and_equals_the_library(server, pipe):
    jsonschema = pytest.importorskip("jsonschema")
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
    }
    for stream in (False, True):
        got = server.client().chat.completions.create(
            model=NAME, messages=MESSAGES, max_tokens=40, temperature=0, response_format=fmt,
            stream=stream,
        )  # fmt: skip
        if stream:
            chunks = [c for c in got if c.choices]
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            content, reason = got.choices[0].message.content, got.choices[0].finish_reason
        assert reason == "stop"
        jsonschema.validate(json.loads(content), SCHEMA)
        want = _greedy(pipe, MESSAGES, 40, json_schema=SCHEMA)
        assert content == want.text


def test_response_format_json_object_and_structured_outputs(server):
    client = server.client()
    seeded = dict(temperature=0.9, seed=5)
    got = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=60, response_format={"type": "json_object"},
        **seeded,
    )  # fmt: skip
    if got.choices[0].finish_reason == "stop":  # else cut by max_tokens: incomplete
        assert isinstance(json.loads(got.choices[0].message.content), dict)
    regex = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    got = client.completions.create(
        model=NAME, prompt="Once upon", max_tokens=20,
        extra_body={"structured_outputs": {"regex": regex}}, **seeded,
    )  # fmt: skip
    assert got.choices[0].finish_reason == "stop"
    assert re.fullmatch(regex, got.choices[0].text)
    choices = ["river", "mountain", "sea"]
    for i in range(3):
        got = client.chat.completions.create(
            model=NAME, messages=MESSAGES, max_tokens=10, temperature=0.9, seed=i,
            extra_body={"structured_outputs": {"choice": choices}},
        )  # fmt: skip
        assert got.choices[0].message.content in choices
    got = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=30, temperature=0,
        extra_body={"structured_outputs": {"json": SCHEMA}},
    )  # fmt: skip
    assert set(json.loads(got.choices[0].message.content)) == {"name", "age"}
    grammar = 'start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[0-9]/'
    got = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=10, temperature=0,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )  # fmt: skip
    assert re.fullmatch(r"yes|no|maybe [0-9]", got.choices[0].message.content)


CLOSED = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]}},
    "required": ["ok", "size"],
    "additionalProperties": False,
}


def test_constrained_requests_beside_free_ones_run_in_slots_and_equal_their_solo_answers(server):
    """A regex, a choice and a closed schema (device tables) run in the slots, not on the
    pipeline path, beside free requests; each answer equals the same request alone, tokens and
    log-probabilities, and validates."""
    jsonschema = pytest.importorskip("jsonschema")
    regex = r"[0-9]{3}-[a-z]{2,5}"
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": CLOSED, "strict": True}}
    args = [
        dict(extra_body={"structured_outputs": {"regex": regex}}, temperature=0),
        dict(extra_body={"structured_outputs": {"choice": ["river", "sea"]}}, temperature=0.9,
             seed=3),
        dict(response_format=fmt, temperature=0),
        dict(temperature=0),
        dict(temperature=0.8, seed=11),
        dict(temperature=0),
    ]  # fmt: skip
    prompts = [[{"role": "user", "content": f"Item {i} of the list"}] for i in range(len(args))]

    def ask(client, i):
        return client.chat.completions.create(
            model=NAME, messages=prompts[i], max_tokens=24, logprobs=True, **args[i]
        )

    def seen(r):
        c = r.choices[0]
        logprobs = [(t.token, t.logprob) for t in c.logprobs.content]
        return c.message.content, c.finish_reason, logprobs

    before = server.log.read_text().count("pipeline path")
    solo = [seen(ask(server.client(), i)) for i in range(len(args))]
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)

    async def main():
        async def one(i):
            await asyncio.sleep(0.02 * i)
            return await ask(client, i)

        try:
            return await asyncio.gather(*(one(i) for i in range(len(args))))
        finally:
            await client.close()

    together = [seen(r) for r in asyncio.run(main())]
    assert together == solo
    assert server.log.read_text().count("pipeline path") == before  # all ran in slots
    assert re.fullmatch(regex, solo[0][0]) and solo[0][1] == "stop"
    assert solo[1][0] in ("river", "sea")
    jsonschema.validate(json.loads(solo[2][0]), CLOSED)


BAD_FORMATS = [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": 7}},
            }
        },
        "response_format.json_schema",
    ),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp"),
    (
        {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
        "structured_outputs.regex",
    ),
    ({"structured_outputs": {"regex": "a"}, "ignore_eos": True}, "ignore_eos"),
]


@pytest.mark.parametrize("extra, param", BAD_FORMATS)
def test_bad_formats_get_openai_errors(server, extra, param):
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": 5, **extra}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error


def test_min_tokens_logit_bias_and_ignore_eos_equal_the_library(server, pipe):
    """A bias towards eos ends the answer as soon as min_tokens allows; ignore_eos runs on."""
    bias = {"3": 30.0}  # the fixture's eos
    for min_tokens in (0, 3):
        got = server.client().completions.create(
            model=NAME, prompt="Once upon", max_tokens=8, temperature=0, logit_bias=bias,
            extra_body={"min_tokens": min_tokens},
        )  # fmt: skip
        want = pipe.generate(
            ["Once upon"], chat=False, do_sample=False, max_new_tokens=8,
            sequence_bias=[((3,), 30.0)], min_new_tokens=min_tokens,
        )[0]  # fmt: skip
        assert len(want.token_ids) == min_tokens and want.finish_reason == "eos"
        assert got.choices[0].text == want.text and got.choices[0].finish_reason == "stop"
        assert got.usage.completion_tokens == min_tokens
    got = server.client().completions.create(
        model=NAME, prompt="Once upon", max_tokens=5, temperature=0, logit_bias=bias,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert got.choices[0].finish_reason == "length" and got.usage.completion_tokens == 5


GROW = ROOT / "tests" / "fixtures" / "gemma3-optimum"  # positions from the cache length


def test_a_grow_model_is_served_in_slots_with_the_librarys_answers(tmp_path):
    """A grow-mode decoder runs the slots on its padded rewrite (each row's padding its own);
    the prefix cache stores nothing for it (its valid rows come last). Concurrent greedy and
    seeded requests get the library's answers."""
    s = Server(tmp_path, "--max-batch-size", "2", "--max-model-len", "128", model=GROW)
    try:
        assert "continuous batching in 2 slots" in s.log.read_text()
        grow = text.generation(GROW)
        prompts = ["The quiet river", "Once upon a time there", "A"]
        want = grow.generate(prompts, chat=False, do_sample=False, max_new_tokens=7,
                             token_logprobs=True)  # fmt: skip

        def ask(prompt):
            return s.client().completions.create(
                model=NAME, prompt=prompt, max_tokens=7, temperature=0, logprobs=0
            )

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            got = list(pool.map(ask, prompts))
        for g, w in zip(got, want, strict=True):
            assert g.choices[0].text == w.text
            assert g.choices[0].logprobs.token_logprobs == pytest.approx(w.logprobs, abs=1e-5)
        sampled = [
            s.client().completions.create(
                model=NAME, prompt="Once", max_tokens=6, temperature=0.9, seed=11
            )  # fmt: skip
            for _ in range(2)
        ]
        assert sampled[0].choices[0].text == sampled[1].choices[0].text
    finally:
        assert s.stop() == 0


# -- a draft model (--speculative-model): one server -------------------------------------------

DRAFT = ROOT / "tests" / "fixtures" / "llama-genai-int4"  # llama-optimum's tokenizer, other weights


@pytest.fixture(scope="module")
def drafted(tmp_path_factory):
    """A server whose requests draft with llama-genai-int4, 4 tokens unless they say."""
    s = Server(
        tmp_path_factory.mktemp("drafted"), "--speculative-model", str(DRAFT),
        "--num-speculative-tokens", "4", "--max-batch-size", "2",
    )  # fmt: skip
    yield s
    s.stop()


@pytest.mark.slow  # a server with a draft model: ~5 min on 2 cores, its warm-up included
def test_a_draft_model_serves_the_librarys_greedy_answers_and_usage(drafted, pipe):
    """Greedy answers with the draft model (the server's K, a request's own, none, prompt lookup
    first) are the library's plain ones, log-probabilities and usage too, streamed or not, two
    at a time."""
    from concurrent.futures import ThreadPoolExecutor

    assert "drafting 4 tokens with" in drafted.log.read_text()
    assert _metric(drafted, "transmuter_jax_speculative_drafted_tokens") == 0
    client = drafted.client()
    want = _greedy(pipe, MESSAGES, 16, token_logprobs=True)
    prompt = pipe.prompt_ids(MESSAGES)

    def ask(extra):
        return client.chat.completions.create(
            model=NAME, messages=MESSAGES, max_tokens=16, temperature=0, logprobs=True,
            extra_body=extra,
        )  # fmt: skip

    extras = [{}, {"num_speculative_tokens": 7}, {"num_speculative_tokens": 0},
              {"prompt_lookup_num_tokens": 3}]  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(ask, extras + extras[:2]))
    for extra, got in zip(extras + extras[:2], answers, strict=True):
        choice = got.choices[0]
        assert choice.message.content == want.text, extra
        assert [c.logprob for c in choice.logprobs.content] == pytest.approx(
            want.logprobs, abs=1e-5
        )
        assert got.usage.prompt_tokens == len(prompt)
        assert got.usage.completion_tokens == len(want.token_ids)
        assert got.usage.total_tokens == len(prompt) + len(want.token_ids)
    stream = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    words = ["Once upon", "The quiet river"]
    plain = pipe.generate(words, chat=False, do_sample=False, max_new_tokens=9)
    got = client.completions.create(model=NAME, prompt=words, max_tokens=9, temperature=0)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [w.text for w in plain]
    assert got.usage.completion_tokens == sum(len(w.token_ids) for w in plain)
    drafts = _metric(drafted, "transmuter_jax_speculative_drafted_tokens")
    accepted = _metric(drafted, "transmuter_jax_speculative_accepted_tokens")
    assert drafts > 0 and 0 < accepted <= drafts


def test_a_draft_model_samples_reproducibly_and_refuses_n_with_drafts(drafted):
    client = drafted.client()
    args = dict(model=NAME, messages=MESSAGES, max_tokens=12, temperature=0.9, seed=7)
    first = client.chat.completions.create(**args, logprobs=True)
    assert first.usage.completion_tokens == len(first.choices[0].logprobs.content) > 0
    assert client.chat.completions.create(**args).choices[0].message.content == (
        first.choices[0].message.content
    )
    many = client.chat.completions.create(**args, n=2)  # the server's drafts: not for n > 1
    assert len(many.choices) == 2
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**args, n=2, extra_body={"num_speculative_tokens": 2})
    assert error.value.status_code == 400 and error.value.body["param"] == "n"


def _other_texts(into: pathlib.Path) -> pathlib.Path:
    """A copy of llama-genai-int4 whose tokenizer swaps the ids of two tokens: a draft of other
    token texts."""
    import shutil

    from generation_cases import swap_two_tokens

    shutil.copytree(DRAFT, into)
    swap_two_tokens(DRAFT, into)
    return into


@pytest.mark.parametrize(
    "target, other, message",
    [
        (MODEL, True, r"--speculative-model \S+: the assistant model .* other token texts"),
        (GROW, False,
         r"--speculative-model: the slots cannot run \S+ with a draft model: .*grow cache"),
    ],
)  # fmt: skip
def test_a_draft_model_that_cannot_draft_is_refused_at_start(tmp_path, target, other, message):
    """One error line and status 1, before the server starts."""
    draft = _other_texts(tmp_path / "other") if other else DRAFT
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "transmuter_jax", "serve", str(target), "--port",
           str(_free_port()), "--speculative-model", str(draft)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1, done.stderr
    assert lines[-1].startswith("transmuter-jax: error: "), done.stderr
    assert re.search(message, lines[-1]), lines[-1]
    assert "Traceback" not in done.stderr and "serving" not in done.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-speculative-tokens", "4"], "--num-speculative-tokens needs --speculative-model"),
        (["--speculative-model", "x", "--num-speculative-tokens", "0"], r"must be in \[1, 32\]"),
        (["--speculative-model", "/no/such/draft"], "--speculative-model /no/such/draft: "),
        (["--draft-model", "x", "--num-speculative-tokens", "33"], r"must be in \[1, 32\], got 33"),
    ],
)
def test_bad_speculative_flags_are_refused(flags, message, capsys):
    from transmuter_jax import cli

    assert cli.main(["serve", str(MODEL), *flags]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("transmuter-jax: error: "), err
    assert re.search(message, err[0]), err
