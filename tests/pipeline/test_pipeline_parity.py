"""End-to-end: Thinker -> Talker -> Code2Wav under concurrency, against transformers' generate(return_audio=True).

Greedy float32 on the tiny checkpoint. Three prompts of different lengths run concurrently with staggered
arrivals; each request's text tokens and codec codes must equal the reference exactly and its waveform to
1e-4 (chunking matched to the reference: 300 frames, 25 of left context).
"""

from __future__ import annotations

import functools

import pytest
import torch

from omnistage.core.sampling_params import SamplingParams
from omnistage.models.layers import cpu_kernels
from omnistage.models.layers.fast_linear import PackedLinear, can_pack, onednn_available
from omnistage.models.layers.moe import StackedExperts
from omnistage.models.qwen3_omni.stage_models import TalkerStageModel
from omnistage.models.qwen3_omni.talker import Talker
from omnistage.models.registry import load_pipeline_config
from omnistage.pipeline.engine import OmniEngine
from omnistage.pipeline.engine_args import EngineArgs
from omnistage.testing.reference import captured_codes, load_hf_reference

PROMPTS = [
    "Hi",
    "Tell me a short story about the sea and a small boat.",
    [
        {"role": "system", "content": "You are a helpful voice assistant."},
        {"role": "user", "content": "What is the weather like?"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "And tomorrow?"},
    ],
]
THINKER_TOKENS = [6, 9, 7]
TALKER_TOKENS = 24


def make_engine(ckpt, bridge_args=None, **stage_overrides):
    """The packaged preset (streamed Code2Wav in small chunks: audio equals one-shot decoding, so equals the
    reference for answers of up to 300 frames), with overrides."""
    overrides = {"stages": {"code2wav": {"bridge_args": dict(bridge_args or {})}}}
    for stage, values in stage_overrides.items():
        overrides["stages"].setdefault(stage, {}).update(values)
    return OmniEngine(EngineArgs(str(ckpt)), load_pipeline_config("qwen3_omni", overrides))


def params(i):
    n = THINKER_TOKENS[i]
    return {
        "thinker": SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n),
        "talker": SamplingParams(temperature=0.0, max_tokens=TALKER_TOKENS, repetition_penalty=1.0),
    }


def run(engine, schedule, aborts=None, params=params):
    """schedule: {step: [prompt index, ...]}; returns per prompt index: tokens, codes, audio, finish."""
    aborts = aborts or {}
    ids, results, step = {}, {}, 0
    pending = {k: list(v) for k, v in schedule.items()}
    while pending or engine.has_work():
        for i in pending.pop(step, []):
            ids[engine.add_request(PROMPTS[i], ["text", "audio"], params(i), speaker="ethan")] = i
        for i in aborts.get(step, []):
            rid = next(r for r, j in ids.items() if j == i)
            assert engine.abort(rid)
        for d in engine.step():
            r = results.setdefault(ids[d.req_id], {"tokens": [], "codes": [], "audio": [], "finish": None})
            r["tokens"] += d.new_token_ids
            if d.codes is not None:
                r["codes"].append(d.codes)
            if d.audio is not None:
                r["audio"].append(d.audio)
            if d.finished:
                r["finish"] = d.finish_reason
        step += 1
        assert step < 2000
    for r in results.values():
        r["codes"] = torch.cat(r["codes"], 1) if r["codes"] else None
        r["audio"] = torch.cat(r["audio"]) if r["audio"] else torch.zeros(0)
    return results


def assert_all_free(engine):
    stats = engine.resource_stats()
    for stage in ("thinker", "talker"):
        s = stats[stage]
        assert s["kv_free_blocks"] == s["kv_blocks"], (stage, s)
        assert s["records"] == 0 and s["batch_size"] == 0 and s["bridge_entries"] == 0, (stage, s)
        assert s["running"] == 0 and s["waiting"] == 0, (stage, s)
    c2w = stats["code2wav"]
    assert c2w["pending_chunks"] == 0 and c2w["waiting"] == 0 and c2w["records"] == 0 and c2w["bridge_entries"] == 0
    assert stats["requests"] == 0


