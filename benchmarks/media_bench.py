"""Spoken question in, spoken answer out: omnistage vs transformers generate(return_audio=True), side by side.

Same checkpoint (default: the small preset with its audio and vision towers), same synthesized questions
(3-10 s clips of chirps, tone mixtures and noise shaped into syllables: the models are random, so only the
sizes matter), same thread count, one process. omnistage gets N requests at once; transformers runs them one
at a time (its generate serves one request's audio per call and returns it at the end, so its time to first
audio is its end-to-end time). Reports time to first audio, text tokens/s, audio seconds per wall second,
real-time factor, the audio encoder's share of the Thinker's prefill time and the vocoder's share of the wall
in both, and the ratio's ceiling were all of omnistage but its vocoder free (the vocoders are compute-bound: a
batch does their arithmetic no faster than one request at a time).

    python -m benchmarks.media_bench --preset small --concurrency 1 8 --threads 1
    python -m benchmarks.media_bench --family qwen2_5_omni --preset small --concurrency 1 8 --threads 2

``--bridge-args`` measures other audio chunkings in the same run (one engine each, against the same transformers
run), e.g. Qwen2.5-Omni's fixed 3-block chunks beside the packaged growing ones on longer answers:

    python -m benchmarks.media_bench --family qwen2_5_omni --preset small --concurrency 8 --threads 2 \
        --talker-tokens 300 --hf-requests 1 --bridge-args '{"max_chunk_blocks": null}' '{}'
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.thinker_throughput import resolve_model

RATE = 16000
DURATIONS = (3.0, 6.5, 10.0, 4.5, 8.0, 5.0, 9.0, 3.5)  # seconds, cycled


def spoken_question(i: int) -> np.ndarray:
    """A 3-10 s clip: a chirp or a tone mixture plus noise, gated into syllable-like bursts (~4 per second)."""
    rng = np.random.default_rng(i)
    seconds = DURATIONS[i % len(DURATIONS)]
    t = np.arange(int(seconds * RATE)) / RATE
    if i % 2:
        f0, f1 = 120 + 40 * (i % 3), 600 + 100 * (i % 4)
        voice = np.sin(2 * np.pi * (f0 * t + (f1 - f0) * t**2 / (2 * seconds)))  # linear chirp f0 -> f1
    else:
        voice = sum(np.sin(2 * np.pi * f * t) / k for k, f in enumerate((180, 360, 540, 900), start=1))
    gate = 0.5 * (1 + np.sin(2 * np.pi * 4 * t + rng.uniform(0, np.pi)))
    clip = 0.3 * voice * gate + 0.02 * rng.standard_normal(t.size)
    return (clip / np.abs(clip).max() * 0.8).astype(np.float32)


def messages(clip: np.ndarray) -> list[dict]:
    return [{"role": "user", "content": [{"type": "audio", "audio": clip}]}]


class PrefillClock:
    """Times the Thinker stage's steps that prefill prompt rows, and the encoder runs inside them; and the
    vocoder stage's steps."""

    def __init__(self, engine, vocoder: str) -> None:
        stage = engine.orchestrator.stages["thinker"]
        model = stage.model
        self.prefill = self.encoder = self.vocoder = 0.0
        self._prefilling = False
        step, prepare, acquire = stage.step, model.prepare_inputs, model.encoders.acquire
        voc_stage = engine.orchestrator.stages[vocoder]
        voc_step = voc_stage.step

        def timed_vocoder_step():
            t0 = time.perf_counter()
            out = voc_step()
            self.vocoder += time.perf_counter() - t0
            return out

        voc_stage.step = timed_vocoder_step

        def timed_step():
            self._prefilling = False
            t0 = time.perf_counter()
            out = step()
            if self._prefilling:
                self.prefill += time.perf_counter() - t0
            return out

        def prepare_inputs(ctx, input_ids, positions):
            self._prefilling |= any(lo < r.num_prompt_tokens for lo, r in zip(ctx.num_computed, ctx.requests))
            return prepare(ctx, input_ids, positions)

        def timed_acquire(needs):
            t0 = time.perf_counter()
            acquire(needs)
            self.encoder += time.perf_counter() - t0

        stage.step, model.prepare_inputs, model.encoders.acquire = timed_step, prepare_inputs, timed_acquire

    def reset(self) -> None:
        self.prefill = self.encoder = self.vocoder = 0.0


def run_omnistage(engine, clock: PrefillClock, clips, params):
    prompts = [engine.render_prompt(messages(c)) for c in clips]
    clock.reset()
    t0 = time.perf_counter()
    start, first_audio, tokens, samples = {}, {}, 0, 0
    for p in prompts:
        rid = engine.add_request(p, ["text", "audio"], params)
        start[rid] = time.perf_counter()
    done = set()
    while len(done) < len(prompts):
        for d in engine.step():
            tokens += len(d.new_token_ids)
            if d.audio is not None and d.audio.numel():
                samples += d.audio.numel()
                first_audio.setdefault(d.req_id, time.perf_counter() - start[d.req_id])
            if d.finished:
                if d.error:
                    raise RuntimeError(d.error)
                done.add(d.req_id)
    wall = time.perf_counter() - t0
    return {"wall": wall, "tokens": tokens, "audio_s": samples / engine.info.sample_rate,
            "ttfa": statistics.median(first_audio.values()), "enc_share": clock.encoder / clock.prefill,
            "vocoder": clock.vocoder}


