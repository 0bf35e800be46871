"""Text + speech on an accelerator: omnistage's eager and CUDA-graph runners vs transformers, one process.

transformers runs its requests one at a time on the same device; omnistage gets N at once, once per runner.
Reports audio seconds per wall second, median time to first audio, the ratio to transformers, and whether
both runners produced the same text tokens and codec codes per request (greedy, float32, TF32 off).

    python benchmarks/device_pipeline_speed.py --preset small --device cuda --concurrency 1 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.thinker_throughput import hf_inputs, prompts, resolve_model


def run(engine, texts, thinker_tokens, talker_tokens, device):
    """N requests at once: (wall s, audio s, median first-audio s, {prompt index: (tokens, codes)})."""
    from omnistage import SamplingParams

    params = {
        "thinker": SamplingParams(temperature=0.0, max_tokens=thinker_tokens, min_tokens=thinker_tokens),
        "talker": SamplingParams(temperature=0.0, max_tokens=talker_tokens, repetition_penalty=1.0),
    }
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    index, start, first_audio, samples = {}, {}, {}, 0
    tokens: dict[int, list[int]] = {}
    codes: dict[int, list[torch.Tensor]] = {}
    for i, text in enumerate(texts):
        rid = engine.add_request(text, ["text", "audio"], params)
        index[rid], start[rid] = i, time.perf_counter()
    done = set()
    while len(done) < len(texts):
        for d in engine.step():
            i = index[d.req_id]
            tokens.setdefault(i, []).extend(d.new_token_ids)
            if d.codes is not None:
                codes.setdefault(i, []).append(d.codes.cpu())
            if d.audio is not None:
                samples += d.audio.numel()
                first_audio.setdefault(i, time.perf_counter() - start[d.req_id])
            if d.finished:
                assert d.error is None, d.error
                done.add(d.req_id)
    wall = time.perf_counter() - t0
    outputs = {i: (tokens.get(i, []), torch.cat(codes[i], 1) if i in codes else None) for i in range(len(texts))}
    return wall, samples / engine.info.sample_rate, statistics.median(first_audio.values()), outputs


def run_hf(hf, tok, texts, thinker_tokens, talker_tokens, device):
    """transformers, one request at a time: (wall s, audio s, median end-to-end s)."""
    wall, samples, latencies = 0.0, 0, []
    for x in hf_inputs(tok, texts):
        t0 = time.perf_counter()
        _, wav = hf.generate(x.to(device), speaker="ethan", return_audio=True, thinker_max_new_tokens=thinker_tokens,
                             thinker_min_new_tokens=thinker_tokens, thinker_eos_token_id=hf.config.im_end_token_id,
                             talker_max_new_tokens=talker_tokens, talker_do_sample=False, talker_repetition_penalty=1.0)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        latencies.append(time.perf_counter() - t0)
        wall += latencies[-1]
        samples += wav.numel()
    return wall, samples / 24000, statistics.median(latencies)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--thinker-tokens", type=int, default=48)
    ap.add_argument("--talker-tokens", type=int, default=143)
    ap.add_argument("--hf-requests", type=int, default=1)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="omnistage's (transformers "
                    "runs float32)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    from omnistage.models.registry import load_pipeline_config
    from omnistage.pipeline.engine import EngineArgs, OmniEngine

    model = resolve_model(args.model, args.preset)
    hf = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model, dtype=torch.float32).eval().to(args.device)
    tok = AutoTokenizer.from_pretrained(model)
    with torch.no_grad():
        run_hf(hf, tok, prompts(1), 4, 8, args.device)  # warm-up
        hwall, haudio, hlat = run_hf(hf, tok, prompts(args.hf_requests), args.thinker_tokens, args.talker_tokens,
                                     args.device)
    del hf
    print(f"device={args.device} ({torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'}) "
          f"threads={args.threads} model={args.preset} dtype={args.dtype} thinker_tokens={args.thinker_tokens} "
          f"talker_tokens={args.talker_tokens}")
    print(f"transformers one at a time: {haudio / hwall:.2f} audio s/s, end-to-end {hlat:.2f} s per request")
    print(f"{'runner':>10} {'N':>3} | {'aud s/s':>8} {'TTFA s':>7} {'x thru':>6} {'TTFA/E2E':>8}")
    outputs: dict[tuple[str, int], dict] = {}
    for runner in ("eager", "cuda_graph"):
        sched = {"max_num_seqs": max(args.concurrency)}
        engine = OmniEngine(EngineArgs(model, dtype=args.dtype, device=args.device), load_pipeline_config("qwen3_omni", {
            "runner": runner, "stages": {s: {"scheduler": sched} for s in ("thinker", "talker", "code2wav")}}))
        run(engine, prompts(2), 4, 8, args.device)  # warm-up (and graph capture)
        for n in args.concurrency:
            wall, audio_s, ttfa, outputs[(runner, n)] = run(engine, prompts(n), args.thinker_tokens,
                                                            args.talker_tokens, args.device)
            print(f"{runner:>10} {n:>3} | {audio_s / wall:>8.2f} {ttfa:>7.2f} "
                  f"{(audio_s / wall) / (haudio / hwall):>6.2f} {ttfa / hlat:>8.2f}", flush=True)
        del engine
    for n in args.concurrency:
        eager, graph = outputs[("eager", n)], outputs[("cuda_graph", n)]
        same = all(eager[i][0] == graph[i][0] and torch.equal(eager[i][1], graph[i][1]) for i in eager)
        print(f"N={n}: eager and cuda_graph tokens and codes identical: {same}")


if __name__ == "__main__":
    main()
