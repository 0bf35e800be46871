"""``POST /v1/audio/transcriptions``: OpenAI's speech-to-text file endpoint, answered by the served model
(``speech_to_text``: the Thinker alone, batched with every other request).

The body is ``multipart/form-data`` (read within the body limit, parsed in the preprocessing pool): ``file``
(any audio format the chat API decodes, within the media limits: bytes and seconds), ``model`` (the served
model or one of OpenAI's transcription names), ``language`` (ISO-639-1), ``prompt`` (a hint), ``temperature``
([0, 1], default 0: greedy), ``response_format`` and ``stream``. Other fields are ignored, except those that
would ask for what is not produced: ``timestamp_granularities[]`` and ``include[]`` (logprobs) are 400s, as are
``response_format`` ``srt`` / ``vtt`` / ``diarized_json`` (they need timestamps or speakers). A missing or bad
field is a 400 naming it.

Answers: ``json`` -> ``{"text", "usage"}`` (token usage), ``text`` -> the transcript as ``text/plain``,
``verbose_json`` -> ``{"task", "language", "duration", "text", "usage"}`` (no ``segments``: segment timestamps
are not produced; ``language`` is the one given, else ``"unknown"``: the language is not detected). With
``stream=true`` the transcript streams as OpenAI's SSE events, ``transcript.text.delta`` then
``transcript.text.done`` (with usage); an engine failure after the stream started is an error event.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import create_form_parser

from omnistage.entrypoints import speech_to_text as stt
from omnistage.entrypoints.encoders import run_sse
from omnistage.entrypoints.errors import APIError, unsupported
from omnistage.entrypoints.media_input import MediaBytes, MediaRejection
from omnistage.entrypoints.request_run import RequestRun
from omnistage.entrypoints.translation import EngineJob, Translator
from omnistage.models.media import AUDIO_RATE

RESPONSE_FORMATS = ("json", "text", "verbose_json")
TIMED_FORMATS = ("srt", "vtt", "diarized_json")  # need segment timestamps or speakers
_BOOLS = {"true": True, "false": False}


@dataclass(frozen=True)
class TranscriptionRequest:
    model: str
    response_format: str = "json"
    stream: bool = False
    language: str | None = None
    seconds: float = 0.0  # of audio

    def __post_init__(self) -> None:
        if self.response_format not in RESPONSE_FORMATS:
            raise ValueError(f"response_format must be one of {RESPONSE_FORMATS}")


def _form(body: bytes | bytearray, content_type: str) -> tuple[dict[str, str], dict[str, bytes]]:
    """Fields and files of a multipart (or urlencoded) body, held in memory (the body is already bounded)."""
    fields: dict[str, str] = {}
    files: dict[str, bytes] = {}

    def on_field(f: Any) -> None:
        fields[f.field_name.decode("utf-8", "replace")] = (f.value or b"").decode("utf-8", "replace")

    def on_file(f: Any) -> None:
        f.file_object.seek(0)
        files[f.field_name.decode("utf-8", "replace")] = f.file_object.read()

    try:
        parser = create_form_parser({"Content-Type": content_type.encode("latin-1")}, on_field, on_file,
                                    config={"MAX_MEMORY_FILE_SIZE": len(body) + 1})
        parser.write(bytes(body))
        parser.finalize()
    except (FormParserError, ValueError, UnicodeEncodeError) as exc:
        raise APIError(400, f"the body is not valid multipart/form-data: {exc}", param="file") from None
    return fields, files


def transcription_job(tr: Translator, body: bytes | bytearray, content_type: str, max_tokens: int
                      ) -> tuple[TranscriptionRequest, EngineJob]:
    """The request's form -> the engine job (runs in the preprocessing pool); a 400 names the bad field."""
    if not content_type.lower().startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        raise APIError(400, "the body must be multipart/form-data with a 'file' and a 'model'", param="file")
    if "audio" not in tr.input_kinds:
        raise APIError(400, "this model does not take audio input", param="file")
    fields, files = _form(body, content_type)
    if "file" not in files:
        raise APIError(400, "a 'file' (the audio to transcribe) is required", param="file")
    if not fields.get("model"):
        raise APIError(400, "a 'model' is required", param="model")
    for name in ("timestamp_granularities[]", "timestamp_granularities", "include[]", "include"):
        if fields.get(name):
            raise unsupported(name.removesuffix("[]"), f"{name.removesuffix('[]')} is not supported: this server "
                                                       "produces no timestamps or logprobs")
    fmt = fields.get("response_format", "json")
    if fmt in TIMED_FORMATS:
        raise unsupported("response_format", f"response_format {fmt!r} needs segment timestamps or speakers, which "
                                             f"this server does not produce; use one of {list(RESPONSE_FORMATS)}")
    if fmt not in RESPONSE_FORMATS:
        raise APIError(400, f"response_format must be one of {list(RESPONSE_FORMATS)}, got {fmt[:40]!r}",
                       param="response_format")
    stream = _BOOLS.get(fields.get("stream", "false").lower())
    if stream is None:
        raise APIError(400, "stream must be true or false", param="stream")
    if fields.get("chunking_strategy", "auto") != "auto":
        raise unsupported("chunking_strategy", "chunking_strategy: only 'auto' (the whole file in one request)")
    temperature = _temperature(fields.get("temperature"))
    language, prompt = fields.get("language") or None, fields.get("prompt") or None
    try:
        stt.check_model(fields["model"], tr.served_model_name)
        stt.check_language(language)
        stt.check_prompt(prompt)
    except stt.TranscriptionFieldError as exc:
        raise APIError(404 if exc.code == "model_not_found" else 400, str(exc), param=exc.param,
                       code=exc.code) from None
    audio = _decode(tr, files["file"])
    prompt_ids = tr.prompt(stt.messages(audio, AUDIO_RATE, language, prompt), "file")
    room = tr.info.max_model_len - len(prompt_ids.token_ids)
    if room < 1:
        raise APIError(400, f"the audio fills this model's context of {tr.info.max_model_len} tokens", param="file",
                       code="context_length_exceeded")
    try:
        params = stt.sampling(tr.info, min(max_tokens, room), temperature)
    except stt.TranscriptionFieldError as exc:
        raise APIError(400, str(exc), param="temperature") from None
    req = TranscriptionRequest(fields["model"], fmt, stream, language, audio.shape[0] / AUDIO_RATE)
    return req, EngineJob(prompt_ids, ("text",), params, None)