# Per family: transformers' class, the generation stage, generate's speaker and audio arguments (Qwen2.5-Omni's
# speaks whenever it has a Talker, its greedy Talker stops at codec pad / eos unless held to a minimum).
FAMILIES = {
    "qwen3_omni": ("Qwen3OmniMoeForConditionalGeneration", "code2wav", {"speaker": "ethan", "return_audio": True}),
    "qwen2_5_omni": ("Qwen2_5OmniForConditionalGeneration", "token2wav", {"speaker": "Ethan"}),
}


def run_hf(hf, engine, clips, thinker_tokens, talker_tokens, audio_args=FAMILIES["qwen3_omni"][2],
           vocoder="code2wav"):
    """transformers, one request at a time, on the very prompt ids and audio features omnistage used."""
    from omnistage.models.qwen3_omni.processor import thinker_media

    timing = {"encoder": 0.0, "prefill": 0.0, "vocoder": 0.0}
    marks: dict[str, float] = {}
    calls = {"thinker": 0}

    def enc_pre(*_):
        marks["enc"] = time.perf_counter()

    def enc_post(*_):
        timing["encoder"] += time.perf_counter() - marks["enc"]

    def thinker_pre(*_):
        marks["thinker"] = time.perf_counter()

    def thinker_post(*_):
        calls["thinker"] += 1
        if calls["thinker"] == 1:  # the prefill forward (runs the audio tower inside)
            timing["prefill"] += time.perf_counter() - marks["thinker"]

    def voc_pre(*_):
        marks["vocoder"] = time.perf_counter()

    def voc_post(*_):
        timing["vocoder"] += time.perf_counter() - marks["vocoder"]

    hooks = [hf.thinker.model.audio_tower.register_forward_pre_hook(enc_pre),
             hf.thinker.model.audio_tower.register_forward_hook(enc_post),
             getattr(hf, vocoder).register_forward_pre_hook(voc_pre),
             getattr(hf, vocoder).register_forward_hook(voc_post),
             hf.thinker.register_forward_pre_hook(thinker_pre),
             hf.thinker.register_forward_hook(thinker_post)]
    walls, tokens, samples = [], 0, 0
    try:
        for clip in clips:
            prompt = engine.render_prompt(messages(clip))
            (item,) = thinker_media(prompt.data).items
            ids = torch.tensor([prompt.token_ids])
            calls["thinker"] = 0
            t0 = time.perf_counter()
            with torch.no_grad():
                seq, wav = hf.generate(
                    ids, attention_mask=torch.ones_like(ids), input_features=item.features[None],
                    feature_attention_mask=torch.ones(1, item.features.shape[1], dtype=torch.long),
                    **audio_args, thinker_max_new_tokens=thinker_tokens,
                    thinker_min_new_tokens=thinker_tokens, thinker_eos_token_id=list(engine.family.eos_token_ids),
                    talker_max_new_tokens=talker_tokens, talker_min_new_tokens=talker_tokens,
                    talker_do_sample=False, talker_repetition_penalty=1.0,
                )
            walls.append(time.perf_counter() - t0)
            tokens += seq.shape[1] - ids.shape[1]
            samples += wav.numel()
    finally:
        for h in hooks:
            h.remove()
    wall = sum(walls)
    return {"wall": wall, "tokens": tokens, "audio_s": samples / engine.info.sample_rate,
            "ttfa": statistics.median(walls), "enc_share": timing["encoder"] / timing["prefill"],
            "vocoder": timing["vocoder"]}


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, kind, default, text in (
        ("--model", str, None, "checkpoint dir (default: build the preset into a temp dir)"),
        ("--preset", str, "small", "preset to build when no --model is given"),
        ("--thinker-tokens", int, 24, "text tokens per answer"),
        ("--talker-tokens", int, 64, "codec frames per answer (Qwen3-Omni: 80 ms each; Qwen2.5-Omni: 20 ms)"),
        ("--threads", int, 1, "torch threads (on a shared machine, more than 1 mostly adds contention)"),
        ("--hf-requests", int, 2, "questions transformers answers (one at a time)"),
    ):
        ap.add_argument(flag, type=kind, default=default, help=text)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--family", choices=sorted(FAMILIES), default="qwen3_omni")
    ap.add_argument("--bridge-args", type=json.loads, nargs="+", default=[{}], metavar="JSON",
                    help="overrides of the audio stage's bridge_args, one engine each, measured in turn against the "
                         "same transformers run, e.g. '{\"max_chunk_blocks\": null}' '{}'")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import transformers

    from omnistage import SamplingParams
    from omnistage.models.qwen2_5_omni.loading import quiet_config_checks
    from omnistage.models.registry import load_pipeline_config
    from omnistage.pipeline.engine import OmniEngine
    from omnistage.pipeline.engine_args import EngineArgs

    hf_class, generation, audio_args = FAMILIES[args.family]
    model = resolve_model(args.model, args.preset, args.family)
    top = max(args.concurrency)

    def build(bridge_args: dict):
        stages = {name: {"scheduler": {"max_num_seqs": top}} for name in ("thinker", "talker", generation)}
        stages[generation]["bridge_args"] = bridge_args
        pipeline = load_pipeline_config(args.family, {"stages": stages})
        engine = OmniEngine(EngineArgs(model), pipeline)
        return engine, PrefillClock(engine, generation), dict(pipeline.stage(generation).bridge_args)

    engine, clock, chunking = build(args.bridge_args[0])
    with quiet_config_checks():
        hf = getattr(transformers, hf_class).from_pretrained(model, dtype=torch.float32).eval()
    params = {
        "thinker": SamplingParams(temperature=0.0, max_tokens=args.thinker_tokens, min_tokens=args.thinker_tokens),
        "talker": SamplingParams(temperature=0.0, max_tokens=args.talker_tokens, min_tokens=args.talker_tokens,
                                 repetition_penalty=1.0),
    }
    warm = {k: p.replace(max_tokens=4, min_tokens=4) for k, p in params.items()}
    run_omnistage(engine, clock, [spoken_question(0)[:RATE]], warm)
    run_hf(hf, engine, [spoken_question(0)[:RATE]], 4, 4, audio_args, generation)

    clips = [spoken_question(i) for i in range(top)]
    print(f"CPU: {cpu_name()}, torch threads={args.threads}, {Path(model).name}, float32; questions "
          f"{', '.join(f'{c.size / RATE:.1f}' for c in clips)} s; answers {args.thinker_tokens} text tokens, "
          f"{args.talker_tokens} codec frames")
    with torch.no_grad():
        ref = run_hf(hf, engine, clips[: args.hf_requests], args.thinker_tokens, args.talker_tokens, audio_args,
                     generation)
    for i, bridge_args in enumerate(args.bridge_args):
        if i:
            engine.shutdown()
            engine, clock, chunking = build(bridge_args)
            run_omnistage(engine, clock, [spoken_question(0)[:RATE]], warm)
        print(f"audio chunks: {chunking}")
        print_rows(engine, clock, clips, params, ref, args.concurrency)
    engine.shutdown()


