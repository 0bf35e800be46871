"""A session's configuration (what ``session.update`` sets) and the server's limits for realtime sessions.

``session.update`` is applied field by field onto the current ``SessionConfig`` (absent fields keep their
value; ``turn_detection: null`` switches server VAD off), validated as a whole before anything changes, and
the full effective configuration is returned in ``session.updated`` (``SessionConfig.to_api``).

Input audio: ``audio.input.noise_reduction`` ``{"type": "near_field" | "far_field"}`` filters it before the
VAD and the model (``noise``); ``turn_detection`` is ``server_vad`` or ``semantic_vad`` (``eagerness``: the
end-of-turn rule of ``vad``); ``transcription`` (``model``, ``language``, ``prompt``) transcribes each committed
turn with the served model (``realtime.transcription``; OpenAI's transcription model names map to it,
diarization is refused). A value outside what a field takes is refused as OpenAI refuses it (``invalid_value``,
"Invalid value: ... Supported values are: ...", the field as ``param``) and the session goes on unchanged.
Fields this server does not implement at all (``prompt``, ``tracing``, ``idle_timeout_ms``, ...) are
``unsupported_parameter``.

``tool_choice``: "auto" (the model decides), "none" (no tools offered), "required" or a named function
(``{"type": "function", "name": ...}``): the answer is made to begin with the family's call prefix
(``ToolCallFormat.call_prefix``: Qwen's ``<tool_call>`` tag, for a named function up to its arguments), so it is
a call; its arguments are the model's (not constrained to the schema: an unparseable call comes back as text, as
under "auto"). Such a response is text only (a call is never spoken).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from omnistage.core.validation import check_positive_int
from omnistage.entrypoints import speech_to_text as stt
from omnistage.entrypoints.realtime.events import (
    MAX_TOKENS_INF,
    AudioFormat,
    FunctionToolParams,
    RealtimeError,
    ResponseParams,
    SamplingParamsExt,
    SessionParams,
    TranscriptionParams,
    TurnDetectionParams,
)
from omnistage.entrypoints.voices import UnknownVoice, VoiceMap
from omnistage.pipeline.client import ModelInfo

AUDIO_RATE = 24000  # pcm16 in and out, as the API requires
TRUNCATION_MODES = ("auto", "disabled")
TOOL_CHOICES = ("auto", "none", "required", "function")
THINKER_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty", "seed", "min_tokens", "ignore_eos")
TALKER_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty", "seed", "max_tokens", "min_tokens")
MAX_TOOLS = 128
MAX_TOOL_JSON_CHARS = 64_000  # all tool definitions together, as JSON


@dataclass(frozen=True)
class RealtimeLimits:
    """What one server allows realtime sessions. Audio limits are in seconds of 24 kHz pcm16."""

    max_sessions: int = 16
    max_buffered_audio_s: int = 60  # input audio buffer (one uncommitted turn)
    max_history_items: int = 200  # older items are dropped from the conversation
    max_history_audio_s: int = 120  # user audio kept in the conversation (re-heard every turn: ~13 tokens/s)
    max_event_bytes: int = 8 << 20  # one client event (an audio append of ~2.9 min of base64 pcm16)
    # A session that sends nothing for this long while no response runs is closed, so abandoned connections
    # (a closed laptop lid, a dead proxy) do not hold one of ``max_sessions`` forever.
    idle_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name != "idle_timeout_s":
                check_positive_int(getattr(self, f.name), f.name)
        if not (isinstance(self.idle_timeout_s, (int, float)) and self.idle_timeout_s > 0):
            raise ValueError(f"idle_timeout_s must be a positive number of seconds, got {self.idle_timeout_s!r}")


TURN_DETECTION_TYPES = ("server_vad", "semantic_vad")
NOISE_REDUCTION_TYPES = ("near_field", "far_field")  # ``noise.PROFILES``
EAGERNESS = ("low", "medium", "high", "auto")
# semantic_vad: the silence (ms) that ends a turn, by eagerness, after speech that (held) stops at full level or
# (trailing) trails off; "auto" is "medium", as OpenAI's. See ``vad``.
SEMANTIC_SILENCE_MS = {"low": (2000, 800), "medium": (1200, 400), "high": (600, 200)}


@dataclass(frozen=True)
class TurnDetection:
    """Turn detection settings: ``server_vad`` (the API's fields) or ``semantic_vad`` (``eagerness``; the
    energy VAD with the end-of-turn rule of ``vad``, its threshold and padding at their defaults).
    ``threshold`` in [0, 1] picks the WebRTC VAD's aggressiveness: [0, .25) -> 0, [.25, .5) -> 1,
    [.5, .75) -> 2, [.75, 1] -> 3 (higher = needs clearer speech)."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    type: str = "server_vad"
    eagerness: str = "auto"  # semantic_vad only

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")
        if self.prefix_padding_ms < 0 or self.silence_duration_ms < 20:
            raise ValueError("prefix_padding_ms must be >= 0 and silence_duration_ms >= 20")
        if self.type not in TURN_DETECTION_TYPES or self.eagerness not in EAGERNESS:
            raise ValueError(f"type must be one of {TURN_DETECTION_TYPES} and eagerness one of {EAGERNESS}")

    @property
    def aggressiveness(self) -> int:
        return min(3, int(self.threshold * 4))

    def silence_ms(self, trailing: bool) -> int:
        """The silence that ends a turn; ``trailing``: the speech before it trailed off."""
        if self.type == "server_vad":
            return self.silence_duration_ms
        held, trail = SEMANTIC_SILENCE_MS["medium" if self.eagerness == "auto" else self.eagerness]
        return trail if trailing else held

    def to_api(self) -> dict[str, Any]:
        if self.type == "semantic_vad":
            return {"type": "semantic_vad", "eagerness": self.eagerness, "create_response": self.create_response,
                    "interrupt_response": self.interrupt_response}
        return {"type": "server_vad", "threshold": self.threshold, "prefix_padding_ms": self.prefix_padding_ms,
                "silence_duration_ms": self.silence_duration_ms, "create_response": self.create_response,
                "interrupt_response": self.interrupt_response, "idle_timeout_ms": None}


