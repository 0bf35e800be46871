"""Causal 1-D convolutions used by codec vocoders (Qwen3-Omni Code2Wav).

Both wrappers keep the torch conv module under the attribute ``conv`` so checkpoint names of the form
``<prefix>.conv.weight`` / ``<prefix>.conv.bias`` load unchanged.

Causality is what lets a generation stage batch requests of different lengths with right padding, and
decode audio in chunks with left context: output sample ``t`` never depends on input positions that come
after the ones that produced it.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

# Length rules accept plain ints or integer tensors (one length per request).
LengthT = TypeVar("LengthT", int, torch.Tensor)


class CausalConv1d(nn.Module):
    """Conv1d padded on the left only (plus the right padding needed to complete the last stride).

    With ``stride == 1`` the output has the input's length and position ``t`` sees inputs ``<= t``.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        dilation: int = 1,
        stride: int = 1,
        groups: int = 1,
    ) -> None:
        super().__init__()
        if kernel_size < 1 or dilation < 1 or stride < 1:
            raise ValueError(
                f"kernel_size, dilation and stride must be >= 1, got {kernel_size}, {dilation}, {stride}"
            )
        self.conv = nn.Conv1d(
            in_channels, out_channels, kernel_size, stride=stride, dilation=dilation, groups=groups
        )
        self.stride = stride
        self.receptive_field = (kernel_size - 1) * dilation + 1
        self.left_pad = self.receptive_field - stride

    def output_length(self, length: LengthT) -> LengthT:
        return -(-length // self.stride)  # ceil division; works on ints and integer tensors

    def _right_pad(self, length: int) -> int:
        # Pad so the last (partial) stride still yields a full window.
        return self.output_length(length) * self.stride - length

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = F.pad(hidden, (self.left_pad, self._right_pad(hidden.shape[-1])))
        return self.conv(hidden)


class CausalConvTranspose1d(nn.Module):
    """ConvTranspose1d with ``kernel_size - stride`` samples trimmed from both ends.

    For kernel == stride nothing is trimmed (pure repetition-style upsampling). For kernel == 2 * stride
    the output for input frames ``0..L-1`` is ``(L - 1) * stride`` samples: the trailing samples that would
    also need frame ``L`` are dropped, so the kept samples depend only on frames that exist — appending
    frames (or right padding) never changes them.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1) -> None:
        super().__init__()
        if kernel_size < stride:
            raise ValueError(f"kernel_size ({kernel_size}) must be >= stride ({stride})")
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.stride = stride
        self.trim = kernel_size - stride

    def output_length(self, length: LengthT) -> LengthT:
        kept = (length - 1) * self.stride + self.conv.kernel_size[0] - 2 * self.trim
        return kept.clamp(min=0) if isinstance(kept, torch.Tensor) else max(kept, 0)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.conv(hidden)
        return hidden[..., self.trim : hidden.shape[-1] - self.trim]