@functools.cache
def reference(ckpt_str: str, i: int, repetition_penalty: float = 1.0):
    """transformers' greedy generate for prompt i: (generated ids, codes [Q, T], waveform)."""
    from transformers import AutoTokenizer

    hf = load_hf_reference(ckpt_str)
    tok = AutoTokenizer.from_pretrained(ckpt_str)
    prompt = PROMPTS[i]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    input_ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]
    with captured_codes(hf) as captured:
        n = THINKER_TOKENS[i]
        with torch.no_grad():
            seq, wav = hf.generate(
                input_ids,
                speaker="ethan",
                return_audio=True,
                thinker_max_new_tokens=n,
                thinker_min_new_tokens=n,
                thinker_eos_token_id=hf.config.im_end_token_id,
                talker_max_new_tokens=TALKER_TOKENS,
                talker_do_sample=False,
                talker_repetition_penalty=repetition_penalty,
            )
    return seq[0, input_ids.shape[1] :].tolist(), captured["codes"], wav.reshape(-1)


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return make_engine(tiny_ckpt)


@pytest.fixture(scope="module")
def concurrent(engine):
    out = run(engine, {0: [1], 2: [0], 5: [2]})
    assert_all_free(engine)
    return out


def assert_matches_reference(ckpt, results, prompts=None) -> None:
    """``run``'s results for these prompt indices (default: all): tokens and codes equal transformers' generate,
    audio within 1e-4."""
    for i in range(len(PROMPTS)) if prompts is None else prompts:
        tokens, codes, wav = reference(str(ckpt), i)
        got = results[i]
        assert got["tokens"] == tokens
        assert got["codes"] is not None and got["codes"].shape == codes.shape
        assert torch.equal(got["codes"], codes)
        assert got["audio"].shape == wav.shape
        assert (got["audio"] - wav).abs().max().item() <= 1e-4


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_concurrent_requests_match_transformers(tiny_ckpt, concurrent, i):
    assert_matches_reference(tiny_ckpt, concurrent, [i])
    assert concurrent[i]["finish"] == "length"


def test_batch_invariance_alone_vs_mixed_with_abort(engine, concurrent):
    for i in range(len(PROMPTS)):
        alone = run(engine, {0: [i]})[i]
        assert alone["tokens"] == concurrent[i]["tokens"]
        assert torch.equal(alone["codes"], concurrent[i]["codes"])
        assert (alone["audio"] - concurrent[i]["audio"]).abs().max().item() <= 1e-5
    # A request aborted mid-flight does not disturb the others, and frees everything it held.
    mixed = run(engine, {0: [0, 1], 1: [2]}, aborts={4: [1]})
    assert mixed[1]["finish"] == "abort"
    for i in (0, 2):
        assert mixed[i]["tokens"] == concurrent[i]["tokens"]
        assert torch.equal(mixed[i]["codes"], concurrent[i]["codes"])
    assert_all_free(engine)


def test_batch_invariance_of_a_checkpoint_stored_in_bfloat16_served_in_float32(tmp_path):
    """Weights that are bfloat16 values take other kernels in a float32 model (bfloat16 pair panels everywhere;
    on AMX CPUs Code2Wav's convolutions on AMX tiles): each request's tokens, codes and audio are still the same
    alone as among others."""
    import dataclasses

    from omnistage.checkpoints.builder import build_checkpoint
    from omnistage.checkpoints.presets import get_preset

    ckpt = build_checkpoint(tmp_path, dataclasses.replace(get_preset("tiny"), storage_dtype="bfloat16"), seed=3)
    eng = make_engine(ckpt)
    if cpu_kernels.available() and cpu_kernels._has_pairs():
        thinker = eng.orchestrator.stages["thinker"].runner.model.thinker
        panels = [m.panels for m in thinker.modules() if isinstance(m, PackedLinear) and m.panels is not None]
        assert panels and all(p.dtype == torch.bfloat16 for p in panels)
    together = run(eng, {0: [0, 1, 2]})
    for i in range(len(PROMPTS)):
        alone = run(eng, {0: [i]})[i]
        assert alone["tokens"] == together[i]["tokens"]
        assert torch.equal(alone["codes"], together[i]["codes"])
        assert (alone["audio"] - together[i]["audio"]).abs().max().item() <= 1e-5
    assert_all_free(eng)


def test_text_only_request_never_reaches_the_talker(engine):
    seen = []

    def listener(ev):
        seen.append((ev.stage, set(ev.client_outputs) | set(ev.finished)))

    engine.orchestrator.listeners.append(listener)
    try:
        rid = engine.add_request("Hi", ["text"], SamplingParams(temperature=0.0, max_tokens=4))
        while engine.has_work():
            engine.step()
    finally:
        engine.orchestrator.listeners.remove(listener)
    assert any(stage == "thinker" and rid in ids for stage, ids in seen)
    assert not any(stage != "thinker" and rid in ids for stage, ids in seen)
    assert_all_free(engine)


