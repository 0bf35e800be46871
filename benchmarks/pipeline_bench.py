"""Text + speech, end to end: omnistage's streaming three-stage pipeline vs transformers generate(return_audio=True).

Same checkpoint, prompts and thread count in one process. omnistage gets N requests at once; transformers
runs them one at a time (its generate serves one request's audio per call). Reports text tokens/s, audio
seconds per wall second, time to first audio chunk, real-time factor (wall / audio seconds), audio seconds
per CPU second (the work measure when other processes share the cores), the ratios, and whether
omnistage's answer tokens and codec codes equal transformers' for the requests both ran (Qwen3-Omni,
float32). Then, per concurrency, where the time went: per stage (its steps) and per component (Thinker,
Talker, code predictor, Code2Wav, sampler, engine overhead = the rest of the wall time), each with its
achieved GFLOP/s and GB/s, the machine's bound for its work (measured GEMM and read peaks, roofline.py)
and transformers' time for the same part. Memory: each in-process configuration is first loaded alone in a
fresh process (as ``omnistage serve`` starts), for its resident size after the load, its peak during it, and
what each component holds; and this process's resident size after the timed runs.

    python -m benchmarks.pipeline_bench --preset small --concurrency 1 16 --threads 2 --hf-requests 16 \
        --configs float32 float32-exact bfloat16 float32-mp
    python -m benchmarks.pipeline_bench --family qwen2_5_omni --preset small --concurrency 16 \
        --hf-requests 1 --hf-thinker-tokens 8 --hf-talker-tokens 32

Qwen2.5-Omni's reference is slow on CPU (its Token2Wav re-runs the speaker encoder at every ODE evaluation):
--hf-thinker-tokens / --hf-talker-tokens give transformers shorter requests (same ratio of text to codes)
without changing what omnistage runs (no token comparison then).

``--distributed-executor-backend mp`` (or a configuration's ``-mp`` suffix, e.g. ``bfloat16-mp``, to compare
backends in one run) runs every stage in its own worker process (``--threads`` split between them) and adds, per row, a stage trace (busy share of the wall time per stage, share of time with two or more
stages busy, each worker's share of time waiting) and the transport cost of a hand-off (bytes, encode / decode /
transit milliseconds); the per-component breakdown needs the models in this process (``inproc``).
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.roofline import (
    DecoderShape,
    Peaks,
    code2wav_work,
    code_predictor_work,
    count_flops,
    decoder_forward_work,
    largest_tensor_bytes,
    logits_work,
    measure_peaks,
    read_dtype,
    stored_dtype,
    with_three_parts,
)
from benchmarks.stage_timers import Component, StageTimers
from benchmarks.stage_trace import StageTrace, cpu_seconds, snapshot, transport_report
from benchmarks.thinker_throughput import hf_inputs, prompts, resolve_model
from omnistage.models.layers import amx_kernels
from omnistage.runner.memory_use import weight_bytes_by_component
from omnistage.runtime_env import freeze_loaded_objects, release_free_heap, resident_bytes
from omnistage.testing.reference import captured_codes

CODE_PREDICTOR, SAMPLER, OVERHEAD = "code predictor", "sampler", "engine overhead"


@dataclass
class Run:
    wall: float
    cpu: float  # CPU seconds: this process and any stage workers
    tokens: int
    audio_s: float
    latency: float  # median: time to first audio (omnistage) or end-to-end (transformers)
    outputs: list[tuple[list[int], torch.Tensor | None]] | None  # per request: answer tokens, codes [Q, T]


def run_omnistage(engine, texts, thinker_tokens, talker_tokens, fixed_speech=True) -> Run:
    """``fixed_speech``: the Talker runs all ``talker_tokens`` (its EOS banned, as the Thinker's), else it
    may end at its codec EOS."""
    from omnistage import SamplingParams

    params = {
        "thinker": SamplingParams(temperature=0.0, max_tokens=thinker_tokens, min_tokens=thinker_tokens),
        "talker": SamplingParams(temperature=0.0, max_tokens=talker_tokens, repetition_penalty=1.0,
                                 min_tokens=talker_tokens if fixed_speech else 0),
    }
    t0, c0 = time.perf_counter(), sum(cpu_seconds(engine).values())
    start, first_audio, tokens, samples = {}, {}, 0, 0
    outputs: dict[str, tuple[list[int], list[torch.Tensor]]] = {}
    for t in texts:
        rid = engine.add_request(t, ["text", "audio"], params)
        start[rid] = time.perf_counter()
        outputs[rid] = ([], [])
    done = set()
    while len(done) < len(texts):
        for d in engine.step():
            tokens += len(d.new_token_ids)
            outputs[d.req_id][0].extend(d.new_token_ids)
            if d.codes is not None:
                outputs[d.req_id][1].append(d.codes)
            if d.audio is not None:
                samples += d.audio.numel()
                first_audio.setdefault(d.req_id, time.perf_counter() - start[d.req_id])
            if d.finished:
                done.add(d.req_id)
    wall, cpu = time.perf_counter() - t0, sum(cpu_seconds(engine).values()) - c0
    results = [(toks, torch.cat(codes, dim=1) if codes else None) for toks, codes in outputs.values()]
    return Run(wall, cpu, tokens, samples / engine.info.sample_rate, statistics.median(first_audio.values()),
               results)


def run_hf(hf, tok, eos_ids, fixed_speech, texts, thinker_tokens, talker_tokens, sample_rate) -> Run:
    """transformers one request at a time; ``eos_ids``: the engine's stop ids, so that min_new_tokens bans
    the same ids as omnistage's min_tokens. The codes are caught on their way into Code2Wav."""
    wall, samples, latencies, tokens, results = 0.0, 0, [], 0, []
    c0 = time.process_time()
    with captured_codes(hf) as captured:
        for x in hf_inputs(tok, texts):
            x = x.to(hf.device)
            t0 = time.perf_counter()
            seq, wav = hf.generate(x, speaker="ethan", return_audio=True, thinker_max_new_tokens=thinker_tokens,
                                   thinker_min_new_tokens=thinker_tokens, thinker_eos_token_id=list(eos_ids),
                                   talker_max_new_tokens=talker_tokens, talker_do_sample=False,
                                   talker_min_new_tokens=talker_tokens if fixed_speech else 0,
                                   talker_repetition_penalty=1.0)
            if x.is_cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            wall += dt
            latencies.append(dt)
            samples += wav.numel()
            tokens += seq.shape[1] - x.shape[1]
            results.append((seq[0, x.shape[1]:].tolist(), captured.pop("codes", None)))
    return Run(wall, time.process_time() - c0, tokens, samples / sample_rate, statistics.median(latencies), results)


def run_hf_qwen2_5_omni(hf, engine, fixed_speech, texts, thinker_tokens, talker_tokens, sample_rate) -> Run:
    """transformers' Qwen2.5-Omni, one request at a time, on the prompt ids omnistage renders (with its speech
    system prompt); the Talker's EOS ids are the checkpoint's (generate's defaults are the released model's)."""
    from omnistage.testing.qwen2_5_omni.reference import explicit_talker_mask

    tc = hf.config.talker_config
    wall, samples, latencies, tokens = 0.0, 0, [], 0
    c0 = time.process_time()
    for text in texts:
        x = torch.tensor([engine.render_prompt(text).token_ids])
        t0 = time.perf_counter()
        with explicit_talker_mask(hf):
            seq, wav = hf.generate(x, speaker="Chelsie", thinker_max_new_tokens=thinker_tokens,
                                   thinker_min_new_tokens=thinker_tokens, thinker_do_sample=False,
                                   talker_max_new_tokens=talker_tokens, talker_do_sample=False,
                                   talker_min_new_tokens=talker_tokens if fixed_speech else 0,
                                   talker_repetition_penalty=1.0,
                                   talker_eos_token_id=[tc.tts_codec_pad_token_id, tc.tts_codec_end_token_id])
        dt = time.perf_counter() - t0
        wall += dt
        latencies.append(dt)
        samples += wav.numel()
        tokens += seq.shape[1] - x.shape[1]
    return Run(wall, time.process_time() - c0, tokens, samples / sample_rate, statistics.median(latencies), None)


def output_difference(ours, theirs) -> str | None:
    """None when the answer tokens (transformers may append the EOS that ended its answer) and every codec
    code are equal; else where they first differ."""
    (tok_a, codes_a), (tok_b, codes_b) = ours, theirs
    if tok_a != tok_b[: len(tok_a)] or len(tok_b) - len(tok_a) > 1:
        at = next((i for i, (x, y) in enumerate(zip(tok_a, tok_b)) if x != y), min(len(tok_a), len(tok_b)))
        return f"text token {at}"
    if codes_a is None or codes_b is None:
        return None if codes_a is None and codes_b is None else "codes on one side only"
    if codes_a.shape != codes_b.shape:
        return f"codes shape {tuple(codes_a.shape)} vs {tuple(codes_b.shape)}"
    differs = (codes_a != codes_b).any(dim=0).nonzero()
    return f"frame {int(differs[0])}" if differs.numel() else None


def parity_cell(ours: Run, theirs: Run, comparable: bool) -> str:
    if not comparable or ours.outputs is None or theirs.outputs is None:
        return "n/a"
    n = min(len(ours.outputs), len(theirs.outputs))
    return f"{sum(output_difference(ours.outputs[i], theirs.outputs[i]) is None for i in range(n))}/{n}"


def parity_details(ours: Run, theirs: Run) -> list[str]:
    """Which requests differ from transformers' answer, and where first."""
    if ours.outputs is None or theirs.outputs is None:
        return []
    diffs = [(i, output_difference(a, b)) for i, (a, b) in enumerate(zip(ours.outputs, theirs.outputs))]
    return [f"    request {i}: first differs at {d}" for i, d in diffs if d is not None]


# ---- timers ------------------------------------------------------------------------------------------
def stage_steps(trace: StageTrace, t0: float, t1: float, order: list[str]) -> dict[str, Component]:
    """Each stage's steps inside [t0, t1] (scheduler, runner, model, sampling, its output building), as the
    stages time them."""
    busy = trace.summary(t0, t1)["busy"]
    counts: dict[str, int] = {}
    for stage, start, _end in trace.steps:
        if t0 <= start < t1:
            counts[stage] = counts.get(stage, 0) + 1
    return {name: Component(seconds=busy.get(name, 0.0), calls=counts.get(name, 0)) for name in order}


def trace_lines(trace: StageTrace, t0: float, t1: float, before: dict | None, after: dict | None) -> list[str]:
    """Stage workers: busy and waiting shares, overlap, transport cost per hand-off."""
    window = trace.summary(t0, t1)
    busy = " ".join(f"{k} {100 * v / window['wall']:.0f}%" for k, v in sorted(window["busy"].items()))
    waiting = " ".join(f"{k} {100 - 100 * v / window['wall']:.0f}%" for k, v in sorted(window["busy"].items()))
    lines = [f"    stages busy (share of wall): {busy}; any stage busy {100 * window['any']:.0f}%, two or more at "
             f"once {100 * window['overlap']:.0f}%; workers waiting (share of wall): {waiting}"]
    if before is not None and after is not None:
        lines += ["    " + line for line in transport_report(before, after)]
    return lines


_FRAME_FLOPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # (weak: an engine's model is freed with it)


def code2wav_frame_flops(c2w) -> float:
    """Counted matmul/conv flops of one Code2Wav frame (once per loaded model): a 50-frame probe through a model
    of the same config on the reference kernels, whose torch convolutions the counter sees, unlike omnistage's
    own kernels (the served model's packed layers no longer hold their unpacked weights); its weights are left
    uninitialised (their values do not change the count; its buffers are the served model's) and freed after."""
    if c2w not in _FRAME_FLOPS:
        from omnistage.models.qwen3_omni.code2wav import Code2Wav

        with torch.device("meta"):
            reference = Code2Wav(c2w.config, reference_kernels=True)
        reference = reference.to_empty(device="cpu").eval()
        with torch.no_grad():
            # (positions, code offsets: the served model's; its packed layers' buffers are not the reference's)
            served = dict(c2w.named_buffers())
            for name, buffer in reference.named_buffers():
                buffer.copy_(served[name])
        probe = torch.zeros(1, c2w.config.num_quantizers, 50, dtype=torch.long)
        _FRAME_FLOPS[c2w] = count_flops(reference, probe) / 50
        del reference
        release_free_heap()
    return _FRAME_FLOPS[c2w]


def attach_component_timers(engine, dtype: torch.dtype, model_dir: str) -> StageTimers:
    """Each stage's model calls, the Talker's code predictor and the AR sampler (these never nest). Work
    models (for the bound) where the model's shape is known: Qwen3-Omni's decoders and Code2Wav; a decoder's
    weights counted at the width the checkpoint stores them in where narrower than ``dtype``."""
    import omnistage.runner.ar_runner as ar_runner
    from omnistage.models.layers.decoder import DecoderConfig

    timers = StageTimers()
    for name, stage in engine.orchestrator.stages.items():
        model = stage.runner.model
        if hasattr(model, "forward_batch"):  # a generation stage
            work = None
            if hasattr(model, "code2wav"):
                # (the weights as held: packed copies included)
                weight_bytes = sum(weight_bytes_by_component(model).values())
                work = code2wav_work(code2wav_frame_flops(model.code2wav), weight_bytes)
            timers.attach(model, "forward_batch", name, work)
            continue
        part = getattr(model, name, None)  # Qwen3-Omni: ThinkerStageModel.thinker, TalkerStageModel.talker
        cfg = getattr(part, "cfg", None)
        stored = stored_dtype(model_dir, f"{name}.")
        shape = DecoderShape.from_config(cfg, dtype, stored) if isinstance(cfg, DecoderConfig) else None
        timers.attach(model, "forward", name, decoder_forward_work(shape) if shape else None)
        timers.attach(model, "compute_logits", name,
                      logits_work(cfg.hidden_size, part.vocab_size, read_dtype(dtype, stored)) if shape else None)
        predictor = getattr(part, "code_predictor", None)
        if predictor is not None:
            cp_shape = DecoderShape.from_config(predictor.cfg.decoder, dtype, stored)
            # The serving path (whole compiled frame) where it exists, else the eager one.
            serving = "complete_frames" if hasattr(part, "complete_frames") else "predict_codes"
            timers.attach(part, serving, CODE_PREDICTOR,
                          code_predictor_work(cp_shape, predictor.cfg.vocab_size, predictor.num_code_groups))
    timers.attach(ar_runner, "sample", SAMPLER)
    return timers


def attach_hf_timers(hf, family: str) -> StageTimers:
    timers = StageTimers()
    timers.attach(hf.thinker, "forward", "thinker")
    timers.attach(hf.talker, "forward", "talker")
    if family == "qwen2_5_omni":
        timers.attach(hf.token2wav, "forward", "token2wav")
    else:
        # Called from the talker's prepare_inputs_for_generation, not from its forward: no nesting.
        timers.attach(hf.talker.code_predictor, "generate", CODE_PREDICTOR)
        timers.attach(hf.code2wav, "forward", "code2wav")
    return timers


def depth_factors(engine) -> tuple[dict[str, float], str] | None:
    """Per component, how its time grows from this checkpoint's depth to the released depth (Thinker 48, Talker
    20, code predictor 5, Code2Wav 8 layers), assuming each part keeps its measured speed: the share of its work
    that sits in the layer stacks is scaled by full / measured layers, the rest (embeddings, output heads,
    Code2Wav's convolutional decoder) stays. Shares: decoders and the code predictor by the weights a step reads
    (decode batches read their weights once per step), Code2Wav by its flops per frame. Qwen3-Omni in this
    process only; None otherwise."""
    from omnistage.checkpoints.real import REAL
    from omnistage.models.layers.decoder import DecoderConfig
    from omnistage.models.layers.fast_linear import PackedLinear

    full = {"thinker": REAL.thinker.num_layers, "talker": REAL.talker.num_layers,
            CODE_PREDICTOR: REAL.code_predictor.num_layers, "code2wav": REAL.code2wav.num_layers}
    factors, depths = {}, []

    def grow(name: str, layers: int, layer_share: float) -> None:
        factors[name] = layer_share * full[name] / layers + (1 - layer_share)
        depths.append(f"{name} {layers}->{full[name]}")

    def stack_and_all_experts(cfg: DecoderConfig) -> float:  # parameters a decode batch reads in its layers
        shape = DecoderShape.from_config(cfg, torch.float32)
        return shape.dense_params + shape.sparse_layers * shape.num_experts * shape.expert_params

    for name, stage in engine.orchestrator.stages.items():
        model = stage.runner.model
        part = getattr(model, name, None)
        if name in ("thinker", "talker") and isinstance(getattr(part, "cfg", None), DecoderConfig):
            stack = stack_and_all_experts(part.cfg)
            grow(name, part.cfg.num_layers, stack / (stack + part.cfg.hidden_size * part.vocab_size))
            predictor = getattr(part, "code_predictor", None)
            if predictor is not None:
                cp = predictor.cfg.decoder
                stack = stack_and_all_experts(cp)
                grow(CODE_PREDICTOR, cp.num_layers, stack / (stack + cp.hidden_size * predictor.cfg.vocab_size))
        elif name == "code2wav" and hasattr(model, "code2wav"):
            c2w = model.code2wav
            cfg = c2w.config
            counted = code2wav_frame_flops(c2w)  # packed linears (the fast option) are not counted by torch
            h = cfg.hidden_size
            stack = 2 * cfg.num_hidden_layers * (4 * h * h + 3 * h * cfg.intermediate_size)  # per frame row
            packed = any(isinstance(m, PackedLinear) for m in c2w.pre_transformer.modules())
            grow(name, cfg.num_hidden_layers, stack / (counted + (stack if packed else 0)))
    if not factors:
        return None
    return factors, ", ".join(depths)


def projection_lines(depth: tuple[dict[str, float], str], config: Config, n: int, wall: float, audio: float,
                     ours: dict[str, Component], hf_wall: float, hf: dict[str, Component], hf_scale: float,
                     hf_audio: float) -> list[str]:
    """Ours and transformers' measured component times scaled to the released depth (``depth_factors``); the
    rest of each wall time (sampling, bridges, overhead) is kept as measured."""
    factors, depths = depth
    lines = [f"projection to the released depth ({depths} layers), {config} N={n}: a projection from the measured "
             "per-component times, not a measurement",
             f"    {'component':<16} {'factor':>6} {'ours s':>8} {'proj s':>8} | {'hf s':>8} {'proj s':>8}"]
    ours_wall, hf_total = wall, hf_wall * hf_scale
    for name, factor in factors.items():
        c, theirs = ours.get(name), hf.get(name)
        mine = c.seconds if c else 0.0
        their = theirs.seconds * hf_scale if theirs else 0.0
        ours_wall += mine * (factor - 1)
        hf_total += their * (factor - 1)
        lines.append(f"    {name:<16} {factor:>6.2f} {mine:>8.2f} {mine * factor:>8.2f} | {their:>8.2f} "
                     f"{their * factor:>8.2f}")
    ours_rate, hf_rate = audio / ours_wall, hf_audio * hf_scale / hf_total
    lines.append(f"    projected wall: ours {ours_wall:.2f} s ({ours_rate:.3f} audio-s/s), transformers {hf_total:.2f} s "
                 f"for {n} requests one by one ({hf_rate:.3f} audio-s/s): {ours_rate / hf_rate:.2f}x")
    return lines


def compile_note(engine) -> str:
    """How the code predictor's frame ran: its passes in the CPU decoder-pass kernel, compiled (and how long the
    compiling first call took) or eager."""
    talker = engine.orchestrator.stages.get("talker")
    runner = getattr(talker, "runner", None)  # none in this process with stage workers
    if runner is None:
        return "in a stage worker"
    part = getattr(runner.model, "talker", None)
    predictor = getattr(part, "code_predictor", None)
    if predictor is not None and predictor.pass_layers():
        return "each pass's decoder layers in one CPU kernel call (cpu_kernels.DecoderPass), nothing compiled"
    compiler = getattr(predictor, "frame_compiler", None)
    if compiler is None:
        return "eager (no compiled path)"
    if not compiler.active:
        return f"eager ({compiler.failure or 'compiling disabled'})"
    took = compiler.compile_seconds
    return f"compiled (first call, compiling included: {'-' if took is None else f'{took:.1f} s'}, in the warm-up)"


def decode_step_note(engine) -> str:
    """Which decoders run their decode steps' layers in one CPU kernel call (``cpu_kernels.decoder_step``)."""
    names = []
    for name, stage in engine.orchestrator.stages.items():
        part = getattr(getattr(getattr(stage, "runner", None), "model", None), name, None)
        decoder = getattr(part, "model", None)
        if hasattr(decoder, "kernel_layers") and decoder.kernel_layers():
            names.append(name)
    return f"{', '.join(names)} in one CPU kernel call (cpu_kernels.decoder_step)" if names else "layer by layer"


def allocator_note() -> str:
    try:
        from omnistage.runtime_env import configure_allocator
    except ImportError:
        return "malloc defaults (no runtime_env)"
    return str(configure_allocator())  # applied once per process (the engine did it): reports the settings


# ---- tables ------------------------------------------------------------------------------------------
def stage_table(wall: float, stages: dict[str, Component]) -> list[str]:
    lines = [f"    {'stage':<16} {'step s':>8} {'share':>6} {'steps':>6} {'ms/step':>8}"]
    for name, c in stages.items():
        lines.append(f"    {name:<16} {c.seconds:>8.2f} {c.seconds / wall:>6.1%} {c.calls:>6} "
                     f"{1e3 * c.seconds / max(c.calls, 1):>8.1f}")
    between = wall - sum(c.seconds for c in stages.values())
    lines.append(f"    {'between steps':<16} {between:>8.2f} {between / wall:>6.1%}  (routing, bridges, deltas)")
    return lines


def component_table(wall: float, ours: dict[str, Component], hf_wall: float, hf: dict[str, Component],
                    hf_scale: float, peaks: Peaks) -> list[str]:
    """Ours for all N requests next to transformers' time for the same part, scaled to N requests."""
    lines = [f"    {'component':<16} {'ours s':>8} {'share':>6} {'calls':>6} {'GFLOP':>8} {'GB':>7} {'GFLOP/s':>8} "
             f"{'GB/s':>6} {'bound s':>8} {'bnd/ours':>8} | {'hf s':>8} {'hf/ours':>7}"]

    def hf_cell(seconds: float | None, ours_s: float) -> str:
        if seconds is None:
            return f"{'-':>8} {'-':>7}"
        return f"{seconds:>8.2f} {seconds / ours_s if ours_s else float('nan'):>7.1f}"

    bounds = 0.0
    for name, c in ours.items():
        measured = c.flops or c.bytes
        work = (f"{c.flops / 1e9:>8.1f} {c.bytes / 1e9:>7.2f} {c.flops / 1e9 / c.seconds if c.seconds else 0:>8.1f} "
                f"{c.bytes / 1e9 / c.seconds if c.seconds else 0:>6.1f}") if measured else f"{'':>8} {'':>7} {'':>8} {'':>6}"
        bound = peaks.bound_seconds(c.flops, c.bytes) if measured else None
        bcells = f"{bound:>8.3f} {bound / c.seconds if c.seconds else 0:>8.1%}" if bound is not None else f"{'-':>8} {'-':>8}"
        bounds += bound or 0.0
        theirs = hf.get(name)
        lines.append(f"    {name:<16} {c.seconds:>8.2f} {c.seconds / wall:>6.1%} {c.calls:>6} {work} {bcells} | "
                     f"{hf_cell(theirs.seconds * hf_scale if theirs else None, c.seconds)}")
    rest = wall - sum(c.seconds for c in ours.values())
    hf_rest = (hf_wall - sum(c.seconds for c in hf.values())) * hf_scale
    lines.append(f"    {OVERHEAD:<16} {rest:>8.2f} {rest / wall:>6.1%} {'':>6} {'':>8} {'':>7} {'':>8} {'':>6} "
                 f"{'':>8} {'':>8} | {hf_cell(hf_rest, rest)}")
    # the wall's bound: the measured components' bounds summed (the stages take turns on the same cores)
    lines.append(f"    {'total':<16} {wall:>8.2f} {1:>6.0%} {'':>6} {'':>8} {'':>7} {'':>8} {'':>6} {bounds:>8.3f} "
                 f"{bounds / wall:>8.1%} | {hf_cell(hf_wall * hf_scale, wall)}")
    return lines


@dataclass(frozen=True)
class Config:
    """One omnistage configuration of a run: serving dtype, the kernels (``fast``, the default, or ``-exact``:
    ``EngineArgs(fast=False)``, the reference's kernels) and, when given, its own executor backend (``-mp``: one
    worker process per stage, the thread budget split between them)."""

    dtype: str
    fast: bool
    backend: str | None = None  # None: --distributed-executor-backend

    @classmethod
    def parse(cls, text: str) -> Config:
        dtype, *options = text.split("-")
        backend = options.pop() if options and options[-1] in ("mp", "inproc") else None
        if dtype not in ("float32", "bfloat16") or options not in ([], ["exact"]):
            raise argparse.ArgumentTypeError(
                f"expected float32 or bfloat16, then optionally -exact, then optionally -mp / -inproc; got {text!r}")
        return cls(dtype, options != ["exact"], backend)

    def __str__(self) -> str:
        return self.dtype + ("" if self.fast else "-exact") + (f"-{self.backend}" if self.backend else "")


def throughput_row(label: str, ours: Run, theirs: Run, comparable: bool) -> str:
    return (f"{label:>18} | {ours.tokens / ours.wall:>10.1f} {ours.audio_s / ours.wall:>12.2f} "
            f"{ours.latency:>11.2f} {ours.wall / ours.audio_s:>8.2f} {ours.audio_s / ours.cpu:>11.3f} | "
            f"{theirs.tokens / theirs.wall:>8.1f} {theirs.audio_s / theirs.wall:>10.2f} "
            f"{theirs.latency:>8.2f} {theirs.wall / theirs.audio_s:>7.2f} {theirs.audio_s / theirs.cpu:>11.3f} | "
            f"{(ours.audio_s / ours.wall) / (theirs.audio_s / theirs.wall):>6.2f} "
            f"{(ours.audio_s / ours.cpu) / (theirs.audio_s / theirs.cpu):>6.2f} "
            f"{ours.latency / theirs.latency:>8.2f} {parity_cell(ours, theirs, comparable):>10}")


THROUGHPUT_HEADER = (f"{'config, N':>18} | {'ours tok/s':>10} {'ours aud s/s':>12} {'ours TTFA s':>11} {'ours RTF':>8} "
                     f"{'aud s/cpu s':>11} | {'hf tok/s':>8} {'hf aud s/s':>10} {'hf E2E s':>8} {'hf RTF':>7} "
                     f"{'aud s/cpu s':>11} | {'x thru':>6} {'x cpu':>6} {'TTFA/E2E':>8} {'same as hf':>10}")


class PeakResident:
    """This process's peak anonymous resident memory while the block runs, sampled every 2 ms from a thread
    (the kernel's own peak, ``VmHWM``, counts the checkpoint's file pages too, which it can drop)."""

    def __enter__(self) -> PeakResident:
        self.peak, self._stop = resident_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, resident_bytes())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, resident_bytes())


