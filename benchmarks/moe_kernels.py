"""Stacked-expert GEMMs: one grouped GEMM (torch._grouped_mm) vs a loop of per-expert GEMMs, by row count.

Rows are (token, slot) pairs sorted by expert, as SparseMoE runs them; sizes are the small preset's Thinker
(H 768, I 384, 16 experts) and Talker (H 512, I 256) experts. Prints CPU time per call of both paths and
checks they give the same bits (the measurement behind the grouped default in omnistage/models/layers/moe.py).

    python -m benchmarks.moe_kernels --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch

from omnistage.models.layers.moe import StackedExperts


def cpu_time(experts: StackedExperts, x: torch.Tensor, counts: torch.Tensor, grouped: bool, repeats: int) -> float:
    experts(x, counts, grouped)
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        experts(x, counts, grouped)
        best = min(best, time.process_time() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 16, 64, 256, 1024, 2048])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    print(f"threads={args.threads} dtype={args.dtype} (best-of-{args.repeats} process CPU time per call)")
    print(f"{'experts':>14} {'rows':>5} {'loop ms':>8} {'grouped ms':>10} {'same bits':>9}")
    for name, hidden, inter in (("thinker", 768, 384), ("talker", 512, 256)):
        experts = StackedExperts(16, hidden, inter)
        with torch.no_grad():
            for p in experts.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        experts = experts.to(dtype)
        for rows in args.rows:
            ids = torch.randint(0, 16, (rows,), generator=gen)
            counts = torch.bincount(ids, minlength=16)
            x = torch.randn(rows, hidden, generator=gen).to(dtype)
            with torch.inference_mode():
                same = torch.equal(experts(x, counts, grouped=False), experts(x, counts, grouped=True))
                loop = cpu_time(experts, x, counts, False, args.repeats)
                grouped = cpu_time(experts, x, counts, True, args.repeats)
            print(f"{name:>14} {rows:>5} {loop * 1e3:>8.2f} {grouped * 1e3:>10.2f} {str(same):>9}", flush=True)


if __name__ == "__main__":
    main()
