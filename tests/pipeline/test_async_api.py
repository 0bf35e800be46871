"""AsyncOmni: per-request streams of text deltas and audio chunks; closing a stream aborts the request."""

import asyncio
import threading

import pytest
import torch

from omnistage.core.sampling_params import SamplingParams
from omnistage.models.registry import load_pipeline_config
from omnistage.pipeline.omni import AsyncOmni, Omni

PARAMS = {
    "thinker": SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8),
    "talker": SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.0),
}
CHUNKS = {"stages": {"code2wav": {"bridge_args": {"first_chunk_frames": 4, "chunk_frames": 8}}}}


@pytest.fixture(scope="module")
def async_omni(tiny_ckpt):
    omni = AsyncOmni(tiny_ckpt, pipeline=load_pipeline_config("qwen3_omni", CHUNKS))
    yield omni
    omni.shutdown()


async def collect(omni, prompt, **kw):
    tokens, audio, chunks, last = [], [], 0, None
    async for d in omni.generate(prompt, ["text", "audio"], PARAMS, **kw):
        tokens += d.new_token_ids
        if d.audio is not None:
            audio.append(d.audio)
            chunks += 1
        last = d
    return tokens, torch.cat(audio) if audio else torch.zeros(0), chunks, last


def test_concurrent_streams_each_get_their_own_text_and_audio(tiny_ckpt, async_omni):
    prompts = ["Hi", "Tell me a short story about the sea and a small boat."]
    offline = Omni(tiny_ckpt, pipeline=load_pipeline_config("qwen3_omni", CHUNKS)).generate(
        prompts, modalities=["text", "audio"], sampling_params=PARAMS)

    async def main():
        return await asyncio.gather(*(collect(async_omni, p) for p in prompts))

    results = asyncio.run(main())
    for (tokens, audio, chunks, last), ref in zip(results, offline):
        assert last.finished and last.finish_reason == "length"
        assert tokens == ref.token_ids
        assert chunks > 1  # audio really streamed in several chunks
        assert audio.shape == ref.audio.shape and (audio - ref.audio).abs().max().item() <= 1e-5


def test_closing_a_stream_early_aborts_it_everywhere(async_omni):
    async def main():
        stream = async_omni.generate("Tell me a short story about the sea.", ["text", "audio"], PARAMS)
        first = await stream.__anext__()
        await stream.aclose()  # the client went away
        return first, await async_omni.resource_stats()

    first, stats = asyncio.run(main())
    assert not first.finished
    assert stats["requests"] == 0
    for stage in ("thinker", "talker"):
        assert stats[stage]["kv_free_blocks"] == stats[stage]["kv_blocks"]
        assert stats[stage]["records"] == 0 and stats[stage]["bridge_entries"] == 0
    assert stats["code2wav"]["waiting"] == 0 and stats["code2wav"]["pending_chunks"] == 0
    assert stats["code2wav"]["records"] == 0 and stats["code2wav"]["bridge_entries"] == 0
    assert async_omni.num_unfinished == 0


def test_bad_request_raises_at_submit_and_the_engine_lives_on(async_omni):
    async def main():
        with pytest.raises(ValueError, match="unknown voice"):
            async for _ in async_omni.generate("Hi", ["text", "audio"], PARAMS, speaker="nobody"):
                pass
        return await collect(async_omni, "Hi")

    tokens, _, _, last = asyncio.run(main())
    assert last.finished and len(tokens) == 8


def test_giving_up_while_the_submission_is_queued_aborts_it_once_accepted(async_omni):
    """A caller cancelled while its submission waits for the engine thread (e.g. the HTTP client left): the
    submission still runs there, and the request is aborted right after it; a submission that is refused
    (an id already in flight) aborts nothing, least of all the request that owns that id."""
    gate, blocked = threading.Event(), threading.Event()
    gate.set()

    def hold(_events) -> None:
        if not gate.is_set():
            blocked.set()
            gate.wait(30)

    async_omni.add_step_listener(hold)
    long = {"thinker": SamplingParams(temperature=0.0, max_tokens=2000, min_tokens=2000, ignore_eos=True)}

    async def give_up_while_queued(request_id: str) -> None:
        before = async_omni._commands.qsize()
        task = asyncio.ensure_future(async_omni.generate("Hi", ["text"], long, request_id=request_id).__anext__())
        while async_omni._commands.qsize() == before:  # the submission is queued behind the held engine
            await asyncio.sleep(0.001)
        task.cancel()
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def main():
        running = async_omni.generate("Tell me a story.", ["text"], long, request_id="owner")
        await running.__anext__()
        stats = []
        for rid in ("late", "owner"):  # a fresh id, then the running request's own id (refused at submit)
            blocked.clear()
            gate.clear()
            assert await asyncio.to_thread(blocked.wait, 30)
            await give_up_while_queued(rid)
            stats.append(await async_omni.resource_stats())  # runs after the submission and the abort
        still = await running.__anext__()  # the owner is untouched by the refused duplicate
        await running.aclose()
        return stats, still, await async_omni.resource_stats()

    try:
        (after_late, after_dup), still, end = asyncio.run(main())
    finally:
        gate.set()
        async_omni.engine.orchestrator.listeners.remove(hold)
    assert after_late["requests"] == 1 and after_dup["requests"] == 1  # only the owner
    assert not still.finished and still.new_token_ids
    assert end["requests"] == 0 and async_omni.num_unfinished == 0
