"""A deterministic engine client (the ``EngineClient`` interface the server uses, as ``AsyncOmni``).

It lets the server tests reach states the real engine cannot be forced into cheaply (a full queue, a
dead engine) and observe aborts exactly. Text tokens are characters (token id = code point); the answer
to a prompt is fixed by ``answer``; each audio chunk is a short ramp whose values depend on the token.
A prompt containing ``STALL`` stops after two tokens and waits until it is aborted: a request a test knows
to be unfinished, whatever the machine's speed.
"""

from __future__ import annotations

import asyncio

import torch

from omnistage.core.sampling_params import SamplingParams
from omnistage.models.family import PreparedPrompt
from omnistage.models.tool_calls import QWEN_TOOL_CALLS
from omnistage.pipeline.client import ModelInfo, RequestDelta
from omnistage.pipeline.omni import EngineDeadError, QueueFullError

SAMPLE_RATE = 24000
CHUNK = 480
STALL = "<stall>"


class CharTokenizer:
    eos_token_id = 0

    def __len__(self) -> int:
        return 0x110000  # every code point is a token

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i > 0)


INFO = ModelInfo(
    name="fake-omni",
    family="fake",
    max_model_len=200,
    output_modalities=("text", "audio"),
    text_stage="thinker",
    stage_sampling={"thinker": SamplingParams(temperature=0.0, max_tokens=64),
                    "talker": SamplingParams(temperature=0.9, max_tokens=64)},
    voices=("ethan", "chelsie"),
    default_voice="ethan",
    sample_rate=SAMPLE_RATE,
    tool_calls=QWEN_TOOL_CALLS,  # the fake model writes calls as Qwen's models do
)


def chunk_audio(token: int) -> torch.Tensor:
    return torch.linspace(-0.5, 0.5, CHUNK) * ((token % 7) + 1) / 8


class FakeOmni:
    def __init__(self, answer: str = "hello world", delay: float = 0.002) -> None:
        self.info = INFO
        self.tokenizer = CharTokenizer()
        self.listeners = []
        self.answer = answer
        self.delay = delay
        self.dead: BaseException | None = None
        self.queue_full = False
        self.active: set[str] = set()
        self.aborted: list[str] = []
        self.submitted: list[dict] = []
        self.fail_with: str | None = None  # finish every request with this reason ("error": the engine failed it)

    def render_prompt(self, messages) -> PreparedPrompt:
        if not messages:
            raise ValueError("messages must not be empty")
        ids = [ord(c) for m in messages for c in f"<{m['role']}>{m['content']}"]
        if len(ids) + 1 > self.info.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; this model allows at most {self.info.max_model_len - 1}")
        return PreparedPrompt(ids)

    def add_step_listener(self, fn) -> None:
        self.listeners.append(fn)

    async def generate(self, prompt, modalities=("text",), sampling_params=None, speaker=None, request_id=None):
        if self.dead is not None:
            raise EngineDeadError("engine stopped")
        if self.queue_full:
            raise QueueFullError("1 requests are already waiting")
        self.submitted.append({"prompt": prompt, "modalities": tuple(modalities), "params": sampling_params,
                               "speaker": speaker, "request_id": request_id})
        self.active.add(request_id)
        finished = False
        params = sampling_params["thinker"]
        stop_ids = set(params.stop_token_ids)
        stall = STALL in "".join(chr(t) for t in prompt.token_ids)
        answer, delay = self.answer_for(prompt)
        try:
            tokens = [ord(c) for c in answer][: params.max_tokens]
            reason = self.fail_with or ("length" if len(tokens) < len(answer) else "stop")
            for i, tok in enumerate(tokens):
                if stall and i == 2:
                    await asyncio.Event().wait()  # only an abort (closing this generator) ends it
                await asyncio.sleep(delay)
                audio = chunk_audio(tok) if "audio" in modalities else None
                yield RequestDelta(request_id, new_token_ids=[tok], audio=audio)
                if tok in stop_ids:
                    reason = "stop"
                    break
            finished = True
            error = "failed by the test" if reason == "error" else None
            yield RequestDelta(request_id, finished=True, finish_reason=reason, error=error)
        finally:
            self.active.discard(request_id)
            if not finished:
                self.aborted.append(request_id)

    def answer_for(self, prompt: PreparedPrompt) -> tuple[str, float]:
        """The answer to ``prompt`` and the delay before each of its tokens."""
        return self.answer, self.delay

    async def abort(self, request_id: str) -> bool:
        return False

    async def resource_stats(self) -> dict:
        n = len(self.active)
        return {"thinker": {"running": n, "waiting": 0, "kv_usage": 0.1 * n, "records": n},
                "talker": {"running": 0, "waiting": 0, "kv_usage": 0.0, "records": 0},
                "code2wav": {"running": 0, "waiting": 0}, "requests": n}

    def shutdown(self) -> None:
        pass
