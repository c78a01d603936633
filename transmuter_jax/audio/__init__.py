"""Audio tasks: speech to text with Whisper (audio loading, log-mel features, the pipeline).

See docs/speech.md.
"""

from .features import FeatureExtractor, mel_filters
from .load import Audio, AudioError, duration, load
from .speech_to_text import SpeechResult, SpeechToText, speech_to_text

__all__ = [
    "Audio",
    "AudioError",
    "FeatureExtractor",
    "SpeechResult",
    "SpeechToText",
    "duration",
    "load",
    "mel_filters",
    "speech_to_text",
]
