"""Code2Wav: per-frame cost of stateful streaming in chunks vs one-shot decoding of the same frames.

B requests of F frames each. One-shot: one ``decode`` call over all B x F frames. Streaming: the B requests
advance together, ``chunk`` frames per batched ``Code2WavStreamer.decode`` call, until F frames are done.
Prints ms per frame (time / (B * F)) as wall time and as this process's CPU time (on a machine shared with
other jobs the CPU time is the steadier number; with several threads it adds up all of them), the ratio to
one-shot (CPU time), and the max abs difference of the streamed audio to one-shot. Each configuration is
warmed up once (short run) before it is timed.

    python -m benchmarks.code2wav_stream_speed --preset small --frames 300 --chunks 1 4 25 300 \
        --batch 1 8 --threads 1 2

Kernels: ``--kernels reference fast`` runs every configuration with both decoder kernels on the same model
(``reference``: torch's [B, C, T] convolutions as in transformers; ``fast``: the channels-last default) and
adds the fast path's ratio to the reference (CPU time), its GFLOP/s (convolution and GEMM FLOPs of the
call, counted once on the reference path) and its max abs difference to the reference's output (same
mode). The process uses the serving engine's allocator setting (``runtime_env.configure_allocator``).

    python -m benchmarks.code2wav_stream_speed --preset small --frames 150 --chunks 25 --batch 16 \
        --threads 1 2 --dtype float32 bfloat16 --kernels reference fast
"""

from __future__ import annotations

import argparse
import platform
import time

import torch


def load_code2wav(model_dir: str, dtype: torch.dtype):
    from omnistage.models.loader import load_into
    from omnistage.models.qwen3_omni.code2wav import Code2Wav, Code2WavConfig

    model = Code2Wav(Code2WavConfig.from_checkpoint(model_dir))
    load_into(model, model_dir, "code2wav.", dtype)
    return model.eval()


class Timer:
    """Wall and process CPU seconds of a block."""

    def __enter__(self) -> Timer:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def one_shot(model, codes: torch.Tensor) -> tuple[Timer, torch.Tensor]:
    lengths = torch.full((codes.shape[0],), codes.shape[-1])
    with Timer() as timer, torch.no_grad():
        wave, _ = model.decode(codes, lengths)
    return timer, wave


def streamed(streamer, codes: torch.Tensor, chunk: int) -> tuple[Timer, torch.Tensor]:
    batch, _, frames = codes.shape
    states = [None] * batch
    pieces = []
    with Timer() as timer:
        for pos in range(0, frames, chunk):
            n = min(chunk, frames - pos)
            out = streamer.decode(codes[:, :, pos : pos + n], [n] * batch, states)
            states = out.states
            pieces.append(out.wave)  # lockstep rows: every row has the same length
    return timer, torch.cat(pieces, dim=1)


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def decode(model, streamer, codes: torch.Tensor, chunk: int | None) -> tuple[Timer, torch.Tensor]:
    """One-shot (``chunk`` None) or streamed decoding of ``codes``."""
    return one_shot(model, codes) if chunk is None else streamed(streamer, codes, chunk)


def count_flops(model, streamer, codes: torch.Tensor, chunk: int | None) -> int:
    """Convolution and matmul FLOPs of a decode on the reference kernels (torch's flop counter)."""
    from torch.utils.flop_counter import FlopCounterMode

    fast = model.reference_kernels
    model.reference_kernels = True
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        decode(model, streamer, codes, chunk)
    model.reference_kernels = fast
    return counter.get_total_flops()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--frames", type=int, default=300)
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 25, 300])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], nargs="+", default=["float32"])
    ap.add_argument("--kernels", choices=["reference", "fast"], nargs="+", default=["fast"])
    args = ap.parse_args()

    from benchmarks.thinker_throughput import resolve_model
    from omnistage.models.qwen3_omni.code2wav_stream import Code2WavStreamer
    from omnistage.runtime_env import configure_allocator

    configure_allocator()
    model_dir = resolve_model(args.model, args.preset)
    print(f"CPU: {cpu_name()}; {args.frames} frames per request; CPU ms/frame is this process's CPU time")
    print(f"{'dtype':>8} {'threads':>7} {'batch':>5} {'kernels':>9} {'mode':>10} {'wall ms':>8} {'CPU ms':>8} "
          f"{'GFLOP/s':>7} {'vs 1-shot':>9} {'vs ref':>6} {'max diff':>9} {'diff ref':>9}")
    for dtype in args.dtype:
        model = load_code2wav(model_dir, getattr(torch, dtype))
        streamer = Code2WavStreamer(model)
        cfg = model.config
        gen = torch.Generator().manual_seed(0)
        for threads in args.threads:
            torch.set_num_threads(threads)
            for batch in args.batch:
                codes = torch.randint(0, cfg.codebook_size, (batch, cfg.num_quantizers, args.frames), generator=gen)
                frames = batch * args.frames
                modes = [("one-shot", None)] + [(f"chunk {c}", c) for c in args.chunks]
                results: dict[tuple[str, str], tuple[Timer, torch.Tensor]] = {}
                flops: dict[str, int] = {}
                for name, chunk in modes:
                    flops[name] = count_flops(model, streamer, codes, chunk)
                for kernels in args.kernels:
                    model.reference_kernels = kernels == "reference"
                    for name, chunk in modes:
                        decode(model, streamer, codes[..., : min(args.frames, 2 * (chunk or 25))], chunk)  # warm-up
                        results[kernels, name] = decode(model, streamer, codes, chunk)
                for kernels in args.kernels:
                    base = results[kernels, "one-shot"][0].cpu
                    for name, _ in modes:
                        timer, wave = results[kernels, name]
                        own = results[kernels, "one-shot"][1]
                        diff = "" if name == "one-shot" else f"{(wave.float() - own.float()).abs().max().item():.1e}"
                        ref = results.get(("reference", name))
                        vs_ref = f"{ref[0].cpu / timer.cpu:.2f}" if ref and kernels != "reference" else ""
                        diff_ref = (f"{(wave.float() - ref[1].float()).abs().max().item():.1e}"
                                    if ref and kernels != "reference" else "")
                        print(f"{dtype:>8} {threads:>7} {batch:>5} {kernels:>9} {name:>10} "
                              f"{timer.wall / frames * 1e3:>8.2f} {timer.cpu / frames * 1e3:>8.2f} "
                              f"{flops[name] / timer.wall / 1e9:>7.1f} {timer.cpu / base:>9.2f} {vs_ref:>6} "
                              f"{diff:>9} {diff_ref:>9}")


if __name__ == "__main__":
    main()
