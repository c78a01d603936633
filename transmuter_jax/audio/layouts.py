"""How the encoder of a Whisper export feeds its decoder, in the three exporters' layouts.

The files are found by :func:`transmuter_jax.hub.files`; this module wires the two graphs:

- optimum (``encoder_model.onnx``, ``decoder_model_merged.onnx``) and transformers.js /
  onnx-community (the same under ``onnx/``, one file per dtype): the encoder takes
  ``input_features`` and returns ``last_hidden_state``, which the decoder takes as
  ``encoder_hidden_states``; the decoder's first step computes the cross-attention cache.
- onnxruntime-genai (``encoder.onnx``, ``decoder.onnx``, ``genai_config.json``): the encoder takes
  ``audio_features`` and returns ``hidden_states`` and the cross-attention cache
  (``present_key_cross_N``, ``present_value_cross_N``), which the decoder takes at every step as
  ``past_key_cross_N``, ``past_value_cross_N``.

Outputs that nothing reads (the attention weights that transformers.js exports of Whisper return
for word timestamps) are pruned from the graphs, so they are not computed.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..generation.cache import layout, present_name
from ..onnx.model import Model, load
from ..tasks.runner import output_names

HIDDEN = ("last_hidden_state", "hidden_states")  # the encoder's hidden states (optimum, genai)
BATCHES = (4, 2, 1)
"""The inputs of one encoder call. Four at once run about 10% faster than one by one (tiny.en,
2 cores, AVX-512); each row's output is the one it gets alone (bit for bit on that machine;
within 1e-6 wherever tests/test_speech_to_text.py runs)."""


class Encoder:
    """A Whisper encoder and the decoder inputs it gives, from :func:`encoder`.

    Attributes:
        model: the encoder graph, pruned to the outputs the decoder takes.
        features: its input of log-mel features (input_features, or genai's audio_features).
        given: decoder input name -> the encoder output that gives it.
    """

    def __init__(self, model: Model, features: str, given: Mapping[str, str]):
        self.model, self.features, self.given = model, features, dict(given)

    def __call__(self, features: np.ndarray) -> dict[str, np.ndarray]:
        """The decoder's given inputs (one row per input) for ``features`` [B, bins, frames],
        encoded in calls of :data:`BATCHES` inputs, the largest that fits first (three compiled
        shapes at most)."""
        calls, start = [], 0
        while start < len(features):
            size = next(b for b in BATCHES if b <= len(features) - start)
            calls.append(self.model({self.features: features[start : start + size]}))
            start += size
        return {
            name: np.concatenate([np.asarray(out[output]) for out in calls])
            for name, output in self.given.items()
        }


def encoder(path: str, decoder: Model, config: Mapping) -> Encoder:
    """The encoder at ``path`` wired to ``decoder``: it gives encoder_hidden_states when the
    decoder takes them, and the cross-attention cache when the decoder takes it from the caller
    (:attr:`transmuter_jax.generation.CacheLayout.given`).

    Raises:
        ValueError: the encoder lacks an output the decoder needs, or takes other inputs than
            the features, or the decoder takes nothing from it.
    """
    outputs = output_names(path)
    names = {i.name for i in decoder.inputs}
    given: dict[str, str] = {}
    if "encoder_hidden_states" in names:
        hidden = next((n for n in HIDDEN if n in outputs), outputs[0])
        given["encoder_hidden_states"] = hidden
    for name in layout(decoder, dict(config)).given:
        want = present_name(name)
        if want not in outputs:
            raise ValueError(
                f"the decoder {decoder.path!r} takes the cross-attention cache {name!r}, which "
                f"the encoder {path!r} does not return (no output {want!r}; it has {outputs})"
            )
        given[name] = want
    if not given:
        raise ValueError(
            f"the decoder {decoder.path!r} takes neither encoder_hidden_states nor a "
            "cross-attention cache from the encoder: it is not a Whisper decoder"
        )
    model = load(path, outputs=sorted(set(given.values())))
    if len(model.inputs) != 1:
        raise ValueError(
            f"the encoder {path!r} takes {[i.name for i in model.inputs]}; a Whisper encoder "
            "takes one input, the log-mel features"
        )
    return Encoder(model, model.inputs[0].name, given)
