"""Incremental detokenization: turn generated ids into text pieces as they arrive.

`TextStream` decodes a sliding window of ids (a prefix offset and a read offset, as
text-generation-inference does), so each `push` costs time in the window's length, not in the
length of the whole text:

* `prefix` = decode(ids[prefix_offset:read_offset]), `text` = decode(ids[prefix_offset:]);
* when `text` extends `prefix` and does not end with U+FFFD (an incomplete multi-byte
  character), the piece `text[len(prefix):]` is emitted and the window moves on;
  otherwise the ids are held back until more arrive.

The prefix window is there because decoders such as Metaspace or `Strip` drop the leading space
of the first token they see: decoding the previous tokens along with the new ones keeps that
space. With `skip_special_tokens`, special ids are dropped before windowing, so a window never
starts with an id that decodes to nothing.

With `clean_up_tokenization_spaces` (transformers' removal of the space before ".", ",", "'s",
...), the pieces are held back up to the last space that is safe to cut at: a space that follows
a character other than a space or "'". Cleaning the text piece by piece at such cuts gives the
same text as cleaning it whole.

`finish()` decodes all the ids at once and returns the rest of that text, so that the pieces
plus `finish()` equal `tokenizer.decode(ids, skip_special_tokens)`. If the emitted text is not a
prefix of the full decode (a decoder whose output for earlier ids depends on later ones), that
cannot be undone: `finish()` then returns the held-back text of the window and sets `exact` to
False.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

__all__ = ["TextStream"]

_INCOMPLETE = "\ufffd"


def _safe_cut(text: str) -> int:
    """The end of the longest prefix of `text` that can be cleaned up on its own."""
    end = len(text)
    while True:
        end = text.rfind(" ", 1, end)
        if end <= 0:
            return 0
        if text[end - 1] not in " '":
            return end


class TextStream:
    """Turns token ids, pushed as they are generated, into text pieces.

    Attributes:
        skip_special_tokens: whether special tokens are left out of the text.
        exact: False when `finish()` could not make the pieces equal the full decode.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        """Stream the ids decoded by `tokenizer`."""
        self._tokenizer = tokenizer
        self.skip_special_tokens = bool(skip_special_tokens)
        self._clean = tokenizer.clean_up_tokenization_spaces
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""
        self._pending = ""  # raw text held back for the clean-up
        self._pieces: list[str] = []
        self._finished = False
        self.exact = True

    @property
    def ids(self) -> list[int]:
        """The ids pushed so far (without the special ones when they are skipped)."""
        return list(self._ids)

    @property
    def text(self) -> str:
        """The text emitted so far."""
        return "".join(self._pieces)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def push(self, token_ids: Iterable[int] | int) -> str:
        """Add generated ids; return the text they complete (may be "").

        Raises:
            RuntimeError: the stream is finished.
        """
        if self._finished:
            raise RuntimeError(
                "this TextStream is finished; start a new one with tokenizer.streamer()"
            )
        if isinstance(token_ids, numbers.Integral):
            token_ids = [token_ids]
        new = [int(token) for token in token_ids]
        if self.skip_special_tokens:
            special = self._tokenizer.special_ids
            new = [token for token in new if token not in special]
        if not new:
            return ""
        self._ids.extend(new)
        text = self._decode(self._ids[self._prefix_offset :])
        prefix = self._prefix_text
        if len(text) <= len(prefix) or text.endswith(_INCOMPLETE) or not text.startswith(prefix):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return self._emit(text[len(prefix) :])

    def _emit(self, piece: str) -> str:
        if self._clean:
            self._pending += piece
            cut = _safe_cut(self._pending)
            piece = self._tokenizer.clean_up_tokenization(self._pending[:cut]) if cut else ""
            self._pending = self._pending[cut:]
        if piece:
            self._pieces.append(piece)
        return piece

    def finish(self) -> str:
        """Return the rest of the text; the stream takes no more ids.

        The pieces and this rest together equal `tokenizer.decode(all ids,
        skip_special_tokens)` whenever `exact` stays True.
        """
        if self._finished:
            return ""
        self._finished = True
        full = self._tokenizer.decode(self._ids, skip_special_tokens=self.skip_special_tokens)
        emitted = self.text
        if full.startswith(emitted):
            rest = full[len(emitted) :]
        else:
            self.exact = False
            text = self._decode(self._ids[self._prefix_offset :])
            rest = self._pending + text[len(self._prefix_text) :]
            if self._clean:
                rest = self._tokenizer.clean_up_tokenization(rest)
        self._pending = ""
        if rest:
            self._pieces.append(rest)
        return rest