@dataclass(frozen=True)
class Transcription:
    """Input audio transcription (``audio.input.transcription``): each committed user turn is transcribed by the
    served model (``entrypoints.speech_to_text``; ``model`` is the name the client gave, echoed)."""

    model: str
    language: str | None = None
    prompt: str | None = None

    def __post_init__(self) -> None:
        stt.check_language(self.language)
        stt.check_prompt(self.prompt)

    def to_api(self) -> dict[str, Any]:
        return {"model": self.model, "language": self.language, "prompt": self.prompt or ""}


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str = ""
    parameters: str = "{}"  # JSON Schema as JSON text (frozen)

    def to_api(self) -> dict[str, Any]:
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": json.loads(self.parameters)}


@dataclass(frozen=True)
class Sampling:
    """Extension: per-stage sampling overrides as (field, value) pairs."""

    thinker: tuple[tuple[str, Any], ...] = ()
    talker: tuple[tuple[str, Any], ...] = ()

    def to_api(self) -> dict[str, Any] | None:
        if not self.thinker and not self.talker:
            return None
        out: dict[str, Any] = dict(self.thinker)
        if self.talker:
            out["talker"] = dict(self.talker)
        return out


@dataclass(frozen=True)
class SessionConfig:
    instructions: str = ""
    voice: str | None = None
    output_modalities: tuple[str, ...] = ("audio",)
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    transcription: Transcription | None = None
    noise_reduction: str | None = None  # near_field | far_field (``noise``)
    tools: tuple[FunctionTool, ...] = ()
    tool_choice: str = "auto"  # auto | none | required | function (then ``tool_choice_name``)
    tool_choice_name: str | None = None
    max_output_tokens: int | None = None  # None: "inf" (the deployment's default for the Thinker)
    truncation: str = "auto"
    sampling: Sampling = field(default_factory=Sampling)

    def __post_init__(self) -> None:
        if self.output_modalities not in (("audio",), ("text",)):
            raise ValueError(f"output_modalities must be ['audio'] or ['text'], got {list(self.output_modalities)}")
        if self.tool_choice not in TOOL_CHOICES or (self.tool_choice == "function") != bool(self.tool_choice_name):
            raise ValueError(f"tool_choice must be one of {TOOL_CHOICES} (a name with 'function'), got "
                             f"{self.tool_choice!r}, {self.tool_choice_name!r}")
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(f"truncation must be one of {TRUNCATION_MODES}")
        if self.max_output_tokens is not None:
            check_positive_int(self.max_output_tokens, "max_output_tokens")

    @property
    def wants_audio(self) -> bool:
        return self.output_modalities == ("audio",)

    @property
    def active_tools(self) -> tuple[FunctionTool, ...]:
        return self.tools if self.tool_choice != "none" else ()

    @property
    def forces_call(self) -> bool:
        return self.tool_choice in ("required", "function")

    def tool_choice_api(self) -> str | dict[str, str]:
        if self.tool_choice == "function":
            return {"type": "function", "name": self.tool_choice_name}
        return self.tool_choice

    def to_api(self, session_id: str, model: str) -> dict[str, Any]:
        fmt = {"type": "audio/pcm", "rate": AUDIO_RATE}
        out = {
            "type": "realtime", "object": "realtime.session", "id": session_id, "model": model,
            "output_modalities": list(self.output_modalities), "instructions": self.instructions,
            "audio": {
                "input": {"format": fmt,
                          "noise_reduction": {"type": self.noise_reduction} if self.noise_reduction else None,
                          "transcription": self.transcription.to_api() if self.transcription else None,
                          "turn_detection": self.turn_detection.to_api() if self.turn_detection else None},
                "output": {"format": fmt, "voice": self.voice, "speed": 1.0},
            },
            "tools": [t.to_api() for t in self.tools], "tool_choice": self.tool_choice_api(),
            "max_output_tokens": self.max_output_tokens or MAX_TOKENS_INF, "truncation": self.truncation,
            "tracing": None, "prompt": None, "include": None, "expires_at": 0,
        }
        sampling = self.sampling.to_api()
        if sampling is not None:
            out["sampling"] = sampling
        return out


