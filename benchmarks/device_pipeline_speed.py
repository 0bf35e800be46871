"""Text + speech on an accelerator: omnistage's eager and CUDA-graph runners vs transformers, one process.

transformers runs its requests one at a time on the same device; omnistage gets N at once, once per runner.
Reports audio seconds per wall second, median time to first audio, the ratio to transformers, and whether
both runners produced the same text tokens and codec codes per request (greedy, float32, TF32 off).

    python benchmarks/device_pipeline_speed.py --preset small --device cuda --concurrency 1 16
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.pipeline_bench import compile_note, run_hf, run_omnistage
from benchmarks.thinker_throughput import prompts, resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--thinker-tokens", type=int, default=48)
    ap.add_argument("--talker-tokens", type=int, default=144, help="codec tokens per answer (EOS banned)")
    ap.add_argument("--hf-requests", type=int, default=1)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="omnistage's (transformers "
                    "runs float32)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    from omnistage.models.registry import family_for_checkpoint, load_pipeline_config
    from omnistage.pipeline.engine import OmniEngine
    from omnistage.pipeline.engine_args import EngineArgs

    model = resolve_model(args.model, args.preset)
    hf = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model, dtype=torch.float32).eval().to(args.device)
    tok = AutoTokenizer.from_pretrained(model)
    eos_ids = family_for_checkpoint(model)(model).eos_token_ids
    with torch.no_grad():
        run_hf(hf, tok, eos_ids, True, prompts(1), 4, 8, 24000)  # warm-up
        ref = run_hf(hf, tok, eos_ids, True, prompts(args.hf_requests), args.thinker_tokens, args.talker_tokens,
                     24000)
    hthru, hlat = ref.audio_s / ref.wall, ref.latency
    del hf
    print(f"device={args.device} ({torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'}) "
          f"threads={args.threads} model={args.preset} dtype={args.dtype} thinker_tokens={args.thinker_tokens} "
          f"talker_tokens={args.talker_tokens}")
    print(f"transformers one at a time: {hthru:.2f} audio s/s, end-to-end {hlat:.2f} s per request")
    print(f"{'runner':>10} {'N':>3} | {'aud s/s':>8} {'TTFA s':>7} {'x thru':>6} {'TTFA/E2E':>8}")
    outputs: dict[tuple[str, int], list] = {}
    for runner in ("eager", "cuda_graph"):
        sched = {"max_num_seqs": max(args.concurrency)}
        engine = OmniEngine(EngineArgs(model, dtype=args.dtype, device=args.device), load_pipeline_config("qwen3_omni", {
            "runner": runner, "stages": {s: {"scheduler": sched} for s in ("thinker", "talker", "code2wav")}}))
        run_omnistage(engine, prompts(2), 4, 8)  # warm-up (and graph capture)
        print(f"{runner}: code predictor {compile_note(engine)}", flush=True)
        for n in args.concurrency:
            ours = run_omnistage(engine, prompts(n), args.thinker_tokens, args.talker_tokens)
            outputs[(runner, n)] = ours.outputs
            thru = ours.audio_s / ours.wall
            print(f"{runner:>10} {n:>3} | {thru:>8.2f} {ours.latency:>7.2f} {thru / hthru:>6.2f} "
                  f"{ours.latency / hlat:>8.2f}", flush=True)
        del engine
    for n in args.concurrency:
        eager, graph = outputs[("eager", n)], outputs[("cuda_graph", n)]
        same = all(a[0] == b[0] and torch.equal(a[1].cpu(), b[1].cpu()) for a, b in zip(eager, graph, strict=True))
        print(f"N={n}: eager and cuda_graph tokens and codes identical: {same}")


if __name__ == "__main__":
    main()
