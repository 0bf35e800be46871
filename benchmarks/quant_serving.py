"""Serving a quantized checkpoint: load time, resident memory, Thinker decode tokens/s at 1 / 4 / 16 requests,
time to first audio and real-time factor of a short spoken answer; and the full-depth projection.

The engine is built the way ``omnistage serve --model DIR --quantization M`` builds it (in process, the
packaged preset). A pre-quantized checkpoint (``make-checkpoint --preset real --quantization int4``) loads as
stored; a bfloat16 one is quantized while loading. ``--project`` adds the released architecture at full depth:
its weight bytes under each method exactly (the memory plan's rule over the real preset's tensor shapes; nothing
is built), and the Thinker decode step extrapolated from this checkpoint's measured step: the output head
(timed alone) + the measured per-layer remainder x 48.

    python benchmarks/quant_serving.py --model /work/bigckpt/real-d2 --quantization int4 --threads 2 --project
"""

from __future__ import annotations

import argparse
import platform
import resource
import time
from pathlib import Path

import torch


def rss_gib() -> tuple[float, float]:
    """(resident now, peak resident) of this process in GiB."""
    now = peak = 0.0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            now = int(line.split()[1]) / (1 << 20)
        elif line.startswith("VmHWM:"):
            peak = int(line.split()[1]) / (1 << 20)
    return now, peak


def full_depth_weight_bytes(method: str, group: int | None, dtype: torch.dtype) -> dict[str, int]:
    """Weight bytes per part of the released architecture at full depth under ``method`` (the memory plan's
    rule: quantized tensors packed for the CPU kernels, the rest in ``dtype``)."""
    import warnings

    from transformers import Qwen3OmniMoeForConditionalGeneration

    from omnistage.checkpoints.config_files import make_hf_config
    from omnistage.checkpoints.presets import build_config_dict
    from omnistage.checkpoints.real import REAL_VOCAB, real_preset
    from omnistage.checkpoints.tokenizer import tokenizer_ids, train_tokenizer
    from omnistage.checkpoints.weights import hub_tensors
    from omnistage.config.quantization import Quantization
    from omnistage.models.qwen3_omni.family import quant_scheme

    preset = real_preset()
    config = build_config_dict(preset, tokenizer_ids(train_tokenizer(preset.bpe_vocab_size)))
    config["thinker_config"]["text_config"]["vocab_size"] = REAL_VOCAB
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        skeleton = Qwen3OmniMoeForConditionalGeneration(make_hf_config(config))
    q = Quantization(method, group)
    schemes = {part: quant_scheme(part, q) for part in ("thinker", "talker")}
    width = dtype.itemsize
    out: dict[str, int] = {}
    hub = ((n, tuple(t.shape)) for name, value in skeleton.state_dict().items() for n, t in hub_tensors(name, value))
    for name, shape in hub:
        part, _, rel = name.partition(".")
        scheme = schemes.get(part)
        quantized = scheme.weight_bytes(rel, shape, width, torch.device("cpu")) if scheme is not None else None
        numel = 1
        for d in shape:
            numel *= d
        key = "thinker towers" if rel.startswith(("audio_tower.", "visual.")) else part
        out[key] = out.get(key, 0) + (numel * width if quantized is None else quantized)
    return out


def thinker_weight_bytes(omni) -> int:
    """The Thinker decoder's weight bytes as held (towers left out)."""
    from omnistage.runner.memory_use import weight_bytes_by_component

    stage_model = omni.engine.orchestrator.stages["thinker"].runner.model
    return sum(v for k, v in weight_bytes_by_component(stage_model).items() if not k.startswith("encoders"))


def decode_step_bytes(omni, batch: int) -> float:
    """Bytes one Thinker decode step of ``batch`` rows reads at least: every weight but the experts and the
    embedding table, each MoE layer's experts in the expected share a batch selects (1 - (1 - k/E)^batch of
    them, for uniformly routed tokens), and one embedding row per request; the KV cache of short prompts is
    left out (it adds to the bound, so leaving it out makes the ratio stricter)."""
    from omnistage.models.layers.moe import SparseMoE
    from omnistage.models.layers.quant_layers import QuantExperts

    thinker = omni.engine.orchestrator.stages["thinker"].runner.model.thinker
    total = thinker_weight_bytes(omni)
    embed = thinker.model.embed_tokens.weight
    expert_bytes = selected = 0.0
    for layer in thinker.modules():
        if isinstance(layer, SparseMoE) and isinstance(layer.experts, QuantExperts):
            nbytes = layer.experts.gate_up_q.nbytes + layer.experts.down_q.nbytes
            expert_bytes += nbytes
            selected += nbytes * (1 - (1 - layer.top_k / layer.num_experts) ** batch)
    embed_bytes = embed.numel() * embed.element_size()
    return total - expert_bytes - embed_bytes + selected + batch * embed_bytes / embed.shape[0]


def decode_run(omni, n: int, max_tokens: int) -> tuple[float, float, int]:
    """``n`` text requests of ``max_tokens`` greedy tokens at once -> (seconds to the last request's first
    token, seconds per decode step after it, tokens generated)."""
    from benchmarks.thinker_throughput import prompts
    from omnistage import SamplingParams

    engine = omni.engine
    t0 = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
    ids = {engine.add_request(t, ["text"], params) for t in prompts(n)}
    started: set[str] = set()
    first = None
    tokens = 0
    while ids:
        for d in engine.step():
            tokens += len(d.new_token_ids)
            if d.new_token_ids:
                started.add(d.req_id)
            if d.finished:
                ids.discard(d.req_id)
        if first is None and len(started) == n:
            first = time.perf_counter()
    end = time.perf_counter()
    return first - t0, (end - first) / max(1, max_tokens - 1), tokens


