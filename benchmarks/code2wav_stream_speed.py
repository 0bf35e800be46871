"""Code2Wav: per-frame cost of stateful streaming in chunks vs one-shot decoding of the same frames.

B requests of F frames each. One-shot: one ``decode`` call over all B x F frames. Streaming: the B requests
advance together, ``chunk`` frames per batched ``Code2WavStreamer.decode`` call, until F frames are done.
Prints ms per frame (time / (B * F)) as wall time and as this process's CPU time (on a machine shared with
other jobs the CPU time is the steadier number; with several threads it adds up all of them), the ratio to
one-shot (CPU time), and the max abs difference of the streamed audio to one-shot. Each configuration is
warmed up once (short run) before it is timed.

    python -m benchmarks.code2wav_stream_speed --preset small --frames 300 --chunks 1 4 25 300 \
        --batch 1 8 --threads 1 2
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--frames", type=int, default=300)
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 25, 300])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()

    from benchmarks.thinker_throughput import resolve_model
    from omnistage.models.qwen3_omni.code2wav_stream import Code2WavStreamer

    model = load_code2wav(resolve_model(args.model, args.preset), getattr(torch, args.dtype))
    streamer = Code2WavStreamer(model)
    cfg = model.config
    gen = torch.Generator().manual_seed(0)
    print(f"CPU: {cpu_name()}; {args.dtype}; hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, "
          f"decoder_dim {cfg.decoder_dim}; {args.frames} frames per request")
    print(f"{'threads':>7} {'batch':>5} {'mode':>10} {'wall ms':>8} {'CPU ms':>8} {'vs 1-shot':>9} {'max diff':>9}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for batch in args.batch:
            codes = torch.randint(0, cfg.codebook_size, (batch, cfg.num_quantizers, args.frames), generator=gen)
            one_shot(model, codes[..., : min(args.frames, 50)])  # warm-up
            timer, reference = one_shot(model, codes)
            frames = batch * args.frames
            base = timer.cpu / frames
            print(f"{threads:>7} {batch:>5} {'one-shot':>10} {timer.wall / frames * 1e3:>8.2f} {base * 1e3:>8.2f} "
                  f"{1.0:>9.2f} {'':>9}")
            for chunk in args.chunks:
                streamed(streamer, codes[..., : min(args.frames, 2 * chunk)], chunk)  # warm-up
                timer, wave = streamed(streamer, codes, chunk)
                diff = (wave.float() - reference.float()).abs().max().item()
                print(f"{threads:>7} {batch:>5} {'chunk ' + str(chunk):>10} {timer.wall / frames * 1e3:>8.2f} "
                      f"{timer.cpu / frames * 1e3:>8.2f} {timer.cpu / frames / base:>9.2f} {diff:>9.1e}")


if __name__ == "__main__":
    main()
