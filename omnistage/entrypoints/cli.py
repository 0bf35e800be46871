"""The ``omnistage`` command: make-checkpoint, generate, plan, serve, bench (one function per subcommand)."""

from __future__ import annotations

import argparse
import sys
import wave
from pathlib import Path

from omnistage.config.quantization import QUANT_METHODS


def _make_checkpoint(args: argparse.Namespace) -> int:
    from omnistage.checkpoints.builder import build_checkpoint

    try:
        family = {"family": args.family} if args.family else {}
        path = build_checkpoint(args.dir, preset=args.preset, seed=args.seed, max_shard_bytes=args.max_shard_bytes,
                                depth=args.depth, quantization=args.quantization,
                                quantization_group_size=args.quantization_group_size, **family)
    except ValueError as exc:  # an unknown family, or a preset the family does not have
        print(f"omnistage make-checkpoint: error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


def write_wav(path: str | Path, audio, sample_rate: int) -> None:
    """float32 mono in [-1, 1] -> 16-bit PCM WAV."""
    import torch

    pcm = (audio.clamp(-1, 1) * 32767).round().to(torch.int16).numpy().tobytes()
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm)


def _generate(args: argparse.Namespace) -> int:
    from omnistage import Omni, SamplingParams  # the public API (tests replace omnistage.Omni)

    omni = Omni(args.model, stage_config=args.stage_config, dtype=args.dtype, device=args.device,
                distributed_executor_backend=args.distributed_executor_backend, fast=args.fast,
                quantization=args.quantization, quantization_group_size=args.quantization_group_size,
                enable_prefix_caching=args.enable_prefix_caching)
    modalities = ["text", "audio"] if args.audio else ["text"]
    info = omni.info
    params = {info.text_stage: SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)}
    if args.audio and args.seed is not None:
        # --seed makes the spoken answer reproducible too (the Talker samples by default).
        for name, defaults in info.stage_sampling.items():
            if name != info.text_stage:
                params[name] = defaults.replace(seed=args.seed)
    prompts = [_with_media(text, args) for text in args.prompt]
    with omni:
        outs = omni.generate(prompts, modalities=modalities, sampling_params=params, speaker=args.voice,
                             use_tqdm=len(prompts) > 1, use_audio_in_video=args.use_audio_in_video)
    for i, out in enumerate(outs):
        print(out.text)
        if args.audio:
            path = Path(args.audio)
            if len(outs) > 1:
                path = path.with_name(f"{path.stem}-{i}{path.suffix}")
            write_wav(path, out.audio, out.sample_rate)
            print(f"wrote {path} ({out.audio.numel() / out.sample_rate:.2f} s at {out.sample_rate} Hz)",
                  file=sys.stderr)
    return 0


def _with_media(text: str, args: argparse.Namespace):
    """A prompt string, or one user message whose media parts (files, in flag order) precede the text."""
    parts = [{"type": "audio", "audio": f} for f in args.audio_in or []]
    parts += [{"type": "image", "image": f} for f in args.image or []]
    parts += [{"type": "video", "video": f} for f in args.video or []]
    if not parts:
        return text
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def _plan(args: argparse.Namespace) -> int:
    """What serving ``args`` would hold per stage and device, and whether it fits, without loading anything."""
    from omnistage.config import ConfigError
    from omnistage.pipeline.engine import plan_engine
    from omnistage.pipeline.memory_plan import device_needs, refusal
    from omnistage.pipeline.omni import engine_args

    try:
        eargs = engine_args(args.model, args.stage_config, args.dtype, args.device, args.fast,
                            args.distributed_executor_backend, args.quantization, args.quantization_group_size,
                            args.enable_prefix_caching)
        plan = plan_engine(eargs)
    except (ConfigError, ValueError) as exc:
        print(f"omnistage plan: error: {exc}", file=sys.stderr)
        return 2
    print(f"{eargs.model}: {plan.family.name}, stages {', '.join(plan.pipeline.order)}, --dtype {eargs.dtype}, "
          f"--quantization {eargs.quantization}, backend {plan.backend}")
    print(f"{'stage':<12}{'device':<10}{'weights':>12}{'KV cache':>12}")
    for p in plan.memory:
        print(f"{p.stage:<12}{p.device:<10}{_size(p.weight_bytes):>12}{_size(p.kv_bytes):>12}")
    if plan.backend == "ray":
        print("backend ray: Ray places the stages on its machines; not compared with this machine's memory")
        return 0
    needs = device_needs(plan.memory)
    for need in needs:
        have = "unknown" if need.have is None else _size(need.have)
        print(f"{need.device}: needs {_size(need.need)}, available {have}: {'fits' if need.fits else 'does not fit'}")
    for need in needs:
        if not need.fits:
            print(f"omnistage plan: {refusal(need, eargs.dtype, eargs.quantization)}", file=sys.stderr)
            return 1
    return 0


