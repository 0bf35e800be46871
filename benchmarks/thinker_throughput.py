"""Thinker text-only throughput: omnistage (continuous batching) vs transformers generate, side by side.

Same checkpoint, same prompts, same thread count, one process. For each concurrency N, N requests are
submitted at once to omnistage; transformers runs them one by one and as one statically padded batch.
Prints generated tokens/s for each and the ratios. Greedy, fixed output length (min = max tokens).

    python benchmarks/thinker_throughput.py --preset small --concurrency 1 8 32 --max-tokens 64 --threads 2
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

PROMPT_WORDS = "tell me about the sea the boat the wind and the small town by the river".split()


def prompts(n: int) -> list[str]:
    # Different lengths on purpose: continuous batching must handle ragged requests.
    return [" ".join(PROMPT_WORDS[: 4 + (i * 5) % len(PROMPT_WORDS)]) + f" ({i})" for i in range(n)]


def run_omnistage(omni, texts, max_tokens) -> tuple[float, int]:
    from omnistage import SamplingParams

    p = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
    t0 = time.perf_counter()
    outs = omni.generate(texts, modalities=["text"], sampling_params=p)
    dt = time.perf_counter() - t0
    return dt, sum(len(o.token_ids) + (1 if o.finish_reason == "stop" else 0) for o in outs)


def resolve_model(model: str | None, preset: str) -> str:
    """The given checkpoint dir, or the preset built into a temp dir (seed 0)."""
    if model is not None:
        return model
    from omnistage.testing.checkpoint import build_checkpoint

    return str(build_checkpoint(Path(tempfile.mkdtemp()) / preset, preset=preset, seed=0))


def hf_inputs(tok, texts):
    return [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, return_tensors="pt",
                                return_dict=True)["input_ids"]
        for t in texts
    ]


def run_hf_one_by_one(hf, ids, max_tokens, eos) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = 0
    for x in ids:
        out = hf.thinker.generate(x, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                  eos_token_id=eos)
        n += out.shape[1] - x.shape[1]
    return time.perf_counter() - t0, n


def run_hf_static_batch(hf, tok, ids, max_tokens, eos) -> tuple[float, int]:
    width = max(x.shape[1] for x in ids)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    batch = torch.full((len(ids), width), pad, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for i, x in enumerate(ids):  # left padding, as decoder-only batching needs
        batch[i, width - x.shape[1]:] = x[0]
        mask[i, width - x.shape[1]:] = 1
    t0 = time.perf_counter()
    out = hf.thinker.generate(batch, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                              do_sample=False, eos_token_id=eos, pad_token_id=pad)
    return time.perf_counter() - t0, (out.shape[1] - width) * len(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint dir (default: build the preset into a temp dir)")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-one-by-one-above", type=int, default=8,
                    help="run transformers one by one only up to this concurrency (it is linear in N)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    from omnistage import Omni
    from omnistage.config import load_pipeline_config

    model = resolve_model(args.model, args.preset)
    top = max(args.concurrency)
    pipeline = load_pipeline_config("qwen3_omni", {"stages": {"thinker": {"scheduler": {
        "max_num_seqs": top, "max_num_batched_tokens": 4096, "max_model_len": 1024}}}})
    omni = Omni(model, pipeline=pipeline)
    hf = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model)
    eos = hf.config.im_end_token_id
    run_omnistage(omni, prompts(2), 4)  # warm-up

    print(f"threads={args.threads} preset/model={Path(model).name} max_tokens={args.max_tokens}")
    print(f"{'N':>4} {'omnistage tok/s':>16} {'hf 1-by-1 tok/s':>16} {'hf static tok/s':>16} "
          f"{'x 1-by-1':>9} {'x static':>9}")
    for n in args.concurrency:
        texts = prompts(n)
        dt, toks = run_omnistage(omni, texts, args.max_tokens)
        ours = toks / dt
        ids = hf_inputs(tok, texts)
        with torch.no_grad():
            if n <= args.skip_one_by_one_above:
                dt1, t1 = run_hf_one_by_one(hf, ids, args.max_tokens, eos)
                one = t1 / dt1
            else:
                one = float("nan")
            dts, ts = run_hf_static_batch(hf, tok, ids, args.max_tokens, eos)
            static = ts / dts
        print(f"{n:>4} {ours:>16.1f} {one:>16.1f} {static:>16.1f} {ours / one:>9.2f} {ours / static:>9.2f}",
              flush=True)


if __name__ == "__main__":
    main()
