"""Stop strings: whether a row's tokens now end in one of them, as transformers 4.57
``StopStringCriteria`` decides it.

transformers does not decode the row's text: it joins the text of each token (the piece
``convert_tokens_to_string`` gives it after a fixed prefix, so a lone byte of a multi-byte
character is U+FFFD) over the row's last ``max(len(s))`` tokens, prompt included, and stops when
a stop string occurs in that text ending inside the last token (the last token may run past the
string's end, the first one may start before its start). A token id the tokenizer does not know
matches nothing, and no string matches across it.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import GenerationError

PREFIX = "abcdef"  # the text put before each token to read its text (transformers' static_prefix)


def token_texts(backend) -> tuple[str | None, ...]:
    """The text of each token id of a ``tokenizers.Tokenizer`` as ``StopStringCriteria`` reads
    it (None for ids missing from the vocabulary).

    Raises:
        ValueError: the decoder loses the prefix text, so the tokens' texts cannot be read.
    """
    base = [backend.id_to_token(i) for i in backend.encode(PREFIX, add_special_tokens=False).ids]
    vocab = backend.get_vocab(with_added_tokens=True)
    decoder = backend.decoder
    texts: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
    for token, index in vocab.items():
        pieces = [*base, token]
        text = decoder.decode(pieces) if decoder is not None else " ".join(pieces)
        start = text.find(PREFIX)
        if start < 0:
            raise GenerationError(
                f"the tokenizer's decoder drops the text {PREFIX!r} before {token!r}"
            )
        texts[index] = text[start + len(PREFIX) :]
    return tuple(texts)


def _can_end(text: str, string: str) -> bool:
    """Whether ``string`` can end inside a token of ``text``: it is in it, or a prefix of it
    ends ``string``."""
    return string in text or any(
        string.endswith(text[:m]) for m in range(1, min(len(text), len(string)) + 1)
    )


class StopStrings:
    """The stop strings of a generation, with the text of each token.

    Attributes:
        strings: the stop strings.
        window: how many of a row's last tokens are read (the longest string's length).
    """

    def __init__(self, strings: Sequence[str], texts: Sequence[str | None]):
        """Raises ValueError when no token can end any of ``strings`` (transformers refuses
        them too)."""
        self.strings = tuple(strings)
        self._texts = tuple(texts)
        self.window = max(len(s) for s in self.strings)
        if not any(t and _can_end(t, s) for s in self.strings for t in self._texts):
            raise GenerationError(
                f"no token of the vocabulary can end any of the stop strings {list(self.strings)}"
            )

    def hit(self, tokens: Sequence[int]) -> bool:
        """Whether ``tokens`` (a row's prompt and new tokens) end in a stop string."""
        pieces: list[str] = []
        for token in reversed(tokens[-self.window :]):
            text = self._texts[token] if 0 <= token < len(self._texts) else None
            if text is None:
                break
            pieces.append(text)
        if not pieces or len(pieces[0]) == 0:
            return False
        last = pieces[0]
        text = "".join(reversed(pieces))
        start = len(text) - len(last)  # where the last token's text starts
        return any(text.find(s, max(0, start + 1 - len(s))) >= 0 for s in self.strings)
