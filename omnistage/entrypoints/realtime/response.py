"""One response of a realtime session: render the conversation, run it on the engine, stream its events.

Events, in order: ``response.created``; for the answer message ``response.output_item.added``,
``conversation.item.added``, ``response.content_part.added``, then ``response.output_audio.delta`` (base64
pcm16, 24 kHz) with ``response.output_audio_transcript.delta`` (audio) or ``response.output_text.delta``
(text), then the ``.done`` events of the part and item and ``conversation.item.done``; for each tool call
``response.output_item.added``, ``conversation.item.added``, ``response.function_call_arguments.delta`` /
``.done``, ``response.output_item.done``, ``conversation.item.done``; last ``response.done`` with the status
and usage, then ``rate_limits.updated`` (a beta client gets the beta names, see ``events.for_protocol``).
``output_audio_buffer.started`` / ``.stopped`` / ``.cleared`` are not sent: OpenAI sends them over WebRTC and SIP
only (its server plays the audio there); over a WebSocket the client owns playback, as here.

Tool calls (``tools``): with tools active the response still asks for speech from the start, but its audio
is held back while the text could be opening a call: until the first non-blank text that cannot begin
the family's call tag (``ModelInfo.tool_calls``; Qwen's ``<tool_call>``), and again while the text ends in a
possible start of the tag (the Talker is one token behind
the Thinker and Code2Wav needs a chunk of frames, so in practice nothing waits). A response that opens with a call never speaks: its audio is dropped and, once
the Thinker's text has ended, the request is aborted in every stage (the Talker would otherwise go on
voicing the call). A call after some text cuts the speech where the call starts: the Talker reads one text
token per codec frame, so the audio of the first ``n`` frames covers the ``n`` tokens before the call.

``tool_choice`` "required" or a named function forces the call: the prompt ends with the format's call prefix
(``ToolCallFormat.call_prefix``, rendered with the ``answer_prefix`` option), the scanner reads that prefix
first, and the response is text only (its ``output_modalities`` say so). ``max_output_tokens`` "inf" lets the
Thinker write up to the context (what the prompt leaves of ``max_model_len``).

Cancellation (``response.cancel``, barge-in, the client leaving) closes the engine stream, which aborts the
request in every stage. The answer then keeps what was played: the audio sent, capped by the wall time since
its first chunk (a client plays in real time), converted to codec frames and so to the text tokens the Talker
had read (speech lags the text it is given, so this may hold a few words not yet voiced; a family that does
not declare ``samples_per_frame`` keeps the text sent so far); ``conversation.item.truncate`` cuts it to what
the client reports it played.
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import contextlib
import logging
import time
from typing import Any

import numpy as np

from omnistage.core.sampling_params import SamplingParams
from omnistage.entrypoints.audio_format import pcm16_bytes, to_int16
from omnistage.entrypoints.detokenizer import IncrementalDetokenizer
from omnistage.entrypoints.metrics import RequestTimer
from omnistage.entrypoints.realtime.config import AUDIO_RATE, ResponseSettings, SessionConfig
from omnistage.entrypoints.realtime.context import SessionClosed, SessionHandle
from omnistage.entrypoints.realtime.conversation import AssistantMessage, FunctionCall, new_item_id
from omnistage.entrypoints.realtime.events import MAX_TOKENS_INF, RealtimeError, new_id, server_event
from omnistage.entrypoints.stage_sampling import SamplingFieldError, stage_params
from omnistage.models.family import PreparedPrompt
from omnistage.pipeline.client import ModelInfo, RequestDelta
from omnistage.pipeline.omni import EngineDeadError, QueueFullError

logger = logging.getLogger("omnistage.realtime")
# Audio deltas carry at most 0.5 s (32 KB of base64): clients' WebSocket message limits (1 MiB by default in
# the websockets library the SDK uses) and smooth playback.
AUDIO_DELTA_SAMPLES = AUDIO_RATE // 2


def response_params(info: ModelInfo, config: SessionConfig, max_tokens: int) -> dict[str, SamplingParams]:
    """Per-stage sampling for a response: the deployment's defaults with the session's overrides, by the
    HTTP API's rule (``entrypoints.stage_sampling``); the Thinker writes at most ``max_tokens``."""
    thinker = {**dict(config.sampling.thinker), "max_tokens": max_tokens}
    try:
        return stage_params(info, thinker, dict(config.sampling.talker))
    except SamplingFieldError as exc:
        raise RealtimeError(str(exc), param=f"sampling.{exc.param}" if exc.param else "sampling") from exc


