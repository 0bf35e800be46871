"""Measure what streaming Token2Wav changes relative to one-shot decoding, per chunk plan.

    python -m omnistage.testing.qwen2_5_omni.streaming_report [--model DIR] [--codes 100] [--steps 10]

Without ``--model`` the tiny checkpoint (seed 0) is built in a temporary directory. Codes are random ids of the
codec vocabulary, noise is seeded, the voice is the first speaker. For each plan: number of windows, codes
needed before the first audio, mel frames the DiT decodes (one-shot: 2 per code), audio length vs one-shot, max |diff| and RMS(diff) / RMS(one-shot).
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from omnistage.models.qwen2_5_omni.dit import ODEConfig
from omnistage.models.qwen2_5_omni.loading import load_config, load_token2wav
from omnistage.models.qwen2_5_omni.streaming import ChunkPlan, Token2WavStream
from omnistage.models.qwen2_5_omni.token2wav import NoiseStream

PLANS = (
    ChunkPlan(3, 2, 1),  # Qwen's own geometry
    ChunkPlan(3, 2, 1, max_chunk_blocks=24),  # the packaged plan: growing chunks
    ChunkPlan(3, 4, 1),
    ChunkPlan(3, 2, 2),
    ChunkPlan(3, 2, 3),
    ChunkPlan(3, 6, 3),
    ChunkPlan(3, 8, 4),
    ChunkPlan(1, 1, 1),
)


def measure(model_dir: str, num_codes: int, steps: int, piece: int = 5) -> list[dict]:
    config = load_config(model_dir)
    t2w = load_token2wav(model_dir, config)
    t2w.ode = ODEConfig(num_steps=steps)
    dit = t2w.code2wav_dit_model
    voice = t2w.voices[0]
    codes = torch.randint(0, config.talker_config.vocab_size, (num_codes,), generator=torch.Generator().manual_seed(5))

    def noise() -> NoiseStream:
        return NoiseStream(torch.Generator().manual_seed(7), t2w.mel_dim)

    rows = []
    with torch.inference_mode():
        whole = t2w(codes[None], noise().take(num_codes * dit.repeats)[None], [voice])[0]
        for plan in PLANS:
            stream = Token2WavStream(plan, dit.block_size, dit.repeats, voice, noise())
            windows, first = [], None
            for i in range(0, num_codes, piece):
                ready = stream.push(codes[i : i + piece])
                if ready and first is None:
                    first = min(i + piece, num_codes)
                windows += ready
            windows += stream.finish()
            audio = torch.cat(t2w.decode_windows(windows))
            diff = audio - whole if audio.shape == whole.shape else None
            rows.append({
                "plan": f"chunk {plan.chunk_blocks} / past {plan.past_blocks} / future {plan.future_blocks}"
                        + (f" / max {plan.max_chunk_blocks}" if plan.max_chunk_blocks else ""),
                "decoded_frames": sum(w.noise.shape[0] for w in windows),
                "windows": len(windows),
                "first_audio_after_codes": first,
                "length": f"{audio.numel()} vs {whole.numel()}",
                "max_abs_diff": None if diff is None else diff.abs().max().item(),
                "rms_rel_diff": None if diff is None else (diff.pow(2).mean() / whole.pow(2).mean()).sqrt().item(),
            })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="Qwen2.5-Omni checkpoint directory (default: build the tiny one)")
    parser.add_argument("--codes", type=int, default=100)
    parser.add_argument("--steps", type=int, default=10, help="ODE steps (transformers' default 10)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = args.model
    if model_dir is None:
        from omnistage.checkpoints.qwen2_5_omni.builder import build_checkpoint

        model_dir = str(build_checkpoint(tempfile.mkdtemp(prefix="q25-stream-"), preset="tiny", seed=0))
    t2w_cfg = load_config(model_dir).token2wav_config.dit_config
    print(f"model {model_dir}: DiT block {t2w_cfg.block_size} mel frames = {t2w_cfg.block_size // t2w_cfg.repeats} "
          f"codes; {args.codes} codes; {args.steps} ODE steps")
    print("| plan (blocks) | windows | mel frames decoded | first audio after codes | samples (chunked vs one-shot) "
          "| max abs diff | RMS diff / RMS |")
    print("|---|---|---|---|---|---|---|")
    for r in measure(model_dir, args.codes, args.steps):
        print(f"| {r['plan']} | {r['windows']} | {r['decoded_frames']} | {r['first_audio_after_codes']} | {r['length']} | "
              f"{r['max_abs_diff']:.2e} | {r['rms_rel_diff']:.2e} |")


if __name__ == "__main__":
    main()