def prefill_rate(omni, tokens: int = 512, runs: int = 3) -> float:
    """Thinker prefill tokens/s of a ~``tokens``-token text prompt: the best of ``runs`` distinct prompts (the first
    long prompt of a process also pays its scratch buffers' first touch; distinct, so the prefix cache cannot
    answer), one output token each."""
    from omnistage import SamplingParams

    best = 0.0
    for i in range(runs):
        text = f"run {i}: " + " ".join(["the sea the boat the wind"] * (tokens // 5))
        t0 = time.perf_counter()
        out = omni.generate(text, ["text"], SamplingParams(temperature=0.0, max_tokens=1))[0]
        best = max(best, len(out.prompt_token_ids) / (time.perf_counter() - t0))
    return best


def head_seconds(omni, rows: int, reps: int = 5) -> float:
    """One Thinker output-head call over ``rows`` rows, as the engine runs it."""
    thinker = omni.engine.orchestrator.stages["thinker"].runner.model.thinker
    h = torch.randn(rows, thinker.lm_head.in_features, dtype=thinker.model.embed_tokens.weight.dtype)
    with torch.inference_mode():
        thinker.compute_logits(h)
        t0 = time.perf_counter()
        for _ in range(reps):
            thinker.compute_logits(h)
    return (time.perf_counter() - t0) / reps


def main() -> None:
    from benchmarks.pipeline_bench import run_omnistage as run_speech
    from omnistage import Omni

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default="int4")
    p.add_argument("--group-size", type=int, default=None, help="int4: default 128; int8: groups, not per channel")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--speech-frames", type=int, default=50, help="Talker frames of the spoken answer (12.5 / s)")
    p.add_argument("--speech-requests", type=int, nargs="+", default=[1, 4])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--project", action="store_true")
    p.add_argument("--stage-config", default=None, help="pipeline YAML (e.g. KV budgets for the full depth)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from omnistage.models.layers import quant_kernels

    bandwidth = quant_kernels.read_bandwidth()
    print(f"# streaming read, {args.threads} threads: {bandwidth / 1e9:.1f} GB/s (quantized kernels: "
          f"{quant_kernels.isa()})")
    print(f"# {args.model}, {args.quantization} (groups of {args.group_size or 'default'}), {args.dtype}: "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    t0 = time.perf_counter()
    omni = Omni(args.model, stage_config=args.stage_config, dtype=args.dtype, quantization=args.quantization,
                quantization_group_size=args.group_size)
    load = time.perf_counter() - t0
    now, peak = rss_gib()
    plan = {m.stage: m for m in omni.engine.memory_plan}
    print(f"load {load:.1f} s; resident {now:.2f} GiB (peak {peak:.2f} GiB, ru_maxrss "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20):.2f} GiB); plan: "
          + ", ".join(f"{s} {m.weight_bytes / (1 << 30):.2f} GiB weights + {m.kv_bytes / (1 << 30):.2f} GiB KV"
                      for s, m in plan.items()))
    steps = {}
    decode_run(omni, 1, 2)  # warm-up: the first requests compile and fill caches
    for n in args.concurrency:
        prefill, step, tokens = decode_run(omni, n, args.max_tokens)
        steps[n] = step
        bound = decode_step_bytes(omni, n) / bandwidth
        print(f"thinker decode, {n:>2} requests: {n / step:7.1f} tokens/s aggregate, {1000 * step:.0f} ms per "
              f"step (bandwidth bound {1000 * bound:.0f} ms: {100 * bound / step:.0f}% of it); all first tokens "
              f"after {prefill:.2f} s")
    print(f"thinker prefill, 512-token prompt: {prefill_rate(omni):.0f} tokens/s (best of 3)")
    for n in args.speech_requests:
        run = run_speech(omni.engine, [f"Say something short ({i})." for i in range(n)], 8, args.speech_frames)
        print(f"spoken answers, {n} requests (8 text tokens, {args.speech_frames} frames each): first audio "
              f"{run.latency:.2f} s (median), {run.audio_s:.2f} s of audio in {run.wall:.2f} s: "
              f"{run.audio_s / run.wall:.2f} audio-s/s aggregate, RTF {run.wall * n / run.audio_s:.2f} per request")
    now, peak = rss_gib()
    print(f"resident after the runs {now:.2f} GiB (peak {peak:.2f} GiB)")
    if args.project:
        layers = len(omni.engine.orchestrator.stages["thinker"].runner.model.thinker.model.layers)
        for n, step in steps.items():
            head = head_seconds(omni, n)
            per_layer = (step - head) / layers
            full = head + 48 * per_layer
            print(f"projected full-depth thinker decode at {n:>2}: head {1000 * head:.0f} ms + 48 x "
                  f"{1000 * per_layer:.0f} ms = {1000 * full:.0f} ms per step -> {n / full:.1f} tokens/s")
        for method in ("none", "int8", args.quantization):
            parts = full_depth_weight_bytes(method, args.group_size, getattr(torch, args.dtype))
            print(f"full depth, {method}: " + ", ".join(f"{k} {v / (1 << 30):.2f} GiB" for k, v in parts.items())
                  + f"; total {sum(parts.values()) / (1 << 30):.2f} GiB")
    omni.shutdown()


if __name__ == "__main__":
    main()
