"""Translation of API requests into engine requests: ``Translator`` turns chat and speech bodies into an
``EngineJob`` (rendered prompt, modalities, per-stage sampling, voice, stops), validating everything that can be
checked before admission. Its entry points run in the preprocessing pool. Sampling fields become per-stage
parameters by ``stage_sampling``'s rule, shared with the realtime API."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from omnistage.core.sampling_params import SamplingParams
from omnistage.entrypoints import audio_format
from omnistage.entrypoints.body import validate
from omnistage.entrypoints.errors import APIError, unsupported
from omnistage.entrypoints.limits import ServerLimits
from omnistage.entrypoints.media_input import PART_KINDS, MediaBudget, MediaBytes, MediaReader, MediaRejection
from omnistage.entrypoints.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    SpeechRequest,
    StageSamplingParams,
)
from omnistage.entrypoints.stage_sampling import SamplingFieldError, stage_params
from omnistage.entrypoints.voices import UnknownVoice, VoiceMap
from omnistage.models.family import PreparedPrompt
from omnistage.pipeline.client import EngineClient

_STAGE_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty", "seed", "max_tokens", "min_tokens")
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS = 1024
MAX_SPEECH_INPUT_CHARS = 4096  # OpenAI's limit


@dataclass
class EngineJob:
    prompt: PreparedPrompt
    modalities: tuple[str, ...]
    params: dict[str, SamplingParams]  # by stage name
    speaker: str | None
    stops: list[str] = field(default_factory=list)
    stop_token_ids: frozenset[int] = frozenset()

    @property
    def wants_audio(self) -> bool:
        return "audio" in self.modalities

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt.token_ids)


class Translator:
    """Turns API request bodies into engine inputs, validating everything that can be checked up front.
    Its entry points (``chat``, ``speech``) run in the preprocessing thread pool."""

    def __init__(self, omni: EngineClient, served_model_name: str, limits: ServerLimits, voices: VoiceMap) -> None:
        self.omni = omni
        self.info = omni.info
        self.voices = voices
        self.served_model_name = served_model_name
        self.max_prompt_chars = limits.prompt_chars(self.info.max_model_len)
        # Token ids a request may name (logit_bias): the text stage's logits, else the tokenizer's.
        self.vocab_size = self.info.vocab_size or len(omni.tokenizer)
        self.media = MediaReader(limits.media)
        self.input_kinds = frozenset(self.info.input_modalities) - {"text"}  # audio / image / video the model takes

    def check_model(self, model: str) -> None:
        if model != self.served_model_name:
            raise APIError(404, f"The model {model!r} does not exist; this server serves "
                                f"{self.served_model_name!r}", param="model", code="model_not_found")

    def voice(self, voice: str | None, param: str) -> str | None:
        if "audio" not in self.info.output_modalities or not self.info.voices:
            raise APIError(400, "this server has no audio stages; request modalities ['text'] only",
                           param="modalities")
        try:
            return self.voices.resolve(voice or self.info.default_voice or "")
        except UnknownVoice as exc:
            raise APIError(400, str(exc), param=param, code="invalid_voice") from None

    def prompt(self, messages: list[dict[str, Any]], param: str, **options: Any) -> PreparedPrompt:
        """Render and tokenize; ``options`` go to the model's media processing (``use_audio_in_video``)."""
        if not messages:
            raise APIError(400, "messages must not be empty", param=param)
        if len(messages) >= self.info.max_model_len:  # each message costs at least one token
            raise APIError(400, f"{len(messages)} messages cannot fit in this model's context of "
                                f"{self.info.max_model_len} tokens", param=param, code="context_length_exceeded")
        chars = sum(_text_chars(m["content"]) for m in messages)
        if chars > self.max_prompt_chars:  # before tokenizing: the tokenizer's work is bounded by this
            raise APIError(400, f"The prompt has {chars} characters; this server accepts at most "
                                f"{self.max_prompt_chars}", param=param, code="context_length_exceeded")
        try:
            prepared = self.omni.render_prompt(messages, **options)
        except ValueError as exc:
            part = _PROCESSOR_PART.search(str(exc))
            if part is not None:  # the model's processor refused a media part: name it as the API does
                where = f"messages.{part[1]}.content.{part[2]}"
                raise APIError(400, f"content part {where}{str(exc)[part.end():]}", param=where,
                               code="invalid_media") from exc
            limit = self.info.max_model_len - 1
            if "at most" in str(exc):
                raise APIError(400, f"This model's maximum context length is {limit} tokens; {exc}", param=param,
                               code="context_length_exceeded") from exc
            raise APIError(400, str(exc), param=param) from exc
        return prepared

    def check_context(self, num_prompt: int, max_tokens: int | None, param: str) -> None:
        limit = self.info.max_model_len
        if max_tokens is not None and num_prompt + max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{num_prompt + max_tokens} tokens ({num_prompt} in the messages, {max_tokens} in "
                                "the completion). Please reduce the length of the messages or completion.",
                           param=param, code="context_length_exceeded")

    def logit_bias(self, bias: dict[int, float] | None) -> dict[int, float] | None:
        if not bias:
            return None
        if len(bias) > MAX_LOGIT_BIAS:
            raise APIError(400, f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed",
                           param="logit_bias")
        for tok in bias:
            if tok >= self.vocab_size:
                raise APIError(400, f"Invalid key in 'logit_bias': {tok} is not a token id of this model "
                                    f"(0 <= id < {self.vocab_size})", param=f"logit_bias.{tok}")
        return bias

    def params(self, thinker: dict[str, Any], talker: StageSamplingParams | None) -> dict[str, SamplingParams]:
        overrides = {k: getattr(talker, k) for k in _STAGE_FIELDS} if talker is not None else {}
        try:
            return stage_params(self.info, thinker, overrides)
        except SamplingFieldError as exc:
            raise APIError(400, str(exc), param=exc.param) from exc

    def messages(self, messages: list[ChatMessage], budget: MediaBudget
                 ) -> tuple[list[dict[str, Any]], list[MediaBytes]]:
        """API messages -> the engine's chat messages, and their media parts read (checked, not decoded yet:
        ``decode_media`` puts the decoded parts in their place). A message without media keeps its text
        parts joined into one string."""
        out: list[dict[str, Any]] = []
        media: list[MediaBytes] = []
        for i, m in enumerate(messages):
            if m.tool_calls:
                raise unsupported(f"messages.{i}.tool_calls", "tool calls are not supported")
            if m.function_call is not None:
                raise unsupported(f"messages.{i}.function_call", "function calls are not supported")
            content: str | list[Any] = m.content or ""
            if isinstance(m.content, list):
                parts: list[Any] = []
                for j, part in enumerate(m.content):
                    parts.append(self.part(m.role, part, f"messages.{i}.content.{j}", budget))
                    if isinstance(parts[-1], MediaBytes):
                        media.append(parts[-1])
                if any(isinstance(p, MediaBytes) for p in parts):
                    content = parts
                else:
                    content = "".join(p["text"] for p in parts)
            out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
        return out, media

    def part(self, role: str, part: ContentPart, where: str, budget: MediaBudget) -> dict[str, str] | MediaBytes:
        if part.type == "text":
            if part.text is None:
                raise APIError(400, f"content part {where} of type 'text' needs a 'text' string", param=f"{where}.text")
            return {"type": "text", "text": part.text}
        kind = PART_KINDS.get(part.type)
        if kind is None:
            if part.type == "file":
                raise APIError(400, f"content part {where} has type 'file', which is not supported: send audio as "
                                    "'input_audio' or 'audio_url', images as 'image_url', video as 'video_url'",
                               param=where, code="unsupported_content")
            supported = ["text", *PART_KINDS] if self.input_kinds else ["text"]
            raise APIError(400, f"content part {where} has unknown type {part.type!r}; supported: "
                                f"{', '.join(map(repr, supported))}", param=f"{where}.type")
        if kind not in self.input_kinds:
            raise APIError(400, f"content part {where} has type {part.type!r}, but this model takes no {kind} input",
                           param=where, code="unsupported_content")
        if role != "user":
            raise APIError(400, f"content part {where}: media parts are accepted in user messages only, not in "
                                f"{role!r} messages", param=where, code="invalid_media")
        body = getattr(part, part.type)
        if body is None:
            raise APIError(400, f"content part {where} of type {part.type!r} needs a {part.type!r} object",
                           param=f"{where}.{part.type}")
        try:
            return self.media.read(budget, where, part.type, body)
        except MediaRejection as exc:
            raise APIError(400, str(exc), param=exc.where, code=exc.code) from None

    def decode_media(self, messages: list[dict[str, Any]], budget: MediaBudget, use_audio_in_video: bool,
                     fps: float | None) -> None:
        """Decode every media part (in prompt order) and put it in its place in ``messages``."""
        for m in messages:
            if isinstance(m["content"], list):
                for j, p in enumerate(m["content"]):
                    if isinstance(p, MediaBytes):
                        try:
                            m["content"][j] = self.media.decode(budget, p, use_audio_in_video, fps)
                        except MediaRejection as exc:
                            raise APIError(400, str(exc), param=exc.where, code=exc.code) from None

    def stops(self, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"stop holds {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed",
                           param="stop")
        for i, s in enumerate(stops):
            if len(s) > MAX_STOP_CHARS:
                raise APIError(400, f"stop strings hold at most {MAX_STOP_CHARS} characters; this one has {len(s)}",
                               param="stop" if isinstance(stop, str) else f"stop.{i}")
        return stops

    @staticmethod
    def check_unsupported(req: ChatCompletionRequest) -> None:
        if req.n not in (None, 1):
            raise APIError(400, "only n=1 is supported", param="n")
        if req.logprobs:
            raise unsupported("logprobs", "logprobs are not supported yet")
        if req.top_logprobs:
            raise unsupported("top_logprobs", "top_logprobs are not supported yet")
        for name in ("tools", "functions"):
            if getattr(req, name):
                raise unsupported(name, f"{name} are not supported: this server does not call tools")
        for name in ("tool_choice", "function_call"):
            if getattr(req, name) not in (None, "none"):
                raise unsupported(name, f"{name} is not supported: this server does not call tools")
        if req.response_format is not None and req.response_format.type != "text":
            raise unsupported("response_format", f"response_format {req.response_format.type!r} is not "
                                                  "supported; only 'text'")
        if req.web_search_options is not None:
            raise unsupported("web_search_options", "web search is not supported")

    def chat(self, body: bytes | bytearray) -> tuple[ChatCompletionRequest, EngineJob, str]:
        req = validate(ChatCompletionRequest, body)
        self.check_model(req.model)
        self.check_unsupported(req)
        modalities = tuple(req.modalities or ("text",))
        if sorted(modalities) not in (["text"], ["audio", "text"]):
            raise APIError(400, f"modalities must be ['text'] or ['text', 'audio'], got {list(modalities)}",
                           param="modalities")
        fmt = "wav"
        speaker = None
        if "audio" in modalities:
            audio = req.audio
            speaker = self.voice(audio.voice if audio else None, "audio.voice")
            try:
                fmt = audio_format.normalize_format(audio.format if audio else "wav")
            except ValueError as exc:
                raise APIError(400, str(exc), param="audio.format") from exc
        budget = self.media.budget()
        messages, media = self.messages(req.messages, budget)
        stops = self.stops(req.stop)
        mm = req.mm_processor_kwargs
        if mm is not None and not self.input_kinds:
            raise APIError(400, "mm_processor_kwargs is not supported: this model takes no media input",
                           param="mm_processor_kwargs", code="unsupported_parameter")
        if req.max_completion_tokens is not None:
            max_tokens, max_param = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, max_param = req.max_tokens, "max_tokens"
        stop_ids = self.single_token_stops(stops)
        thinker = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                   "repetition_penalty": req.repetition_penalty, "frequency_penalty": req.frequency_penalty,
                   "presence_penalty": req.presence_penalty, "logit_bias": self.logit_bias(req.logit_bias),
                   "seed": req.seed, "max_tokens": max_tokens, "min_tokens": req.min_tokens,
                   "ignore_eos": req.ignore_eos or None}
        if stop_ids:
            thinker["stop_token_ids"] = tuple(sorted(stop_ids))
        params = self.params(thinker, req.talker)
        # Everything cheap has passed: now the media are decoded, then the prompt rendered.
        options = {}
        if media:
            uav = mm is not None and mm.use_audio_in_video
            self.decode_media(messages, budget, uav, mm.fps if mm is not None else None)
            if uav:
                options["use_audio_in_video"] = True
        prompt = self.prompt(messages, "messages", **options)
        self.check_context(len(prompt.token_ids), max_tokens, max_param)
        job = EngineJob(prompt, ("text", "audio") if "audio" in modalities else ("text",), params, speaker,
                   stops, frozenset(stop_ids))
        return req, job, fmt

    def single_token_stops(self, stops: list[str]) -> set[int]:
        out = set()
        for s in stops:
            ids = self.omni.tokenizer.encode(s, add_special_tokens=False)
            if len(ids) == 1:
                out.add(int(ids[0]))
        return out

    def speech(self, body: bytes | bytearray) -> tuple[SpeechRequest, EngineJob, str]:
        req = validate(SpeechRequest, body)
        self.check_model(req.model)
        if req.speed != 1.0:
            raise APIError(400, "speed is not supported (only 1.0): the model cannot change its speaking rate",
                           param="speed", code="unsupported_parameter")
        if req.instructions:
            raise unsupported("instructions", "instructions are not supported: the model speaks its own answer")
        if not req.input.strip():
            raise APIError(400, "input must not be empty", param="input")
        if len(req.input) > MAX_SPEECH_INPUT_CHARS:
            raise APIError(400, f"input has {len(req.input)} characters; at most {MAX_SPEECH_INPUT_CHARS} are "
                                "allowed", param="input", code="context_length_exceeded")
        try:
            fmt = audio_format.normalize_format(req.response_format)
        except ValueError as exc:
            raise APIError(400, str(exc), param="response_format") from exc
        if req.stream_format == "sse" and fmt != "pcm16":
            raise APIError(400, "stream_format 'sse' sends pcm chunks; use response_format 'pcm'",
                           param="response_format")
        speaker = self.voice(req.voice, "voice")
        prompt = self.prompt([{"role": "user", "content": req.input}], "input")
        self.check_context(len(prompt.token_ids), req.max_tokens, "max_tokens")
        thinker = {"temperature": req.temperature, "seed": req.seed, "max_tokens": req.max_tokens}
        params = self.params(thinker, req.talker)
        return req, EngineJob(prompt, ("text", "audio"), params, speaker), fmt


# Where the model's processor names a part ("messages[1].content[2]: ..."): the same indices as the API's.
_PROCESSOR_PART = re.compile(r"messages\[(\d+)\]\.content\[(\d+)\]")


def _text_chars(content: str | list[Any]) -> int:
    if isinstance(content, str):
        return len(content)
    return sum(len(p["text"]) for p in content if isinstance(p, dict) and p.get("type") == "text")
