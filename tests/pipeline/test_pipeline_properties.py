"""Pipeline properties under random traffic, on the real engine (tiny checkpoints, float32), for every model
family.

Random mixes of text-only and text+audio requests arrive at staggered steps (Qwen2.5-Omni's prompts include
audio and image input); some are aborted; the KV pools of the Thinker and the Talker are small enough to force
preemption in both; the generation stage's chunking is random; sampling is greedy or seeded with
temperature > 0. Every surviving request must equal its solo run (tokens and codes exactly, audio to float
rounding), every aborted one gets its final event, and afterwards every stage holds nothing (encoder outputs
included). Failures injected into one request of a stage stay with that request, in either family.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from omnistage.core.sampling_params import SamplingParams
from omnistage.models.registry import load_pipeline_config
from omnistage.pipeline.engine import OmniEngine
from omnistage.pipeline.engine_args import EngineArgs
from omnistage.pipeline.faults import ENV_VAR

PROMPTS = [
    "Hi",
    "Sing.",
    "What is the weather like?",
    "Tell me a short story about the sea and a small boat.",
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Why?"}],
]


_media_rng = np.random.default_rng(3)
# Media prompts (Qwen2.5-Omni): a short clip (13 placeholders), a 56 x 56 image (4), both.
CLIP = (_media_rng.standard_normal(8077) * 0.1).astype(np.float32)
PICTURE = _media_rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)
MEDIA_PROMPTS = [
    [{"role": "user", "content": [{"type": "audio", "audio": CLIP}, {"type": "text", "text": "What is it?"}]}],
    [{"role": "user", "content": [{"type": "image", "image": PICTURE}, {"type": "text", "text": "Look."}]}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": [{"type": "image", "image": PICTURE}, {"type": "audio", "audio": CLIP}]}],
]


def _code2wav_args(rng: random.Random) -> dict:
    return {"first_chunk_frames": rng.randint(1, 6), "chunk_frames": rng.randint(1, 8)}


def _token2wav_args(rng: random.Random) -> dict:
    chunk = rng.randint(1, 3)
    return {"chunk_blocks": chunk, "past_blocks": rng.randint(0, 2), "future_blocks": rng.randint(0, 2),
            "max_chunk_blocks": rng.choice([None, chunk, rng.randint(chunk, 8)])}  # fixed or growing chunks


@dataclass(frozen=True)
class Family:
    """What the scenarios need to know about a family: its tiny checkpoint (a fixture), KV pools small enough
    to preempt, its generation stage and random chunking for it."""

    name: str
    checkpoint: str
    max_model_len: int
    thinker_blocks: int
    talker_blocks: int
    generation_stage: str
    random_bridge_args: Callable[[random.Random], dict]
    seeds: tuple[int, ...]
    seed_every_talker: bool = False  # the audio depends on the request's seed even when the Talker is greedy
    media_prompts: tuple = ()  # prompts with media parts, drawn beside PROMPTS


FAMILIES = {
    # The Thinker pool is the smallest that holds one request: with prefix caching on (the default) the
    # requests share the blocks of their common prompts, and a larger pool no longer preempts.
    "qwen3_omni": Family("qwen3_omni", "tiny_ckpt", 64, 16, 18, "code2wav", _code2wav_args, (0, 1, 2)),
    # Prompts carry the ~100-token speech system prompt; Token2Wav's ODE noise follows the request's seed.
    "qwen2_5_omni": Family("qwen2_5_omni", "q25_ckpt", 160, 60, 56, "token2wav", _token2wav_args, (0, 1),
                           seed_every_talker=True, media_prompts=tuple(MEDIA_PROMPTS)),
}


def tight_engine(ckpt, rng: random.Random, family: Family = FAMILIES["qwen3_omni"]) -> OmniEngine:
    bridge = family.random_bridge_args(rng)
    small = {"block_size": 4, "max_model_len": family.max_model_len, "max_num_seqs": 4, "max_num_batched_tokens": 32,
             "kv_cache_bytes": None}
    overrides = {"stages": {
        "thinker": {"scheduler": {**small, "num_blocks": family.thinker_blocks}, "sampling": {"max_tokens": 16}},
        "talker": {"scheduler": {**small, "num_blocks": family.talker_blocks}, "sampling": {"max_tokens": 24}},
        family.generation_stage: {"bridge_args": bridge, "scheduler": {"max_num_seqs": 2}},
    }}
    return OmniEngine(EngineArgs(str(ckpt)), load_pipeline_config(family.name, overrides))


def random_request(rng: random.Random, family: Family) -> dict:
    sampled = rng.random() < 0.5
    thinker = SamplingParams(temperature=0.8 if sampled else 0.0, top_k=20 if sampled else 0,
                             seed=rng.randrange(2**31) if sampled else None, max_tokens=rng.randint(2, 10))
    talker = SamplingParams(temperature=0.9 if sampled else 0.0, top_k=50, repetition_penalty=1.05 if sampled else 1.0,
                            seed=rng.randrange(2**31) if sampled else None, max_tokens=rng.randint(4, 20))
    if family.seed_every_talker and talker.seed is None:
        talker = talker.replace(seed=rng.randrange(2**31))
    audio = rng.random() < 0.7
    return {"prompt": rng.choice([*PROMPTS, *family.media_prompts]), "modalities": ["text", "audio"] if audio else ["text"],
            "params": {"thinker": thinker, "talker": talker}}


def drive(engine: OmniEngine, requests: dict[str, dict], arrivals: dict[int, list[str]],
          aborts: dict[int, list[str]] | None = None) -> dict[str, dict]:
    """Run until idle; arrivals/aborts by engine step. Returns per request: tokens, codes, audio, finish."""
    aborts = aborts or {}
    out = {r: {"tokens": [], "codes": [], "audio": [], "finish": None, "events_after_finish": 0} for r in requests}
    pending = {k: list(v) for k, v in arrivals.items()}
    step = 0
    while pending or engine.has_work():
        for r in pending.pop(step, []):
            spec = requests[r]
            engine.add_request(spec["prompt"], spec["modalities"], spec["params"], "ethan", request_id=r)
        for r in aborts.get(step, []):
            engine.abort(r)
        for d in engine.step():
            o = out[d.req_id]
            o["events_after_finish"] += o["finish"] is not None
            o["tokens"] += d.new_token_ids
            if d.codes is not None:
                o["codes"].append(d.codes)
            if d.audio is not None:
                o["audio"].append(d.audio)
            if d.finished:
                o["finish"], o["error"] = d.finish_reason, d.error
        step += 1
        assert step < 5000
    for o in out.values():
        o["codes"] = torch.cat(o["codes"], 1) if o["codes"] else None
        o["audio"] = torch.cat(o["audio"]) if o["audio"] else torch.zeros(0)
    return out


def assert_idle(engine: OmniEngine) -> None:
    stats = engine.resource_stats()
    assert stats["requests"] == 0
    for name in engine.pipeline.order:
        s = stats[name]
        assert s["running"] == 0 and s["waiting"] == 0, (name, s)
        assert s["records"] == 0 and s["bridge_entries"] == 0, (name, s)
        if "kv_blocks" in s:
            assert s["kv_free_blocks"] == s["kv_blocks"] and s["batch_size"] == 0, (name, s)
        if "pending_chunks" in s:
            assert s["pending_chunks"] == 0, (name, s)
        if "encoder_entries" in s:
            assert s["encoder_entries"] == 0 and s["encoder_holders"] == 0, (name, s)
    assert not engine.has_work()


def assert_same(got: dict, solo: dict, name: str) -> None:
    assert got["tokens"] == solo["tokens"], name
    assert got["finish"] == solo["finish"], name
    if solo["codes"] is None:
        assert got["codes"] is None, name
    else:
        assert got["codes"] is not None and torch.equal(got["codes"], solo["codes"]), name
    assert got["audio"].shape == solo["audio"].shape, name
    if solo["audio"].numel():
        assert (got["audio"] - solo["audio"]).abs().max().item() <= 1e-5, name


def count_preemptions(engine: OmniEngine) -> dict[str, int]:
    counts = {}
    for name in ("thinker", "talker"):
        sched = engine.orchestrator.stages[name].scheduler
        counts[name] = 0
        original = sched._preempt

        def spy(request, _name=name, _original=original):
            counts[_name] += 1
            return _original(request)

        sched._preempt = spy
    return counts


@pytest.mark.parametrize("family", FAMILIES.values(), ids=FAMILIES.keys())
def test_random_traffic_with_preemption_aborts_and_sampling_equals_solo_runs(family, request):
    ckpt = request.getfixturevalue(family.checkpoint)
    totals = {"requests": 0, "audio": 0, "sampled": 0, "aborted": 0, "thinker_preemptions": 0,
              "talker_preemptions": 0, "media": 0}
    for seed in family.seeds:
        rng = random.Random(seed)
        engine = tight_engine(ckpt, rng, family)
        preemptions = count_preemptions(engine)
        requests = {f"s{seed}-r{i}": random_request(rng, family) for i in range(7)}
        arrivals: dict[int, list[str]] = {}
        for r in requests:
            arrivals.setdefault(rng.randint(0, 12), []).append(r)
        first = {r: step for step, rs in arrivals.items() for r in rs}
        victims = rng.sample(sorted(requests), 2)
        aborts: dict[int, list[str]] = {}
        for r in victims:
            aborts.setdefault(first[r] + rng.randint(0, 14), []).append(r)
        mixed = drive(engine, requests, arrivals, aborts)
        assert_idle(engine)
        for r, spec in requests.items():
            got = mixed[r]
            assert got["finish"] is not None, f"{r} never got its final event"
            assert got["events_after_finish"] == 0, f"{r} got events after its final one"
            if got["finish"] == "abort":
                assert r in victims
                continue
            solo = drive(engine, {r: spec}, {0: [r]})[r]
            assert_same(got, solo, r)
            assert_idle(engine)
        totals["requests"] += len(requests)
        totals["audio"] += sum("audio" in s["modalities"] for s in requests.values())
        totals["media"] += sum(any(s["prompt"] is m for m in family.media_prompts) for s in requests.values())
        totals["sampled"] += sum(s["params"]["thinker"].temperature > 0 for s in requests.values())
        totals["aborted"] += sum(mixed[r]["finish"] == "abort" for r in requests)
        totals["thinker_preemptions"] += preemptions["thinker"]
        totals["talker_preemptions"] += preemptions["talker"]
    print(f"property test ({family.name}):", totals)
    # The scenarios exercised what they are for.
    assert totals["thinker_preemptions"] > 0 and totals["talker_preemptions"] > 0
    assert totals["aborted"] > 0 and totals["sampled"] > 0 and totals["audio"] > 0
    assert totals["media"] > 0 or not family.media_prompts


@pytest.mark.parametrize("family, stage", [
    (FAMILIES["qwen3_omni"], "thinker"), (FAMILIES["qwen3_omni"], "talker"), (FAMILIES["qwen3_omni"], "code2wav"),
    (FAMILIES["qwen2_5_omni"], "thinker"), (FAMILIES["qwen2_5_omni"], "talker"),
    (FAMILIES["qwen2_5_omni"], "token2wav"),
], ids=lambda v: v.name if isinstance(v, Family) else v)
def test_a_failure_in_one_request_stays_with_it(family, stage, monkeypatch, request):
    """An injected fault in one request of a stage: that request ends with an error, the others finish
    with their solo outputs, and every stage is empty afterwards (Qwen2.5-Omni's victim and one other request
    bring media: their encoder outputs are freed too)."""
    ckpt = request.getfixturevalue(family.checkpoint)
    monkeypatch.setenv(ENV_VAR, f"{stage}:victim*")
    rng = random.Random(7)
    engine = tight_engine(ckpt, rng, family)
    greedy = {"thinker": SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6),
              "talker": SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.0)}
    seeded = {"thinker": SamplingParams(temperature=0.8, seed=3, max_tokens=6),
              "talker": SamplingParams(temperature=0.9, top_k=50, seed=4, max_tokens=12)}
    media = bool(family.media_prompts)
    if family.seed_every_talker:
        greedy = {**greedy, "talker": greedy["talker"].replace(seed=5)}
    requests = {
        "a": {"prompt": MEDIA_PROMPTS[1] if media else PROMPTS[3], "modalities": ["text", "audio"], "params": seeded},
        "victim": {"prompt": MEDIA_PROMPTS[2] if media else PROMPTS[2], "modalities": ["text", "audio"],
                   "params": greedy},
        "b": {"prompt": PROMPTS[0], "modalities": ["text", "audio"], "params": greedy},
        "c": {"prompt": PROMPTS[1], "modalities": ["text"], "params": seeded},
    }
    mixed = drive(engine, requests, {0: ["a", "victim"], 1: ["b", "c"]})
    assert_idle(engine)
    assert mixed["victim"]["finish"] == "error" and f"injected fault in stage '{stage}'" in mixed["victim"]["error"]
    monkeypatch.delenv(ENV_VAR)
    solo_engine = tight_engine(ckpt, random.Random(7), family)  # same chunking, no faults
    for r in ("a", "b", "c"):
        solo = drive(solo_engine, {r: requests[r]}, {0: [r]})[r]
        assert_same(mixed[r], solo, r)


def test_a_failure_that_belongs_to_the_whole_batch_stops_the_engine_but_alone_it_fails_one_request(
        tiny_ckpt, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "talker:crash*:crash")
    engine = tight_engine(tiny_ckpt, random.Random(7))
    params = {"thinker": SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4),
              "talker": SamplingParams(temperature=0.0, max_tokens=6)}
    spec = {"prompt": PROMPTS[0], "modalities": ["text", "audio"], "params": params}
    alone = drive(engine, {"crash-1": spec}, {0: ["crash-1"]})["crash-1"]
    assert alone["finish"] == "error" and "injected crash" in alone["error"]
    assert_idle(engine)
    with pytest.raises(RuntimeError, match="injected crash in stage 'talker' \\(batch of 2\\)"):
        # (Another prompt for "ok": with the same one it would wait a step for the block crash-2 computes, and
        # the two would not share their first Talker step.)
        drive(engine, {"crash-2": spec, "ok": {**spec, "prompt": PROMPTS[1]}}, {0: ["crash-2", "ok"]})
