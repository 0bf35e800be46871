"""Qwen2.5-Omni end to end on the runtime (Omni / OmniEngine, tiny checkpoint, float32) against transformers'
generate: greedy text, codes and audio per request inside a batch; streaming audio; the Talker waiting for
the Thinker's text; everything freed."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from q25_reference import loaded

from omnistage import Omni
from omnistage.core.sampling_params import SamplingParams
from omnistage.models.qwen2_5_omni.streaming import ChunkPlan, Token2WavStream
from omnistage.models.qwen2_5_omni.token2wav import NoiseStream
from omnistage.models.registry import load_pipeline_config
from omnistage.testing.qwen2_5_omni.reference import explicit_talker_mask, tiny_checkpoint

PROMPTS = [
    "Tell me a short story about the sea.",
    [{"role": "system", "content": "You are a helpful voice assistant."},
     {"role": "user", "content": "What is the weather like?"}],
]
TEXT_TOKENS, CODES, SEED = 8, 40, 5
EOS = tuple(json.loads((tiny_checkpoint() / "generation_config.json").read_text())["eos_token_id"])
# One window over all codes: one-shot Token2Wav, as the reference decodes.
ONE_SHOT = {"chunk_blocks": 10_000, "past_blocks": 0, "future_blocks": 0}


def params(codes: int = CODES, penalty: float = 1.05) -> dict[str, SamplingParams]:
    # 1.05: transformers' default Talker penalty, over the Talker's prompt ids too.
    return {"thinker": SamplingParams(temperature=0.0, max_tokens=TEXT_TOKENS),
            "talker": SamplingParams(temperature=0.0, max_tokens=codes, repetition_penalty=penalty, seed=SEED)}


def omni(**token2wav_args) -> Omni:
    overrides = {"stages": {"token2wav": {"bridge_args": token2wav_args}}} if token2wav_args else {}
    return Omni(tiny_checkpoint(), pipeline=load_pipeline_config("qwen2_5_omni", overrides))


@functools.cache
def hf_speech(ids: tuple[int, ...]) -> tuple[list[int], list[int], torch.Tensor]:
    """transformers' greedy generate(return_audio) for these prompt ids: text tokens, codes, waveform (the ODE
    noise seeded as our Token2Wav seeds it: the request's seed)."""
    ld = loaded()
    tc = ld.config.talker_config
    torch.manual_seed(SEED)
    with torch.no_grad(), explicit_talker_mask(ld.hf):
        seq, wav = ld.hf.generate(
            torch.tensor([ids]), speaker="Chelsie", thinker_max_new_tokens=TEXT_TOKENS, thinker_eos_token_id=list(EOS),
            thinker_do_sample=False, talker_do_sample=False, talker_max_new_tokens=CODES,
            talker_eos_token_id=[tc.tts_codec_pad_token_id, tc.tts_codec_end_token_id],
        )
    talker = ld.cap.talker_result[0, len(ids) + 2 :].tolist()
    stops = [i for i, c in enumerate(talker) if c in (tc.tts_codec_pad_token_id, tc.tts_codec_end_token_id)]
    return seq[0, len(ids) :].tolist(), talker[: stops[0] if stops else None], wav.reshape(-1)


def assert_free(o: Omni) -> None:
    stats = o.engine.resource_stats()
    assert stats["requests"] == 0
    for name in ("thinker", "talker"):
        s = stats[name]
        assert s["kv_free_blocks"] == s["kv_blocks"] and s["records"] == 0 and s["bridge_entries"] == 0, s
    t2w = stats["token2wav"]
    assert t2w["pending_chunks"] == 0 and t2w["records"] == 0 and t2w["bridge_entries"] == 0, t2w


@pytest.fixture(scope="module")
def batched():
    o = omni(**ONE_SHOT)
    outs = o.generate(PROMPTS, ["text", "audio"], params())  # both requests in one batch
    assert_free(o)
    return o, outs


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_text_and_audio_equal_transformers_per_request_in_a_batch(batched, i):
    o, outs = batched
    out = outs[i]
    tokens, codes, wav = hf_speech(tuple(out.prompt_token_ids))
    assert o.info.samples_per_frame == 2 * 240  # declared: realtime barge-in maps played audio to text by it
    stop = tokens[-1] in EOS
    assert out.token_ids == (tokens[:-1] if stop else tokens)
    assert out.codes.shape == (1, len(codes)) and out.codes[0].tolist() == codes
    assert len(codes) > len(tokens)  # the speech runs past the text: tts_text_end / tts_text_pad rows
    assert out.audio.shape == wav.shape == (len(codes) * 2 * 240,)
    diff = (out.audio - wav).abs().max().item()
    print(f"request {i}: {len(out.token_ids)} tokens, {len(codes)} codes equal; audio max |diff| {diff:.1e}")
    assert diff <= 1e-4
    assert out.sample_rate == 24000


