"""AsyncOmni: per-request streams of text deltas and audio chunks; closing a stream aborts the request."""

import asyncio

import pytest
import torch

from omnistage.core.sampling_params import SamplingParams
from omnistage.models.registry import load_pipeline_config
from omnistage.pipeline.omni import AsyncOmni, Omni

PARAMS = {
    "thinker": SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8),
    "talker": SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.0),
}
CHUNKS = {"stages": {"code2wav": {"bridge_args": {"first_chunk_frames": 4, "chunk_frames": 8,
                                                      "left_context_frames": 2}}}}


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
