"""``transmuter-jax transcribe [MODEL] AUDIO...``: speech to text with a Whisper model."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..runtime.paths import not_a_file
from .inputs import model_and_audio, returns
from .options import add_generation_options, add_model_options, check_seed, generation_options
from .output import CompileNotice, print_texts, record, write_line
from .pipelines import speech_pipeline

NAME = "transcribe"
GATHERS = True  # whether its positional items may stand among its options (parser.parse)


def add(commands: Any) -> argparse.ArgumentParser:
    """Adds the command's parser to ``commands`` (argparse's subparsers)."""
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
    add_generation_options(tx)
    add_model_options(tx)

    return tx


def run(args: argparse.Namespace, notice: CompileNotice) -> int:
    """Runs the command; returns the exit status."""
    from .. import audio
    from ..audio import timestamps

    model, files = model_and_audio(args.args)
    for path in files:
        why = not_a_file(path, "an audio")
        if why is not None:
            raise ValueError(why)
    pipe = speech_pipeline(model, args)
    options = generation_options(args)
    check_seed(args, options, pipe.defaults)
    if args.language:
        options["language"] = args.language
    if args.task:
        options["task"] = args.task
    if args.timestamps or args.srt:
        options["return_timestamps"] = True
    n = returns(options, pipe.defaults)
    if n > 1 and not args.json and (args.timestamps or args.srt):
        flag = "--srt" if args.srt else "--timestamps"
        raise ValueError(f"{flag} shows one transcript per file, not --num-return-sequences {n}: "
                         "add --json for the chunks of each sequence")  # fmt: skip
    if not (args.json or args.timestamps or args.srt or n > 1):
        for path in files:
            write_line(pipe.stream(path, seed=args.seed, **options))
        notice.report()
        return 0
    results = pipe.generate(files, seed=args.seed, token_logprobs=args.json, **options)
    notice.report()
    for index, (path, result) in enumerate(zip(files, results, strict=True)):
        if args.json:
            for j, sequence in enumerate(result if n > 1 else [result]):
                out = record(sequence, j if n > 1 else None, file=path)
                if sequence.chunks is not None:
                    out["chunks"] = [{"timestamp": list(c["timestamp"]), "text": c["text"]}
                                     for c in sequence.chunks]  # fmt: skip
                print(json.dumps(out, ensure_ascii=False))
        elif n > 1:
            if len(files) > 1:
                print(f"{path}:")
            print_texts(result)
        elif args.srt:
            if len(files) > 1:
                print(f"NOTE {path}\n")
            for cue in timestamps.subrip(result.chunks or [], audio.duration(path)):
                print(cue)
        else:
            if len(files) > 1:
                print(f"{path}:")
            for line in timestamps.timed_lines(result.chunks or [], audio.duration(path)):
                print(line)
        if index + 1 < len(files) and not args.json:
            print()
    sys.stdout.flush()
    return 0