def _b64(samples: np.ndarray) -> str:
    return base64.b64encode(pcm16_bytes(samples)).decode("ascii")


class ResponseRun:
    def __init__(self, session: SessionHandle, settings: ResponseSettings, speech_end: float | None) -> None:
        self.session, self.settings, self.config = session, settings, settings.config
        ctx = session.ctx
        self.info: ModelInfo = ctx.omni.info
        self.tokenizer = ctx.omni.tokenizer
        self.id = new_id("resp")
        self.speech_end = speech_end  # monotonic time of the VAD stop that triggered it (latency metric)
        self.tools = self.config.active_tools
        self.tool_calls = self.info.tool_calls  # the family's format (rendering refuses tools without one)
        # A forced call (tool_choice "required" or a function) begins with the format's call prefix and is
        # never spoken: such a response is text only.
        forced = self.config.forces_call and self.tool_calls is not None
        self.prefix = self.tool_calls.call_prefix(self.config.tool_choice_name) if forced else ""
        self.wants_audio = self.config.wants_audio and not forced
        self.max_tokens = 0  # the Thinker's limit, once the prompt is known ("inf": what the context leaves)
        self.status, self.reason, self.error = "in_progress", None, None
        self.output: list[AssistantMessage | FunctionCall] = []
        self.message: AssistantMessage | None = None
        self.detok = IncrementalDetokenizer(self.tokenizer)
        self.scanner = self.tool_calls.scanner() if self.tools and self.tool_calls else None
        self.decided = not self.tools  # speech may flow (no tool call can open the answer any more)
        self.blank = ""  # leading blank text held until decided
        self.held: list[np.ndarray] = []  # audio held while the text could be opening a call
        self.marks: list[int] = []  # per token: the answer's text length once that token was decoded
        self.speak_limit: int | None = None  # samples of speech allowed (set when a call cuts it)
        self.sent_samples = 0
        self.first_audio_at: float | None = None
        self.num_frames = 0
        self.cached_tokens = 0  # prompt tokens the engine served from its prefix cache
        self.token_ids: list[int] = []
        self.prompt: PreparedPrompt | None = None
        self.text_done = False
        self.timer: RequestTimer | None = None
        self.submitted: float | None = None  # when the request went to the engine (latency metrics count from it)
        self.finish_reason: str | None = None
        self.first_output = asyncio.Event()  # set at the first engine output or the end (transcriptions wait)
        specials = getattr(self.tokenizer, "all_special_ids", None) or [self.tokenizer.eos_token_id]
        self.special_ids = frozenset(int(t) for t in specials if t is not None)
        self.task: asyncio.Task | None = None

    # ---- control --------------------------------------------------------------------------------------
    def start(self) -> None:
        self.task = asyncio.create_task(self.run(), name=self.id)

    async def cancel(self, reason: str) -> None:
        """Stop the response (aborting its request in every stage) and wait for its ``response.done``."""
        if self.task is None or self.task.done():
            return
        self.reason = reason
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, SessionClosed):
            await self.task

    @property
    def active(self) -> bool:
        return self.task is not None and not self.task.done()

    # ---- the run --------------------------------------------------------------------------------------
    def _api(self) -> dict[str, Any]:
        details = None
        if self.status != "in_progress" and self.status != "completed":
            details = {"type": self.status, "reason": self.reason}
            if self.error is not None:
                details["error"] = {"type": self.error.type, "code": self.error.code, "message": self.error.message}
        return {
            "id": self.id, "object": "realtime.response", "status": self.status, "status_details": details,
            "output": [it.to_api() for it in self.output], "conversation_id": self.session.conversation_id,
            "output_modalities": ["audio"] if self.wants_audio else ["text"],
            "max_output_tokens": self.config.max_output_tokens or MAX_TOKENS_INF,
            "audio": {"output": {"format": {"type": "audio/pcm", "rate": AUDIO_RATE}, "voice": self.voice}},
            "metadata": self.settings.metadata, "usage": self._usage() if self.status != "in_progress" else None,
        }

    @property
    def voice(self) -> str | None:
        """The voice's name as the client chose it (a model voice or a mapped name)."""
        return self.config.voice or self.info.default_voice if self.wants_audio else None

    async def send(self, type: str, **fields: Any) -> None:
        await self.session.send(server_event(type, **fields))

    async def run(self) -> None:
        metrics = self.session.ctx.metrics
        await self.send("response.created", response=self._api())
        try:
            self.prompt = await self.session.render_for(self.config, self.prefix)
            self.max_tokens = self.config.max_output_tokens or self.info.max_model_len - len(self.prompt.token_ids)
            params = response_params(self.info, self.config, self.max_tokens)
            modalities = ("text", "audio") if self.wants_audio else ("text",)
            speaker = self.session.ctx.voices.resolve(self.voice) if self.voice else None
            stream = self.session.ctx.omni.generate(self.prompt, modalities, params, speaker, self.id)
            self.submitted = time.monotonic()
            async with contextlib.aclosing(stream):
                await self._text(self.prefix)  # the answer's own beginning, for the call scanner
                async for delta in stream:
                    self.first_output.set()
                    if self.timer is None:
                        self.timer = RequestTimer(metrics, len(self.prompt.token_ids), self.submitted)
                    if await self._delta(delta):
                        break  # a tool-call answer whose text is complete: the rest is not wanted
            self.status = self.status if self.status != "in_progress" else "completed"
        except asyncio.CancelledError:
            self.status = "cancelled"
            self.finish_reason = "abort"
        except SessionClosed:  # the client is gone: nothing to tell anyone (the stream closed above aborted it)
            self.status, self.reason, self.finish_reason = "cancelled", "client_gone", "abort"
        except RealtimeError as err:
            self._fail(err)
        except QueueFullError as exc:
            self._fail(RealtimeError(f"server is busy: {exc}", code="queue_full", type="rate_limit_error"))
        except EngineDeadError as exc:
            self._fail(RealtimeError(str(exc), code="engine_dead", type="server_error"))
        except ValueError as exc:  # the engine refused the request (e.g. an unsupported input/output mix)
            self._fail(RealtimeError(str(exc), code="invalid_request"))
        except Exception as exc:
            logger.exception("realtime response %s failed", self.id)
            self._fail(RealtimeError(f"internal error: {exc!r}", code="internal_error", type="server_error"))
        finally:
            self.first_output.set()
            with contextlib.suppress(SessionClosed):
                await self._finish()

    def _fail(self, err: RealtimeError) -> None:
        self.status, self.error, self.finish_reason = "failed", err, "error"

    async def _delta(self, d: RequestDelta) -> bool:
        """Handle one engine delta; True when the response should stop here."""
        if d.cached_tokens is not None:
            self.cached_tokens = d.cached_tokens
        if d.new_token_ids:
            self.token_ids.extend(d.new_token_ids)
            self.timer.tokens(len(d.new_token_ids))
            if self.special_ids.intersection(d.new_token_ids):
                self.text_done = True
            before = len(self.detok.text)
            piece = self.detok.add(d.new_token_ids)
            # A delta's text is credited to its last token (its earlier tokens keep the length before it).
            self.marks += [before] * (len(d.new_token_ids) - 1) + [len(self.detok.text)]
            await self._text(piece)
        if d.codes is not None:
            self.num_frames += int(d.codes.shape[-1])
        if d.audio is not None and d.audio.numel():
            self.timer.audio(int(d.audio.numel()))
            await self._audio(to_int16(d.audio))
        if d.finished:
            self.finish_reason = d.finish_reason
            await self._text(self.detok.flush())
            await self._end_of_text()
            if d.finish_reason == "error":
                self._fail(RealtimeError(f"the engine failed while generating this response: {d.error}",
                                         code="request_failed", type="server_error"))
            elif d.finish_reason == "length":
                self.status, self.reason = "incomplete", "max_output_tokens"
            elif d.finish_reason == "abort":
                self.status, self.reason = "cancelled", "aborted"
            return True
        if len(self.token_ids) >= self.max_tokens:
            self.text_done = True
        if self.text_done and self.wants_audio and self.scanner is not None and self.scanner.started_call:
            await self._text(self.detok.flush())
            await self._end_of_text()
            self.finish_reason = "stop"
            return True
        return False

    # ---- text and tool calls ------------------------------------------------------------------------
    async def _text(self, piece: str) -> None:
        if not piece:
            return
        if self.scanner is None:
            await self._plain(piece)
            return
        was_in_call = self.scanner.started_call
        plain, bodies = self.scanner.feed(piece)
        if plain:
            await self._plain(plain)
        if self.scanner.started_call and not was_in_call:
            self._cut_speech(bisect.bisect_right(self.marks, self.scanner.call_offset))
        await self._release()
        for body in bodies:
            await self._call(body)

    async def _plain(self, text: str) -> None:
        if not self.decided:
            if not text.strip():
                self.blank += text
                return
            text, self.blank = self.blank + text, ""
            await self._decide()
        if self.message is None:
            await self._open_message()
        self.message.text += text
        kind = "response.output_audio_transcript.delta" if self.wants_audio else "response.output_text.delta"
        await self.send(kind, delta=text, **self._part())

    async def _decide(self) -> None:
        self.decided = True
        await self._release()

    def _cut_speech(self, num_tokens: int) -> None:
        """A call opened after ``num_tokens`` answer tokens: speech may cover those and nothing after."""
        spf = self.info.samples_per_frame
        self.speak_limit = num_tokens * spf if spf else self.sent_samples
        self.decided, self.blank = True, ""

    async def _call(self, body: str) -> None:
        parsed = self.tool_calls.parse_call(body, self.tools)
        if parsed is None:  # not a call of a known tool: keep it as text (it is not spoken)
            logger.warning("response %s: unparseable tool call %r", self.id, body[:200])
            await self._plain(self.tool_calls.block_text(body))
            return
        item = FunctionCall(new_item_id(), call_id=new_id("call"), name=parsed.name, arguments=parsed.arguments,
                            status="in_progress")
        index = len(self.output)
        self.output.append(item)
        await self.send("response.output_item.added", response_id=self.id, output_index=index, item=item.to_api())
        await self.session.add_item(item)
        ids = {"response_id": self.id, "item_id": item.id, "output_index": index, "call_id": item.call_id}
        await self.send("response.function_call_arguments.delta", delta=item.arguments, **ids)
        await self.send("response.function_call_arguments.done", arguments=item.arguments, name=item.name, **ids)
        item.status = "completed"
        await self.send("response.output_item.done", response_id=self.id, output_index=index, item=item.to_api())
        await self.session.item_done(item)

    async def _end_of_text(self) -> None:
        if self.scanner is not None:
            rest, open_body = self.scanner.flush()
            if rest:
                await self._plain(rest)
            if open_body is not None:  # the text ended inside a call
                await self._plain(self.tool_calls.open_tag + open_body)
        self.decided = True
        await self._release()

    # ---- the answer message and its audio -----------------------------------------------------------
    def _part(self) -> dict[str, Any]:
        return {"response_id": self.id, "item_id": self.message.id, "output_index": self.output.index(self.message),
                "content_index": 0}

    async def _open_message(self) -> None:
        self.message = AssistantMessage(new_item_id(), audio=self.wants_audio)
        index = len(self.output)
        self.output.append(self.message)
        await self.send("response.output_item.added", response_id=self.id, output_index=index,
                        item=self.message.to_api())
        await self.session.add_item(self.message)
        part = {"type": "audio", "transcript": ""} if self.wants_audio else {"type": "text", "text": ""}
        await self.send("response.content_part.added", part=part, **self._part())

    async def _audio(self, samples: np.ndarray) -> None:
        self.held.append(samples)
        await self._release()

    async def _release(self) -> None:
        """Send the held audio unless the text could still be opening a call."""
        if not self.decided or (self.scanner is not None and self.scanner.undecided):
            return
        held, self.held = self.held, []
        for samples in held:
            await self._send_audio(samples)

    async def _send_audio(self, samples: np.ndarray) -> None:
        if self.speak_limit is not None:
            samples = samples[:max(0, self.speak_limit - self.sent_samples)]
        if not samples.size:
            return
        if self.message is None:
            await self._open_message()
        if self.first_audio_at is None:
            self.first_audio_at = time.monotonic()
            if self.speech_end is not None:
                self.session.ctx.metrics.realtime_speech_to_audio.observe(self.first_audio_at - self.speech_end)
        for i in range(0, samples.shape[0], AUDIO_DELTA_SAMPLES):  # a later Code2Wav chunk holds 24 s
            piece = samples[i:i + AUDIO_DELTA_SAMPLES]
            self.sent_samples += piece.shape[0]
            self.message.sent_samples = self.sent_samples
            await self.send("response.output_audio.delta", delta=_b64(piece), **self._part())

    def played_text(self) -> str:
        """The text of the audio the client has played by now (see the module docstring)."""
        spf = self.info.samples_per_frame
        if self.first_audio_at is None:
            return ""
        if not spf:
            return self.message.text
        elapsed = int((time.monotonic() - self.first_audio_at) * AUDIO_RATE)
        frames = min(self.sent_samples, elapsed) // spf
        return self.tokenizer.decode(self.token_ids[:frames], skip_special_tokens=True)

    # ---- the end --------------------------------------------------------------------------------------
    async def _finish(self) -> None:
        m = self.message
        if m is not None:
            if self.status == "cancelled" and self.wants_audio:
                m.text = self.played_text()
            m.status = "completed" if self.status == "completed" else "incomplete"
            m.token_ids = self.token_ids
        if self.timer is None and self.submitted is not None:  # ended before its first output
            self.timer = RequestTimer(self.session.ctx.metrics, len(self.prompt.token_ids), self.submitted)
        if self.timer is not None:
            self.timer.finish(self.finish_reason or "abort", self.info.sample_rate)
        self.session.ctx.metrics.realtime_turns.labels(self.status).inc()
        if m is not None:
            ids = self._part()
            if self.wants_audio:
                await self.send("response.output_audio.done", **ids)
                await self.send("response.output_audio_transcript.done", transcript=m.text, **ids)
                part = {"type": "audio", "transcript": m.text}
            else:
                await self.send("response.output_text.done", text=m.text, **ids)
                part = {"type": "text", "text": m.text}
            await self.send("response.content_part.done", part=part, **ids)
            await self.send("response.output_item.done", response_id=self.id, output_index=ids["output_index"],
                            item=m.to_api())
            await self.session.item_done(m)
        if self.error is not None:
            err = self.error
            await self.session.send(RealtimeError(err.message, err.code, err.param, err.type).event())
        await self.send("response.done", response=self._api())
        # OpenAI's servers follow response.done with the session's limits. This server has no rate limits; the
        # limit a conversation runs into is the context: what this response's prompt and answer left of it.
        usage = self._usage()
        await self.send("rate_limits.updated", rate_limits=[{
            "name": "tokens", "limit": self.info.max_model_len, "reset_seconds": 0.0,
            "remaining": max(0, self.info.max_model_len - usage["input_tokens"] - len(self.token_ids))}])

    def _usage(self) -> dict[str, Any]:
        n_in = len(self.prompt.token_ids) if self.prompt is not None else 0
        audio_in = self.session.audio_prompt_tokens(self.prompt)
        n_text, n_audio = len(self.token_ids), self.num_frames if self.wants_audio else 0
        return {"total_tokens": n_in + n_text + n_audio, "input_tokens": n_in, "output_tokens": n_text + n_audio,
                "input_token_details": {"text_tokens": n_in - audio_in, "audio_tokens": audio_in, "image_tokens": 0,
                                        "cached_tokens": self.cached_tokens},
                "output_token_details": {"text_tokens": n_text, "audio_tokens": n_audio}}
