"""Text + speech, end to end: omnistage's streaming three-stage pipeline vs transformers generate(return_audio=True).

Same checkpoint, prompts and thread count in one process. omnistage gets N requests at once; transformers
runs them one at a time (its generate serves one request's audio per call). Reports text tokens/s, audio
seconds per wall second, time to first audio chunk, real-time factor (wall / audio seconds), and ratios.

    python benchmarks/pipeline_bench.py --preset small --concurrency 1 4 16 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

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
    return wall, tokens, samples / engine.sample_rate, statistics.median(first_audio.values())


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--thinker-tokens", type=int, default=32)
    ap.add_argument("--talker-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf-requests", type=int, default=2, help="requests transformers runs (one at a time)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    from omnistage.models.registry import load_pipeline_config
    from omnistage.pipeline.engine import EngineArgs, OmniEngine

    model = resolve_model(args.model, args.preset)
    top = max(args.concurrency)
    sched = {"max_num_seqs": top}
    pipeline = load_pipeline_config("qwen3_omni", {"stages": {
        "thinker": {"scheduler": sched}, "talker": {"scheduler": sched}, "code2wav": {"scheduler": sched}}})
    engine = OmniEngine(EngineArgs(model), pipeline)
    hf = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model)
    run_omnistage(engine, prompts(1), 4, 8)  # warm-up

    print(f"threads={args.threads} model={Path(model).name} thinker_tokens={args.thinker_tokens} "
          f"talker_tokens={args.talker_tokens} (first audio chunk: {dict(pipeline.stage('code2wav').bridge_args)})")
    print(f"{'N':>3} | {'ours tok/s':>10} {'ours aud s/s':>12} {'ours TTFA s':>11} {'ours RTF':>8} | "
          f"{'hf tok/s':>8} {'hf aud s/s':>10} {'hf E2E s':>8} {'hf RTF':>7} | {'x thru':>6} {'TTFA/E2E':>8}")
    # transformers serves one request per call, so its throughput does not depend on N: measure it once,
    # on the first --hf-requests prompts, and compare every concurrency against it.
    with torch.no_grad():
        hwall, htoks, haudio, hlat = run_hf(hf, tok, prompts(args.hf_requests), args.thinker_tokens,
                                            args.talker_tokens, engine.sample_rate)
    for n in args.concurrency:
        texts = prompts(n)
        wall, toks, audio_s, ttfa = run_omnistage(engine, texts, args.thinker_tokens, args.talker_tokens)
        print(f"{n:>3} | {toks / wall:>10.1f} {audio_s / wall:>12.2f} {ttfa:>11.2f} {wall / audio_s:>8.2f} | "
              f"{htoks / hwall:>8.1f} {haudio / hwall:>10.2f} {hlat:>8.2f} {hwall / haudio:>7.2f} | "
              f"{(audio_s / wall) / (haudio / hwall):>6.2f} {ttfa / hlat:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