# ---- applying updates -------------------------------------------------------------------------------
def invalid_value(param: str, value: Any, supported: list[str], why: str = "") -> RealtimeError:
    """OpenAI's refusal of a value outside what a field takes (``invalid_value``, its wording), with the
    server's reason when the value is one OpenAI's server takes but this one does not."""
    shown = value if isinstance(value, str) else json.dumps(value)[:200]
    listed = supported[0] if len(supported) == 1 else ", ".join(supported[:-1]) + " and " + supported[-1]
    return RealtimeError(f"Invalid value: {shown!r}. Supported values are: {listed}." + (f" {why}" if why else ""),
                         param=param)


def _unsupported(param: str, message: str) -> RealtimeError:
    return RealtimeError(message, code="unsupported_parameter", param=param)


def check_format(fmt: AudioFormat | None, param: str) -> None:
    if fmt is None:
        return
    if fmt.type != "audio/pcm":
        raise _unsupported(f"{param}.type", f"audio format {fmt.type!r} is not supported; only 'audio/pcm' "
                                            f"(pcm16, {AUDIO_RATE} Hz, mono, little-endian)")
    if fmt.rate not in (None, AUDIO_RATE):
        raise _unsupported(f"{param}.rate", f"audio/pcm is {AUDIO_RATE} Hz; got rate {fmt.rate}")


def modalities(value: list[str], info: ModelInfo, param: str) -> tuple[str, ...]:
    mods = tuple(dict.fromkeys(value))
    if mods not in (("audio",), ("text",)):
        raise RealtimeError(f"output_modalities must be ['audio'] or ['text'] (audio comes with its transcript), "
                            f"got {value}", param=param)
    if mods == ("audio",) and "audio" not in info.output_modalities:
        raise RealtimeError("this server has no audio stages; use output_modalities ['text']", param=param,
                            code="unsupported_parameter")
    return mods


def voice(name: str, voices: VoiceMap, param: str) -> str:
    """The voice name as the client chose it (echoed), once it resolves to a model voice."""
    try:
        voices.resolve(name)
    except UnknownVoice as exc:
        raise RealtimeError(str(exc), param=param, code="invalid_voice") from None
    return name.lower()


def tools(value: list[FunctionToolParams], param: str) -> tuple[FunctionTool, ...]:
    if len(value) > MAX_TOOLS:
        raise RealtimeError(f"at most {MAX_TOOLS} tools are allowed, got {len(value)}", param=param)
    out, names = [], set()
    for i, t in enumerate(value):
        if t.type != "function":
            raise _unsupported(f"{param}.{i}.type", f"tool type {t.type!r} is not supported; only 'function'")
        if not t.name:
            raise RealtimeError("a function tool needs a name", param=f"{param}.{i}.name")
        if t.name in names:
            raise RealtimeError(f"tool name {t.name!r} is defined twice", param=f"{param}.{i}.name")
        names.add(t.name)
        out.append(FunctionTool(t.name, t.description or "", json.dumps(t.parameters or {}, ensure_ascii=False)))
    if sum(len(t.parameters) + len(t.description) + len(t.name) for t in out) > MAX_TOOL_JSON_CHARS:
        raise RealtimeError(f"tool definitions hold more than {MAX_TOOL_JSON_CHARS} characters", param=param)
    return tuple(out)


