"""The OpenAI routes on FastAPI: /health, /v1/models, /v1/chat/completions, /v1/completions,
/metrics. Requests become :class:`~.backend.Submission` s; their events become OpenAI's
responses or SSE chunks (sse-starlette)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse

from .backend import Event, Final, Submission
from .protocol import ApiError, ChatRequest, CompletionRequest
from .scheduler import Group, Scheduler

log = logging.getLogger("transmuter_jax.serving")


@dataclasses.dataclass
class Served:
    """What the routes need of the model.

    Attributes:
        name: the served model name (the ``model`` field requests must give).
        pipe: the text-generation pipeline (tokenizer, chat template, defaults).
        max_model_len: the most tokens of prompt plus answer.
        vocab_size: the vocabulary (logit_bias ids must lie in it).
        generation_config: take omitted sampling fields from generation_config.json (vLLM's
            ``--generation-config auto``) instead of OpenAI's defaults.
        decode_steps: the engine's decode chunk (new tokens per device call).
        speculative_tokens: with a draft model (``--speculative-model``), the tokens it drafts
            per step where a request gives no ``num_speculative_tokens``; None without one.
    """

    name: str
    pipe: Any
    max_model_len: int
    vocab_size: int
    generation_config: bool = False
    decode_steps: int | None = None
    speculative_tokens: int | None = None


def _field(loc: Sequence[Any]) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


def _error(error: ApiError, request: Request | None = None) -> JSONResponse:
    """OpenAI's error body; with ``request``, the refusal's one log line (a request the
    scheduler refused has its own)."""
    if request is not None:
        log.info("request %s %s refused: %d %s", request.method, request.url.path,
                 error.status, error.message)  # fmt: skip
    return JSONResponse(error.body(), status_code=error.status)


def create_app(served: Served, scheduler: Scheduler, api_key: str | None = None) -> FastAPI:
    """The FastAPI application serving ``served`` through ``scheduler``."""
    app = FastAPI(title="transmuter-jax", docs_url=None, redoc_url=None)
    metrics = scheduler.metrics

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, error: ApiError) -> JSONResponse:
        return _error(error, None if getattr(error, "logged", False) else request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        if first.get("type") == "json_invalid":
            return _error(
                ApiError(
                    400, f"the body is not valid JSON: {first.get('msg')}", code="invalid_json"
                ),
                request,
            )
        param = _field(first.get("loc", ()))
        return _error(ApiError(400, f"{param}: {first.get('msg')}", param=param), request)

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        path = request.url.path
        if api_key and path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                response = _error(
                    ApiError(
                        401,
                        "a missing or wrong API key (give it as 'Authorization: Bearer KEY')",
                        type="authentication_error",
                        code="invalid_api_key",
                    ),
                    request,
                )
                metrics.requests.labels(path, "401").inc()
                return response
        try:
            response = await call_next(request)
        except Exception as error:  # noqa: BLE001 - the server keeps serving
            log.exception("request %s %s failed", request.method, path)
            response = _error(ApiError(500, f"internal error: {error}", type="server_error"))
        if path.startswith("/v1/"):
            metrics.requests.labels(path, str(response.status_code)).inc()
        return response

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": served.name,
            "object": "model",
            "created": 0,
            "owned_by": "transmuter-jax",
            "max_model_len": served.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        _check_model(served, body.model)
        messages = [_message(m, i) for i, m in enumerate(body.messages)]
        try:
            prompt = served.pipe.prompt_ids(messages, chat=True)
        except (ValueError, TypeError) as error:
            raise ApiError(400, f"messages: {error}", param="messages") from None
        max_tokens = body.max_completion_tokens or body.max_tokens
        top = body.top_logprobs or 0
        if top and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = top if body.logprobs else None
        constraint = await _constraint(served, body)
        sub = _submission(served, body, prompt, max_tokens, logprobs, "messages", constraint)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        group = scheduler.submit(rid, [sub])
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            chunks = _chat_chunks(served, group, body.logprobs, include)
            return EventSourceResponse(_sse(chunks, group), ping=600)
        [finals] = await _finals(group, request)
        return _chat_response(served, rid, sub, finals, body.logprobs)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(served, body.model)
        texts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
        if not texts or not all(texts):
            raise ApiError(400, "prompt: give a non-empty string or list of them", param="prompt")
        if body.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        tok = served.pipe.tokenizer
        prompts = [tok.encode(t, add_special_tokens=True) for t in texts]
        constraint = await _constraint(served, body)
        subs = [
            _submission(served, body, p, body.max_tokens or 16, body.logprobs, "prompt", constraint)
            for p in prompts
        ]
        rid = f"cmpl-{uuid.uuid4().hex}"
        group = scheduler.submit(rid, subs)
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            chunks = _completion_chunks(served, group, body.logprobs is not None, include)
            return EventSourceResponse(_sse(chunks, group), ping=600)
        results = await _finals(group, request)
        return _completion_response(served, rid, subs, results, body.logprobs is not None)

    return app


def _check_model(served: Served, model: str) -> None:
    if model != served.name:
        raise ApiError(
            404,
            f"the model {model!r} does not exist: this server serves {served.name!r}",
            param="model",
            code="model_not_found",
        )


def _message(message: Any, index: int) -> dict[str, str]:
    """A chat message as the chat template takes it: text parts joined."""
    content = message.content
    if content is None:
        content = ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(
                    400,
                    f"messages.{index}.content: only text parts are supported, "
                    f"got {part.get('type')!r}",
                    param=f"messages.{index}.content",
                )
            texts.append(part["text"])
        content = "".join(texts)
    role = "system" if message.role == "developer" else message.role
    return {"role": role, "content": content}


async def _constraint(served: Served, body: Any) -> dict[str, Any]:
    """The structured-output option of ``response_format`` or ``structured_outputs`` (the
    library's json_schema / json_object / regex / grammar / choice), compiled once here so that
    a bad one gets a 400 naming it; {} when there is none."""
    given: list[tuple[str, dict[str, Any]]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise ApiError(
                400,
                "response_format.json_schema: give {'name': ..., 'schema': {...}} with "
                "type 'json_schema'",
                param="response_format.json_schema",
            )
        schema = json.dumps(fmt.json_schema.json_schema, ensure_ascii=False)
        given.append(("response_format.json_schema", {"json_schema": schema}))
    so = body.structured_outputs
    if so is not None:
        fields = {
            "json": ("json_schema", so.json_),
            "regex": ("regex", so.regex),
            "grammar": ("grammar", so.grammar),
            "choice": ("choice", so.choice),
            "json_object": ("json_object", so.json_object or None),
        }
        for name, (option, value) in fields.items():
            if value is None:
                continue
            if option == "json_schema" and not isinstance(value, str):
                value = json.dumps(value, ensure_ascii=False)
            if option == "choice":
                value = tuple(value)
            given.append((f"structured_outputs.{name}", {option: value}))
    if not given:
        return {}
    if len(given) > 1:
        names = " and ".join(p for p, _ in given)
        raise ApiError(400, f"{names}: give one structured-output constraint", param=given[1][0])
    param, options = given[0]
    if body.ignore_eos:
        raise ApiError(400, f"{param}: a constraint ends with eos: ignore_eos cannot be set",
                       param="ignore_eos")  # fmt: skip
    try:
        await asyncio.to_thread(_compile_constraint, served, options)
    except ValueError as error:
        raise ApiError(400, f"{param}: {error}", param=param) from None
    return options


def _compile_constraint(served: Served, options: dict[str, Any]) -> None:
    """Raises ValueError (GenerationError) naming what is wrong with the constraint; builds
    its device table where it has one (cached, for the slots)."""
    import os

    from ..generation import Options
    from ..generation.constraints import from_options, processor

    constraint = from_options(Options(**options))
    eos = served.pipe.defaults.get("eos_token_id") or ()
    eos = (eos,) if isinstance(eos, int) else tuple(eos)
    path = os.path.join(served.pipe.files.folder, "tokenizer.json")
    processor(constraint, path, served.vocab_size, eos)


def _submission(
    served: Served,
    body: Any,
    prompt: list[int],
    max_tokens: int | None,
    logprobs: int | None,
    field: str,
    constraint: dict[str, Any] | None = None,
) -> Submission:
    """The engine's view of a request; raises ApiError for what the model cannot run."""
    limit = served.max_model_len
    if len(prompt) >= limit:
        raise ApiError(
            400,
            f"{field}: the prompt has {len(prompt)} tokens, but this model's "
            f"context is {limit} tokens",
            param=field,
            code="context_length_exceeded",
        )
    new = max_tokens if max_tokens is not None else limit - len(prompt)
    if len(prompt) + new > limit:
        raise ApiError(
            400,
            f"max_tokens: {len(prompt)} prompt tokens + {new} new ones exceed "
            f"this model's context of {limit} tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    options: dict[str, Any] = {"max_new_tokens": new}
    defaults = served.pipe.defaults if served.generation_config else {}
    temperature = body.temperature
    if temperature is None:
        temperature = defaults.get("temperature", 1.0) if defaults.get("do_sample", True) else 0
    if temperature == 0:
        options["do_sample"] = False
    else:
        options.update(do_sample=True, temperature=float(temperature))
        top_p = body.top_p if body.top_p is not None else defaults.get("top_p", 1.0)
        top_k = body.top_k if body.top_k is not None else defaults.get("top_k", 0)
        options.update(top_p=float(top_p), top_k=max(int(top_k or 0), 0))
        if body.min_p:
            options["min_p"] = float(body.min_p)
    if body.repetition_penalty is not None:
        options["repetition_penalty"] = float(body.repetition_penalty)
    if body.min_tokens:
        options["min_new_tokens"] = int(body.min_tokens)
    if body.ignore_eos:
        options["eos_token_id"] = []
    options.update(_speculation(served, body))
    if body.logit_bias:
        options["sequence_bias"] = _logit_bias(body.logit_bias, served.vocab_size)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stop) or len(stop) > 4:
        raise ApiError(400, "stop: up to 4 non-empty strings", param="stop")
    if stop:
        options["stop"] = stop
    if logprobs is not None:
        options["token_logprobs"] = True
        if logprobs:
            options["top_logprobs"] = int(logprobs)
    if served.decode_steps:
        options["decode_steps"] = served.decode_steps
    options.update(constraint or {})
    seed = body.seed if body.seed is not None else secrets.randbits(31)
    return Submission(
        tuple(prompt),
        tuple((k, _frozen(v)) for k, v in sorted(options.items())),
        int(seed),
        n=body.n,
        stop=tuple(stop),
        presence_penalty=float(body.presence_penalty),
        frequency_penalty=float(body.frequency_penalty),
    )


def _speculation(served: Served, body: Any) -> dict[str, int]:
    """The speculative decoding options of a request (docs/speculative.md). Without a draft
    model, ``prompt_lookup_num_tokens`` (or ``num_speculative_tokens``) is prompt lookup's K.
    With one, ``prompt_lookup_num_tokens`` takes precedence (prompt lookup, the draft model
    idle), else the draft model drafts ``num_speculative_tokens`` (0: none) or the server's K;
    with n > 1 a request asks for no speculation (400 where it does) and gets none."""
    lookup, asked = body.prompt_lookup_num_tokens, body.num_speculative_tokens
    if served.speculative_tokens is None:
        lookup = lookup or asked
    elif not lookup:
        k = served.speculative_tokens if asked is None else asked
        if body.n > 1 and asked is None:
            k = 0  # the server's default speculation: not for n > 1
        if k and body.n > 1:
            raise ApiError(400, "num_speculative_tokens: speculative decoding takes n=1", param="n")
        return {"num_assistant_tokens": int(k)}
    if not lookup:
        return {}
    if body.n > 1:
        raise ApiError(400, "prompt_lookup_num_tokens: speculative decoding takes n=1", param="n")
    return {"prompt_lookup_num_tokens": int(lookup)}


def _frozen(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    return value


def _logit_bias(bias: dict[str, float], vocab: int) -> list[tuple[tuple[int], float]]:
    out = []
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise ApiError(
                400, f"logit_bias: the key {key!r} is not a token id", param="logit_bias"
            ) from None
        if not 0 <= token < vocab:
            raise ApiError(
                400,
                f"logit_bias: token id {token} is outside the vocabulary of {vocab}",
                param="logit_bias",
            )
        if not -100 <= value <= 100:
            raise ApiError(
                400,
                f"logit_bias: the bias {value} of token {token} is outside [-100, 100]",
                param="logit_bias",
            )
        out.append(((token,), float(value)))
    return out


async def _left(request: Request) -> None:
    """Returns when the client has closed the connection.

    It waits on ``receive`` itself: ``request.is_disconnected()`` never sees the disconnect
    behind the ``http`` middleware (Starlette's BaseHTTPMiddleware drops the message its
    cancelled poll receives)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.25)  # not expected once the body is read: look again later


async def _finals(group: Group, request: Request) -> list[list[tuple[Final, str]]]:
    """The final answer and finish reason of each choice of each job of ``group``, collected
    as they come; every open job is cancelled when the client goes away or a job fails."""
    finals: dict[tuple[int, int], tuple[Final, str]] = {}

    async def collect() -> None:
        async for index, event in group.events():
            if event.final is not None:
                finals[index, event.choice] = (event.final, event.finish_reason or "stop")

    task, gone = asyncio.ensure_future(collect()), asyncio.ensure_future(_left(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            if gone.exception() is None:
                raise ApiError(499, "the client closed the request", code="client_closed")
            await task  # receive failed: nothing tells of the client any more
        task.result()
    finally:
        task.cancel()
        gone.cancel()
        group.cancel()
    return [[finals[p, c] for c in range(j.submission.n)] for p, j in enumerate(group.jobs)]


def _token(tokenizer: Any, token: int) -> tuple[str, list[int]]:
    text = tokenizer.decode([token], skip_special_tokens=False)
    return text, list(text.encode("utf-8"))


def _chat_logprobs(tokenizer: Any, tokens, logprobs, tops) -> dict[str, Any]:
    content = []
    for i, token in enumerate(tokens):
        text, raw = _token(tokenizer, token)
        best = []
        for t, lp in tops[i] if tops else []:
            s, b = _token(tokenizer, t)
            best.append({"token": s, "logprob": lp, "bytes": b})
        content.append({"token": text, "logprob": logprobs[i], "bytes": raw, "top_logprobs": best})
    return {"content": content, "refusal": None}


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _chat_response(served: Served, rid: str, sub: Submission, finals, logprobs: bool):
    tok = served.pipe.tokenizer
    choices = []
    for index, (final, reason) in enumerate(finals):
        lp = None
        if logprobs:
            lp = _chat_logprobs(tok, final.token_ids, final.logprobs, final.top_logprobs)
        message = {"role": "assistant", "content": final.text}
        choices.append(
            {"index": index, "message": message, "logprobs": lp, "finish_reason": reason}
        )
    completion = sum(len(f.token_ids) for f, _ in finals)
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": served.name,
        "choices": choices,
        "usage": _usage(len(sub.prompt), completion),
    }


def _completion_logprobs(tokenizer: Any, tokens, logprobs, tops, offset: int = 0):
    texts = [_token(tokenizer, t)[0] for t in tokens]
    offsets, at = [], offset
    for text in texts:
        offsets.append(at)
        at += len(text)
    top = None
    if tops is not None:
        top = [{_token(tokenizer, t)[0]: lp for t, lp in best} for best in tops]
    return {
        "tokens": texts,
        "token_logprobs": list(logprobs),
        "top_logprobs": top,
        "text_offset": offsets,
    }


def _completion_response(served: Served, rid: str, subs, results, logprobs: bool):
    tok = served.pipe.tokenizer
    choices, completion = [], 0
    for p, finals in enumerate(results):
        for j, (final, reason) in enumerate(finals):
            lp = None
            if logprobs:
                lp = _completion_logprobs(tok, final.token_ids, final.logprobs, final.top_logprobs)
            choices.append(
                {
                    "index": p * subs[p].n + j,
                    "text": final.text,
                    "logprobs": lp,
                    "finish_reason": reason,
                }
            )
            completion += len(final.token_ids)
    prompt = sum(len(s.prompt) for s in subs)
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": served.name,
        "choices": choices,
        "usage": _usage(prompt, completion),
    }


async def _sse(
    chunks: AsyncIterator[dict[str, Any]], group: Group
) -> AsyncIterator[dict[str, str]]:
    """The SSE events of ``chunks``, then [DONE]; every open job of ``group`` is cancelled when
    the stream ends early (the client went away, a job failed)."""
    try:
        async for chunk in chunks:
            yield {"data": json.dumps(chunk, ensure_ascii=False)}
        yield {"data": "[DONE]"}
    finally:
        group.cancel()


async def _chat_chunks(served: Served, group: Group, logprobs: bool, include: bool):
    tok = served.pipe.tokenizer
    created = int(time.time())
    head = {
        "id": group.id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": served.name,
    }
    extra = {"usage": None} if include else {}

    def chunk(index: int, delta: dict, lp=None, reason=None) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        return {**head, "choices": [choice], **extra}

    [sub] = group.submissions
    for index in range(sub.n):
        yield chunk(index, {"role": "assistant", "content": ""})
    event: Event
    async for _, event in group.events():
        if event.token is not None:
            lp = None
            if logprobs:
                lp = _chat_logprobs(
                    tok,
                    [event.token],
                    [event.logprob],
                    [event.top] if event.top is not None else None,
                )
            if event.text or lp is not None:
                yield chunk(event.choice, {"content": event.text}, lp)
        else:
            if event.text:
                yield chunk(event.choice, {"content": event.text})
            yield chunk(event.choice, {}, None, event.finish_reason)
    if include:
        yield {**head, "choices": [], "usage": _usage(len(sub.prompt), group.completion_tokens)}


async def _completion_chunks(served: Served, group: Group, logprobs: bool, include: bool):
    tok = served.pipe.tokenizer
    head = {
        "id": group.id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": served.name,
    }
    extra = {"usage": None} if include else {}
    async for p, event in group.events():  # the prompts' chunks interleave, as they come
        index = p * group.submissions[p].n + event.choice
        if event.token is not None:
            lp = None
            if logprobs:
                tops = [event.top] if event.top is not None else None
                lp = _completion_logprobs(tok, [event.token], [event.logprob], tops)
            if not event.text and lp is None:
                continue
            choice = {"index": index, "text": event.text, "logprobs": lp, "finish_reason": None}
        else:
            choice = {
                "index": index,
                "text": event.text,
                "logprobs": None,
                "finish_reason": event.finish_reason,
            }
        yield {**head, "choices": [choice], **extra}
    if include:
        prompt = sum(len(s.prompt) for s in group.submissions)
        yield {**head, "choices": [], "usage": _usage(prompt, group.completion_tokens)}
