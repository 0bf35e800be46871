"""Expert kernels on the small preset's Thinker (H 768, I 384) and Talker (H 512, I 256) experts (16, top-4).

1. Stacked-expert GEMMs: one grouped GEMM (torch._grouped_mm) vs a loop of per-expert GEMMs, by row count.
   Rows are (token, slot) pairs sorted by expert, as SparseMoE runs them. Prints CPU time per call of both
   paths and checks they give the same bits (the measurement behind the grouped default in
   omnistage/models/layers/moe.py).
2. MoE layers by token count (a stack of them, weights streamed from memory) with the ``fast`` option: a
   oneDNN-packed GEMM per expert with rows (the layout without the CPU kernels) vs the expert kernel
   (``omnistage/models/layers/cpu_kernels.py``), next to the default kernels' grouped GEMM; which one serves
   by default; the largest difference to the default kernels' output (the measurement behind the kernel's
   bfloat16 row limit).

    python -m benchmarks.moe_kernels --threads 2 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import contextmanager

import torch

from omnistage.models.layers.fast_linear import fast_kernels
from omnistage.models.layers.moe import SparseMoE, StackedExperts

SIZES = (("thinker", 768, 384), ("talker", 512, 256))


def wall_time(repeats: int, call, *args, **kwargs) -> float:
    # Wall time, not process CPU time: with several threads CPU time also counts OpenMP's spinning waits.
    call(*args, **kwargs)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call(*args, **kwargs)
        best = min(best, time.perf_counter() - start)
    return best


def seeded(module: torch.nn.Module, gen: torch.Generator, dtype: torch.dtype) -> torch.nn.Module:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return module.to(dtype)


def stacked_gemms(args: argparse.Namespace, dtype: torch.dtype, gen: torch.Generator) -> None:
    print(f"{'experts':>14} {'rows':>5} {'loop ms':>8} {'grouped ms':>10} {'same bits':>9}")
    for name, hidden, inter in SIZES:
        experts = seeded(StackedExperts(16, hidden, inter), gen, dtype)
        for rows in args.rows:
            ids = torch.randint(0, 16, (rows,), generator=gen)
            counts = torch.bincount(ids, minlength=16)
            x = torch.randn(rows, hidden, generator=gen).to(dtype)
            with torch.inference_mode():
                same = torch.equal(experts(x, counts, grouped=False), experts(x, counts, grouped=True))
                loop = wall_time(args.repeats, experts, x, counts, False)
                grouped = wall_time(args.repeats, experts, x, counts, True)
            print(f"{name:>14} {rows:>5} {loop * 1e3:>8.2f} {grouped * 1e3:>10.2f} {str(same):>9}", flush=True)


@contextmanager
def cpu_kernels_off():
    old = os.environ.get("OMNISTAGE_CPU_KERNELS")
    os.environ["OMNISTAGE_CPU_KERNELS"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["OMNISTAGE_CPU_KERNELS"]
        else:
            os.environ["OMNISTAGE_CPU_KERNELS"] = old


def fast_copies(reference: list[SparseMoE], hidden: int, inter: int, dtype: torch.dtype, kernel: bool) -> list:
    """The ``fast`` option's layers with ``reference``'s weights; ``kernel=False``: without the expert kernel."""
    layers = []
    for ref in reference:
        layer = SparseMoE(hidden, inter, 16, 4, True).to(dtype)
        layer.load_state_dict(ref.state_dict())
        if kernel:
            layers.append(fast_kernels(layer, True))
        else:
            with cpu_kernels_off():
                layers.append(fast_kernels(layer, True))
    return layers


def moe_layers(args: argparse.Namespace, dtype: torch.dtype, gen: torch.Generator) -> None:
    # A stack of layers, each with its own weights, run one after another: their weights stream from memory as
    # in a decoder step (one layer's weights alone would stay in the cache between timed calls).
    print(f"{'MoE layer':>14} {'tokens':>6} {'default ms':>10} {'oneDNN/expert':>13} {'kernel':>7} "
          f"{'served by':>9} {'max diff':>9}   (ms per layer, a stack of {args.layers})")
    for name, hidden, inter in SIZES:
        reference = [seeded(SparseMoE(hidden, inter, 16, 4, True), gen, dtype) for _ in range(args.layers)]

        per_expert = fast_copies(reference, hidden, inter, dtype, kernel=False)
        fast = fast_copies(reference, hidden, inter, dtype, kernel=True)

        def stack(layers: list[SparseMoE], x: torch.Tensor, **kwargs) -> torch.Tensor:
            for layer in layers:
                x = x + layer(x, **kwargs)
            return x

        for tokens in args.tokens:
            x = torch.randn(tokens, hidden, generator=gen).to(dtype)
            with torch.inference_mode():
                default = wall_time(args.repeats, stack, reference, x) / args.layers
                onednn = wall_time(args.repeats, stack, per_expert, x) / args.layers
                kernel = "-"
                if fast[0].experts.panels is not None:
                    kernel = f"{wall_time(args.repeats, stack, fast, x, kernel=True) / args.layers * 1e3:.2f}"
                picked = "kernel" if fast[0].uses_kernel(x) else "oneDNN"
                diff = (fast[0](x) - reference[0](x)).abs().max().item()
            print(f"{name:>14} {tokens:>6} {default * 1e3:>10.2f} {onednn * 1e3:>13.2f} {kernel:>7} {picked:>9} "
                  f"{diff:>9.1e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 16, 64, 256, 1024, 2048])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 16, 24, 32, 48, 64])
    ap.add_argument("--layers", type=int, default=8, help="MoE layers in the timed stack")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--layers-only", action="store_true", help="skip part 1 (stacked-expert GEMMs)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    print(f"threads={args.threads} dtype={args.dtype} (best-of-{args.repeats} wall time per call)")
    if not args.layers_only:
        stacked_gemms(args, dtype, gen)
    moe_layers(args, dtype, gen)


if __name__ == "__main__":
    main()