def load_memory(model: str, config_text: str, family: str, overrides: dict | None) -> str:
    """Load ``config``'s engine in this process and say what the load took (``fresh_load_memory`` runs it in a
    new process): per stage what the engine planned (weights, KV), what its stages hold (weights per
    component, measured), the resident memory after the load and its peak during it."""
    from omnistage.models.registry import load_pipeline_config
    from omnistage.pipeline.engine import OmniEngine
    from omnistage.pipeline.engine_args import EngineArgs

    config = Config.parse(config_text)
    with PeakResident() as peak:
        engine = OmniEngine(EngineArgs(model, dtype=config.dtype, fast=config.fast),
                            load_pipeline_config(family, overrides))
    rss, largest = resident_bytes(), largest_tensor_bytes(model, getattr(torch, config.dtype))
    plan = engine.memory_plan
    stages = ", ".join(f"{p.stage} {p.weight_bytes / 1e9:.2f} + {p.kv_bytes / 1e9:.2f}" for p in plan)
    weights = sum(p.weight_bytes for p in plan)
    kv = sum(p.kv_bytes for p in plan)
    ratio = (f"{(rss - kv) / weights:.3f}x the weights with the KV pools counted; peak during the load "
             f"{peak.peak / 1e9:.2f} GB = {(peak.peak - kv - largest) / weights:.3f}x with the KV pools and the "
             f"largest tensor ({largest / 1e9:.2f} GB) counted" if weights and rss else "n/a")
    held = engine.resource_stats()
    parts = "; ".join(
        f"{name}: " + ", ".join(f"{c} {b / 1e9:.3f}" for c, b in sorted(s["weight_bytes"].items(), key=lambda x: -x[1]))
        + f", KV {s['kv_cache_bytes'] / 1e9:.3f}"
        for name, s in held.items() if isinstance(s, dict) and "weight_bytes" in s)
    engine.shutdown()
    return (f"memory, {config}, loaded in a fresh process: planned GB weights + KV per stage: {stages}; resident "
            f"after the load {rss / 1e9:.2f} GB ({ratio})\n  held GB per component: {parts}")


