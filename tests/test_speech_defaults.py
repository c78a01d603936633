"""The generation defaults of transformers' ASR pipeline (transformers 4.57.6's
_default_generation_config and its max_length rule), which speech_to_text() starts from."""

from __future__ import annotations

from transmuter_jax.audio.defaults import pipeline_defaults


def test_five_beams_and_the_files_length():
    # Whisper's generation_config.json sets max_length 448: the pipeline drops its 256
    assert pipeline_defaults({"max_length": 448}, {}) == {"num_beams": 5}
    assert pipeline_defaults({}, {}) == {"num_beams": 5, "max_new_tokens": 256}
    assert pipeline_defaults({"max_length": 20}, {}) == {"num_beams": 5, "max_new_tokens": 256}


def test_the_callers_options_win():
    assert pipeline_defaults({}, {"num_beams": 1}) == {"max_new_tokens": 256}
    assert pipeline_defaults({}, {"max_length": 30}) == {"num_beams": 5}
    assert pipeline_defaults({}, {"max_new_tokens": 9, "num_beams": 2}) == {}


def test_the_models_num_beams_does_not_replace_the_pipelines():
    """transformers keeps the pipeline's num_beams (not the global default 1) over the model's."""
    assert pipeline_defaults({"num_beams": 2, "max_length": 64}, {}) == {"num_beams": 5}
