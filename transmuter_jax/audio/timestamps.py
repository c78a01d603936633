"""Whisper's timestamp rules (transformers' WhisperTimeStampLogitsProcessor) as a processor of
the task (the chunks of a transcript come from :func:`.chunks.merge`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..generation.processors import LOWEST


def processor(config: Mapping[str, Any]) -> tuple[Callable, Callable]:
    """The ``(state, process)`` pair of the timestamp rules for generation_config.json ``config``.

    After the forced prompt (which ends before <|notimestamps|>), for each row:

    - <|notimestamps|> is removed;
    - the first token is a timestamp, at most ``max_initial_timestamp_index`` steps of 0.02 s;
    - timestamps come in pairs: after a pair the next token is text; after a lone timestamp it
      is a timestamp or a token from eos up (the text tokens below eos are removed);
    - timestamps never decrease, and after a pair they increase;
    - when the timestamps together are more likely than the most likely text token, the token
      is a timestamp.
    """
    no_stamps = int(config["no_timestamps_token_id"])
    begin = no_stamps + 1
    eos = config.get("eos_token_id")
    eos = config.get("bos_token_id") if eos is None else eos
    eos = int(eos[0] if isinstance(eos, list | tuple) else eos)
    initial = config.get("max_initial_timestamp_index")

    def state(row: Mapping[str, Any]) -> np.ndarray:
        """[4] int32: first step?, removed timestamps (1) or text (2) or nothing (0), and the
        first timestamp id that stays allowed."""
        seq = list(row["generated"])[::-1]  # oldest first
        last = len(seq) >= 1 and seq[-1] >= begin
        before = len(seq) < 2 or seq[-2] >= begin
        mode = (1 if before else 2) if last else 0
        stamps = [t for t in seq if t >= begin]
        low = begin
        if stamps:
            low = stamps[-1] if last and not before else stamps[-1] + 1
        return np.array([len(seq) == 0, mode, low, 0], np.int32)

    def process(scores: jax.Array, state: jax.Array) -> jax.Array:
        """[V] the scores of one row after the rules."""
        ids = jnp.arange(scores.shape[-1])
        stamp = ids >= begin
        scores = scores.at[no_stamps].set(LOWEST)
        scores = jnp.where((state[1] == 1) & stamp, LOWEST, scores)
        scores = jnp.where((state[1] == 2) & (ids < eos), LOWEST, scores)
        scores = jnp.where(stamp & (ids < state[2]), LOWEST, scores)
        first = state[0] == 1
        scores = jnp.where(first & ~stamp, LOWEST, scores)
        if initial is not None:
            scores = jnp.where(first & (ids > begin + int(initial)), LOWEST, scores)
        logprobs = jax.nn.log_softmax(jnp.where(scores <= LOWEST, -jnp.inf, scores))
        stamps = jax.nn.logsumexp(jnp.where(stamp, logprobs, -jnp.inf))
        text = jnp.max(jnp.where(stamp, -jnp.inf, logprobs))
        return jnp.where((stamps > text) & ~stamp, LOWEST, scores)

    return state, process


# ------------------------------------------------------------------ showing a transcript's times


def clock(seconds: float | None, comma: bool = False) -> str:
    """Seconds as HH:MM:SS.mmm (SubRip: HH:MM:SS,mmm)."""
    millis = round((seconds or 0.0) * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{',' if comma else '.'}{millis:03d}"


def spans(chunks: Sequence[Mapping[str, Any]], duration: float) -> list[tuple[float, float]]:
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


def subrip(chunks: Sequence[Mapping[str, Any]], duration: float) -> list[str]:
    """The SubRip cues of ``chunks`` (of audio ``duration`` seconds long), each ending with an
    empty line."""
    return [
        f"{cue}\n{clock(begin, True)} --> {clock(end, True)}\n{chunk['text'].strip()}\n"
        for cue, (chunk, (begin, end)) in enumerate(
            zip(chunks, spans(chunks, duration), strict=True), 1
        )
    ]


def timed_lines(chunks: Sequence[Mapping[str, Any]], duration: float) -> list[str]:
    """``[start - end] text`` for each chunk."""
    return [
        f"[{clock(begin)} - {clock(end)}] {chunk['text'].strip()}"
        for chunk, (begin, end) in zip(chunks, spans(chunks, duration), strict=True)
    ]
