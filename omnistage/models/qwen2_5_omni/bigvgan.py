"""Qwen2.5-Omni Token2Wav, part 2: the BigVGAN vocoder (mel spectrogram -> 24 kHz waveform).

Names follow the checkpoint under ``token2wav.code2wav_bigvgan_model.``: ``conv_pre``, ``ups.i.0`` (transposed
convs), ``resblocks`` (AMP blocks: dilated convs with anti-aliased SnakeBeta activations — 2x upsample with a
Kaiser-windowed sinc, SnakeBeta, 2x downsample), ``activation_post``, ``conv_post``; output clamped to [-1, 1].

Every convolution is centred ('same' padding), so output sample ``s`` of mel frame ``f = s // hop`` depends on
the mel frames within ``context_frames()`` of ``f``; decoding a window of mel frames and keeping only its
interior therefore gives the same samples as decoding the whole spectrogram (what streaming relies on).
A transposed convolution whose ``kernel - rate`` is odd (padding ``(kernel - rate) // 2``, as transformers builds
it) gives one sample more than ``rate`` per input: the waveform then has ``tail`` samples past ``T * hop``, made
at the spectrogram's end (a stream emits them with its last window).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

_ACT_RATIO = 2
_ACT_KERNEL = 12


def kaiser_sinc_filter(cutoff: float, half_width: float, kernel_size: int) -> torch.Tensor:
    """Low-pass FIR taps [1, 1, K]: Kaiser window (beta from the transition width) times a sinc, sum 1."""
    half = kernel_size // 2
    attenuation = 2.285 * (half - 1) * math.pi * 4 * half_width + 7.95
    if attenuation > 50.0:
        beta = 0.1102 * (attenuation - 8.7)
    elif attenuation >= 21.0:
        beta = 0.5842 * (attenuation - 21) ** 0.4 + 0.07886 * (attenuation - 21.0)
    else:
        beta = 0.0
    window = torch.kaiser_window(kernel_size, beta=beta, periodic=False, dtype=torch.float32)
    if kernel_size % 2 == 0:
        t = torch.arange(-half, half) + 0.5
    else:
        t = torch.arange(kernel_size) - half
    taps = 2 * cutoff * window * torch.sinc(2 * cutoff * t)
    return (taps / taps.sum()).view(1, 1, kernel_size)


class SnakeBeta(nn.Module):
    """x + sin^2(x * e^alpha) / e^beta, per channel."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = torch.exp(self.alpha)[None, :, None]
        beta = torch.exp(self.beta)[None, :, None]
        return x + (1.0 / (beta + 1e-9)) * torch.pow(torch.sin(x * alpha), 2)