def fresh_load_memory(model: str, config: Config, family: str, overrides: dict | None) -> str:
    """``load_memory`` in a new process, as ``omnistage serve`` starts: this one has held transformers' model
    and other engines, whose freed memory the allocator cannot all give back."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(load_memory, model, str(config), family, overrides).result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--family", default="qwen3_omni", choices=["qwen3_omni", "qwen2_5_omni"],
                    help="model family of the built --preset checkpoint (a --model dir names its own)")
    ap.add_argument("--preset", default="small", help="a builder preset, or 'real' (the released architecture)")
    ap.add_argument("--depth", default=None,
                    help="with --preset real: layers per stack (e.g. thinker=2,talker=2,code_predictor=2,code2wav=2,"
                         "audio=2,vision=2); the checkpoint is built for the run and removed after it")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--configs", type=Config.parse, nargs="+", default=[Config("float32", True)],
                    help="omnistage configurations, each run against the same transformers run: float32 (default), "
                         "bfloat16, float32-exact, bfloat16-exact (exact: EngineArgs(fast=False), the reference's "
                         "kernels); a -mp suffix runs that configuration with one worker process per stage")
    ap.add_argument("--thinker-tokens", type=int, default=48)
    ap.add_argument("--talker-tokens", type=int, default=144,
                    help="codec tokens per answer: frames + 1, the last one has no residual codes")
    ap.add_argument("--speech-may-end", action="store_true",
                    help="the Talker may stop at its codec EOS (default: exactly --talker-tokens, EOS banned)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eager", action="store_true", help="no torch.compile (OMNISTAGE_COMPILE=0)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="every stage's batch cap (default: the packaged preset's)")
    ap.add_argument("--repeats", type=int, default=1, help="omnistage runs per concurrency; the fastest counts")
    ap.add_argument("--hf-requests", type=int, default=2, help="requests transformers runs (one at a time)")
    ap.add_argument("--hf-thinker-tokens", type=int, default=None, help="transformers' (default: --thinker-tokens)")
    ap.add_argument("--hf-talker-tokens", type=int, default=None, help="transformers' (default: --talker-tokens)")
    ap.add_argument("--distributed-executor-backend", choices=["inproc", "mp", "ray"], default="inproc")
    args = ap.parse_args()
    if args.eager:
        os.environ["OMNISTAGE_COMPILE"] = "0"
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    from omnistage.models.registry import family_for_checkpoint, load_pipeline_config
    from omnistage.pipeline.engine import OmniEngine
    from omnistage.pipeline.engine_args import EngineArgs

    fixed_speech = not args.speech_may_end
    model = resolve_model(args.model, args.preset, args.family, args.depth)
    family = family_for_checkpoint(model).name
    stages = load_pipeline_config(family).order
    backend = args.distributed_executor_backend

    def overrides_for(backend: str | None) -> dict | None:
        per_stage: dict = {}
        if args.max_num_seqs:
            per_stage["scheduler"] = {"max_num_seqs": args.max_num_seqs}
        if backend not in (None, "inproc"):  # stage workers share the thread budget (at least one each)
            per_stage["threads"] = max(1, args.threads // len(stages))
        return {"stages": {name: per_stage for name in stages}} if per_stage else None

    def pipeline_for(backend: str | None):
        return load_pipeline_config(family, overrides_for(backend))

    pipeline = pipeline_for(backend)
    # Each in-process configuration's load, measured first, in a fresh process, with nothing else loaded.
    loads = {str(c): fresh_load_memory(model, c, family, overrides_for(None))
             for c in args.configs if (c.backend or backend) in (None, "inproc")}
    trace = StageTrace()

    def build(config: Config) -> OmniEngine:
        own = config.backend or backend
        gc.collect()
        release_free_heap()
        engine = OmniEngine(EngineArgs(model, dtype=config.dtype, fast=config.fast,
                                       distributed_executor_backend=own), pipeline_for(own))
        engine.orchestrator.listeners.append(trace)
        # Warm-up at every concurrency: whatever is built lazily per batch size is built here, not timed.
        for n in sorted(set(args.concurrency)):
            run_omnistage(engine, prompts(n), 4, 8)
        freeze_loaded_objects()  # as `omnistage serve` and stage workers do after their load (thawed at shutdown)
        return engine

    if family == "qwen2_5_omni":
        from omnistage.testing.qwen2_5_omni.reference import load_hf_reference

        engine = build(args.configs[0])
        hf = load_hf_reference(model)
        reference = functools.partial(run_hf_qwen2_5_omni, hf, engine, fixed_speech)
    else:
        # transformers runs first and is freed before omnistage loads: at the released widths one float32 copy
        # of each does not fit a 24 GiB machine at once.
        engine = None
        hf = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model, dtype=torch.float32).eval()
        checkpoint = family_for_checkpoint(model)(model)
        reference = functools.partial(run_hf, hf, AutoTokenizer.from_pretrained(model), checkpoint.eos_token_ids,
                                      fixed_speech)
        sample_rate = checkpoint.sample_rate
    hf_rss = resident_bytes()
    hf_thinker = args.hf_thinker_tokens or args.thinker_tokens
    hf_talker = args.hf_talker_tokens or args.talker_tokens
    # Same requests on both sides: compare answers (equality is the contract in float32; bfloat16 rounds
    # differently, so its count says how often greedy picks still agree).
    comparable = (hf_thinker, hf_talker) == (args.thinker_tokens, args.talker_tokens)

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown") if Path("/proc/cpuinfo").exists() else "unknown"
    caps = {name: pipeline.stage(name).scheduler.max_num_seqs for name in stages}
    worker_threads = max(1, args.threads // len(stages))
    print(f"cpu={cpu} threads={args.threads} backend={backend} (threads per stage worker, under mp/ray: "
          f"{worker_threads}) load_avg_1m={os.getloadavg()[0]:.1f} model={Path(model).name} "
          f"({family}) max_num_seqs={caps}")
    print(f"thinker_tokens={args.thinker_tokens} talker_tokens={args.talker_tokens} "
          f"({'exactly' if fixed_speech else 'at most'}) transformers: "
          f"{hf_thinker}/{hf_talker} tokens, {args.hf_requests} requests one by one, float32; audio chunks: "
          f"{dict(pipeline.stage(stages[-1]).bridge_args)}")
    dtypes = list(dict.fromkeys(c.dtype for c in args.configs))
    bf16_weights = stored_dtype(model) == torch.bfloat16  # (float32's peak: AMX's exact products count)
    peaks_before = {d: measure_peaks(getattr(torch, d), bf16_weights=bf16_weights) for d in dtypes}
    # transformers serves one request per call, so its throughput does not depend on N: measure it once,
    # on the first --hf-requests prompts, and compare every configuration and concurrency against it.
    hf_timers = attach_hf_timers(hf, family)
    with torch.no_grad():
        theirs = reference(prompts(args.hf_requests), hf_thinker, hf_talker,
                           engine.info.sample_rate if engine is not None else sample_rate)
    hf_timers.detach()
    print(f"transformers: {theirs.wall:.2f} s, resident after its load {hf_rss / 1e9:.2f} GB", flush=True)
    if engine is None:
        del hf, reference
        engine = build(args.configs[0])
    print(f"code predictor: {compile_note(engine)}; decode steps: {decode_step_note(engine)}; "
          f"allocator: {allocator_note()}", flush=True)

    # Each row as soon as it is measured (a long run cut short keeps what it had); the breakdowns at the end.
    print(THROUGHPUT_HEADER, flush=True)
    measured = []
    timers = None
    for i, config in enumerate(args.configs):
        if i:
            gc.unfreeze()  # the frozen engine can be collected again
            engine.shutdown()  # one engine's weights and KV pools (and workers) at a time
            del engine
            timers = None  # (they wrap the old engine's modules: they would keep its weights alive)
            engine = build(config)
        if str(config) in loads:
            print(loads[str(config)], flush=True)
        # Model timers need the models in this process; stage workers get the trace and transport lines.
        timers = (attach_component_timers(engine, getattr(torch, config.dtype), model) if engine.workers is None
                  else None)
        depth = depth_factors(engine) if timers is not None and family == "qwen3_omni" else None
        for n in args.concurrency:
            best = None
            for _ in range(args.repeats):
                if timers is not None:
                    timers.reset()
                counters = snapshot(engine) if engine.workers is not None else None
                t0 = time.monotonic()
                run = run_omnistage(engine, prompts(n), args.thinker_tokens, args.talker_tokens, fixed_speech)
                t1 = time.monotonic()
                if best is None or run.wall < best[0].wall:
                    comps = timers.snapshot() if timers is not None else None
                    workers = None if counters is None else trace_lines(trace, t0, t1, counters, snapshot(engine))
                    best = (run, comps, stage_steps(trace, t0, t1, stages), workers)
            ours, comps, steps, workers = best
            print(throughput_row(f"{config} {n:>3}", ours, theirs, comparable), flush=True)
            details = parity_details(ours, theirs) if comparable and config.dtype == "float32" else []
            if details:  # the configuration whose contract is equality: say where it broke
                print("\n".join(details), flush=True)
            if workers is not None:
                print("\n".join(workers), flush=True)
            measured.append((config, n, ours, comps, steps, depth))
        if timers is not None:
            timers.detach()
        print(f"resident after the runs, {config}: {resident_bytes() / 1e9:.2f} GB (the activations' blocks "
              f"stay for reuse: runtime_env.configure_allocator)", flush=True)
    engine.shutdown()

    lines = []
    # Measured before and after the runs, the better kept: the neighbours' load only ever lowers a peak.
    peaks_all = {d: peaks_before[d].best(measure_peaks(getattr(torch, d), bf16_weights=bf16_weights)) for d in dtypes}
    if bf16_weights and {"float32", "bfloat16"} <= peaks_all.keys():
        # float32's three-part products at a third of the best bfloat16 rate of the run (one probe alone can land
        # in a slow phase of a shared VM: 309 against 2300 GFLOP/s)
        peaks_all["float32"] = with_three_parts(peaks_all["float32"], peaks_all["bfloat16"])
    for dtype_name in dtypes:
        peaks = peaks_all[dtype_name]
        lines.append(f"peaks ({dtype_name}, {args.threads} threads, better of before/after the runs): GEMM "
                     f"{peaks.gemm_gflops:.0f} GFLOP/s, read {peaks.read_gbps:.1f} GB/s; "
                     f"bound = max(GFLOP / GEMM peak, GB / read peak)"
                     + ("; the checkpoint stores bfloat16: weights counted at 2 bytes"
                        if bf16_weights and dtype_name == "float32" else "")
                     + (", float32's GEMM peak the better of torch's float32 matmul and a third of its bfloat16 "
                        "one (AMX's exact three-part products)"
                        if bf16_weights and dtype_name == "float32" and amx_kernels.available() else ""))
        for config, n, ours, comps, steps, depth in measured:
            if config.dtype != dtype_name or comps is None:
                continue
            wall, scale = ours.wall, n / args.hf_requests
            lines += [f"where the time went, {config} N={n} (wall {wall:.2f} s): ours for all {n} requests; "
                      f"transformers' time per part over {args.hf_requests} requests, scaled to {n}",
                      *stage_table(wall, steps),
                      *component_table(wall, comps, theirs.wall, hf_timers.components, scale, peaks)]
            if depth is not None and any(f != 1 for f in depth[0].values()):
                lines += projection_lines(depth, config, n, wall, ours.audio_s, comps, theirs.wall,
                                          hf_timers.components, scale, theirs.audio_s)
    lines.append(f"load_avg_1m at the end {os.getloadavg()[0]:.1f}")
    print("\n".join(lines))

if __name__ == "__main__":
    main()
