"""Text + speech, end to end: omnistage's streaming three-stage pipeline vs transformers generate(return_audio=True).

Same checkpoint, prompts and thread count in one process. omnistage gets N requests at once; transformers
runs them one at a time (its generate serves one request's audio per call). Reports text tokens/s, audio
seconds per wall second, time to first audio chunk, real-time factor (wall / audio seconds), and ratios.

    python benchmarks/pipeline_bench.py --preset small --concurrency 1 4 16 --threads 2
    python -m benchmarks.pipeline_bench --family qwen2_5_omni --preset small --concurrency 16 \
        --hf-requests 1 --hf-thinker-tokens 8 --hf-talker-tokens 32

Qwen2.5-Omni's reference is slow on CPU (its Token2Wav re-runs the speaker encoder at every ODE evaluation):
--hf-thinker-tokens / --hf-talker-tokens give transformers shorter requests (same ratio of text to codes)
without changing what omnistage runs.

``--distributed-executor-backend mp`` runs every stage in its own worker process (``--threads`` split between
them) and adds, per row, a stage trace (busy share of the wall time per stage, share of time with two or more
stages busy, each worker's share of time waiting) and the transport cost of a hand-off (bytes, encode / decode / transit milliseconds).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from pathlib import Path

import torch

from benchmarks.stage_trace import StageTrace, cpu_seconds, snapshot, transport_report
from benchmarks.thinker_throughput import hf_inputs, prompts, resolve_model


def run_omnistage(engine, texts, thinker_tokens, talker_tokens):
    from omnistage import SamplingParams

    params = {
        "thinker": SamplingParams(temperature=0.0, max_tokens=thinker_tokens, min_tokens=thinker_tokens),
        "talker": SamplingParams(temperature=0.0, max_tokens=talker_tokens, repetition_penalty=1.0),
    }
    t0 = time.perf_counter()
    start, first_audio, tokens, samples = {}, {}, 0, 0
    for t in texts:
        rid = engine.add_request(t, ["text", "audio"], params)
        start[rid] = time.perf_counter()
    done = set()
    while len(done) < len(texts):
        for d in engine.step():
            tokens += len(d.new_token_ids)
            if d.audio is not None:
                samples += d.audio.numel()
                first_audio.setdefault(d.req_id, time.perf_counter() - start[d.req_id])
            if d.finished:
                done.add(d.req_id)
    wall = time.perf_counter() - t0
    return wall, tokens, samples / engine.info.sample_rate, statistics.median(first_audio.values())


def run_hf(hf, tok, texts, thinker_tokens, talker_tokens, sample_rate):
    wall, samples, latencies, tokens = 0.0, 0, [], 0
    for x in hf_inputs(tok, texts):
        t0 = time.perf_counter()
        seq, wav = hf.generate(x, speaker="ethan", return_audio=True, thinker_max_new_tokens=thinker_tokens,
                               thinker_min_new_tokens=thinker_tokens, thinker_eos_token_id=hf.config.im_end_token_id,
                               talker_max_new_tokens=talker_tokens, talker_do_sample=False,
                               talker_repetition_penalty=1.0)
        dt = time.perf_counter() - t0
        wall += dt
        latencies.append(dt)
        samples += wav.numel()
        tokens += seq.shape[1] - x.shape[1]
    return wall, tokens, samples / sample_rate, statistics.median(latencies)


def run_hf_qwen2_5_omni(hf, engine, texts, thinker_tokens, talker_tokens, sample_rate):
    """transformers' Qwen2.5-Omni, one request at a time, on the prompt ids omnistage renders (with its speech
    system prompt); the Talker's EOS ids are the checkpoint's (generate's defaults are the released model's)."""
    from omnistage.testing.qwen2_5_omni.reference import explicit_talker_mask

    tc = hf.config.talker_config
    wall, samples, latencies, tokens = 0.0, 0, [], 0
    for text in texts:
        x = torch.tensor([engine.render_prompt(text).token_ids])
        t0 = time.perf_counter()
        with explicit_talker_mask(hf):
            seq, wav = hf.generate(x, speaker="Chelsie", thinker_max_new_tokens=thinker_tokens,
                                   thinker_min_new_tokens=thinker_tokens, thinker_do_sample=False,
                                   talker_max_new_tokens=talker_tokens, talker_do_sample=False,
                                   talker_repetition_penalty=1.0,
                                   talker_eos_token_id=[tc.tts_codec_pad_token_id, tc.tts_codec_end_token_id])
        dt = time.perf_counter() - t0
        wall += dt
        latencies.append(dt)
        samples += wav.numel()
        tokens += seq.shape[1] - x.shape[1]
    return wall, tokens, samples / sample_rate, statistics.median(latencies)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--family", default="qwen3_omni", choices=["qwen3_omni", "qwen2_5_omni"],
                    help="model family of the built --preset checkpoint (a --model dir names its own)")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--thinker-tokens", type=int, default=32)
    ap.add_argument("--talker-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf-requests", type=int, default=2, help="requests transformers runs (one at a time)")
    ap.add_argument("--hf-thinker-tokens", type=int, default=None, help="transformers' (default: --thinker-tokens)")
    ap.add_argument("--hf-talker-tokens", type=int, default=None, help="transformers' (default: --talker-tokens)")
    ap.add_argument("--distributed-executor-backend", choices=["inproc", "mp", "ray"], default="inproc")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    from omnistage.models.registry import family_for_checkpoint, load_pipeline_config
    from omnistage.pipeline.engine import EngineArgs, OmniEngine

    model = resolve_model(args.model, args.preset, args.family)
    family = family_for_checkpoint(model).name
    top = max(args.concurrency)
    sched = {"max_num_seqs": top}
    stages = load_pipeline_config(family).order
    backend = args.distributed_executor_backend
    # Stage workers share the thread budget (at least one each); in-process stages use all of it in turn.
    per_stage = {"scheduler": sched} if backend == "inproc" else {"scheduler": sched,
                                                                    "threads": max(1, args.threads // len(stages))}
    pipeline = load_pipeline_config(family, {"stages": {name: per_stage for name in stages}})
    engine = OmniEngine(EngineArgs(model, distributed_executor_backend=backend), pipeline)
    trace = StageTrace()
    engine.orchestrator.listeners.append(trace)
    if family == "qwen2_5_omni":
        from omnistage.testing.qwen2_5_omni.reference import load_hf_reference

        hf = load_hf_reference(model)
        reference = functools.partial(run_hf_qwen2_5_omni, hf, engine)
    else:
        hf = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model, dtype=torch.float32).eval()
        reference = functools.partial(run_hf, hf, AutoTokenizer.from_pretrained(model))
    run_omnistage(engine, prompts(1), 4, 8)  # warm-up
    hf_thinker = args.hf_thinker_tokens or args.thinker_tokens
    hf_talker = args.hf_talker_tokens or args.talker_tokens

    print(f"threads={args.threads} backend={backend} (threads per stage worker: {per_stage.get('threads', '-')}) "
          f"model={Path(model).name} ({family}) thinker_tokens={args.thinker_tokens} "
          f"talker_tokens={args.talker_tokens} transformers: {hf_thinker}/{hf_talker} tokens "
          f"(audio chunks: {dict(pipeline.stage(stages[-1]).bridge_args)})")
    # "aud s/cpu s": audio seconds per CPU second (ours: this process and its stage workers), the work measure
    # when the machine is shared (wall-clock rates then depend on the neighbours' load).
    print(f"{'N':>3} | {'ours tok/s':>10} {'ours aud s/s':>12} {'ours TTFA s':>11} {'ours RTF':>8} "
          f"{'aud s/cpu s':>11} | {'hf tok/s':>8} {'hf aud s/s':>10} {'hf E2E s':>8} {'hf RTF':>7} "
          f"{'aud s/cpu s':>11} | {'x thru':>6} {'x cpu':>6} {'TTFA/E2E':>8}")
    # transformers serves one request per call, so its throughput does not depend on N: measure it once,
    # on the first --hf-requests prompts, and compare every concurrency against it.
    cpu = time.process_time()
    with torch.no_grad():
        hwall, htoks, haudio, hlat = reference(prompts(args.hf_requests), hf_thinker, hf_talker,
                                               engine.info.sample_rate)
    hcpu = time.process_time() - cpu
    for n in args.concurrency:
        texts = prompts(n)
        counters = snapshot(engine) if engine.workers is not None else None
        cpu0 = cpu_seconds(engine)
        t0 = time.monotonic()
        wall, toks, audio_s, ttfa = run_omnistage(engine, texts, args.thinker_tokens, args.talker_tokens)
        window = trace.summary(t0, time.monotonic())
        cpu = {k: v - cpu0[k] for k, v in cpu_seconds(engine).items()}
        ocpu = sum(cpu.values())
        print(f"{n:>3} | {toks / wall:>10.1f} {audio_s / wall:>12.2f} {ttfa:>11.2f} {wall / audio_s:>8.2f} "
              f"{audio_s / ocpu:>11.3f} | {htoks / hwall:>8.1f} {haudio / hwall:>10.2f} {hlat:>8.2f} "
              f"{hwall / haudio:>7.2f} {haudio / hcpu:>11.3f} | {(audio_s / wall) / (haudio / hwall):>6.2f} "
              f"{(audio_s / ocpu) / (haudio / hcpu):>6.2f} {ttfa / hlat:>8.2f}", flush=True)
        busy = " ".join(f"{k} {100 * v / window['wall']:.0f}%" for k, v in sorted(window["busy"].items()))
        print(f"    stages busy (share of wall): {busy}; any stage busy {100 * window['any']:.0f}%, "
              f"two or more at once {100 * window['overlap']:.0f}%; CPU s: "
              f"{', '.join(f'{k} {v:.1f}' for k, v in cpu.items())}", flush=True)
        if counters is not None:  # a worker not stepping waits: for upstream input, or for the API process
            waiting = " ".join(f"{k} {100 - 100 * v / window['wall']:.0f}%" for k, v in sorted(window["busy"].items()))
            print(f"    workers waiting (share of wall): {waiting}", flush=True)
            for line in transport_report(counters, snapshot(engine)):
                print("    " + line, flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