def tool_choice(value: str | dict[str, Any], param: str) -> dict[str, Any]:
    """``tool_choice`` as SessionConfig fields."""
    if isinstance(value, dict):
        if value.get("type") != "function":
            raise RealtimeError(f"tool_choice type {value.get('type')!r} is not supported; 'function' (or the "
                                "strings 'auto', 'none', 'required')", param=f"{param}.type")
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise RealtimeError("a function tool_choice needs the function's name", param=f"{param}.name")
        return {"tool_choice": "function", "tool_choice_name": name}
    if value in ("auto", "none", "required"):
        return {"tool_choice": value, "tool_choice_name": None}
    raise invalid_value(param, value, ["'auto'", "'none'", "'required'", "{'type': 'function', 'name': ...}"])


def check_tool_choice(config: SessionConfig, param: str) -> None:
    """A forced call needs a tool to call (checked on the configuration after an update, as tools and
    tool_choice may change together)."""
    if config.tool_choice == "required" and not config.tools:
        raise RealtimeError("tool_choice 'required' needs at least one tool", param=param)
    if config.tool_choice == "function" and config.tool_choice_name not in {t.name for t in config.tools}:
        raise RealtimeError(f"tool_choice names {config.tool_choice_name!r}, which is not one of the tools "
                            f"{[t.name for t in config.tools]}", param=f"{param}.name")


def max_tokens(value: int | str, param: str) -> int | None:
    if value == MAX_TOKENS_INF:
        return None
    if not 1 <= int(value) <= 4096:
        raise RealtimeError(f"max_output_tokens must be in [1, 4096] or 'inf', got {value}", param=param)
    return int(value)


def sampling(value: SamplingParamsExt, param: str) -> Sampling:
    if value.max_tokens is not None:
        raise RealtimeError("the Thinker's limit is max_output_tokens", param=f"{param}.max_tokens")
    thinker = tuple((k, getattr(value, k)) for k in THINKER_FIELDS if getattr(value, k) is not None)
    talker = ()
    if value.talker is not None:
        talker = tuple((k, getattr(value.talker, k)) for k in TALKER_FIELDS if getattr(value.talker, k) is not None)
    return Sampling(thinker, talker)


def _turn_detection(td: TurnDetectionParams | None, current: TurnDetection | None, param: str) -> TurnDetection | None:
    if td is None:
        return None
    if td.type not in TURN_DETECTION_TYPES:
        raise invalid_value(f"{param}.type", td.type, [f"'{t}'" for t in TURN_DETECTION_TYPES])
    if td.idle_timeout_ms is not None:
        raise _unsupported(f"{param}.idle_timeout_ms", "idle_timeout_ms is not supported")
    base = current or TurnDetection()
    fields: dict[str, Any] = {"type": td.type}
    if td.type == "semantic_vad":  # OpenAI's semantic_vad has no threshold, padding or silence: the defaults
        if td.eagerness is not None and td.eagerness not in EAGERNESS:
            raise invalid_value(f"{param}.eagerness", td.eagerness, [f"'{e}'" for e in EAGERNESS])
        base = TurnDetection(create_response=base.create_response, interrupt_response=base.interrupt_response)
        fields["eagerness"] = td.eagerness or "auto"
        names: tuple[str, ...] = ("create_response", "interrupt_response")
    else:
        names = ("threshold", "prefix_padding_ms", "silence_duration_ms", "create_response", "interrupt_response")
    fields.update({k: getattr(td, k) for k in names if getattr(td, k) is not None})
    return dataclasses.replace(base, **fields)


def _noise_reduction(value: Any, param: str) -> str | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else value
    if kind not in NOISE_REDUCTION_TYPES:
        raise invalid_value(param + (".type" if isinstance(value, dict) else ""), kind,
                            [f"'{k}'" for k in NOISE_REDUCTION_TYPES] + ["null"])
    return kind


def _transcription(t: TranscriptionParams | None, served: str, param: str) -> Transcription | None:
    if t is None:
        return None
    model = t.model or served
    try:
        stt.check_model(model, served)
        return Transcription(model, t.language, t.prompt)
    except stt.TranscriptionFieldError as exc:
        raise RealtimeError(str(exc), code=exc.code, param=f"{param}.{exc.param}") from None


