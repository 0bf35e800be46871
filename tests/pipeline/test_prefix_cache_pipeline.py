"""Prefix caching end to end (tiny checkpoint, float32): every request's text tokens, codec codes and waveform are
identical with caching on and off, while the Thinker and the Talker really serve rows from their caches.

Codes and tokens are compared exactly; waveforms to 1e-5 (Code2Wav batches by step timing). Each scenario runs the same schedule on an engine with caching on and on one with it off (``EngineArgs``), both
built from the packaged preset with the same overrides, and compares request by request.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistage.core.sampling_params import SamplingParams
from omnistage.models.registry import load_pipeline_config
from omnistage.pipeline.engine import OmniEngine
from omnistage.pipeline.engine_args import EngineArgs
from omnistage.pipeline.faults import ENV_VAR

SYSTEM = {"role": "system", "content": "You are a helpful voice assistant. Answer briefly and kindly, and always "
                                       "say something about the sea and the small boats on it."}
TURN1 = [SYSTEM, {"role": "user", "content": "What is the weather like today by the harbour?"}]
TURN2 = TURN1 + [{"role": "assistant", "content": "Sunny and calm."},
                 {"role": "user", "content": "And tomorrow, will the boats go out?"}]
OTHER = [SYSTEM, {"role": "user", "content": "Tell me about fish."}]
_t = np.arange(8000) / 16000
CLIP = (0.3 * np.sin(2 * np.pi * 330 * _t)).astype(np.float32)  # 0.5 s
CLIP2 = (0.3 * np.sin(2 * np.pi * 440 * _t)).astype(np.float32)


def audio_turn(clip) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": [{"type": "audio", "audio": clip},
                                                 {"type": "text", "text": "What is this sound?"}]}]


def greedy(seed=None):
    return {"thinker": SamplingParams(temperature=0.0, max_tokens=5, min_tokens=5),
            "talker": SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10, repetition_penalty=1.0)}


def sampled(seed):
    return {"thinker": SamplingParams(temperature=0.9, top_k=20, max_tokens=5, min_tokens=5, seed=seed),
            "talker": SamplingParams(temperature=0.9, top_k=20, max_tokens=10, min_tokens=10, seed=seed + 100)}


def make_engine(ckpt, caching: bool, **stages) -> OmniEngine:
    overrides = {"stages": {name: dict(values) for name, values in stages.items()}}
    engine = OmniEngine(EngineArgs(str(ckpt), fast=False, enable_prefix_caching=caching),
                        load_pipeline_config("qwen3_omni", overrides))
    # Count the Thinker's preemptions from its scheduler's outputs (a spy: nothing else changes).
    scheduler = engine.orchestrator.stages["thinker"].scheduler
    schedule, engine.preempted = scheduler.schedule, set()

    def spy():
        out = schedule()
        engine.preempted |= out.preempted_req_ids
        return out

    scheduler.schedule = spy
    return engine


def run(engine: OmniEngine, schedule: dict[int, list[tuple]], aborts: dict[int, list[str]] | None = None):
    """schedule: {step: [(name, prompt, modalities, params), ...]}; returns {name: tokens, codes, audio, finish}."""
    aborts = aborts or {}
    ids, results, step = {}, {}, 0
    pending = dict(schedule)
    while pending or engine.has_work():
        for name, prompt, modalities, params in pending.pop(step, []):
            # A "fail-" name is the request's id (OMNISTAGE_FAULTS patterns match it).
            rid = name if name.startswith("fail-") else None
            ids[engine.add_request(prompt, modalities, params, speaker="ethan", request_id=rid)] = name
        for name in aborts.get(step, []):
            assert engine.abort(next(r for r, n in ids.items() if n == name))
        for d in engine.step():
            r = results.setdefault(ids[d.req_id], {"tokens": [], "codes": [], "audio": [], "finish": None})
            r["tokens"] += d.new_token_ids
            r["codes"] += [] if d.codes is None else [d.codes]
            r["audio"] += [] if d.audio is None else [d.audio]
            r["finish"] = d.finish_reason if d.finished else r["finish"]
        step += 1
        assert step < 3000
    for r in results.values():
        r["codes"] = torch.cat(r["codes"], 1) if r["codes"] else None
        r["audio"] = torch.cat(r["audio"]) if r["audio"] else None
    return results


def assert_same(on: dict, off: dict) -> None:
    assert on.keys() == off.keys()
    for name in on:
        a, b = on[name], off[name]
        assert a["tokens"] == b["tokens"] and a["finish"] == b["finish"], name
        for key in ("codes", "audio"):
            assert (a[key] is None) == (b[key] is None), (name, key)
        if a["codes"] is not None:
            assert torch.equal(a["codes"], b["codes"]), name
            # Code2Wav's batches follow the step timing, which caching changes: its batch invariance is 1e-5
            # (as in test_pipeline_parity); the codes it decodes are exact.
            assert (a["audio"] - b["audio"]).abs().max().item() <= 1e-5, name


def assert_all_free(engine: OmniEngine) -> None:
    stats = engine.resource_stats()
    for stage in ("thinker", "talker"):
        s = stats[stage]
        assert s["kv_free_blocks"] == s["kv_blocks"] and s["records"] == 0 and s["bridge_entries"] == 0, (stage, s)


def hits(engine: OmniEngine) -> dict[str, int]:
    stats = engine.resource_stats()
    return {stage: stats[stage]["prefix_cache_hits"] for stage in ("thinker", "talker")}


def on_and_off(ckpt, schedule, aborts=None, **stages):
    results, engines = [], []
    for caching in (True, False):
        engine = make_engine(ckpt, caching, **stages)
        results.append(run(engine, schedule, aborts))
        assert_all_free(engine)
        engines.append(engine)
    assert_same(*results)
    assert hits(engines[1]) == {"thinker": 0, "talker": 0}
    return results[0], engines[0]


SPEECH = ["text", "audio"]


@pytest.mark.parametrize("params", [greedy, sampled], ids=["greedy", "seeded-sampling"])
def test_a_spoken_conversation_reuses_both_stages_and_is_identical(tiny_ckpt, params):
    """Turn 2 re-sends turn 1 (the Thinker's and the Talker's rows of it are cached); a request sharing only
    the system prompt runs alongside turn 2; the exact same prompt again hits all but its last token."""
    schedule = {0: [("turn1", TURN1, SPEECH, params(1))],
                40: [("turn2", TURN2, SPEECH, params(2)), ("other", OTHER, SPEECH, params(3))],
                80: [("again", TURN2, SPEECH, params(2))]}
    results, engine = on_and_off(tiny_ckpt, schedule)
    got = hits(engine)
    assert got["thinker"] >= 3 * 16 and got["talker"] >= 16, got
    # The same prompt with the same seeds gives the same answer: the fully cached run is exact too.
    assert_same({"x": results["again"]}, {"x": results["turn2"]})


def test_preemption_chunked_prefill_and_abort_mid_prefill_are_identical(tiny_ckpt):
    """A Thinker pool of 8 blocks (the four requests need about 16) preempts and evicts; 24-token chunks; one is
    aborted in the middle of its prefill and the same prompt comes back, taking the blocks it had computed."""
    schedule = {0: [("a", TURN2, SPEECH, greedy()), ("b", OTHER, ["text"], greedy()),
                    ("c", TURN1, SPEECH, greedy())],
                1: [("doomed", TURN2 + [{"role": "user", "content": "One more thing."}], ["text"], greedy())],
                60: [("back", TURN2 + [{"role": "user", "content": "One more thing."}], ["text"], greedy())]}
    thinker = {"scheduler": {"num_blocks": 8, "max_model_len": 128, "max_num_batched_tokens": 24},
               "sampling": {"max_tokens": 64}}
    on, engine = on_and_off(tiny_ckpt, schedule, aborts={2: ["doomed"]}, thinker=thinker)
    assert on["doomed"]["finish"] == "abort" and on["back"]["finish"] == "length"
    assert engine.preempted and engine.resource_stats()["thinker"]["prefix_cache_evictions"] > 0


def test_a_request_failing_in_the_step_that_admits_a_cache_hit_leaves_the_hit_exact(tiny_ckpt, monkeypatch):
    """A Thinker fault cancels the step that admitted a spoken request with a cache hit; the step runs again
    without the failed request, and the Talker rows of the cache-served positions (made in the step that admits)
    still reach the Talker: the answer is the same prompt's solo answer, and the failure is the other's alone."""
    monkeypatch.setenv(ENV_VAR, "thinker:fail-*")
    schedule = {0: [("turn1", TURN1, SPEECH, greedy())],
                40: [("again", TURN1, SPEECH, greedy()), ("fail-1", OTHER, SPEECH, greedy())]}
    on, engine = on_and_off(tiny_ckpt, schedule)
    assert on["fail-1"]["finish"] == "error" and on["again"]["finish"] == on["turn1"]["finish"]
    assert hits(engine)["thinker"] >= 16
    assert_same({"x": on["again"]}, {"x": on["turn1"]})


def test_the_talker_refuses_a_prompt_with_rows_that_never_arrived(tiny_ckpt):
    """A gap among the Thinker rows the Talker reads would be read as zeros (wrong speech, no error): refused."""
    engine = make_engine(tiny_ckpt, True)
    talker = engine.orchestrator.stages["talker"].runner.model
    ids = engine.render_prompt(TURN1).token_ids
    thinker = engine.orchestrator.stages["thinker"].runner.model.thinker
    rows = dict(enumerate(thinker.embed(torch.tensor(ids)).unbind(0)))
    first = rows[len(ids) - 1]
    speaker = engine.family.speakers["ethan"]
    talker.build_prefill(ids, rows, {}, first, speaker)  # every row there: builds
    del rows[len(ids) - 2]
    with pytest.raises(RuntimeError, match=rf"positions \[{len(ids) - 2}\] never arrived"):
        talker.build_prefill(ids, rows, {}, first, speaker)


def test_media_prompts_are_identical_and_cached_only_where_the_rows_are_equal(tiny_ckpt):
    """A text answer about a clip: the same clip again is served from the cache past the clip's rows; another
    clip of the same length shares only the system prompt. A spoken answer about a clip reuses only what
    precedes the clip (the Talker needs the clip rows' accept-layer states from a forward pass)."""
    schedule = {0: [("clip", audio_turn(CLIP), ["text"], greedy())],
                30: [("same clip", audio_turn(CLIP), ["text"], greedy())],
                60: [("other clip", audio_turn(CLIP2), ["text"], greedy())],
                90: [("spoken", audio_turn(CLIP), SPEECH, greedy())]}
    _, engine = on_and_off(tiny_ckpt, schedule)
    prompt = engine.render_prompt(audio_turn(CLIP)).token_ids
    audio_id = engine.family.config.thinker_config.audio_token_id
    first_audio = list(prompt).index(audio_id)
    full = (len(prompt) - 1) // 16 * 16
    system = first_audio // 16 * 16
    # same clip: everything but the last block; other clip: the system prompt; spoken: rows before the clip.
    assert hits(engine)["thinker"] == full + system + system


def test_qwen2_5_omni_text_answers_reuse_the_thinker_and_spoken_ones_prefill_in_full(q25_ckpt):
    """Qwen2.5-Omni's Talker reads the Thinker's embedding + final hidden row of every prompt position, which
    only a forward pass gives: a request that speaks takes no cached block, a text answer does; both are
    identical to caching off."""
    schedule = {0: [("turn1", TURN1, ["text"], greedy())],
                30: [("turn2", TURN2, ["text"], greedy())],
                60: [("spoken", TURN2, SPEECH, greedy())]}
    results, engines = [], []
    for caching in (True, False):
        engine = OmniEngine(EngineArgs(str(q25_ckpt), fast=False, enable_prefix_caching=caching),
                            load_pipeline_config("qwen2_5_omni"))
        results.append(run(engine, schedule))
        assert_all_free(engine)
        engines.append(engine)
    on, off = results
    for name in on:
        assert on[name]["tokens"] == off[name]["tokens"] and on[name]["finish"] == off[name]["finish"], name
    # (Token2Wav holds no KV: its waveform follows from these codes and the request's unseeded noise.)
    assert on["spoken"]["codes"] is not None and torch.equal(on["spoken"]["codes"], off["spoken"]["codes"])
    stats = [e.resource_stats()["thinker"] for e in engines]
    assert stats[1]["prefix_cache_hits"] == 0
    # Only turn2 (text) hit: the spoken request re-sent the same prompt and prefilled all of it.
    block = engines[0].pipeline.stage("thinker").scheduler.block_size
    prompt = len(engines[0].render_prompt(TURN2).token_ids)
    assert 0 < stats[0]["prefix_cache_hits"] <= prompt - 1 and stats[0]["prefix_cache_hits"] % block == 0
