"""One realtime session: its configuration, input audio buffer with server VAD, conversation, and the one
response that may be running; handles each client event and sends the server events.

Turn taking with server VAD (or semantic VAD: the same events, its end-of-turn rule in ``vad``): ``input_audio_buffer.speech_started`` when speech begins (and, with
``interrupt_response``, the running response is cancelled: barge-in), ``speech_stopped`` after
``silence_duration_ms`` of silence, then the speech is committed as a user audio item
(``input_audio_buffer.committed``, ``conversation.item.added``, ``conversation.item.done``) and, with
``create_response``, answered.
Without turn detection the client commits (``input_audio_buffer.commit``) and asks (``response.create``).
A function call's result comes back as a ``function_call_output`` item; the client then asks for the next
response with ``response.create`` (as with OpenAI's server).

Conversation items: every item added (a committed turn, ``conversation.item.create``, a response's message or
call) is announced with ``conversation.item.added``, and with ``conversation.item.done`` once complete (at once
for the client's and the committed ones, after ``response.output_item.done`` for a response's); a beta client
(``events.for_protocol``) gets one ``conversation.item.created`` instead. Client-chosen item ids and
``previous_item_id`` (an id, or ``"root"``: first) are kept and echoed; an id already in the conversation is
refused (``duplicate_item_id``). ``conversation.item.retrieve`` answers ``conversation.item.retrieved`` with the
item, user audio included (base64 pcm16, 24 kHz); retrieve, truncate and delete of an unknown id get OpenAI's
``item_<action>_invalid_item_id``.

With ``audio.input.transcription`` each committed turn is also transcribed by the model, after the answer it
starts is under way (``transcription``: ``conversation.item.input_audio_transcription.delta`` / ``.completed``).

With ``audio.input.noise_reduction`` the appended audio is filtered first (``noise``: it lags by 10.7 ms).

Input audio is 24 kHz pcm16; the model hears it through its processor, which resamples to 16 kHz with soxr
(the same path as any audio part of a chat message).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from omnistage.entrypoints import speech_to_text as stt
from omnistage.entrypoints.realtime import config as cfg
from omnistage.entrypoints.realtime.config import AUDIO_RATE, SessionConfig
from omnistage.entrypoints.realtime.context import RealtimeContext, SessionClosed
from omnistage.entrypoints.realtime.conversation import (
    AssistantMessage,
    Conversation,
    Item,
    UserMessage,
    item_from_params,
    new_item_id,
)
from omnistage.entrypoints.realtime.events import (
    AudioAppend,
    ItemCreate,
    ItemRef,
    ItemTruncate,
    RealtimeError,
    ResponseCancel,
    ResponseCreate,
    ResponseParams,
    SessionUpdate,
    for_protocol,
    new_id,
    parse_client_event,
    server_event,
)
from omnistage.entrypoints.realtime.input_buffer import MIN_COMMIT_MS, InputAudioBuffer, ms_to_samples
from omnistage.entrypoints.realtime.noise import NoiseReducer
from omnistage.entrypoints.realtime.response import ResponseRun
from omnistage.entrypoints.realtime.transcription import TranscriptionRun
from omnistage.entrypoints.realtime.vad import SpeechDetector
from omnistage.models.family import PreparedPrompt
from omnistage.pipeline.client import EngineClient

logger = logging.getLogger("omnistage.realtime")

IDLE_KEEP_MS = 500  # kept beyond the prefix padding while no speech is going on (the start is decided late)


class RealtimeSession:
    def __init__(self, ctx: RealtimeContext, send: Callable[[str], Awaitable[None]], beta: bool = False) -> None:
        self.ctx = ctx
        self._send = send
        self.beta = beta  # the client asked for the beta protocol (its event names)
        self._send_lock = asyncio.Lock()
        self.closed = False
        info = ctx.omni.info
        self.id, self.conversation_id = new_id("sess"), new_id("conv")
        audio = "audio" in info.output_modalities and bool(info.voices)
        self.config = SessionConfig(voice=info.default_voice if audio else None,
                                    output_modalities=("audio",) if audio else ("text",))
        limits = ctx.limits
        self.buffer = InputAudioBuffer(limits.max_buffered_audio_s * AUDIO_RATE)
        self.detector = SpeechDetector(self.config.turn_detection)
        self.conversation = Conversation(limits.max_history_items, limits.max_history_audio_s * AUDIO_RATE,
                                         info.tool_calls)
        self.response: ResponseRun | None = None
        self.denoiser: NoiseReducer | None = None  # with noise_reduction set
        self.transcriptions: list[TranscriptionRun] = []  # running (and recently finished) input transcriptions
        self.speech: tuple[str, int] | None = None  # (item id, audio_start_ms) of the speech in progress
        self.overflow_reported = False

    # ---- sending ------------------------------------------------------------------------------------
    async def send(self, event: dict[str, Any]) -> None:
        if self.closed:
            raise SessionClosed()
        event = for_protocol(event, self.beta)
        if event is None:
            return
        text = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
        async with self._send_lock:
            try:
                await self._send(text)
            except Exception as exc:  # the socket is gone (disconnect, close frame sent, transport error)
                self.closed = True
                raise SessionClosed() from exc

    async def start(self) -> None:
        await self.send(server_event("session.created", session=self.config.to_api(self.id, self.ctx.model)))

    async def close(self) -> None:
        """The client is gone: stop the response (aborting it in every stage) and drop the session's state."""
        self.closed = True
        if self.response is not None:
            await self.response.cancel("client_gone")
        for run in self.transcriptions:
            await run.cancel()
        self.buffer.clear()
        self.conversation.items.clear()

    # ---- dispatch -----------------------------------------------------------------------------------
    async def handle(self, raw: str | bytes) -> None:
        """One client event; every mistake becomes an ``error`` event and the session goes on."""
        event_id = None
        try:
            kind, event, event_id = parse_client_event(raw)
            await self._HANDLERS[kind](self, event)
        except RealtimeError as err:
            err.event_id = err.event_id or event_id
            await self.send(err.event())
        except SessionClosed:
            raise
        except Exception as exc:
            logger.exception("realtime session %s: internal error", self.id)
            await self.send(RealtimeError(f"internal error: {exc!r}", code="internal_error", type="server_error",
                                          event_id=event_id).event())

    async def _session_update(self, e: SessionUpdate) -> None:
        new = cfg.apply_session_update(self.config, e.session, self.ctx.omni.info, self.ctx.model,
                                       self.ctx.voices)
        if new.noise_reduction != self.config.noise_reduction:
            self.denoiser = NoiseReducer(new.noise_reduction) if new.noise_reduction else None
        if new.turn_detection != self.config.turn_detection:
            if new.turn_detection is not None:
                self.detector.reconfigure(new.turn_detection)
            if new.turn_detection is None or self.config.turn_detection is None:
                self.detector.reset()
                self.speech = None
        self.config = new
        await self.send(server_event("session.updated", session=new.to_api(self.id, self.ctx.model)))

    # ---- input audio --------------------------------------------------------------------------------
    async def _append(self, e: AudioAppend) -> None:
        try:
            data = base64.b64decode(e.audio, validate=True)
        except (binascii.Error, ValueError):
            raise RealtimeError("audio is not valid base64", param="audio") from None
        if len(data) % 2:
            raise RealtimeError("audio must be pcm16 (an even number of bytes)", param="audio")
        samples = np.frombuffer(data, dtype="<i2")
        if self.denoiser is not None:  # the VAD, the buffer and the model get the filtered stream
            samples = self.denoiser.process(samples)
        dropped = self.buffer.append(samples)
        if dropped and not self.overflow_reported:
            self.overflow_reported = True
            await self.send(RealtimeError(
                f"the input audio buffer holds at most {self.ctx.limits.max_buffered_audio_s} s; later audio of this "
                "turn is dropped (commit or clear the buffer)", code="input_audio_buffer_full", param="audio").event())
        td = self.config.turn_detection
        if td is None:
            return
        for ev in self.detector.feed(samples):
            if ev.kind == "started":
                await self._speech_started(ev.ms)
            else:
                await self._speech_stopped(ev.ms)
        if self.speech is None:
            self.buffer.keep_last(ms_to_samples(td.prefix_padding_ms + IDLE_KEEP_MS))

    async def _speech_started(self, ms: int) -> None:
        item_id = new_item_id()
        self.speech = (item_id, ms)
        self.buffer.keep_last(self.buffer.end - ms_to_samples(ms))  # the turn starts here
        await self.send(server_event("input_audio_buffer.speech_started", audio_start_ms=ms, item_id=item_id))
        if self.response is not None and self.response.active and self.config.turn_detection.interrupt_response:
            await self.response.cancel("turn_detected")  # barge-in

    async def _speech_stopped(self, ms: int) -> None:
        stopped_at = time.monotonic()
        item_id, start_ms = self.speech or (new_item_id(), ms)
        self.speech = None
        await self.send(server_event("input_audio_buffer.speech_stopped", audio_end_ms=ms, item_id=item_id))
        audio = self.buffer.take(ms_to_samples(start_ms), ms_to_samples(ms))
        self.overflow_reported = False
        if not audio.size:
            return
        item = await self._commit_audio(item_id, audio)
        try:
            if self.config.turn_detection.create_response:
                await self._create_response(self._settings(None), stopped_at)
        finally:  # after the answer it starts (see ``transcription``)
            self._transcribe(item, self.response.first_output if self.response is not None else None)

    async def _commit(self, _: Any) -> None:
        audio = self.buffer.take()
        self.detector.reset()
        item_id = self.speech[0] if self.speech else new_item_id()
        self.speech = None
        self.overflow_reported = False
        if audio.shape[0] < ms_to_samples(MIN_COMMIT_MS):
            raise RealtimeError(f"buffer too small: expected at least {MIN_COMMIT_MS} ms of audio, got "
                                f"{audio.shape[0] * 1000 // AUDIO_RATE} ms", code="input_audio_buffer_commit_empty")
        self._transcribe(await self._commit_audio(item_id, audio))

    async def _commit_audio(self, item_id: str, audio: np.ndarray) -> UserMessage:
        item = UserMessage(item_id, [("audio", audio)])
        prev = await self.add_item(item, announce=False)
        await self.send(server_event("input_audio_buffer.committed", item_id=item_id, previous_item_id=prev))
        await self._announce(item, prev)
        return item

    def _transcribe(self, item: UserMessage, after: asyncio.Event | None = None) -> None:
        """Transcribe a committed turn if the session asks for it (``transcription``)."""
        if self.config.transcription is None:
            return
        self.transcriptions = [t for t in self.transcriptions if not t.done]
        run = TranscriptionRun(self, item, 0, self.config.transcription, after)
        self.transcriptions.append(run)
        run.start()

    async def _clear(self, _: Any) -> None:
        self.buffer.clear()
        self.detector.reset()
        self.speech = None
        self.overflow_reported = False
        await self.send(server_event("input_audio_buffer.cleared"))

    # ---- conversation -------------------------------------------------------------------------------
    async def add_item(self, item: Item, previous_item_id: str | None = None, announce: bool = True) -> str | None:
        """Add an item (announcing it, see the module docstring); returns the id before it."""
        before = {it.id for it in self.conversation.items}
        prev = self.conversation.add(item, previous_item_id)
        if announce:
            await self._announce(item, prev)
        for gone in before - {it.id for it in self.conversation.items}:  # dropped by the history bounds
            await self.send(server_event("conversation.item.deleted", item_id=gone))
        return prev

    async def _announce(self, item: Item, prev: str | None) -> None:
        api = item.to_api()
        await self.send(server_event("conversation.item.added", item=api, previous_item_id=prev))
        if api["status"] == "completed":
            await self.send(server_event("conversation.item.done", item=api, previous_item_id=prev))

    async def item_done(self, item: Item) -> None:
        """A response's item is complete: ``conversation.item.done`` (unless it has left the conversation)."""
        if item in self.conversation.items:
            await self.send(server_event("conversation.item.done", item=item.to_api(),
                                         previous_item_id=self.conversation.previous_id(item)))

    async def _item_retrieve(self, e: ItemRef) -> None:
        item = self.conversation.get(e.item_id, "retrieve")
        await self.send(server_event("conversation.item.retrieved", item=item.to_api(with_audio=True)))

    async def _item_create(self, e: ItemCreate) -> None:
        item = item_from_params(e.item)
        await self.add_item(item, e.previous_item_id)

    async def _item_truncate(self, e: ItemTruncate) -> None:
        item = self.conversation.get(e.item_id, "truncate")
        if not isinstance(item, AssistantMessage) or not item.audio:
            raise RealtimeError(f"item {e.item_id!r} is not an assistant message with audio: only those can be "
                                "truncated", param="item_id")
        if self.response is not None and self.response.active and item in self.response.output:
            raise RealtimeError("the item's response is still running; cancel it first", param="item_id")
        if e.content_index != 0:
            raise RealtimeError("the item has one content part (index 0)", param="content_index")
        sent_ms = item.sent_samples * 1000 // AUDIO_RATE
        if e.audio_end_ms > sent_ms:
            raise RealtimeError(f"audio_end_ms ({e.audio_end_ms}) is beyond the item's audio ({sent_ms} ms)",
                                param="audio_end_ms")
        spf = self.ctx.omni.info.samples_per_frame
        if spf:
            frames = ms_to_samples(e.audio_end_ms) // spf
            item.text = self.ctx.omni.tokenizer.decode(item.token_ids[:frames], skip_special_tokens=True)
        item.sent_samples = ms_to_samples(e.audio_end_ms)
        await self.send(server_event("conversation.item.truncated", item_id=item.id, content_index=0,
                                     audio_end_ms=e.audio_end_ms))

    async def _item_delete(self, e: ItemRef) -> None:
        self.conversation.delete(e.item_id)
        await self.send(server_event("conversation.item.deleted", item_id=e.item_id))

    async def render_for(self, config: SessionConfig, answer_prefix: str = "") -> PreparedPrompt:
        """The prompt for a response: the conversation as chat messages, rendered in the pool (an empty one:
        the instructions alone). A prompt that leaves no room for the answer (``max_output_tokens``, or one token
        for "inf") drops its oldest items (``truncation: "auto"``) until it fits. ``answer_prefix``: the text the
        answer is made to begin with (a forced tool call's)."""
        info = self.ctx.omni.info
        max_tokens = config.max_output_tokens or 1
        tools = config.active_tools
        loop = asyncio.get_running_loop()
        while True:
            check_not_empty(self.conversation, config)
            messages = self.conversation.messages(config.instructions, tools)
            prompt, error = await loop.run_in_executor(self.ctx.pool, _render, self.ctx.omni, messages,
                                                       answer_prefix)
            too_long = error is not None and "at most" in str(error)
            if error is None and len(prompt.token_ids) + max_tokens > info.max_model_len:
                too_long = True
            if not too_long:
                if error is not None:
                    raise RealtimeError(str(error), code="invalid_request")
                return prompt
            if config.truncation != "auto" or len(self.conversation.items) <= 1:
                raise RealtimeError(f"the conversation does not fit this model's context of {info.max_model_len} "
                                    f"tokens with {max_tokens} for the answer", code="context_length_exceeded")
            gone = self.conversation.items.pop(0)
            await self.send(server_event("conversation.item.deleted", item_id=gone.id))

    def audio_prompt_tokens(self, prompt: PreparedPrompt | None) -> int:
        return 0 if prompt is None else stt.audio_tokens(self.ctx.omni.tokenizer, prompt.token_ids)

    # ---- responses ----------------------------------------------------------------------------------
    async def _response_create(self, e: ResponseCreate) -> None:
        await self._create_response(self._settings(e.response), None)

    def _settings(self, r: ResponseParams | None) -> cfg.ResponseSettings:
        return cfg.response_settings(self.config, r, self.ctx.omni.info, self.ctx.voices)

    async def _create_response(self, settings: cfg.ResponseSettings, speech_end: float | None) -> None:
        if self.response is not None and self.response.active:
            raise RealtimeError(f"Conversation already has an active response in progress: {self.response.id}. "
                                "Wait until the response is finished before creating a new one.",
                                code="conversation_already_has_active_response")
        check_not_empty(self.conversation, settings.config)
        self.response = ResponseRun(self, settings, speech_end)
        self.response.start()

    async def _response_cancel(self, e: ResponseCancel) -> None:
        r = self.response
        if r is None or not r.active or e.response_id not in (None, r.id):
            raise RealtimeError("Cancellation failed: no active response found", code="response_cancel_not_active")
        await r.cancel("client_cancelled")

    _HANDLERS = {
        "session.update": _session_update,
        "input_audio_buffer.append": _append,
        "input_audio_buffer.commit": _commit,
        "input_audio_buffer.clear": _clear,
        "conversation.item.create": _item_create,
        "conversation.item.truncate": _item_truncate,
        "conversation.item.delete": _item_delete,
        "conversation.item.retrieve": _item_retrieve,
        "response.create": _response_create,
        "response.cancel": _response_cancel,
    }


def check_not_empty(conversation: Conversation, config: SessionConfig) -> None:
    """A response needs something to answer: an item, or instructions (a greeting on an empty conversation)."""
    if not conversation.items and not config.instructions:
        raise RealtimeError("the conversation is empty: add an item, commit audio or give instructions first",
                            code="conversation_empty")


def _render(omni: EngineClient, messages: list[dict[str, Any]],
            answer_prefix: str) -> tuple[PreparedPrompt | None, Exception | None]:
    try:
        if answer_prefix:
            return omni.render_prompt(messages, answer_prefix=answer_prefix), None
        return omni.render_prompt(messages), None
    except ValueError as exc:
        return None, exc

