"""Audio loading and Whisper log-mel features against transformers' WhisperFeatureExtractor
(references of tests/fixtures/make_speech.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile

from transmuter_jax.audio import AudioError, FeatureExtractor, load
from transmuter_jax.audio import features as features_module

FIXTURE = Path(__file__).parent / "fixtures" / "whisper-speech-optimum"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def ref():
    with np.load(FIXTURE / "speech.npz") as data:
        return dict(data)


@pytest.fixture(scope="module")
def extractor():
    return FeatureExtractor.from_folder(FIXTURE)


def test_config_is_read(extractor):
    config = json.loads((FIXTURE / "preprocessor_config.json").read_text())
    assert extractor.bins == config["feature_size"]
    assert (extractor.samples, extractor.frames) == (config["n_samples"], config["nb_max_frames"])


@pytest.mark.parametrize("clip", ["noise", "tone", "short", "chirp"])
def test_features_80_bins(ref, extractor, clip):
    want = ref[f"features/80/{clip}"]
    got = extractor([ref[f"clip/{clip}"]])[0]
    assert got.shape == want.shape == (80, 3000)
    np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0)


def test_features_128_bins(ref):
    want = ref["features/128/tone"]
    got = FeatureExtractor(bins=128)([ref["clip/tone"]])[0]
    assert got.shape == want.shape == (128, 3000)
    np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0)


def test_features_truncated_to_chunk(ref):
    """chunk_length=2: the 2.5 s clip is cut to 2 s (200 frames)."""
    want = ref["features/2s/chirp"]
    got = FeatureExtractor.from_config({"chunk_length": 2})([ref["clip/chirp"]])[0]
    assert got.shape == want.shape == (80, 200)
    np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0)


def test_features_of_a_batch_of_lengths(ref, extractor):
    names = json.loads((FIXTURE / "speech.json").read_text())["batch"]
    want = ref["features/80/batch"]
    got = extractor([ref[f"clip/{n}"] for n in names])
    assert got.shape == want.shape == (len(names), 80, 3000)
    np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0)


def test_stereo_44k_file_is_mixed_and_resampled(ref, extractor):
    samples = load(FIXTURE / "stereo-44k.wav", extractor.rate)
    assert samples.ndim == 1 and samples.dtype == np.float32
    assert len(samples) == round(0.6 * extractor.rate)
    got = extractor([samples])[0]
    np.testing.assert_allclose(got, ref["features/80/stereo-44k"], atol=TOLERANCE, rtol=0)


def test_bytes_and_path_and_array_agree(ref):
    path = FIXTURE / "stereo-44k.wav"
    from_path = load(str(path), 16000)
    np.testing.assert_array_equal(load(path.read_bytes(), 16000), from_path)
    stereo, rate = soundfile.read(path, dtype="float32")
    np.testing.assert_array_equal(load(stereo, 16000, sampling_rate=rate), from_path)
    # channels first, as librosa gives it
    np.testing.assert_array_equal(load(stereo.T.copy(), 16000, sampling_rate=rate), from_path)


def test_array_at_the_rate_is_unchanged(ref):
    clip = ref["clip/noise"]
    np.testing.assert_array_equal(load(clip, 16000, sampling_rate=16000), clip)
    assert load(clip.astype(np.float64), 16000, sampling_rate=16000).dtype == np.float32


@pytest.mark.parametrize(
    ("audio", "rate", "message"),
    [
        (np.zeros(0, np.float32), 16000, "empty"),
        (np.zeros(1600, np.float32), 16000, "silent"),
        (np.array([0.1, np.nan, 0.2], np.float32), 16000, "NaN"),
        (np.array([0.1, np.inf], np.float32), 16000, "infinite"),
        (np.ones(10, np.float32), None, "sampling_rate"),
        (np.ones(10, np.int16), 16000, "floats"),
        (b"not audio at all", None, "cannot read"),
        ("/no/such/file.wav", None, "no audio file"),
    ],
)
def test_bad_input_is_a_clear_error(audio, rate, message):
    with pytest.raises(AudioError, match=message):
        load(audio, 16000, sampling_rate=rate)
    assert issubclass(AudioError, ValueError)


def test_unreadable_file(tmp_path):
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF....WAVEfmt nonsense")
    with pytest.raises(AudioError, match="cannot read"):
        load(bad, 16000)


def test_file_rate_disagreeing_with_sampling_rate():
    with pytest.raises(AudioError, match="44100 Hz"):
        load(FIXTURE / "stereo-44k.wav", 16000, sampling_rate=16000)


def test_empty_file(tmp_path):
    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros(0, np.float32), 16000, format="WAV")
    with pytest.raises(AudioError, match="empty"):
        load(buffer.getvalue(), 16000)


def test_without_soundfile_the_error_says_how_to_install_it(monkeypatch):
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "soundfile", None)
    module = importlib.import_module("transmuter_jax.audio.load")
    with pytest.raises(ImportError, match=r"pip install 'transmuter_jax\[audio\]'"):
        module.load(b"RIFF", 16000)


def _every_frame(extractor: FeatureExtractor, samples: np.ndarray) -> np.ndarray:
    """log_mel's steps over every frame, the silent ones too."""
    half = extractor.n_fft // 2
    padded = np.pad(np.asarray(samples, np.float64), half, mode="reflect")
    count = 1 + (len(padded) - extractor.n_fft) // extractor.hop
    starts = np.arange(count)[:, None] * extractor.hop
    n = np.arange(extractor.n_fft)
    window = 0.5 - 0.5 * np.cos(2 * np.pi * n / extractor.n_fft)
    power = np.abs(np.fft.rfft(padded[starts + n] * window, axis=-1)) ** 2
    mel = features_module._product(power[:-1], extractor.filters)
    log = np.log10(np.maximum(mel, 1e-10))
    log = np.maximum(log, log.max() - 8.0)
    return ((log + 4.0) / 4.0).T.astype(np.float32)


@pytest.mark.parametrize("length", [1, 400, 12_345, 176_000, 479_999, 480_000])
@pytest.mark.parametrize("config", [{}, {"do_normalize": True}, {"padding_value": 0.25}])
def test_silent_frames_skipped_give_every_frame_s_bits(length, config):
    """The frames past a clip's last nonzero sample are not transformed: the features are bit
    for bit those of every frame transformed (a clip with silence inside it too)."""
    rng = np.random.default_rng(length)
    clip = (rng.standard_normal(length) * 0.1).astype(np.float32)
    clip[length // 3 : length // 2] = 0.0
    extractor = FeatureExtractor.from_config(config)
    fitted = extractor.fit(clip)
    np.testing.assert_array_equal(extractor.log_mel(fitted), _every_frame(extractor, fitted))
