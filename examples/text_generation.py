"""Text generation with the default model: a chat answer, a streamed answer, a batch, sampling.

Usage: python examples/text_generation.py [MODEL]
(MODEL: a folder or hub id; default: SmolLM2-135M-Instruct, prepared on first use.)
"""

from __future__ import annotations

import sys

from transmuter_jax import text


def main(model: str | None) -> None:
    pipe = text.generation(model, max_new_tokens=48)
    # A string is a user message in the chat template when the model has one (chat=False: not).
    print(pipe("What is the capital of France?"))

    messages = [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ]
    for piece in pipe.stream(messages):
        print(piece, end="", flush=True)
    print()

    answers = pipe(["Name a fruit.", "Name a color.", "Name a planet."])
    for answer in answers:
        print("-", answer)

    result = pipe.generate(
        ["Write a haiku about the sea."], do_sample=True, temperature=0.8, seed=1,
        token_logprobs=True,
    )[0]  # fmt: skip
    print(result.text)
    mean = sum(result.logprobs) / max(len(result.logprobs), 1)
    print(f"{len(result.token_ids)} tokens, finish reason {result.finish_reason}, "
          f"mean log-probability {mean:.2f}")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