class AntiAliasedSnake(nn.Module):
    """Upsample x2 (replicate-padded transposed FIR), SnakeBeta, downsample x2 (replicate-padded FIR)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.act = SnakeBeta(channels)
        self.filter = nn.Buffer(kaiser_sinc_filter(0.5 / _ACT_RATIO, 0.6 / _ACT_RATIO, _ACT_KERNEL), persistent=False)
        pad = _ACT_KERNEL // _ACT_RATIO - 1
        self.up_pad = pad
        self.up_trim_left = pad * _ACT_RATIO + (_ACT_KERNEL - _ACT_RATIO) // 2
        self.up_trim_right = pad * _ACT_RATIO + (_ACT_KERNEL - _ACT_RATIO + 1) // 2
        self.down_pad = (_ACT_KERNEL // 2 - 1, _ACT_KERNEL // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = x.shape[1]
        taps = self.filter.to(x.dtype).expand(c, -1, -1)
        x = F.pad(x, (self.up_pad, self.up_pad), mode="replicate")
        x = _ACT_RATIO * F.conv_transpose1d(x, taps, stride=_ACT_RATIO, groups=c)
        x = x[..., self.up_trim_left : -self.up_trim_right]
        x = self.act(x)
        x = F.pad(x, self.down_pad, mode="replicate")
        return F.conv1d(x, taps, stride=_ACT_RATIO, groups=c)

    # Output sample radius, in samples of this rate: upsampled taps reach K / 2 fine samples (K / 4 here),
    # the downsample FIR K / 2 fine samples again.
    radius = math.ceil(_ACT_KERNEL / _ACT_RATIO)


def _same_conv(channels: int, kernel: int, dilation: int) -> nn.Conv1d:
    return nn.Conv1d(channels, channels, kernel, 1, dilation=dilation, padding=(kernel * dilation - dilation) // 2)


# transformers builds three residual units per AMP block from the first three dilations, ignoring any further ones.
_UNITS = 3


class AMPBlock(nn.Module):
    def __init__(self, channels: int, kernel: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        dilations = tuple(dilations[:_UNITS])
        self.convs1 = nn.ModuleList(_same_conv(channels, kernel, d) for d in dilations)
        self.convs2 = nn.ModuleList(_same_conv(channels, kernel, 1) for _ in dilations)
        self.activations = nn.ModuleList(AntiAliasedSnake(channels) for _ in range(2 * len(dilations)))
        self.radius = sum(
            2 * AntiAliasedSnake.radius + (kernel - 1) // 2 * d + (kernel - 1) // 2 for d in dilations
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acts = self.activations
        for conv1, conv2, act1, act2 in zip(self.convs1, self.convs2, acts[::2], acts[1::2]):
            x = x + conv2(act2(conv1(act1(x))))
        return x


def check_geometry(
    rates: Sequence[int], kernels: Sequence[int], resblock_kernels: Sequence[int],
    resblock_dilations: Sequence[Sequence[int]],
) -> None:
    """Refuse what cannot run: a residual unit's convolutions must keep their input's length, so its kernel is odd
    (its second convolution is undilated; transformers builds an even one but fails adding it to its input)."""
    if len(rates) != len(kernels):
        raise ValueError("upsample_rates and upsample_kernel_sizes must have the same length")
    for r, k in zip(rates, kernels):
        if r < 1 or k < r:
            raise ValueError(f"upsample kernel {k} and rate {r}: need rate >= 1 and kernel >= rate")
    if len(resblock_kernels) != len(resblock_dilations):
        raise ValueError("resblock_kernel_sizes and resblock_dilation_sizes must have the same length")
    for k in resblock_kernels:
        if k % 2 == 0:
            raise ValueError(
                f"resblock kernel {k} changes the signal's length (resblock_kernel_sizes must be odd): a residual "
                "unit's sum cannot be formed"
            )


def tail_samples(rates: Sequence[int], kernels: Sequence[int]) -> int:
    """Samples past ``T * hop``: each layer with an odd ``kernel - rate`` adds one, scaled by the later rates."""
    tail = 0
    for r, k in zip(rates, kernels):
        tail = tail * r + (k - r) % 2
    return tail


class BigVGAN(nn.Module):
    """Built from ``token2wav_config.bigvgan_config``."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        rates, kernels = list(cfg.upsample_rates), list(cfg.upsample_kernel_sizes)
        check_geometry(rates, kernels, cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes)
        ch = int(cfg.upsample_initial_channel)
        self.num_kernels = len(cfg.resblock_kernel_sizes)
        self.conv_pre = nn.Conv1d(cfg.mel_dim, ch, 7, 1, padding=3)
        self.ups = nn.ModuleList(
            nn.ModuleList([nn.ConvTranspose1d(ch >> i, ch >> (i + 1), k, r, padding=(k - r) // 2)])
            for i, (r, k) in enumerate(zip(rates, kernels))
        )
        self.resblocks = nn.ModuleList(
            AMPBlock(ch >> (i + 1), k, tuple(d))
            for i in range(len(rates))
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes)
        )
        self.activation_post = AntiAliasedSnake(ch >> len(rates))
        self.conv_post = nn.Conv1d(ch >> len(rates), 1, 7, 1, padding=3, bias=False)
        self.rates = rates
        self.kernels = kernels
        self.hop = int(np.prod(rates))
        self.tail = tail_samples(rates, kernels)

    def context_frames(self) -> int:
        """Mel frames on each side of a frame that can reach its output samples (a safe upper bound)."""
        frames = 3.0  # conv_pre
        rate = 1
        for i, (r, k) in enumerate(zip(self.rates, self.kernels)):
            frames += math.ceil(k / 2 / r + 1) / rate  # transposed conv: input samples of the previous rate
            rate *= r
            widest = max(self.resblocks[i * self.num_kernels + j].radius for j in range(self.num_kernels))
            frames += widest / rate
        frames += (AntiAliasedSnake.radius + 3) / rate  # activation_post + conv_post
        return math.ceil(frames)

    @staticmethod
    def _normalize(mel: torch.Tensor) -> torch.Tensor:
        # exp -> dB (floor -115 dB) - 20 dB, mapped linearly onto [-1, 1].
        min_level = torch.exp(torch.tensor(-115 / 20.0 * np.log(10), device=mel.device, dtype=mel.dtype))
        db = 20 * torch.log10(torch.clamp(torch.exp(mel), min=min_level)) - 20
        return torch.clamp(2 * ((db + 115) / 115) - 1, -1, 1)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """mel [B, mel_dim, T] -> waveform [B, T * hop + tail] in [-1, 1]."""
        x = self.conv_pre(self._normalize(mel))
        for i, up in enumerate(self.ups):
            x = up[0](x)
            blocks = self.resblocks[i * self.num_kernels : (i + 1) * self.num_kernels]
            x = sum(block(x) for block in blocks) / self.num_kernels
        x = self.conv_post(self.activation_post(x))
        return torch.clamp(x, min=-1.0, max=1.0).squeeze(1)
