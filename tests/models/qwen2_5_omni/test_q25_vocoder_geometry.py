"""BigVGAN geometries off the released ones: transposed convolutions whose ``kernel - rate`` is odd (transformers
accepts them; each such layer makes one sample more per utterance), more dilations than transformers reads, and
the geometries nobody can run (refused at load, naming the field). One-shot and streamed audio against
transformers' own vocoder and generate."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniBigVGANConfig
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavBigVGANModel

from omnistage import Omni
from omnistage.checkpoints.qwen2_5_omni.builder import build_checkpoint
from omnistage.checkpoints.qwen2_5_omni.presets import BigVGANSpec, get_preset
from omnistage.core.sampling_params import SamplingParams
from omnistage.models.qwen2_5_omni.bigvgan import BigVGAN, tail_samples
from omnistage.models.qwen2_5_omni.dit import ODEConfig
from omnistage.models.qwen2_5_omni.loading import load_config, load_token2wav
from omnistage.models.qwen2_5_omni.streaming import ChunkPlan, Token2WavStream
from omnistage.models.qwen2_5_omni.token2wav import NoiseStream
from omnistage.models.registry import load_pipeline_config
from omnistage.testing.qwen2_5_omni.reference import reference_speech

# rates, kernels: odd kernel - rate in none of the layers (the control) and in some (tails of 3, 7 and 16 samples).
GEOMETRIES = [
    ((5, 3, 4, 4), (11, 7, 8, 8)),
    ((3, 2), (6, 5)),
    ((4, 2, 3), (5, 4, 6)),
    ((2, 3, 5), (3, 5, 6)),
]


def _hf_vocoder(rates, kernels, res_kernels=(3, 7), dilations=((1, 3, 5), (1, 3, 5))):
    cfg = Qwen2_5OmniBigVGANConfig(
        mel_dim=16, upsample_initial_channel=16, resblock_kernel_sizes=list(res_kernels),
        resblock_dilation_sizes=[list(d) for d in dilations], upsample_rates=list(rates),
        upsample_kernel_sizes=list(kernels),
    )
    torch.manual_seed(0)
    hf = Qwen2_5OmniToken2WavBigVGANModel(cfg).eval()
    with torch.no_grad():  # SnakeBeta's alpha / beta start at 0: give every channel its own
        for name, p in hf.named_parameters():
            if name.endswith((".alpha", ".beta")):
                p.uniform_(-0.5, 0.5)
    return cfg, hf


def _ours(cfg, hf) -> BigVGAN:
    ours = BigVGAN(cfg).eval()
    theirs = hf.state_dict()
    ours.load_state_dict({k: theirs[k] for k in ours.state_dict()}, strict=True)
    return ours


@pytest.mark.parametrize("rates,kernels", GEOMETRIES)
@torch.inference_mode()
def test_one_shot_equals_transformers_with_its_extra_samples(rates, kernels):
    cfg, hf = _hf_vocoder(rates, kernels)
    ours = _ours(cfg, hf)
    hop = ours.hop
    tail = sum((k - r) % 2 * int(torch.tensor(rates[i + 1 :]).prod()) for i, (r, k) in enumerate(zip(rates, kernels)))
    assert ours.tail == tail_samples(rates, kernels) == tail
    mel = torch.randn(2, 16, 13) - 3
    want = torch.stack([hf(m[None]) for m in mel])  # transformers squeezes the batch away
    got = ours(mel)
    assert got.shape == want.shape == (2, 13 * hop + tail)
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("rates,kernels", GEOMETRIES)
@torch.inference_mode()
def test_windows_with_context_and_the_tail_last_rebuild_the_whole(rates, kernels):
    """The streaming contract at the vocoder: every frame's samples from a window with ``context_frames`` on
    each side; the window that ends the spectrogram also gives the tail."""
    cfg, hf = _hf_vocoder(rates, kernels)
    ours = _ours(cfg, hf)
    mel = torch.randn(1, 16, 40) - 3
    whole, hop, context = ours(mel)[0], ours.hop, ours.context_frames()
    parts, total = [], mel.shape[-1]
    for s in range(0, total, 7):
        e, a = min(total, s + 7), max(0, s - context)
        wave = ours(mel[:, :, a : min(total, e + context)])[0]
        parts.append(wave[(s - a) * hop : (e - a) * hop + (ours.tail if e == total else 0)])
    assert (torch.cat(parts) - whole).abs().max().item() <= 1e-5


def test_geometries_that_cannot_run_are_refused_naming_the_field():
    base = get_preset("tiny").bigvgan
    with pytest.raises(ValueError, match="resblock kernel 4 changes"):
        replace(base, resblock_kernel_sizes=(3, 4))
    with pytest.raises(ValueError, match="kernel >= rate"):
        replace(base, upsample_kernel_sizes=(11, 7, 8, 3))
    with pytest.raises(ValueError, match="same length"):
        replace(base, upsample_rates=(5, 3))
    # transformers fails the same even kernel at its first residual sum
    cfg, hf = _hf_vocoder((2,), (4,), res_kernels=(4,), dilations=((1, 3, 5),))
    with pytest.raises(RuntimeError):
        hf(torch.zeros(1, 16, 5))
    with pytest.raises(ValueError, match="resblock kernel 4 changes"):
        BigVGAN(cfg)


@torch.inference_mode()
def test_dilations_past_the_third_are_ignored_as_transformers_does():
    cfg, hf = _hf_vocoder((3, 2), (6, 5), dilations=((1, 3, 5, 7), (2, 1, 4, 3)))
    ours = _ours(cfg, hf)  # strict: the same three units per block as the checkpoint holds
    mel = torch.randn(1, 16, 9) - 3
    assert (ours(mel) - hf(mel)).abs().max().item() <= 1e-5


# ---- the whole model on a checkpoint with odd upsampling layers ------------------------------------------------

ODD = BigVGANSpec(
    upsample_initial_channel=16, upsample_rates=(5, 3, 4, 4), upsample_kernel_sizes=(10, 7, 9, 8),
    resblock_kernel_sizes=(3, 7), resblock_dilation_sizes=((1, 3, 5), (1, 3, 5)),
)
TEXT_TOKENS, CODES, SEED = 6, 30, 5
ONE_SHOT = {"chunk_blocks": 10_000, "past_blocks": 0, "future_blocks": 0}


@functools.cache
def odd_checkpoint() -> Path:
    out = Path(tempfile.mkdtemp(prefix="omnistage-q25-odd-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    return build_checkpoint(out, preset=replace(get_preset("tiny"), name="odd", bigvgan=ODD), seed=3)


def _params() -> dict[str, SamplingParams]:
    return {"thinker": SamplingParams(temperature=0.0, max_tokens=TEXT_TOKENS),
            "talker": SamplingParams(temperature=0.0, max_tokens=CODES, repetition_penalty=1.05, seed=SEED)}


def test_speech_equals_transformers_generate_with_the_tail():
    ckpt = odd_checkpoint()
    pipeline = load_pipeline_config("qwen2_5_omni", {"stages": {"token2wav": {"bridge_args": ONE_SHOT}}})
    with Omni(ckpt, pipeline=pipeline) as o:
        out = o.generate(["Tell me a short story about the sea."], ["text", "audio"], _params())[0]
    assert out.error is None and out.codes.numel() > 0
    _, wav = reference_speech(ckpt, out.prompt_token_ids, TEXT_TOKENS, CODES, SEED)
    assert out.audio.shape == wav.shape == (out.codes.numel() * 2 * 5 * 3 * 4 * 4 + 3 * 4 * 4 + 4,)
    assert (out.audio - wav).abs().max().item() <= 1e-4


@pytest.mark.parametrize(
    "plan,tol",
    [
        (ChunkPlan(chunk_blocks=2, past_blocks=100, future_blocks=100), 1e-4),  # the DiT sees everything
        (ChunkPlan(chunk_blocks=1, past_blocks=1, future_blocks=0), None),  # no look-ahead: the last chunk waits
        (ChunkPlan(chunk_blocks=1, past_blocks=1, future_blocks=1, max_chunk_blocks=4), None),
    ],
)
@torch.inference_mode()
def test_streamed_windows_end_with_the_tail(plan, tol):
    ckpt = odd_checkpoint()
    t2w = load_token2wav(ckpt, load_config(ckpt), torch.device("cpu"))
    t2w.ode = ODEConfig(num_steps=4)
    dit = t2w.code2wav_dit_model
    codes = torch.randint(0, dit.num_embeds, (29,), generator=torch.Generator().manual_seed(1))
    noise = lambda: NoiseStream(torch.Generator().manual_seed(SEED), t2w.mel_dim)  # noqa: E731
    whole = t2w(codes[None], noise().take(codes.numel() * t2w.repeats)[None], ["Ethan"])[0]
    stream = Token2WavStream(plan, dit.block_size, dit.repeats, "Ethan", noise(), tail=t2w.tail > 0)
    windows = []
    for i in range(0, codes.numel(), dit.block_size // dit.repeats):  # a block of codes at a time
        windows += stream.push(codes[i : i + dit.block_size // dit.repeats])
    rest = stream.finish()
    assert rest and rest[-1].last and not any(w.last for w in windows + rest[:-1])
    waves = t2w.decode_windows(windows + rest)
    assert [w.numel() for w in waves[:-1]] == [w.keep_frames * t2w.hop for w in (windows + rest)[:-1]]
    audio = torch.cat(waves)
    assert audio.shape == whole.shape == (codes.numel() * t2w.repeats * t2w.hop + t2w.tail,)
    if tol is not None:
        assert (audio - whole).abs().max().item() <= tol
