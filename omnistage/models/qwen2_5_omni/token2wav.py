"""Qwen2.5-Omni Token2Wav: codec tokens -> mel (DiT, ODE) -> waveform (BigVGAN), batched over requests.

The unit of work is a *window* (``Token2WavWindow``): a request's codes over some range, the ODE's initial noise
for those mel frames, the voice, and which mel frames of the window to turn into audio. One-shot decoding is
one window covering all codes; streaming (``streaming.py``) decodes overlapping windows. Windows of equal length
run as one DiT batch; the vocoder runs on each window's kept frames plus context, batched by length the same
way. Nothing is carried between calls: a window holds everything its audio depends on.

Initial noise: transformers draws it inside ``Qwen2_5OmniToken2WavDiTModel.sample`` as
``torch.randn([1, 2N, mel_dim])`` from the global generator (one request at a time). Here it is an input,
drawn per request from that request's own ``torch.Generator`` (``NoiseStream``). On CPU, a generator seeded
with ``s`` yields the same values as ``torch.manual_seed(s); torch.randn(...)``, and drawing the rows in
pieces as codes arrive yields the same values as one draw of all rows, as long as every draw is a multiple
of 16 values and so is the whole (CPU normal sampling works in blocks of 16; with the real mel_dim 80 every
code's 160 values qualify). So seeding the reference's global generator with the request's seed right before
its Token2Wav call reproduces our noise exactly; on other devices noise is still drawn on the CPU and copied.

Codes outside the DiT's code table (Talker control ids; a trained Talker emits them only as EOS, which never
reaches Token2Wav) are mapped to id 0, the DiT's "no code" embedding; transformers would fail on them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from omnistage.models.qwen2_5_omni.bigvgan import BigVGAN
from omnistage.models.qwen2_5_omni.dit import DiT, ODEConfig
from omnistage.models.qwen2_5_omni.voices import Speaker

_NORMAL_BLOCK = 16  # CPU normal_ fills in blocks of 16 values


class NoiseStream:
    """A request's ODE noise rows [rows, mel_dim], drawn in order from its own CPU generator."""

    def __init__(self, generator: torch.Generator, mel_dim: int) -> None:
        if generator.device.type != "cpu":
            raise ValueError("noise is drawn from a CPU generator (reproducible on every device)")
        self.generator = generator
        self.mel_dim = mel_dim
        self._unit = _NORMAL_BLOCK // math.gcd(mel_dim, _NORMAL_BLOCK)  # rows per draw multiple of 16 values
        self._spare = torch.empty(0, mel_dim)

    def take(self, rows: int) -> torch.Tensor:
        if rows < 0:
            raise ValueError(f"rows must be >= 0, got {rows}")
        need = rows - self._spare.shape[0]
        if need > 0:
            draw = -(-need // self._unit) * self._unit
            fresh = torch.randn(draw, self.mel_dim, generator=self.generator)
            self._spare = torch.cat((self._spare, fresh))
        out, self._spare = self._spare[:rows], self._spare[rows:]
        return out


@dataclass
class Token2WavWindow:
    """One request's codes over a window and what to keep of it.

    codes [n] (codec ids); noise [n * repeats, mel_dim]; the audio returned covers mel frames
    ``[keep_start, keep_start + keep_frames)`` of the window, i.e. ``keep_frames * hop`` samples; the vocoder
    also reads up to its context of mel frames on both sides that lie inside the window. ``last``: the window
    ends the utterance, and its audio also carries the vocoder's samples past the last frame (``BigVGAN.tail``).
    """

    codes: torch.Tensor
    noise: torch.Tensor
    voice: str
    keep_start: int
    keep_frames: int
    last: bool = False

    def __post_init__(self) -> None:
        if self.codes.dim() != 1 or self.codes.numel() == 0:
            raise ValueError("codes must be a non-empty 1-D tensor")
        frames = self.noise.shape[0]
        if frames % self.codes.numel():
            raise ValueError(f"noise has {frames} rows for {self.codes.numel()} codes")
        if not (0 <= self.keep_start and self.keep_frames > 0 and self.keep_start + self.keep_frames <= frames):
            raise ValueError(f"kept frames [{self.keep_start}, +{self.keep_frames}) outside the {frames}-frame window")
        if self.last and self.keep_start + self.keep_frames != frames:
            raise ValueError("the last window must keep its frames up to its end")


def _groups(lengths: list[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        out.setdefault(n, []).append(i)
    return out


class Token2Wav(nn.Module):
    """``code2wav_dit_model`` + ``code2wav_bigvgan_model`` (checkpoint names under ``token2wav.``)."""

    def __init__(self, config: Any, ode: ODEConfig | None = None) -> None:
        super().__init__()
        t2w = config.token2wav_config
        self.code2wav_dit_model = DiT(t2w.dit_config)
        self.code2wav_bigvgan_model = BigVGAN(t2w.bigvgan_config)
        if t2w.bigvgan_config.mel_dim != t2w.dit_config.mel_dim:
            raise ValueError("DiT and BigVGAN disagree on mel_dim")
        self.ode = ode or ODEConfig()
        self.mel_dim = self.code2wav_dit_model.mel_dim
        self.repeats = self.code2wav_dit_model.repeats
        self.hop = self.code2wav_bigvgan_model.hop
        self.tail = self.code2wav_bigvgan_model.tail
        self.vocoder_context = self.code2wav_bigvgan_model.context_frames()
        self._voices: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @property
    def voices(self) -> list[str]:
        return sorted(self._voices)

    @torch.inference_mode()
    def set_speakers(self, speakers: Mapping[str, Speaker]) -> None:
        """Precompute each voice's speaker features (ECAPA over its reference mel and over a zero mel for the
        unconditioned branch) and its cond: they are the same for every request and every ODE step."""
        weight = self.code2wav_dit_model.proj_out.weight
        encoder = self.code2wav_dit_model.input_embed.spk_encoder
        self._voices = {}
        for name, spk in speakers.items():
            ref = spk.ref_mel.to(weight.device, weight.dtype)[None]
            feats = encoder(torch.cat((ref, torch.zeros_like(ref))))
            self._voices[name] = (feats[0], feats[1], spk.cond.to(weight.device, weight.dtype))

    def _voice_inputs(self, voices: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        try:
            rows = [self._voices[v] for v in voices]
        except KeyError as e:
            raise ValueError(f"voice {e.args[0]!r} has no speaker features; known: {self.voices}") from None
        return tuple(torch.stack(col) for col in zip(*rows))  # type: ignore[return-value]

    def mel(self, codes: torch.Tensor, noise: torch.Tensor, voices: list[str]) -> torch.Tensor:
        """Equal-length batch: codes [B, N], noise [B, N * repeats, mel] -> mel [B, mel, N * repeats]."""
        dit = self.code2wav_dit_model
        device, dtype = dit.proj_out.weight.device, dit.proj_out.weight.dtype
        codes = codes.to(device)
        codes = torch.where((codes >= 0) & (codes <= dit.num_embeds), codes, torch.zeros_like(codes))
        spk, spk_uncond, cond = self._voice_inputs(voices)
        conditioning = dit.conditioning(codes, spk, spk_uncond, cond)
        return dit.sample(noise.to(device, dtype), conditioning, self.ode)

    def forward(self, codes: torch.Tensor, noise: torch.Tensor, voices: list[str]) -> torch.Tensor:
        """One-shot decode of an equal-length batch: -> waveform [B, N * repeats * hop + tail]."""
        return self.code2wav_bigvgan_model(self.mel(codes, noise, voices))

    def decode_windows(self, windows: list[Token2WavWindow]) -> list[torch.Tensor]:
        """Each window's kept audio (``keep_frames * hop`` samples, and the vocoder's tail for the last), in
        input order."""
        mels: list[torch.Tensor | None] = [None] * len(windows)
        for _, members in _groups([w.codes.numel() for w in windows]).items():
            group = [windows[i] for i in members]
            out = self.mel(
                torch.stack([w.codes for w in group]),
                torch.stack([w.noise for w in group]),
                [w.voice for w in group],
            )
            for i, m in zip(members, out):
                mels[i] = m
        spans = []
        for w, m in zip(windows, mels):
            assert m is not None
            left = min(self.vocoder_context, w.keep_start)
            right = min(self.vocoder_context, m.shape[-1] - w.keep_start - w.keep_frames)
            spans.append((w.keep_start - left, w.keep_start + w.keep_frames + right, left))
        audio: list[torch.Tensor | None] = [None] * len(windows)
        for _, members in _groups([b - a for a, b, _ in spans]).items():
            batch = torch.stack([mels[i][:, spans[i][0] : spans[i][1]] for i in members])  # type: ignore[index]
            wave = self.code2wav_bigvgan_model(batch)
            for i, row in zip(members, wave):
                start = spans[i][2] * self.hop
                kept = windows[i].keep_frames * self.hop + (self.tail if windows[i].last else 0)
                audio[i] = row[start : start + kept]
        return audio  # type: ignore[return-value]
