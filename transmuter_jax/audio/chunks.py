"""Long audio as transformers' ASR pipeline runs it (``chunk_length_s``): overlapping windows of
the samples, each decoded as a row of one batch, and their tokens merged back into one transcript
by the rules of the Whisper tokenizer's ``_decode_asr`` (transformers 4.57)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

SEGMENT_SIZE = 1500  # timestamp steps of one 30 s window (the offset of a new decoding pass)


@dataclasses.dataclass(frozen=True)
class Window:
    """One chunk of an input.

    Attributes:
        start: its first sample in the input.
        samples: its samples (at most the chunk length).
        stride: ``(length, left, right)`` in samples: its length and the overlap it shares with
            the chunk before (left) and after (right); 0 at the ends of the input.
    """

    start: int
    samples: np.ndarray
    stride: tuple[int, int, int]


MIN_STEP = 0.1
"""The least advance of a chunk over the last (seconds): tinier chunks are refused."""


def lengths(
    chunk_length_s: float, stride_length_s: float | Sequence[float] | None, rate: int, window: int
) -> tuple[int, int, int]:
    """``(chunk, left, right)`` in samples at ``rate`` Hz, as the pipeline rounds them.

    Args:
        chunk_length_s: the chunk length in seconds (> 0, at most the extractor's window).
        stride_length_s: the overlap on each side in seconds, or ``(left, right)``; None:
            ``chunk_length_s / 6`` each side.
        rate: the sampling rate.
        window: the extractor's input length in samples (30 s): a longer chunk would be cut.

    Raises:
        ValueError: a chunk length that is not positive or longer than the window, a negative
            stride, or strides that together are longer than the chunk.
    """
    if isinstance(chunk_length_s, np.generic):
        chunk_length_s = chunk_length_s.item()
    if isinstance(chunk_length_s, bool) or not isinstance(chunk_length_s, int | float):
        raise ValueError(f"chunk_length_s is a number of seconds, got {chunk_length_s!r}")
    if not math.isfinite(chunk_length_s):
        raise ValueError(f"chunk_length_s is a finite number of seconds, got {chunk_length_s}")
    if not chunk_length_s > 0:
        raise ValueError(f"chunk_length_s is a positive number of seconds, got {chunk_length_s}")
    chunk = int(round(chunk_length_s * rate))
    if chunk > window:
        raise ValueError(
            f"chunk_length_s={chunk_length_s} is longer than the feature extractor's window of "
            f"{window / rate:g} s (the chunk would be cut)"
        )
    if chunk < MIN_STEP * rate:
        raise ValueError(
            f"chunk_length_s={chunk_length_s} is shorter than the least of {MIN_STEP:g} s"
        )
    if stride_length_s is None:
        stride_length_s = chunk_length_s / 6
    if isinstance(stride_length_s, np.generic):
        stride_length_s = stride_length_s.item()
    try:
        pair = (
            [stride_length_s, stride_length_s]
            if isinstance(stride_length_s, int | float)
            else [s.item() if isinstance(s, np.generic) else s for s in stride_length_s]
        )
    except TypeError:
        pair = []
    if len(pair) != 2 or any(isinstance(s, bool) or not isinstance(s, int | float) for s in pair):
        raise ValueError(f"stride_length_s is seconds or (left, right), got {stride_length_s!r}")
    if not all(math.isfinite(s) for s in pair):
        raise ValueError(f"stride_length_s is finite seconds, got {stride_length_s!r}")
    if min(pair) < 0:
        raise ValueError(f"stride_length_s is not negative, got {stride_length_s!r}")
    left, right = (int(round(s * rate)) for s in pair)
    if chunk - left - right < MIN_STEP * rate and left + right < chunk:
        raise ValueError(
            f"chunk_length_s={chunk_length_s} with stride_length_s={stride_length_s!r} advances "
            f"{(chunk - left - right) / rate:g} s a chunk, less than the least of {MIN_STEP:g} s"
        )
    if left + right >= chunk:
        # the pipeline refuses left + right > chunk; equal would make a step of 0 samples
        raise ValueError(
            f"stride_length_s={stride_length_s!r} is too large for chunk_length_s="
            f"{chunk_length_s}: the two strides ({(left + right) / rate:g} s) must be shorter "
            "than the chunk"
        )
    return chunk, left, right


def split(samples: np.ndarray, chunk: int, left: int, right: int) -> list[Window]:
    """The chunks of ``samples`` as the pipeline's ``chunk_iter`` cuts them: one every
    ``chunk - left - right`` samples, ``chunk`` long (the last one shorter), until one reaches
    the end; a last chunk no longer than its left stride is dropped."""
    total, step = len(samples), chunk - left - right
    out = []
    for start in range(0, total, step):
        end = start + chunk
        piece = samples[start:end]
        last = end >= total
        stride = (len(piece), 0 if start == 0 else left, 0 if last else right)
        if len(piece) > stride[1]:
            out.append(Window(start, piece, stride))
        if last:
            break
    return out


Token = tuple[int, int, int]  # (token id, chunk, position in the chunk's tokens)


def overlap_merge(sequences: Sequence[Sequence[Token]]) -> list[Token]:
    """The tokens of consecutive chunks merged at their best overlap, as transformers'
    ``_find_longest_common_sequence``: each next sequence slides along the end of the merged
    one; the alignment with the most equal tokens per overlapping token (at least two equal,
    longer overlaps winning ties) is kept, the first half of the overlap taken from the left
    sequence and the second half from the right one. Without such an alignment the sequences
    are concatenated. Compares the token ids; the rest of each tuple comes along."""
    left = list(sequences[0])
    merged: list[Token] = []
    for right in sequences[1:]:
        right = list(right)
        ids_l = np.array([t[0] for t in left], np.int64)
        ids_r = np.array([t[0] for t in right], np.int64)
        n_l, n_r = len(left), len(right)
        best, cut = 0.0, (n_l, n_l, 0, 0)
        for i in range(1, n_l + n_r):
            l0, l1 = max(0, n_l - i), min(n_l, n_l + n_r - i)
            r0, r1 = max(0, i - n_l), min(n_r, i)
            matches = int(np.sum(ids_l[l0:l1] == ids_r[r0:r1]))
            score = matches / i + i / 10000.0
            if matches > 1 and score > best:
                best, cut = score, (l0, l1, r0, r1)
        l0, l1, r0, r1 = cut
        merged.extend(left[: (l0 + l1) // 2])
        left = right[(r0 + r1) // 2 :]
    merged.extend(left)
    return merged


@dataclasses.dataclass
class Merged:
    """The transcript of one input from its chunks.

    Attributes:
        text: the text (the pieces of ``chunks`` joined).
        tokens: the merged text tokens, each ``(id, chunk, position)``: the chunk and the
            position in its tokens it was taken from.
        chunks: ``{"timestamp": (start, end), "text": ...}`` in seconds from the start of the
            input (end None when the transcript ends without a closing timestamp).
    """

    text: str
    tokens: list[Token]
    chunks: list[dict[str, Any]]


def merge(
    rows: Sequence[Sequence[int]],
    strides: Sequence[tuple[float, float, float]],
    *,
    timestamps: bool,
    begin: int,
    special: frozenset[int] | set[int],
    languages: Mapping[int, str],
    precision: float,
    decode: Callable[[list[int]], str],
) -> Merged:
    """The transcript of one input from the new tokens of its chunks (without prompt and eos),
    by the rules of transformers' ``_decode_asr``:

    - special tokens are dropped; a language token other than the one before ends the current
      piece (without timestamps);
    - text tokens gather into pieces that a pair of timestamps (start, end) closes; timestamps
      are shifted by the chunk's place in the input;
    - a timestamp in the left stride of a chunk after text, and the timestamps in its right
      stride (the last one and those after the right stride's start), open or close nothing;
    - the text tokens of the chunks of one piece are merged with :func:`overlap_merge`.

    Args:
        rows: the new tokens of each chunk, in order.
        strides: ``(length, left, right)`` of each chunk in seconds; ``(0, 0, 0)`` for an input
            decoded in one pass (the pipeline without chunking).
        timestamps: whether the tokens were decoded with timestamps (return_timestamps).
        begin: the id of the first timestamp token.
        special: the special token ids (transformers' ``all_special_ids``), timestamps excluded.
        languages: the language tokens of the model, id to code.
        precision: seconds per timestamp step.
        decode: the text of a list of token ids.
    """
    pieces: list[tuple[list[float | None], list[Token]]] = []
    span: list[float | None] = [None, None]
    pending: list[list[Token]] = []  # the tokens of the current piece, per chunk
    language = None
    offset = 0.0
    skip = False

    def close() -> None:
        pieces.append((span, overlap_merge(pending)))

    for index, (tokens, (length, left, right)) in enumerate(zip(rows, strides, strict=True)):
        tokens = [int(t) for t in tokens]
        offset -= left
        right_start = length - right
        first = left / precision + begin if left else begin
        last = None
        if right:
            for token in reversed(tokens):
                if token >= begin:
                    if last is not None and (token - begin) * precision < right_start:
                        break
                    last = token
        top = before_top = gone = 0.0  # a new decoding pass inside the chunk restarts its times
        current: list[Token] = []
        for i, token in enumerate(tokens):
            if token in special:
                code = languages.get(token)
                if code is None:
                    continue
                if language and code != language and not timestamps:
                    pending.append(current)
                    close()
                    pending, current, span = [], [], [None, None]
                language = code
            elif token >= begin:
                time = float((token - begin) * precision)
                if time < top:
                    lone = i >= 2 and not (tokens[i - 1] >= begin and tokens[i - 2] >= begin)
                    if lone:  # a pass that ended on a lone timestamp
                        gone += precision * SEGMENT_SIZE
                    else:
                        top = before_top
                        gone += before_top
                before_top, top = top, time
                at = round((token - begin) * precision + offset + gone, 2)
                if last and token >= last:
                    skip = True  # in the right stride: the next chunk places it
                elif skip or (pending and token < first):
                    skip = False
                elif span[0] is None:
                    span[0] = at
                elif at != span[0]:  # a repeated start timestamp stays the start
                    span[1] = at
                    pending.append(current)
                    close()
                    pending, current, span = [], [], [None, None]
            else:
                current.append((token, index, i))
        offset += length - right
        if current:
            pending.append(current)
        elif not any(pending):
            pending, span = [], [None, None]
    if pending:
        close()
    chunks = [
        {"timestamp": (a, b), "text": decode([t[0] for t in tokens])} for (a, b), tokens in pieces
    ]
    return Merged(
        text="".join(c["text"] for c in chunks),
        tokens=[t for _, tokens in pieces for t in tokens],
        chunks=chunks,
    )


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of the batch: a whole input, or one chunk of it.

    Attributes:
        input: the index of its input in the call.
        samples: its samples.
        stride: ``(length, left, right)`` in seconds for a chunk; None for a whole input decoded
            in one pass.
    """

    input: int
    samples: np.ndarray
    stride: tuple[float, float, float] | None = None


def rows(
    inputs: Sequence[np.ndarray],
    rate: int,
    window: int,
    chunk_length_s: float | None = None,
    stride_length_s: float | Sequence[float] | None = None,
) -> list[Row]:
    """The rows of a batch of inputs (mono samples at ``rate``), in order.

    An input longer than ``window`` samples (the extractor's 30 s) is cut into chunks of
    ``chunk_length_s`` (None: the window), as the pipeline's ``chunk_length_s``; with
    ``chunk_length_s`` given, every input is. The others are one row each.

    Raises:
        ValueError: bad chunk or stride lengths (see :func:`lengths`), or an input longer than the
            window with ``chunk_length_s=0`` (sequential long-form decoding is not supported).
    """
    chunked = chunk_length_s is not None
    if chunked and not isinstance(chunk_length_s, bool) and chunk_length_s == 0:
        chunked, chunk_length_s = False, None
        for samples in inputs:
            if len(samples) > window:
                raise ValueError(
                    f"an input of {len(samples) / rate:g} s is longer than the "
                    f"{window / rate:g} s window and chunk_length_s=0: sequential long-form "
                    "decoding is not supported; give chunk_length_s > 0"
                )
    sizes = None
    if chunked or any(len(s) > window for s in inputs):
        length = window / rate if chunk_length_s is None else chunk_length_s
        sizes = lengths(length, stride_length_s, rate, window)
    out = []
    for index, samples in enumerate(inputs):
        if sizes is None or not (chunked or len(samples) > window):
            out.append(Row(index, samples))
            continue
        for piece in split(samples, *sizes):
            seconds = tuple(n / rate for n in piece.stride)
            out.append(Row(index, piece.samples, seconds))  # type: ignore[arg-type]
    return out
