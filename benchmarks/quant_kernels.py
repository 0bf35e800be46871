"""Quantized linear layers and MoE layers: omnistage's kernels (``quant_kernels``) vs torch's weight-only ops
and the bfloat16 GEMM, side by side at the released Thinker's shapes, reported as time, weight bytes read per
second and ratios, with the machine's streaming read bandwidth measured in the same run.

    python benchmarks/quant_kernels.py --threads 2
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch
import torch.nn.functional as F

from omnistage.models.layers import quant_kernels
from omnistage.models.layers.quant import QuantFormat, pack_nibbles, pack_weight, quantize

# (name, out_features, in_features) of the released Thinker: an expert's gate/up and down, q/k/v, o
SHAPES = [("expert gate_up", 1536, 2048), ("expert down", 2048, 768), ("qkv", 5120, 2048), ("o", 2048, 4096)]


def timed(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth = quant_kernels.read_bandwidth()
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} threads, "
          f"kernels {quant_kernels.isa()}; streaming read {bandwidth / 1e9:.1f} GB/s")
    fmt = QuantFormat(4, 128)
    print("| layer | rows | ours int4 | torch int4pack | bf16 GEMM | ours int4 GB/s | ours vs int4pack | ours vs bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    for name, n, k in SHAPES:
        w = torch.randn(n, k) / k**0.5
        values, scales = quantize(w, fmt)
        ours = (4, 128, pack_nibbles(values), scales.to(torch.bfloat16))
        os.environ["OMNISTAGE_CPU_KERNELS"] = "0"  # (while packing: torch's int4pack layout, for comparison)
        int4pack = pack_weight(values, scales, fmt, torch.bfloat16)
        del os.environ["OMNISTAGE_CPU_KERNELS"]
        dense = w.to(torch.bfloat16)
        nbytes = ours[2].numel() + ours[3].numel() * 2
        for rows in args.rows:
            x = torch.randn(rows, k).to(torch.bfloat16)
            reps = max(5, int(2e8 / (n * k * max(rows, 4))))
            t_ours = timed(lambda x=x, w=ours: quant_kernels.linear(x, *w), reps)
            t_torch = timed(lambda x=x, w=int4pack: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w.data, 128,
                                                                                                w.scales), reps)
            t_dense = timed(lambda x=x, w=dense: F.linear(x, w), reps)
            print(f"| {name} {n}x{k} | {rows} | {1e6 * t_ours:.0f} us | {1e6 * t_torch:.0f} us | "
                  f"{1e6 * t_dense:.0f} us | {nbytes / t_ours / 1e9:.1f} | {t_torch / t_ours:.2f}x | "
                  f"{t_dense / t_ours:.2f}x |")
    # one MoE layer (128 experts, top-8) in one call vs one torch call pair per expert with rows
    experts, hidden, inter, top_k = 128, 2048, 768, 8
    gu = torch.randn(experts, 2 * inter, hidden) / hidden**0.5
    dn = torch.randn(experts, hidden, inter) / inter**0.5
    gu_w = pack_weight(*quantize(gu.reshape(-1, hidden), fmt), fmt, torch.bfloat16)
    dn_w = pack_weight(*quantize(dn.reshape(-1, inter), fmt), fmt, torch.bfloat16)
    gu_args = (4, 128, gu_w.data.view(experts, 2 * inter, -1), gu_w.scales.view(experts, 2 * inter, -1))
    dn_args = (4, 128, dn_w.data.view(experts, hidden, -1), dn_w.scales.view(experts, hidden, -1))
    del gu, dn
    print("\n| MoE layer, 128 experts top-8 | tokens | one call | experts' weight bytes read per second |")
    print("|---|---|---|---|")
    for tokens in args.rows:
        ids = torch.rand(tokens, experts).topk(top_k, dim=1).indices  # uniformly routed tokens
        counts = torch.bincount(ids.flatten(), minlength=experts)
        x = torch.randn(int(counts.sum()), hidden).to(torch.bfloat16)
        t = timed(lambda x=x, c=counts: quant_kernels.moe(x, c, gu_args, dn_args), max(3, int(50 / tokens)))
        used = int((counts > 0).sum())
        per_expert = (gu_args[2][0].numel() + gu_args[3][0].numel() * 2 + dn_args[2][0].numel()
                      + dn_args[3][0].numel() * 2)
        print(f"| | {tokens} | {1e3 * t:.2f} ms | {used * per_expert / t / 1e9:.1f} GB/s ({used} experts) |")


if __name__ == "__main__":
    main()
