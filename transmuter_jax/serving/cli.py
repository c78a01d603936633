"""``transmuter-jax serve [MODEL]``: its options (:func:`add_arguments`) and runner (:func:`run`).

Only argparse is imported at module level, so the command line stays quick to start; FastAPI,
uvicorn and the model load in :func:`run`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Any

API_KEY_ENV = "TRANSMUTER_JAX_API_KEY"
MAX_MODEL_LEN = 2048  # the default context at most: each slot holds this many cache rows
DECODE_STEPS = 8  # the default decode chunk of the slots
PREFIX_CACHE_BYTES = 256 << 20
SPECULATIVE_TOKENS = 5  # the default draft length of --speculative-model's requests
MAX_SPECULATIVE_TOKENS = 32  # generation.options.MAX_DRAFT (not imported: argparse only here)
HELP = "serve a model behind the OpenAI API (needs the 'serve' extra)"
DESCRIPTION = (
    "Serve MODEL (a folder, a hub id, or the default model when left out) behind an "
    "OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions, /v1/models, /health, "
    "/metrics. Stops on SIGTERM or Ctrl-C. See docs/serving.md."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the options of ``serve`` to ``parser``."""
    parser.add_argument("model", nargs="?", metavar="MODEL")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model name requests give (default: MODEL, or 'default')",
    )
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=8,
        metavar="B",
        help="the most requests that run together: the engine's slots (default 8)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        metavar="N",
        help="the most tokens of prompt plus answer; each slot holds this many cache rows "
        f"(default: the model's positions, at most {MAX_MODEL_LEN})",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=64,
        metavar="N",
        help="the most requests waiting; one more gets 429 (default 64)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on "
        f"/v1 routes (default: ${API_KEY_ENV}, else none)",
    )
    parser.add_argument(
        "--chat-template",
        metavar="TEMPLATE",
        help="a Jinja chat template, or a file holding one, replacing the tokenizer's",
    )
    parser.add_argument(
        "--generation-config",
        choices=("openai", "auto"),
        default="openai",
        help="omitted sampling fields: OpenAI's defaults (temperature 1.0), or "
        "'auto': generation_config.json's, as vLLM's flag",
    )
    parser.add_argument(
        "--decode-steps",
        type=int,
        metavar="K",
        help=f"the most new tokens per decode chunk (default {DECODE_STEPS}); a chunk is also "
        "cut to about 0.25 s: a request waits at most one chunk to join",
    )
    parser.add_argument(
        "--prefix-cache-bytes",
        type=_size,
        default=PREFIX_CACHE_BYTES,
        metavar="BYTES",
        help="the most bytes of prompt KV rows kept on the device for later prompts that start "
        "the same way (suffixes K, M, G; 0: off; default 256M)",
    )
    parser.add_argument(
        "--speculative-model",
        "--draft-model",
        dest="speculative_model",
        metavar="DRAFT",
        help="a draft model of the same tokenizer (a folder or hub id): requests decode "
        "speculatively with it (docs/speculative.md)",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        metavar="K",
        help="the tokens the draft model drafts per step where a request does not say "
        f"(1 to {MAX_SPECULATIVE_TOKENS}; default {SPECULATIVE_TOKENS}); needs --speculative-model",
    )
    parser.add_argument("--dtype", help="variant of the ONNX files: fp32 (default), q4, int4, ...")
    parser.add_argument("--file", help="the decoder .onnx file to use, relative to MODEL")
    parser.add_argument("--verbose", "-v", action="store_true", help="show details and tracebacks")


