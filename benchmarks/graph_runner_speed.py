"""Decode speed of the CUDA-graph runner vs the eager runner (Thinker, text only), same run, same tokens.

On CUDA the graph runner captures decode steps as CUDA graphs; on CPU it runs the same static-buffer path eagerly (a
correctness path, expected slower). Prints tok/s per batch size and checks both runners produce identical
greedy tokens.

    python benchmarks/graph_runner_speed.py --preset small --device cuda --batch 1 16 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from benchmarks.thinker_throughput import prompts, resolve_model
    from omnistage import Omni, SamplingParams
    from omnistage.models.registry import load_pipeline_config

    model = resolve_model(args.model, args.preset)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, min_tokens=args.max_tokens)
    results: dict[tuple[str, int], tuple[float, list]] = {}
    for runner in ("eager", "cuda_graph"):
        pipeline = load_pipeline_config("qwen3_omni", {"runner": runner, "stages": {"thinker": {"scheduler": {
            "max_num_seqs": max(args.batch), "max_model_len": args.max_model_len}}}})
        omni = Omni(model, pipeline=pipeline, device=args.device)
        omni.generate(prompts(2), sampling_params=params)  # warm-up (and graph capture)
        for n in args.batch:
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = omni.generate(prompts(n), sampling_params=params)
            dt = time.perf_counter() - t0
            results[(runner, n)] = (n * args.max_tokens / dt, [o.token_ids for o in outs])
        del omni
    print(f"device={args.device} threads={args.threads} max_tokens={args.max_tokens} "
          f"max_model_len={args.max_model_len}")
    for n in args.batch:
        eager, graph = results[("eager", n)], results[("cuda_graph", n)]
        print(f"batch {n:>3}: eager {eager[0]:8.1f} tok/s   cuda_graph {graph[0]:8.1f} tok/s   "
              f"ratio {graph[0] / eager[0]:5.2f}   identical tokens: {eager[1] == graph[1]}", flush=True)


if __name__ == "__main__":
    main()
