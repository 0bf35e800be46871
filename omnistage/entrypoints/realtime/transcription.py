"""Input audio transcription in a realtime session (``audio.input.transcription``): each committed user turn is
transcribed by the served model (``entrypoints.speech_to_text``: the Thinker hears the turn and writes it down),
as its own text-only engine request beside the session's responses.

Off the answer's critical path: a transcription whose turn starts a response waits until that response has its
first output (or has ended), so the answer's prefill never queues behind the transcription's; after that the
engine batches both. Events, each with the item's id and the audio part's ``content_index``:
``conversation.item.input_audio_transcription.delta`` (text as it streams) and ``.completed`` (the transcript and
its token usage), or ``.failed`` (the error; never an ``error`` event, as OpenAI's). The transcript is kept in the
item's input_audio part (``conversation.item.retrieve`` shows it); the model keeps hearing the audio itself. The
session's close cancels its transcriptions (aborting their requests in the engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import numpy as np

from omnistage.entrypoints import speech_to_text as stt
from omnistage.entrypoints.detokenizer import IncrementalDetokenizer
from omnistage.entrypoints.realtime.config import AUDIO_RATE, Transcription
from omnistage.entrypoints.realtime.context import SessionClosed, SessionHandle
from omnistage.entrypoints.realtime.conversation import UserMessage
from omnistage.entrypoints.realtime.events import RealtimeError, new_id, server_event
from omnistage.pipeline.omni import EngineDeadError, QueueFullError

logger = logging.getLogger("omnistage.realtime")
EVENT = "conversation.item.input_audio_transcription"


class TranscriptionRun:
    def __init__(self, session: SessionHandle, item: UserMessage, content_index: int, config: Transcription,
                 after: asyncio.Event | None = None) -> None:
        self.session, self.item, self.content_index, self.config = session, item, content_index, config
        self.after = after  # set once the response this turn started has its first output (or has ended)
        self.id = new_id("transcribe")
        self.text = ""
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.run(), name=self.id)

    async def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    @property
    def done(self) -> bool:
        return self.task is not None and self.task.done()

    async def send(self, kind: str, **fields: Any) -> None:
        await self.session.send(server_event(f"{EVENT}.{kind}", item_id=self.item.id,
                                             content_index=self.content_index, **fields))

    async def run(self) -> None:
        try:
            await self._transcribe()
        except SessionClosed:
            pass
        except RealtimeError as err:
            await self._failed(err)
        except QueueFullError as exc:
            await self._failed(RealtimeError(f"server is busy: {exc}", code="queue_full", type="rate_limit_error"))
        except EngineDeadError as exc:
            await self._failed(RealtimeError(str(exc), code="engine_dead", type="server_error"))
        except ValueError as exc:  # the model's processing refused the audio
            await self._failed(RealtimeError(str(exc), code="invalid_request"))
        except Exception as exc:
            logger.exception("realtime transcription %s failed", self.id)
            await self._failed(RealtimeError(f"internal error: {exc!r}", code="internal_error", type="server_error"))

    async def _failed(self, err: RealtimeError) -> None:
        with contextlib.suppress(SessionClosed):
            await self.send("failed", error={"type": err.type, "code": err.code, "message": err.message,
                                             "param": err.param})

    async def _transcribe(self) -> None:
        if self.after is not None:
            await self.after.wait()
        ctx = self.session.ctx
        info = ctx.omni.info
        samples = self.item.parts[self.content_index][1]
        messages = stt.messages(samples.astype(np.float32) / 32768.0, AUDIO_RATE, self.config.language,
                                self.config.prompt)
        loop = asyncio.get_running_loop()
        prompt = await loop.run_in_executor(ctx.pool, ctx.omni.render_prompt, messages)
        max_tokens = min(ctx.transcript_tokens, info.max_model_len - len(prompt.token_ids))
        if max_tokens < 1:
            raise RealtimeError(f"the turn's audio fills this model's context of {info.max_model_len} tokens",
                                code="context_length_exceeded")
        detok = IncrementalDetokenizer(ctx.omni.tokenizer)
        num_tokens = 0
        stream = ctx.omni.generate(prompt, ("text",), stt.sampling(info, max_tokens), None, self.id)
        async with contextlib.aclosing(stream):
            async for d in stream:
                num_tokens += len(d.new_token_ids)
                piece = detok.add(d.new_token_ids) if d.new_token_ids else ""
                if d.finished:
                    piece += detok.flush()
                if piece:
                    self.text += piece
                    await self.send("delta", delta=piece)
                if d.finished:
                    if d.finish_reason == "error":
                        raise RealtimeError(f"the engine failed while transcribing: {d.error}",
                                            code="request_failed", type="server_error")
                    break
        self.item.transcripts[self.content_index] = self.text
        n_in, audio_in = len(prompt.token_ids), self.session.audio_prompt_tokens(prompt)
        usage = {"type": "tokens", "input_tokens": n_in, "output_tokens": num_tokens, "total_tokens": n_in + num_tokens,
                 "input_token_details": {"text_tokens": n_in - audio_in, "audio_tokens": audio_in}}
        await self.send("completed", transcript=self.text, usage=usage)