def _temperature(value: str | None) -> float | None:
    if value is None or value == "":
        return None
    try:
        t = float(value)
    except ValueError:
        t = math.nan
    if not 0.0 <= t <= 1.0:
        raise APIError(400, f"temperature must be a number in [0, 1], got {value[:40]!r}", param="temperature")
    return t


def _decode(tr: Translator, data: bytes) -> Any:
    if not data:
        raise APIError(400, "the file is empty", param="file", code="invalid_media")
    budget = tr.media.budget()
    if len(data) > budget.bytes:
        raise APIError(400, f"the file has {len(data)} bytes; this server accepts at most {budget.bytes}",
                       param="file", code="media_limit_exceeded")
    try:
        return tr.media.decode(budget, MediaBytes("file", "audio", data), False, None)["audio"]
    except MediaRejection as exc:
        raise APIError(400, str(exc), param="file", code=exc.code) from None


def usage(run: RequestRun, audio_tokens: int) -> dict[str, Any]:
    n_in = run.job.num_prompt_tokens
    return {"type": "tokens", "input_tokens": n_in, "output_tokens": run.num_tokens,
            "total_tokens": n_in + run.num_tokens,
            "input_token_details": {"text_tokens": n_in - audio_tokens, "audio_tokens": audio_tokens}}


def transcription_body(req: TranscriptionRequest, text: str, usage: dict[str, Any]) -> dict[str, Any] | str:
    """The answer as ``response_format`` has it (a str for ``text``)."""
    if req.response_format == "text":
        return text
    if req.response_format == "verbose_json":
        language = stt.LANGUAGES.get(req.language, req.language).lower() if req.language else "unknown"
        return {"task": "transcribe", "language": language, "duration": round(req.seconds, 3), "text": text,
                "usage": usage}
    return {"text": text, "usage": usage}


def transcription_sse(run: RequestRun, audio_tokens: int) -> AsyncIterator[str]:
    def event(kind: str, value: Any) -> dict[str, Any] | None:
        return {"type": "transcript.text.delta", "delta": value, "logprobs": None} if kind == "text" else None

    def done() -> dict[str, Any]:
        return {"type": "transcript.text.done", "text": run.text, "logprobs": None, "usage": usage(run, audio_tokens)}

    return run_sse(run, event, done)