def test_text_only_equals_transformers_and_never_reaches_the_talker(batched):
    o, outs = batched
    seen = []  # (stage, requests it reported on, requests it sent rows downstream for)
    o.engine.orchestrator.listeners.append(
        lambda ev: seen.append((ev.stage, set(ev.client_outputs) | set(ev.finished), set(ev.stage_outputs))))
    text = o.generate(PROMPTS, ["text"], params()["thinker"])
    o.engine.orchestrator.listeners.clear()
    assert [t.token_ids for t in text] == [out.token_ids for out in outs]  # the same text with or without speech
    assert all(t.audio is None and t.codes is None for t in text)
    ids = {t.request_id for t in text}
    assert any(stage == "thinker" and ids & reported for stage, reported, _ in seen)
    assert not any(stage != "thinker" and ids & reported for stage, reported, _ in seen)
    assert not any(ids & sent for _, _, sent in seen)  # no Talker rows gathered for text-only requests
    assert_free(o)


def test_audio_streams_before_the_talker_finishes_in_qwen_windows():
    """The packaged geometry (3 new blocks, 2 back, 1 ahead, later chunks growing): audio arrives while the
    Talker still runs, and is exactly the windows of the request's codes decoded on their own."""
    o = omni()
    rid = o.engine.add_request(PROMPTS[0], ["text", "audio"], params(codes=40), "ethan")
    audio, codes, first_audio_with_talker_running = [], [], None
    while o.engine.has_work():
        for d in o.engine.step():
            if d.codes is not None:
                codes.append(d.codes)
            if d.audio is not None:
                audio.append(d.audio)
                if first_audio_with_talker_running is None:
                    first_audio_with_talker_running = rid in o.engine.orchestrator.stages["talker"].runner.records
    assert first_audio_with_talker_running is True
    codes = torch.cat(codes, 1)[0]
    t2w = o.engine.orchestrator.stages["token2wav"].runner.model.token2wav
    dit = t2w.code2wav_dit_model
    plan = ChunkPlan(**o.engine.pipeline.stage("token2wav").bridge_args)
    assert plan.max_chunk_blocks is not None and plan.next_chunk(6) > plan.chunk_blocks  # the packaged plan grows
    alone = Token2WavStream(plan, dit.block_size, dit.repeats, "Ethan",
                            NoiseStream(torch.Generator().manual_seed(SEED), dit.mel_dim))
    with torch.inference_mode():
        windows = alone.push(codes) + alone.finish()
        expect = torch.cat(t2w.decode_windows(windows))
    got = torch.cat(audio)
    assert len(audio) == len(windows) > 2 and got.shape == expect.shape == (codes.numel() * 2 * t2w.hop,)
    assert windows[2].keep_frames > windows[1].keep_frames  # a grown chunk was served
    assert (got - expect).abs().max().item() <= 1e-5
    assert_free(o)


def test_talker_waits_for_text_when_the_thinker_is_slower(batched):
    """Throttle the Thinker to every third engine step: the Talker pauses (keeping its KV) instead of running
    ahead of its text, and still speaks exactly the same codes and audio."""
    _, outs = batched
    o = omni(**ONE_SHOT)
    thinker = o.engine.orchestrator.stages["thinker"]
    real_has_work, ticks = thinker.has_work, iter(range(10**6))
    thinker.has_work = lambda: next(ticks) % 3 == 0 and real_has_work()
    sched = o.engine.orchestrator.stages["talker"].scheduler
    pauses, real_pause = [], sched.pause_for_input

    def spy(req_id):
        pauses.append(sched.kv.stats().num_used_blocks)
        return real_pause(req_id)

    sched.pause_for_input = spy
    got = o.generate(PROMPTS, ["text", "audio"], params())
    assert pauses and all(used > 0 for used in pauses)
    for g, want in zip(got, outs):
        assert g.token_ids == want.token_ids and torch.equal(g.codes, want.codes)
        assert (g.audio - want.audio).abs().max().item() <= 1e-5
    assert_free(o)


def test_unknown_voice_lists_the_speakers():
    with pytest.raises(ValueError, match=r"unknown voice 'nobody'; available: \['chelsie', 'ethan'\]"):
        omni().generate("Hi", ["text", "audio"], speaker="nobody")