def _size(text: str) -> int:
    """A byte count: an integer with an optional K, M or G (powers of 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    number, unit = (text[:-1], units[text[-1].upper()]) if text[-1:].upper() in units else (text, 1)
    try:
        value = int(float(number) * unit)
    except (ValueError, OverflowError):  # not a number, or not finite (inf, nan, 1e999)
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (say 512M or 2G)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a byte count must not be negative, got {text!r}")
    return value


def _template(value: str | None) -> str | None:
    if value is not None and os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value


def _check(args: argparse.Namespace) -> None:
    for name in ("max_batch_size", "max_queue", "port"):
        if getattr(args, name) < (0 if name == "port" else 1):
            raise ValueError(
                f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}"
            )
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ValueError(f"--max-model-len must be at least 2, got {args.max_model_len}")
    if args.decode_steps is not None and args.decode_steps < 1:
        raise ValueError(f"--decode-steps must be positive, got {args.decode_steps}")
    k = args.num_speculative_tokens
    if k is not None and not args.speculative_model:
        raise ValueError("--num-speculative-tokens needs --speculative-model (a draft model)")
    if k is not None and not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            f"--num-speculative-tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}"
        )


def _api_key(args: argparse.Namespace) -> str | None:
    """The key /v1 routes require: --api-key, else $TRANSMUTER_JAX_API_KEY; None when neither
    gives one."""
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def _draft(pipe: Any, model: str) -> Any:
    """The draft model ``model`` (a ``TextGeneration``); raises ValueError naming the flag when
    it cannot draft for ``pipe`` (another vocabulary or token texts, a grow cache)."""
    from .. import text
    from ..tasks import decoding

    try:
        draft = text.generation(model)
        helper = (draft.files.folder, draft.decoder, draft.embed)
        decoding.check_assistant(pipe.files.folder, pipe.decoder, pipe.embed, helper)
    except (ValueError, OSError) as error:
        raise ValueError(f"--speculative-model {model}: {error}") from None
    return draft


def run(args: argparse.Namespace) -> int:
    """Loads the model and serves it until SIGTERM or Ctrl-C; returns the exit status."""
    _check(args)
    try:
        import uvicorn

        from .app import Served, create_app
        from .backend import PipelineBackend
        from .metrics import Metrics
        from .scheduler import Scheduler
        from .slots import SlotBackend
    except ImportError as error:
        raise ValueError(
            f"serve needs the 'serve' extra: pip install 'transmuter_jax[serve]' ({error})"
        ) from None
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr
    )
    log = logging.getLogger("transmuter_jax.serving")
    from .. import hub, text

    pipe = text.generation(
        args.model, dtype=args.dtype, file=args.file, chat_template=_template(args.chat_template)
    )
    draft = _draft(pipe, args.speculative_model) if args.speculative_model else None
    raw = hub.read_json(pipe.files.folder, "config.json")  # or genai_config.json's equivalent
    config = raw.get("text_config", raw) if isinstance(raw.get("text_config"), dict) else raw
    positions = int(config.get("max_position_embeddings") or 2048)
    max_len = min(args.max_model_len or min(positions, MAX_MODEL_LEN), positions)
    vocab = hub.vocab_size(raw) or pipe.tokenizer.backend.get_vocab_size(with_added_tokens=True)
    name = args.served_model_name or args.model or "default"
    steps = args.decode_steps or DECODE_STEPS
    auto = args.generation_config == "auto"
    k = None
    if draft is not None:
        k = args.num_speculative_tokens or SPECULATIVE_TOKENS
    served = Served(name, pipe, max_len, vocab, auto, args.decode_steps, k)
    try:
        backend = SlotBackend(
            pipe, args.max_batch_size, max_model_len=max_len, decode_steps=steps,
            prefix_cache_bytes=args.prefix_cache_bytes, draft=draft, draft_tokens=k or 0,
        )  # fmt: skip
        prefixes = backend.prefixes
        kind = f"continuous batching in {args.max_batch_size} slots of {steps}-token chunks"
    except ValueError as error:  # a model the slots cannot run
        if draft is not None:  # the draft model drafts in the slots only
            raise ValueError(
                f"--speculative-model: the slots cannot run {pipe.files.folder} with a draft "
                f"model: {error}"
            ) from None
        backend, prefixes = PipelineBackend(pipe, args.max_batch_size), None
        kind = f"static batching (the slots cannot run this model: {error})"
    if draft is not None:
        kind += f", drafting {k} tokens with {draft.files.folder}"
    metrics = Metrics(
        lambda: backend.waiting,
        lambda: backend.running,
        prefix=(lambda: prefixes.stats) if prefixes is not None else None,
        speculative=(lambda: backend.speculated) if isinstance(backend, SlotBackend) else None,
    )
    scheduler = Scheduler(backend, metrics, args.max_queue)
    api_key = _api_key(args)
    app = create_app(served, scheduler, api_key)
    log.info(
        "serving %s as %r on http://%s:%d (%s, context %d)",
        pipe.files.folder,
        name,
        args.host,
        args.port,
        kind,
        max_len,
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5
        )
    )
    # uvicorn shuts down gracefully on SIGTERM, then raises it again with the handler it found:
    # this one, so that the process exits 0 after the shutdown.
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: None)
    try:
        server.run()
    finally:
        scheduler.closing = True
        backend.close()
        signal.signal(signal.SIGTERM, previous)
    log.info("stopped")
    return 0