@pytest.mark.parametrize("abort_step", [0, 2, 6, 12])
def test_abort_at_each_stage_frees_everything(engine, abort_step):
    run(engine, {0: [1]}, aborts={abort_step: [1]})
    assert_all_free(engine)


def test_streaming_audio_arrives_before_thinker_finishes_and_equals_one_shot_decoding(tiny_ckpt):
    args = {"first_chunk_frames": 1, "chunk_frames": 3}
    eng = make_engine(tiny_ckpt, args)
    n = 30
    p = {
        "thinker": SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n),
        "talker": SamplingParams(temperature=0.0, max_tokens=TALKER_TOKENS, repetition_penalty=1.0),
    }
    rid = eng.add_request(PROMPTS[1], ["text", "audio"], p, speaker="ethan")
    text_done_at = first_audio_at = None
    audio, codes, step = [], [], 0
    while eng.has_work():
        step += 1
        for d in eng.step():
            assert d.req_id == rid
            if d.audio is not None:
                audio.append(d.audio)
                first_audio_at = first_audio_at or step
            if d.codes is not None:
                codes.append(d.codes)
        if text_done_at is None and rid not in eng.orchestrator.stages["thinker"].runner.records:
            text_done_at = step
    assert first_audio_at is not None and text_done_at is not None
    assert first_audio_at < text_done_at, "audio must stream while the Thinker is still writing"
    code2wav = eng.orchestrator.stages["code2wav"].runner.model.code2wav
    all_codes = torch.cat(codes, 1)
    with torch.no_grad():
        expect = code2wav(all_codes[None])[0, 0]  # one-shot decoding of every frame
    got = torch.cat(audio)
    assert got.shape == expect.shape
    assert (got - expect).abs().max().item() <= 1e-5
    assert_all_free(eng)


def test_cuda_graph_runner_gives_identical_tokens_codes_and_audio(tiny_ckpt, concurrent):
    from omnistage.runner.graph_runner import CUDAGraphARRunner

    eng = OmniEngine(
        EngineArgs(str(tiny_ckpt)),
        load_pipeline_config(
            "qwen3_omni",
            {"runner": "cuda_graph"},
        ),
    )
    assert isinstance(eng.orchestrator.stages["talker"].runner, CUDAGraphARRunner)
    v2 = run(eng, {0: [1], 2: [0], 5: [2]})
    for i in range(len(PROMPTS)):
        assert v2[i]["tokens"] == concurrent[i]["tokens"]
        assert torch.equal(v2[i]["codes"], concurrent[i]["codes"])
        assert (v2[i]["audio"] - concurrent[i]["audio"]).abs().max().item() <= 1e-5
    assert eng.orchestrator.stages["talker"].runner.stats.replays > 0
    assert_all_free(eng)


def test_talker_preemption_recomputes_to_identical_codes_and_audio(tiny_ckpt, concurrent):
    small_pool = {"scheduler": {"block_size": 4, "num_blocks": 14, "max_model_len": 56}, "sampling": {"max_tokens": 32}}
    eng = make_engine(tiny_ckpt, talker=small_pool)
    preempted = []
    sched = eng.orchestrator.stages["talker"].scheduler
    original = sched._preempt

    def spy(request):
        preempted.append(request.req_id)
        return original(request)

    sched._preempt = spy
    got = run(eng, {0: [0, 1, 2]})
    assert preempted, "the pool was meant to be too small for three talkers at once"
    for i in range(len(PROMPTS)):
        assert got[i]["tokens"] == concurrent[i]["tokens"]
        assert torch.equal(got[i]["codes"], concurrent[i]["codes"])
        assert (got[i]["audio"] - concurrent[i]["audio"]).abs().max().item() <= 1e-5
    assert_all_free(eng)


