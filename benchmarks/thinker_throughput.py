"""Thinker text-only throughput: omnistage (continuous batching) vs transformers generate, side by side.

Same checkpoint, same prompts, same thread count, one process. For each concurrency N, N requests are
submitted at once to omnistage; transformers runs them one by one and as one statically padded batch.
Prints generated tokens/s for each and the ratios. Greedy, fixed output length (min = max tokens).

    python benchmarks/thinker_throughput.py --preset small --concurrency 1 8 32 --max-tokens 64 --threads 2
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import tempfile
import time
from pathlib import Path

import torch

PROMPT_WORDS = "tell me about the sea the boat the wind and the small town by the river".split()


def prompts(n: int) -> list[str]:
    # Different lengths on purpose: continuous batching must handle ragged requests.
    return [" ".join(PROMPT_WORDS[: 4 + (i * 5) % len(PROMPT_WORDS)]) + f" ({i})" for i in range(n)]


def lengths(n: int, max_tokens: int, ragged: bool) -> list[int]:
    """Output length per request: all max_tokens, or (ragged) max/4, max/2, 3max/4, max in turn — the
    spread real traffic has, which a static batch pays for at its longest member."""
    if not ragged:
        return [max_tokens] * n
    return [max(1, max_tokens * (1 + i % 4) // 4) for i in range(n)]


def run_omnistage(omni, texts, lens) -> tuple[float, int]:
    from omnistage import SamplingParams

    engine = omni.engine
    t0 = time.perf_counter()
    ids = {engine.add_request(t, ["text"], SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n))
           for t, n in zip(texts, lens)}
    tokens = 0
    while ids:
        for d in engine.step():
            tokens += len(d.new_token_ids) + (1 if d.finish_reason == "stop" else 0)
            if d.finished:
                ids.discard(d.req_id)
    return time.perf_counter() - t0, tokens


def resolve_model(model: str | None, preset: str, family: str = "qwen3_omni", depth: str | None = None) -> str:
    """The given checkpoint dir, or the family's preset built into a temp dir (seed 0), removed when the process
    exits (the small preset is ~0.7 GB, the released widths at 2 layers 5.2 GB: runs must not leave one behind
    each). ``preset`` "real": the released architecture with ``depth`` (``STACK=N,...``) layers."""
    if model is not None:
        return model
    from omnistage.checkpoints.builder import build_checkpoint

    root = Path(tempfile.mkdtemp(prefix="omnistage-bench-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return str(build_checkpoint(root / preset, preset=preset, seed=0, family=family, depth=depth))


def hf_inputs(tok, texts):
    return [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, return_tensors="pt",
                                return_dict=True)["input_ids"]
        for t in texts
    ]


def run_hf_one_by_one(hf, ids, lens, eos) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = 0
    for x, m in zip(ids, lens):
        out = hf.thinker.generate(x, max_new_tokens=m, min_new_tokens=m, do_sample=False, eos_token_id=eos)
        n += out.shape[1] - x.shape[1]
    return time.perf_counter() - t0, n


def run_hf_static_batch(hf, tok, ids, lens, eos) -> tuple[float, int]:
    """One padded batch run to the longest request; only each request's own tokens count as output."""
    max_tokens = max(lens)
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
    assert out.shape[1] - width == max_tokens
    return time.perf_counter() - t0, sum(lens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint dir (default: build the preset into a temp dir)")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ragged", action="store_true", help="per-request output lengths max/4 .. max")
    ap.add_argument("--skip-one-by-one-above", type=int, default=8,
                    help="run transformers one by one only up to this concurrency (it is linear in N)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    from omnistage import Omni
    from omnistage.models.registry import load_pipeline_config

    model = resolve_model(args.model, args.preset)
    top = max(args.concurrency)
    pipeline = load_pipeline_config("qwen3_omni", {"stages": {"thinker": {"scheduler": {
        "max_num_seqs": top, "max_num_batched_tokens": 4096, "max_model_len": 1024}}}})
    omni = Omni(model, pipeline=pipeline)
    hf = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model)
    eos = hf.config.im_end_token_id
    run_omnistage(omni, prompts(2), [4, 4])  # warm-up

    print(f"threads={args.threads} preset/model={Path(model).name} max_tokens={args.max_tokens} "
          f"lengths={'ragged (max/4..max)' if args.ragged else 'fixed'}")
    print(f"{'N':>4} {'omnistage tok/s':>16} {'hf 1-by-1 tok/s':>16} {'hf static tok/s':>16} "
          f"{'x 1-by-1':>9} {'x static':>9}")
    for n in args.concurrency:
        texts, lens = prompts(n), lengths(n, args.max_tokens, args.ragged)
        dt, toks = run_omnistage(omni, texts, lens)
        ours = toks / dt
        ids = hf_inputs(tok, texts)
        with torch.no_grad():
            if n <= args.skip_one_by_one_above:
                dt1, t1 = run_hf_one_by_one(hf, ids, lens, eos)
                one = t1 / dt1
            else:
                one = float("nan")
            dts, ts = run_hf_static_batch(hf, tok, ids, lens, eos)
            static = ts / dts
        print(f"{n:>4} {ours:>16.1f} {one:>16.1f} {static:>16.1f} {ours / one:>9.2f} {ours / static:>9.2f}",
              flush=True)


if __name__ == "__main__":
    main()