def _size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 28 else f"{n / (1 << 20):.1f} MiB"


def _serve(args: argparse.Namespace) -> int:
    from omnistage.entrypoints.serve_args import serve_from_args

    return serve_from_args(args)


def _bench(args: argparse.Namespace) -> int:
    from omnistage.entrypoints.bench import run_from_args

    return run_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnistage", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-checkpoint", help="write a random checkpoint of a model family in the HF format")
    p.add_argument("dir")
    p.add_argument("--family", default=None,
                   help="model family (default: the built-in model's; an unknown name lists the families)")
    p.add_argument("--preset", default="tiny",
                   help="the family's size preset (an unknown name lists them); 'real': the released architecture "
                        "(checkpoints/real.py), written in 5 GB bfloat16 shards (70.5 GB at full depth)")
    p.add_argument("--depth", default=None,
                   help="with --preset real: layers per stack, e.g. thinker=2,talker=2,code_predictor=2,code2wav=2,"
                        "audio=2,vision=2 (unnamed stacks keep their released depth)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shard-bytes", type=int, default=None,
                   help="split the weights into shards + model.safetensors.index.json above this size")
    p.add_argument("--quantization", choices=list(QUANT_METHODS), default="none",
                   help="with --preset real: write the weights `omnistage serve --quantization` would quantize "
                        "pre-quantized (compressed-tensors pack-quantized; int4 full depth: ~19 GB)")
    p.add_argument("--quantization-group-size", type=int, default=None,
                   help="inputs per scale: int4's groups (default 128); int8: groups instead of per channel")
    p.set_defaults(func=_make_checkpoint)

    p = sub.add_parser("generate", help="answer prompts offline (text, and speech with --audio)")
    p.add_argument("prompt", nargs="+")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--stage-config", default=None, help="pipeline preset name or YAML path")
    p.add_argument("--audio", metavar="OUT.wav", help="also speak the answer and write it here")
    p.add_argument("--audio-in", metavar="FILE", action="append", help="audio the prompt is about (repeatable)")
    p.add_argument("--image", metavar="FILE", action="append", help="image the prompt is about (repeatable)")
    p.add_argument("--video", metavar="FILE", action="append", help="video the prompt is about (repeatable)")
    p.add_argument("--use-audio-in-video", action="store_true", help="videos bring their audio track")
    p.add_argument("--voice", default=None)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="seeds the Thinker and, with --audio, the Talker")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=_generate)

    from omnistage.entrypoints.bench import add_bench_arguments
    from omnistage.entrypoints.serve_args import add_engine_arguments, add_serve_arguments

    add_engine_arguments(p)

    p = sub.add_parser("plan", help="what serving a checkpoint would hold per stage and device (weights, KV), and "
                                    "whether it fits, before loading anything")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--stage-config", default=None, help="pipeline preset name or YAML path")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    add_engine_arguments(p)
    p.set_defaults(func=_plan)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_arguments(p)
    p.set_defaults(func=_serve)

    p = sub.add_parser("bench", help="drive a running server and print latency percentiles")
    add_bench_arguments(p)
    p.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