def test_offline_text_api_matches_transformers_greedy_generate(tiny_ckpt):
    from transformers import AutoTokenizer

    from omnistage import Omni

    omni = Omni(tiny_ckpt)
    hf, tok = load_hf_reference(tiny_ckpt), AutoTokenizer.from_pretrained(str(tiny_ckpt))
    outs = omni.generate(PROMPTS, modalities=["text"], sampling_params=SamplingParams(temperature=0.0, max_tokens=8))
    assert len({o.request_id for o in outs}) == len(PROMPTS)  # one output per prompt, in prompt order below
    for prompt, out in zip(PROMPTS, outs):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
            "input_ids"
        ]
        assert out.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            ref = hf.thinker.generate(ids, max_new_tokens=8, do_sample=False,
                                      eos_token_id=list(omni.engine.family.eos_token_ids))[0, ids.shape[1]:].tolist()
        stop = ref[-1] in omni.engine.family.eos_token_ids
        # Our token_ids exclude the stop token; the reference includes it.
        assert out.token_ids == (ref[:-1] if stop else ref)
        assert out.finish_reason == ("stop" if stop else "length")
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
        assert out.audio is None and out.codes is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"prompt": []}, "empty"),
        ({"prompt": [1, 10**6]}, "token ids"),
        ({"prompt": "hi", "modalities": ["audio"]}, "modalities"),
        ({"prompt": "hi", "modalities": ["text", "audio"], "speaker": "nobody"}, "unknown voice"),
        ({"prompt": "hi", "sampling_params": {"nope": SamplingParams()}}, "unknown stage"),
        ({"prompt": "x " * 5000}, "at most"),
        ({"prompt": [{"role": "robot", "content": "hi"}]}, "role"),
    ],
)
def test_bad_requests_are_rejected_before_touching_any_stage(engine, kwargs, match):
    kwargs = {"modalities": ["text"], **kwargs}
    with pytest.raises(ValueError, match=match):
        engine.add_request(**kwargs)
    assert_all_free(engine)
    assert not engine.has_work()


def test_talker_waits_for_text_when_the_thinker_is_slower(tiny_ckpt, concurrent):
    """Throttle the Thinker to every third engine step: the Talker must pause (keeping its KV) instead of
    running ahead of its text, and still produce exactly the same codes and audio."""
    eng = make_engine(tiny_ckpt)
    thinker = eng.orchestrator.stages["thinker"]
    real_has_work, ticks = thinker.has_work, iter(range(10**6))
    thinker.has_work = lambda: next(ticks) % 3 == 0 and real_has_work()
    pauses = []
    sched = eng.orchestrator.stages["talker"].scheduler
    real_pause = sched.pause_for_input

    def spy(req_id):
        pauses.append((req_id, sched.kv.stats().num_used_blocks))
        return real_pause(req_id)

    sched.pause_for_input = spy
    got = run(eng, {0: [1, 2]})
    assert pauses and all(used > 0 for _, used in pauses)  # paused while holding its blocks
    for i in (1, 2):
        assert got[i]["tokens"] == concurrent[i]["tokens"]
        assert torch.equal(got[i]["codes"], concurrent[i]["codes"])
        assert (got[i]["audio"] - concurrent[i]["audio"]).abs().max().item() <= 1e-5
    assert_all_free(eng)


def test_stop_token_ends_the_answer_and_is_not_returned(engine):
    def answer(params):
        rid = engine.add_request("Hi", ["text"], params)
        tokens, reason = [], None
        while engine.has_work():
            for d in engine.step():
                assert d.req_id == rid
                tokens += d.new_token_ids
                reason = d.finish_reason if d.finished else reason
        return tokens, reason

    free_run, reason = answer(SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert reason == "length" and len(free_run) == 6
    stop_at = next(i for i in range(1, 6) if free_run[i] not in free_run[:i])  # first occurrence
    tokens, reason = answer(SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                           stop_token_ids=[free_run[stop_at]]))
    assert reason == "stop" and tokens == free_run[:stop_at]
    assert_all_free(engine)


@pytest.mark.parametrize("dtype, fast", [("bfloat16", False), ("float32", True), ("bfloat16", True)])
def test_bfloat16_and_fast_pipelines_run_end_to_end(tiny_ckpt, dtype, fast):
    """The serving options without parity (their rounding differs from the reference): bfloat16 weights and
    KV, and ``fast`` (linear layers through oneDNN on packed weights) in either dtype."""
    eng = OmniEngine(EngineArgs(str(tiny_ckpt), dtype=dtype, fast=fast), load_pipeline_config("qwen3_omni"))
    thinker = eng.orchestrator.stages["thinker"].runner
    assert next(thinker.model.thinker.parameters()).dtype == getattr(torch, dtype)
    assert thinker.kv_caches[0].dtype == getattr(torch, dtype)
    if fast and can_pack(torch.empty(1, 1, dtype=getattr(torch, dtype))):  # (oneDNN bfloat16: AVX-512 CPUs)
        for name in ("thinker", "talker", "code2wav"):
            model = eng.orchestrator.stages[name].runner.model
            module = getattr(model, name)
            assert any(isinstance(m, PackedLinear) for m in module.modules()), name
    got = run(eng, {0: [1]})[1]
    assert len(got["tokens"]) == THINKER_TOKENS[1] and got["finish"] == "length"
    frames = got["codes"].shape[1]
    assert frames > 0
    code2wav = eng.orchestrator.stages["code2wav"].runner.model.code2wav
    assert got["audio"].dtype == torch.float32 and torch.isfinite(got["audio"]).all()
    assert got["audio"].numel() == code2wav.samples_for_frames(frames)  # streamed: the one-shot length rule
    assert_all_free(eng)


