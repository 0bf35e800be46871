"""Causal 1-D convolutions used by codec vocoders (Qwen3-Omni Code2Wav).

Both wrappers keep the torch conv module under the attribute ``conv`` so checkpoint names of the form
``<prefix>.conv.weight`` / ``<prefix>.conv.bias`` load unchanged.

Causality is what lets a generation stage batch requests of different lengths with right padding, and
decode audio in chunks with left context: output sample ``t`` never depends on input positions that come
after the ones that produced it.

Streaming (``forward_stream``): a call sees only new inputs plus the few inputs before them that its
window still reaches (``history_size`` of them, zeros at the start of a stream, exactly the zeros the
one-shot ``forward`` pads with), and returns the history for the next call. Rows of a batch may hold
different numbers of valid inputs (right padding); each row's next history ends at its own last valid
input, so padding never enters a history.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

# Length rules accept plain ints or integer tensors (one length per request).
LengthT = TypeVar("LengthT", int, torch.Tensor)


def slide_window(extended: torch.Tensor, starts: int | torch.Tensor, size: int, dim: int = -1) -> torch.Tensor:
    """Row b of the result is ``extended[b]`` from ``starts[b]`` for ``size`` positions along ``dim``.

    ``starts`` is one int for all rows (a view) or a [B] integer tensor (one gather, no per-row loop).
    """
    if isinstance(starts, int):
        return extended.narrow(dim, starts, size)
    dim %= extended.dim()
    offsets_shape = [1] * extended.dim()
    offsets_shape[dim] = size
    starts_shape = [1] * extended.dim()
    starts_shape[0] = -1
    index = starts.view(starts_shape) + torch.arange(size, device=extended.device).view(offsets_shape)
    shape = list(extended.shape)
    shape[dim] = size
    return extended.gather(dim, index.expand(shape))


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
        pad = (self.left_pad, self._right_pad(hidden.shape[-1]))
        if pad != (0, 0):  # F.pad copies even when it pads nothing (kernel-1 convolutions)
            hidden = F.pad(hidden, pad)
        return self.conv(hidden)

    @property
    def history_size(self) -> int:
        """Inputs before a streaming call's new ones that its outputs still see (stride 1 only)."""
        if self.stride != 1:
            raise ValueError(f"streaming needs stride 1, this convolution has stride {self.stride}")
        return self.left_pad

    def forward_stream(
        self, hidden: torch.Tensor, history: torch.Tensor, valid: int | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """New inputs [B, C_in, W] after ``history`` [B, C_in, history_size] -> (outputs [B, C_out, W],
        next history). ``valid`` (int or [B]) counts each row's valid inputs; outputs past it are padding.
        """
        extended = torch.cat((history, hidden), -1)
        return self.conv(extended), slide_window(extended, valid, self.history_size)


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
        if self.trim in (0, self.stride):
            return self._forward_matmul(hidden)
        hidden = self.conv(hidden)
        return hidden[..., self.trim : hidden.shape[-1] - self.trim]

    def _forward_matmul(self, hidden: torch.Tensor) -> torch.Tensor:
        """kernel == stride or 2 * stride as one GEMM plus an overlap-add.

        Same result as the trimmed ConvTranspose1d (up to float rounding), but torch's CPU transposed
        convolution is slow for short inputs (a streaming call's few new frames: ~4x the GEMM's time).
        Input position i gives ``kernel`` samples per channel from ``i * stride``; with kernel == 2 * stride
        kept block j is the second half of input j's samples plus the first half of input j + 1's.
        """
        batch, channels, length = hidden.shape
        out_channels, stride = self.conv.out_channels, self.stride
        taps = 1 if self.trim == 0 else 2
        weight = self.conv.weight.reshape(channels, out_channels * taps * stride)
        bias = self.conv.bias
        if bias is not None:  # added once per output sample: to the first tap block only
            bias = F.pad(bias[:, None, None].expand(out_channels, 1, stride), (0, 0, 0, taps - 1)).reshape(-1)
        rows = hidden.transpose(1, 2).reshape(batch * length, channels)
        z = (rows @ weight if bias is None else torch.addmm(bias, rows, weight))
        z = z.view(batch, length, out_channels, taps, stride).permute(0, 2, 1, 3, 4)
        if taps == 1:
            return z.reshape(batch, out_channels, length * stride)
        blocks = max(length - 1, 0)
        out = hidden.new_empty((batch, out_channels, blocks, stride))
        torch.add(z[:, :, 1:, 0], z[:, :, :-1, 1], out=out)
        return out.view(batch, out_channels, blocks * stride)

    @property
    def history_size(self) -> int:
        """Previous inputs a streaming call needs: 0 for kernel == stride, 1 for kernel == 2 * stride."""
        if self.trim not in (0, self.stride):
            raise ValueError(
                f"streaming supports kernel == stride or 2 * stride, got kernel "
                f"{self.conv.kernel_size[0]} and stride {self.stride}"
            )
        return 0 if self.trim == 0 else 1

    def stream_output_length(self, inputs: int, starts_stream: bool) -> int:
        """Samples a streaming call emits for ``inputs`` new inputs; the first input of a stream emits
        ``stride`` fewer (its leading samples are the ones ``forward`` trims)."""
        if self.history_size == 0 or not starts_stream:
            return inputs * self.stride
        return max(inputs - 1, 0) * self.stride

    def forward_stream(
        self,
        hidden: torch.Tensor,
        last: torch.Tensor,
        valid: int | torch.Tensor,
        starting: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Kernel 2 * stride: new inputs [B, C_in, W] after the previous input ``last`` [B, C_in, 1] ->
        (outputs [B, C_out, W * stride], next ``last``).

        Output block j (``stride`` samples) needs inputs j and j + 1, so a call emits the block that was
        waiting for its first new input, then one block per new input except the last, whose block waits
        for the next call. Rows listed in ``starting`` (index tensor) begin their stream here: they have no
        previous input, and their first block is the one ``forward`` trims, so their inputs move one place
        left and they emit ``stride`` samples fewer (left-aligned; the rest of the row is padding).
        """
        extended = torch.cat((last, hidden), -1)
        # Copy: for rows that start here `extended` is rewritten below, and a view would follow it.
        next_last = slide_window(extended, valid, 1).contiguous()
        if starting is not None:
            extended[starting, :, :-1] = hidden[starting]
        return self.forward(extended), next_last