def apply_session_update(config: SessionConfig, s: SessionParams, info: ModelInfo, model: str,
                         voices: VoiceMap) -> SessionConfig:
    """The configuration after ``session.update``; raises RealtimeError (and changes nothing) if any field
    is invalid or unsupported."""
    p = "session"
    if s.type not in (None, "realtime"):
        raise _unsupported(f"{p}.type", f"session type {s.type!r} is not supported; only 'realtime'")
    if s.model not in (None, model):
        raise RealtimeError(f"this server serves {model!r}, not {s.model!r}", param=f"{p}.model",
                            code="model_not_found")
    for name in ("prompt", "tracing", "include", "reasoning"):
        if getattr(s, name) not in (None, []):
            raise _unsupported(f"{p}.{name}", f"{name} is not supported")
    new = _shared(s, info, p)
    if s.audio is not None:
        a = s.audio
        if a.input is not None:
            check_format(a.input.format, f"{p}.audio.input.format")
            if "transcription" in a.input.model_fields_set:
                new["transcription"] = _transcription(a.input.transcription, model, f"{p}.audio.input.transcription")
            if "noise_reduction" in a.input.model_fields_set:
                new["noise_reduction"] = _noise_reduction(a.input.noise_reduction, f"{p}.audio.input.noise_reduction")
            if "turn_detection" in a.input.model_fields_set:
                new["turn_detection"] = _turn_detection(a.input.turn_detection, config.turn_detection,
                                                        f"{p}.audio.input.turn_detection")
        if a.output is not None:
            check_format(a.output.format, f"{p}.audio.output.format")
            if a.output.speed not in (None, 1.0):
                raise _unsupported(f"{p}.audio.output.speed", "speed is not supported (only 1.0)")
            if a.output.voice is not None:
                new["voice"] = voice(a.output.voice, voices, f"{p}.audio.output.voice")
    if s.truncation is not None:
        if s.truncation not in TRUNCATION_MODES:
            raise _unsupported(f"{p}.truncation", f"truncation must be one of {TRUNCATION_MODES}")
        new["truncation"] = s.truncation
    out = dataclasses.replace(config, **new)
    check_tool_choice(out, f"{p}.tool_choice")
    return out


def _shared(r: SessionParams | ResponseParams, info: ModelInfo, p: str) -> dict[str, Any]:
    """The fields ``session.update`` and ``response.create`` have in common, validated."""
    new: dict[str, Any] = {}
    if r.instructions is not None:
        new["instructions"] = r.instructions
    if r.output_modalities is not None:
        new["output_modalities"] = modalities(r.output_modalities, info, f"{p}.output_modalities")
    if r.max_output_tokens is not None:
        new["max_output_tokens"] = max_tokens(r.max_output_tokens, f"{p}.max_output_tokens")
    if r.tools is not None:
        new["tools"] = tools(r.tools, f"{p}.tools")
    if r.tool_choice is not None:
        new.update(tool_choice(r.tool_choice, f"{p}.tool_choice"))
    if r.sampling is not None:
        new["sampling"] = sampling(r.sampling, f"{p}.sampling")
    return new


@dataclass(frozen=True)
class ResponseSettings:
    """What one response uses: the session's configuration with ``response.create``'s overrides."""

    config: SessionConfig
    metadata: dict[str, str] | None = None


def response_settings(config: SessionConfig, r: ResponseParams | None, info: ModelInfo,
                      voices: VoiceMap) -> ResponseSettings:
    if r is None:
        return ResponseSettings(config)
    p = "response"
    if r.conversation not in (None, "auto"):
        raise _unsupported(f"{p}.conversation", "only responses in the session's conversation ('auto') are "
                                                "supported")
    if r.input is not None:
        raise _unsupported(f"{p}.input", "response input items are not supported; add items to the conversation")
    new = _shared(r, info, p)
    if r.audio is not None and r.audio.output is not None:
        check_format(r.audio.output.format, f"{p}.audio.output.format")
        if r.audio.output.voice is not None:
            new["voice"] = voice(r.audio.output.voice, voices, f"{p}.audio.output.voice")
    out = dataclasses.replace(config, **new)
    check_tool_choice(out, f"{p}.tool_choice")
    return ResponseSettings(out, r.metadata)