@pytest.mark.skipif(not onednn_available(), reason="oneDNN is not available in this torch build")
def test_fast_compiled_pipeline_matches_transformers(tiny_ckpt, monkeypatch):
    """``fast`` as served: the code predictor's passes through the decoder-pass kernel where it builds (else its
    frame compiled: packed heads, inductor's own norms and activations), decode steps through the decoder-step
    kernel and the expert kernel for the other batches: its rounding differs from the reference's, its tokens
    and codes do not, here."""
    monkeypatch.setenv("OMNISTAGE_COMPILE", "1")
    kernel_rows = []
    kernel = StackedExperts.kernel
    monkeypatch.setattr(StackedExperts, "kernel", lambda self, x, *a: kernel_rows.append(len(x)) or kernel(self, x, *a))
    step_rows, step = [], cpu_kernels.decoder_step
    monkeypatch.setattr(cpu_kernels, "decoder_step", lambda x, *a: step_rows.append(len(x)) or step(x, *a))
    # Whether each Talker step's forward brought its logits (decode steps: the codec head in the kernel's call),
    # and how often the runner computed them itself.
    forward_logits, head_calls = [], []
    with_logits, compute_logits = Talker.forward_with_logits, TalkerStageModel.compute_logits

    def recorded_forward(self, *args):
        hidden, logits = with_logits(self, *args)
        forward_logits.append(logits is not None)
        return hidden, logits

    monkeypatch.setattr(Talker, "forward_with_logits", recorded_forward)
    monkeypatch.setattr(TalkerStageModel, "compute_logits",
                        lambda self, h: head_calls.append(len(h)) or compute_logits(self, h))
    eng = OmniEngine(EngineArgs(str(tiny_ckpt), fast=True), load_pipeline_config("qwen3_omni"))
    predictor = eng.orchestrator.stages["talker"].runner.model.talker.code_predictor
    assert predictor.packed_heads is not None and not predictor.frame_compiler.exact
    got = run(eng, {0: [1], 2: [0], 5: [2]})
    if cpu_kernels.available():  # every frame's passes in the kernel: no graph compiled
        assert predictor.pass_layers() and predictor.frame_compiler.compile_seconds is None
    else:
        assert predictor.frame_compiler.failure is None and predictor.frame_compiler.compile_seconds is not None
    # Decode steps of 1-3 rows ran all their layers in one decoder-step call each, and the prefills took the
    # expert kernel (where the kernels build: a C compiler).
    if cpu_kernels.available():
        assert {1, 2, 3} <= set(step_rows) and max(kernel_rows) > 3
        assert forward_logits.count(True) > forward_logits.count(False)  # decode steps outnumber prefills
    assert len(head_calls) <= forward_logits.count(False)  # logits from the forward were used, not recomputed
    for i in range(len(PROMPTS)):
        tokens, codes, wav = reference(str(tiny_ckpt), i)
        assert got[i]["tokens"] == tokens
        assert torch.equal(got[i]["codes"], codes), i
        assert (got[i]["audio"] - wav).abs().max().item() <= 1e-4
    assert_all_free(eng)


def test_talker_repetition_penalty_matches_transformers(tiny_ckpt):
    """The talker penalty (transformers default 1.05; 2.0 here so it bites) sees only generated codec ids."""
    eng = make_engine(tiny_ckpt)
    i = 1
    p = params(i)
    p["talker"] = p["talker"].replace(repetition_penalty=2.0)
    ids = {eng.add_request(PROMPTS[i], ["text", "audio"], p, speaker="ethan")}
    codes = []
    while eng.has_work():
        for d in eng.step():
            assert d.req_id in ids
            if d.codes is not None:
                codes.append(d.codes)
    _, ref_codes, _ = reference(str(tiny_ckpt), i, 2.0)
    got = torch.cat(codes, 1)
    assert got.shape == ref_codes.shape and torch.equal(got, ref_codes)
    assert not torch.equal(ref_codes, reference(str(tiny_ckpt), i)[1])  # the penalty really changed codes