def print_rows(engine, clock, clips, params, ref, concurrency) -> None:
    print(f"{'':>3} | {'omnistage':^68} | {'transformers (1 at a time)':^56} | {'ratio':^22}")
    print(f"{'N':>3} | {'TTFA s':>7} {'tok/s':>7} {'audio s/s':>9} {'RTF':>6} {'enc % prefill':>13} {'voc %':>6} "
          f"{'wall s':>7} | {'TTFA s':>7} {'tok/s':>7} {'audio s/s':>9} {'RTF':>6} {'enc % prefill':>13} "
          f"{'voc %':>6} | {'x thru':>6} {'TTFA':>6} {'ceiling':>8}")
    for n in concurrency:
        ours = run_omnistage(engine, clock, clips[:n], params)
        print(f"{n:>3} | {ours['ttfa']:>7.2f} {ours['tokens'] / ours['wall']:>7.1f} "
              f"{ours['audio_s'] / ours['wall']:>9.2f} {ours['wall'] / ours['audio_s']:>6.2f} "
              f"{100 * ours['enc_share']:>12.1f}% {100 * ours['vocoder'] / ours['wall']:>5.1f}% {ours['wall']:>7.1f} | "
              f"{ref['ttfa']:>7.2f} {ref['tokens'] / ref['wall']:>7.1f} {ref['audio_s'] / ref['wall']:>9.2f} "
              f"{ref['wall'] / ref['audio_s']:>6.2f} {100 * ref['enc_share']:>12.1f}% "
              f"{100 * ref['vocoder'] / ref['wall']:>5.1f}% | "
              f"{(ours['audio_s'] / ours['wall']) / (ref['audio_s'] / ref['wall']):>6.2f} "
              f"{ours['ttfa'] / ref['ttfa']:>6.2f} {throughput_ceiling(ours, ref):>7.2f}x", flush=True)


def throughput_ceiling(ours: dict, ref: dict) -> float:
    """The throughput ratio were all of omnistage but its vocoder stage free: our audio seconds per vocoder
    second against transformers' audio seconds per wall second."""
    if not ours["vocoder"]:
        return float("inf")
    return (ours["audio_s"] / ours["vocoder"]) / (ref["audio_s"] / ref["wall"])


if __name__ == "__main__":
    main()
