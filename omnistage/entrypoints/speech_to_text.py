"""Speech to text by the served model itself, shared by ``POST /v1/audio/transcriptions`` and realtime input
transcription (``session.audio.input.transcription``).

There is no separate ASR model: the Thinker hears the audio as a user turn followed by a transcription
instruction (``instruction``: Qwen-Omni's ASR prompt, with the language and the client's ``prompt`` as hints)
and writes the transcript as text. It is a text-only request (no Talker, no vocoder), batched by the engine with
every other request. Greedy unless the client sets a temperature (OpenAI's default for transcriptions is 0).

Model names: OpenAI's transcription models (``TRANSCRIBE_MODELS``: ``whisper-1``, ``gpt-4o-transcribe``,
``gpt-4o-mini-transcribe``, ...) and the served model's own name all mean "the served model" (clients
hard-code them). ``gpt-4o-transcribe-diarize`` is refused: speaker labels are not produced.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from omnistage.core.sampling_params import SamplingParams
from omnistage.entrypoints.stage_sampling import SamplingFieldError, stage_params
from omnistage.pipeline.client import ModelInfo

TRANSCRIBE_MODELS = ("whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe", "gpt-4o-mini-transcribe-2025-12-15",
                     "gpt-transcribe", "gpt-live-transcribe", "gpt-realtime-whisper")
DIARIZE_MODEL = "gpt-4o-transcribe-diarize"
INSTRUCTION = "Transcribe the audio into text."
MAX_PROMPT_CHARS = 1024  # the client's hint (OpenAI's whisper-1 reads 224 tokens of it)
DEFAULT_MAX_TOKENS = 448  # a transcript's length limit (Whisper's decoder length: ~30 s of fast speech)
# ISO-639-1 codes named in the instruction (the languages Qwen3-Omni hears); other valid codes are named as given.
LANGUAGES = {"en": "English", "zh": "Chinese", "yue": "Cantonese", "ja": "Japanese", "ko": "Korean", "de": "German",
             "fr": "French", "es": "Spanish", "it": "Italian", "pt": "Portuguese", "ru": "Russian", "ar": "Arabic",
             "id": "Indonesian", "th": "Thai", "vi": "Vietnamese", "tr": "Turkish", "hi": "Hindi", "ms": "Malay",
             "nl": "Dutch", "ur": "Urdu"}
_LANGUAGE_CODE = re.compile(r"[a-z]{2,3}")


class TranscriptionFieldError(ValueError):
    """A transcription field the request cannot have; ``param`` names it (relative: ``model``, ``language``)."""

    def __init__(self, message: str, param: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code


def check_model(model: str, served: str) -> None:
    """``model`` means the served model (see the module docstring), or it is refused."""
    if model == DIARIZE_MODEL:
        raise TranscriptionFieldError(f"{DIARIZE_MODEL!r} is not supported: this server gives no speaker labels; use "
                                      f"one of {[served, *TRANSCRIBE_MODELS]}", "model")
    if model != served and model not in TRANSCRIBE_MODELS:
        raise TranscriptionFieldError(f"The model {model!r} does not exist; this server transcribes with {served!r} "
                                      f"(also accepted as {', '.join(TRANSCRIBE_MODELS)})", "model",
                                      code="model_not_found")


def check_language(language: str | None) -> None:
    if language is not None and not _LANGUAGE_CODE.fullmatch(language):
        raise TranscriptionFieldError(f"language must be an ISO-639-1 code such as 'en', got {language[:20]!r}",
                                      "language")


def check_prompt(prompt: str | None) -> None:
    if prompt is not None and len(prompt) > MAX_PROMPT_CHARS:
        raise TranscriptionFieldError(f"prompt holds {len(prompt)} characters; at most {MAX_PROMPT_CHARS}", "prompt")


def instruction(language: str | None = None, prompt: str | None = None) -> str:
    """The text after the audio: the instruction, then the hints the client gave."""
    text = INSTRUCTION
    if language:
        text += f" The speech is in {LANGUAGES.get(language, language)}."
    if prompt:
        text += f" Context: {prompt}"
    return text


def messages(audio: np.ndarray, rate: int, language: str | None = None, prompt: str | None = None
             ) -> list[dict[str, Any]]:
    """The chat messages of a transcription: one user turn, the audio (float32 mono) then the instruction."""
    return [{"role": "user", "content": [{"type": "audio", "audio": (audio, rate)},
                                         {"type": "text", "text": instruction(language, prompt)}]}]


def sampling(info: ModelInfo, max_tokens: int, temperature: float | None = None) -> dict[str, SamplingParams]:
    """The Thinker's sampling for a transcription: greedy unless ``temperature`` is given, at most
    ``max_tokens``, the deployment's other defaults (stop tokens included)."""
    try:
        return stage_params(info, {"temperature": temperature or 0.0, "max_tokens": max_tokens, "min_tokens": 0}, {})
    except SamplingFieldError as exc:
        raise TranscriptionFieldError(str(exc), exc.param or "temperature") from exc


def audio_tokens(tokenizer: Any, token_ids: list[int]) -> int:
    """How many of a prompt's tokens are audio rows (the model's ``<|audio_pad|>`` placeholders; 0 if it has
    none)."""
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    pad = convert("<|audio_pad|>") if convert is not None else None
    if not isinstance(pad, int) or pad == getattr(tokenizer, "unk_token_id", None):
        return 0
    return sum(1 for t in token_ids if t == pad)
