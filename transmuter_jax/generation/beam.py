"""Host-side beam search bookkeeping, as transformers 4.57 ``_beam_search`` does it.

The compiled selection gives, for each prompt, the best ``max(2, 1 + eos tokens) * num_beams``
candidates (token, source beam, accumulated score, token log-probability). Here each prompt keeps
its running beams and its finished hypotheses, and decides when it stops.
Scores are float32 as in transformers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

MASKED = np.float32(-1.0e9)  # transformers' penalty for candidates that cannot be chosen


def _top(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest values, largest first (ties: lower index first)."""
    return np.argsort(-values, kind="stable")[:k]


@dataclasses.dataclass
class Hypothesis:
    score: np.float32
    tokens: list[int]
    logprobs: list[float]
    finished: bool


@dataclasses.dataclass
class BeamPrompt:
    """The beams of one prompt."""

    prompt: int  # decoder prompt length
    max_length: int  # prompt + max_new_tokens
    beams: int
    length_penalty: float
    early_stopping: bool | str
    eos: tuple[int, ...]
    stop: Callable[[list[int]], bool] | None = None  # whether new tokens end in a stop string
    tokens: list[list[int]] = dataclasses.field(default_factory=list)  # running beams
    logprobs: list[list[float]] = dataclasses.field(default_factory=list)
    scores: np.ndarray = None  # [beams] float32 running scores
    hypotheses: list[Hypothesis] = dataclasses.field(default_factory=list)
    unsatisfied: bool = True  # improvement still possible
    done: bool = False

    def __post_init__(self):
        self.tokens = [[] for _ in range(self.beams)]
        self.logprobs = [[] for _ in range(self.beams)]
        self.scores = np.full(self.beams, MASKED, np.float32)
        self.scores[0] = 0.0  # all beams start equal: only the first counts
        self.hypotheses = [Hypothesis(MASKED, [], [], False) for _ in range(self.beams)]

    def step(self, tokens, sources, scores, logprobs) -> np.ndarray:
        """Takes the step's candidates (best first); returns each new beam's source beam."""
        k = self.beams
        cur = self.prompt + len(self.tokens[0])
        ends = np.array(
            [t in self.eos or cur + 1 >= self.max_length for t in tokens.tolist()], bool
        )
        if self.stop is not None:  # transformers: a stop string ends a candidate as eos does
            for j, t in enumerate(tokens.tolist()):
                ends[j] |= self.stop(self.tokens[sources[j]] + [t])
        scores = scores.astype(np.float32)
        # The next running beams: the best candidates that do not end.
        running = _top(scores + ends.astype(np.float32) * MASKED, k)
        # Finished hypotheses: candidates among the first num_beams that end.
        just = ends & (np.arange(len(tokens)) < k)
        length = np.float32((cur + 1 - self.prompt) ** self.length_penalty)
        final = scores / length
        full = all(h.finished for h in self.hypotheses) and self.early_stopping is True
        final = final + np.float32(full) * MASKED
        final = final + np.float32(not self.unsatisfied) * MASKED
        final = final + (~just).astype(np.float32) * MASKED
        merged = np.concatenate([np.array([h.score for h in self.hypotheses], np.float32), final])
        pool = list(self.hypotheses) + [
            Hypothesis(
                final[j],
                self.tokens[sources[j]] + [int(tokens[j])],
                self.logprobs[sources[j]] + [float(logprobs[j])],
                bool(just[j]),
            )
            for j in range(len(tokens))
        ]
        self.hypotheses = [pool[i] for i in _top(merged, k)]
        self.tokens = [self.tokens[sources[j]] + [int(tokens[j])] for j in running]
        self.logprobs = [self.logprobs[sources[j]] + [float(logprobs[j])] for j in running]
        self.scores = (scores + ends.astype(np.float32) * MASKED)[running]
        self._check_stop(cur + 1, ends)
        return np.asarray(sources)[running]

    def _check_stop(self, cur: int, ends: np.ndarray) -> None:
        if self.early_stopping == "never" and self.length_penalty > 0:
            best = self.max_length - self.prompt
        else:
            best = cur - self.prompt
        possible = self.scores[0] / np.float32(best**self.length_penalty)
        worst = min(h.score for h in self.hypotheses)
        bars = [worst if h.finished else MASKED for h in self.hypotheses]
        self.unsatisfied = self.unsatisfied and any(possible > b for b in bars)
        all_finished = all(h.finished for h in self.hypotheses) and self.early_stopping is True
        self.done = not (self.unsatisfied and not all_finished and not ends.all())

    def result(self) -> tuple[list[int], list[float], float]:
        """The best hypothesis: new tokens without the eos, their log-probabilities, its score."""
        return self.results(1)[0]

    def results(self, n: int) -> list[tuple[list[int], list[float], float]]:
        """The ``n`` best hypotheses (``n`` <= beams), best first, as :meth:`result` gives one."""
        out = []
        for best in self.hypotheses[:n]:
            tokens, logprobs = list(best.tokens), list(best.logprobs)
            if tokens and tokens[-1] in self.eos:
                tokens = tokens[:-1]
            out.append((tokens, logprobs, float(best.score)))
        return out
