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

Channels-last path (``*_channels_last``): the same convolutions on [B, T, C] signals. Audio decoders keep
few channels at many samples, where torch's [B, C, T] convolutions spend much of their time converting
layouts: oneDNN runs a channels-last convolution without reordering activations (up to 1.7x faster for
32-64 channels in bfloat16 on this project's AVX-512 CPU), kernel-1 convolutions and transposed
convolutions become plain GEMMs whose outputs already have the next layer's layout, and streaming
histories are prepended with contiguous copies. Wide convolutions with many outputs in a call
(``dft_conv.takes``) run as products of small DFTs instead: a quarter of the multiplications. Results equal the
[B, C, T] path up to float rounding (other summation order). Weights in the layouts these calls need are derived on first use and kept until
the weight changes; ``use_amx`` instead packs them once for ``amx_kernels`` (AMX CPUs, bfloat16-valued weights),
which then serve the channels-last path, and releases the unpacked weight (one copy held; a packed module's
``state_dict()`` raises, as ``fast_linear``'s packed layers do).
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.models.layers import amx_kernels, cpu_kernels, dft_conv
from omnistage.models.layers.fast_linear import release_weight

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


def _input_at(last: torch.Tensor, hidden: torch.Tensor, valid: int | torch.Tensor) -> torch.Tensor:
    """Row b of ``[last; hidden]`` (along dim 1) at position ``valid[b]``, [B, 1, C], a copy: ``slide_window`` of
    the concatenation without making it."""
    if isinstance(valid, int):
        return (hidden.narrow(1, valid - 1, 1) if valid else last).clone()
    picked = slide_window(hidden, (valid - 1).clamp(min=0), 1, dim=1)
    return torch.where((valid > 0).view(-1, 1, 1), picked, last)


def derived(module: nn.Module, name: str, weight: torch.Tensor, make) -> torch.Tensor:
    """``make(weight)`` cached on ``module`` until ``weight`` changes (new tensor, in-place update, dtype).

    Inference tensors (weights made under ``torch.inference_mode``) keep no version counter: an in-place
    update of one of those under inference mode is not seen."""
    version = 0 if weight.is_inference() else weight._version
    key = (weight.data_ptr(), version, weight.dtype, weight.device)
    cached = module.__dict__.get(name)
    if cached is None or cached[0] != key:
        with torch.no_grad():
            cached = (key, make(weight.detach()))
        module.__dict__[name] = cached
    return cached[1]


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
        self.amx_weight: amx_kernels.AmxWeight | None = None

    def use_amx(self) -> bool:
        """Serve the channels-last path from AMX tiles (``amx_kernels``) where they take this convolution (stride
        1, no groups, more than ``FEW_OUTPUTS`` outputs, a bfloat16-valued weight, an AMX CPU): the weight
        is packed once, now (call after loading), and its unpacked copy released. Returns whether they do."""
        conv = self.conv
        if (self.amx_weight is None and self.stride == 1 and conv.groups == 1 and conv.out_channels > self.FEW_OUTPUTS
                and amx_kernels.takes(conv.weight)):
            self.amx_weight = amx_kernels.pack(conv.weight)
            release_weight(conv, "weight")  # every CPU path of a packed convolution reads the tiles
        return self.amx_weight is not None

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

    def amx_channels_last(
        self, x: torch.Tensor, left: torch.Tensor | None, snake: tuple[torch.Tensor, torch.Tensor] | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``apply_padded_channels_last`` of the inputs ``left`` [B, H, C_in] (its left context: zeros or a
        stream's carried inputs; None for none) then x [B, T, C_in] through SnakeBeta ``snake`` = (alpha, scale),
        on AMX tiles (``use_amx`` took the weight): the activated, concatenated inputs are never stored."""
        if residual is not None and not residual.is_contiguous():
            residual = residual.contiguous()
        return amx_kernels.conv(x, self.amx_weight, self.conv.dilation[0], self.conv.bias, residual, left, snake)

    def forward_stream(
        self, hidden: torch.Tensor, history: torch.Tensor, valid: int | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """New inputs [B, C_in, W] after ``history`` [B, C_in, history_size] -> (outputs [B, C_out, W],
        next history). ``valid`` (int or [B]) counts each row's valid inputs; outputs past it are padding.
        """
        extended = torch.cat((history, hidden), -1)
        return self.conv(extended), slide_window(extended, valid, self.history_size)

    # -- channels-last path ---------------------------------------------------------------------------

    def forward_channels_last(self, hidden: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T, C_in] -> [B, T_out, C_out] (plus ``residual`` [B, T_out, C_out] when given): ``forward``
        in the channels-last layout."""
        pad = (self.left_pad, self._right_pad(hidden.shape[1]))
        if pad != (0, 0):
            hidden = F.pad(hidden, (0, 0, *pad))
        return self.apply_padded_channels_last(hidden, residual)

    # oneDNN runs a convolution with very few output channels (a vocoder's last layer: one) at a few GFLOP/s;
    # up to this many, one GEMM gives every tap's output and the taps are summed at their shifts instead.
    FEW_OUTPUTS = 4

    def _few_outputs_channels_last(self, padded: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        conv = self.conv
        kernel, dilation = conv.kernel_size[0], conv.dilation[0]
        batch, length, channels = padded.shape
        out_length = length - (kernel - 1) * dilation
        weight = derived(  # [C_in, kernel * C_out], columns ordered (tap, channel)
            self, "_cl_taps_weight", conv.weight, lambda w: w.permute(1, 2, 0).reshape(w.shape[1], -1).contiguous()
        )
        taps = (padded.reshape(-1, channels) @ weight).view(batch, length, kernel, conv.out_channels)
        out = taps[:, :out_length, 0].clone() if residual is None else residual + taps[:, :out_length, 0]
        for tap in range(1, kernel):
            out += taps[:, tap * dilation : tap * dilation + out_length, tap]
        return out if conv.bias is None else out.add_(conv.bias)

    def apply_padded_channels_last(self, padded: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The convolution over inputs [B, T_in, C_in] that already carry their left context (padding or a
        streaming history) -> [B, T_out, C_out], plus ``residual`` when given (``residual`` may be
        overwritten with the result: a kernel-1 convolution accumulates into it)."""
        conv = self.conv
        batch = padded.shape[0]
        if self.amx_weight is not None and padded.device.type == "cpu":
            if residual is not None and not residual.is_contiguous():
                residual = residual.contiguous()
            return amx_kernels.conv(padded, self.amx_weight, conv.dilation[0], conv.bias, residual)
        if conv.kernel_size[0] == 1 and self.stride == 1 and conv.groups == 1:
            # A pointwise convolution is one GEMM; the residual is its accumulator (no extra pass).
            weight = derived(self, "_cl_gemm_weight", conv.weight, lambda w: w[:, :, 0].t().contiguous())
            rows = padded.reshape(-1, conv.in_channels)
            if residual is None:
                out = rows @ weight if conv.bias is None else torch.addmm(conv.bias, rows, weight)
            else:
                out = residual.reshape(-1, conv.out_channels).addmm_(rows, weight)
                if conv.bias is not None:
                    out.add_(conv.bias)
            return out.view(batch, -1, conv.out_channels)
        if conv.out_channels * conv.groups <= self.FEW_OUTPUTS and conv.groups == 1 and self.stride == 1:
            return self._few_outputs_channels_last(padded, residual)
        dilation = conv.dilation[0]
        if (self.stride == 1 and conv.groups == 1
                and dft_conv.takes(padded, conv.weight, dilation, padded.shape[1] - (conv.kernel_size[0] - 1) * dilation)):
            return dft_conv.conv(padded, conv.weight, conv.bias, dilation, residual)
        weight = derived(
            self, "_cl_conv_weight", conv.weight,
            lambda w: w.unsqueeze(2).contiguous(memory_format=torch.channels_last),
        )
        # [B, T, C] viewed as NCHW with H = 1 has channels-last strides, which oneDNN reads in place.
        out = F.conv2d(
            padded.transpose(1, 2).unsqueeze(2), weight, conv.bias,
            stride=(1, self.stride), dilation=(1, conv.dilation[0]), groups=conv.groups,
        )
        out = out.squeeze(2).transpose(1, 2)
        if not out.is_contiguous():  # oneDNN keeps channels-last; this is a guard for other backends
            out = out.contiguous()
        return out if residual is None else out.add_(residual)


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
        self.amx_weight: amx_kernels.AmxWeight | None = None

    def use_amx(self) -> bool:
        """Serve ``forward_channels_last``'s GEMM from AMX tiles where they take the weight (kernel == stride or
        2 * stride, a bfloat16-valued weight, an AMX CPU): packed once, now, the unpacked weight released. Returns
        whether they do."""
        if self.amx_weight is None and self.trim in (0, self.stride) and amx_kernels.takes(self.conv.weight):
            # The GEMM's weight as a convolution over consecutive inputs: tap 0 the earlier input's rows.
            gemm = self._gemm_weight(self.conv.weight.detach()).t()  # [stride * C_out, taps * C_in]
            taps = 2 if self.trim else 1
            self.amx_weight = amx_kernels.pack(gemm.reshape(gemm.shape[0], taps, -1).permute(0, 2, 1))
            release_weight(self.conv, "weight")  # (inputs too short for the tiles: _packed_gemm_weight)
        return self.amx_weight is not None

    # Above this many bytes of float32 weight a GEMM library's blocking beats conv_pairs' jobs, which each read the
    # whole weight (2 Zen 3 threads, 16 x 25 frames: 0.97x at 11.8 MB, 0.65x at 75 MB; 1.07-1.65x at up to 8 MB).
    PAIRS_WEIGHT_BYTES = 8 << 20

    def takes_pairs_kernel(self, hidden: torch.Tensor) -> bool:
        """Whether ``cpu_kernels.conv_pairs`` serves this layer's channels-last path for ``hidden``: kernel
        2 * stride without AMX, float32 on the CPU, the weight at most ``PAIRS_WEIGHT_BYTES``. It activates the
        inputs it reads (SnakeBeta) and reads their pairs in place: no concatenations, and the bias added from its
        sums."""
        weight = self.conv.weight
        return (self.amx_weight is None and self.trim == self.stride and hidden.device.type == "cpu"
                and hidden.dtype == torch.float32 and weight.numel() * 4 <= self.PAIRS_WEIGHT_BYTES
                and cpu_kernels.supports_conv_pairs(weight, self.stride))

    def activates_inputs(self, hidden: torch.Tensor) -> bool:
        """Whether the channels-last path applies a preceding SnakeBeta itself (``snake=``: AMX tiles or
        ``conv_pairs``); a stream's kept input is then the one that came, not activated."""
        return (self.amx_weight is not None and hidden.device.type == "cpu") or self.takes_pairs_kernel(hidden)

    def _pairs_channels_last(self, hidden: torch.Tensor, last: torch.Tensor | None, starting: torch.Tensor | None,
                             snake: tuple[torch.Tensor, torch.Tensor] | None, outputs: int) -> torch.Tensor:
        """``conv_pairs``: [B, outputs * stride, C_out] from ``hidden`` after ``last`` (rows in ``starting``: none)."""
        panels = derived(self, "_cl_pair_panels", self.conv.weight,
                         lambda w: cpu_kernels.pack_linear(self._gemm_weight(w).t()))
        bias = self.conv.bias  # per output sample: repeated for the stride samples of a column block
        bias = (torch.zeros(panels.shape[0] * panels.shape[2]) if bias is None
                else bias.detach().float().repeat(self.stride))
        start = None
        if starting is not None:
            start = torch.zeros(hidden.shape[0], dtype=torch.bool)
            start[starting] = True
        out = cpu_kernels.conv_pairs(hidden, last, start, snake, panels, bias, outputs)
        return out.view(hidden.shape[0], outputs * self.stride, self.conv.out_channels)

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
        channels_last: bool = False,
        snake: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Kernel 2 * stride: new inputs [B, C_in, W] after the previous input ``last`` [B, C_in, 1] ->
        (outputs [B, C_out, W * stride], next ``last``).

        Output block j (``stride`` samples) needs inputs j and j + 1, so a call emits the block that was
        waiting for its first new input, then one block per new input except the last, whose block waits
        for the next call. Rows listed in ``starting`` (index tensor) begin their stream here: they have no
        previous input, and their first block is the one ``forward`` trims, so their inputs move one place
        left and they emit ``stride`` samples fewer (left-aligned; the rest of the row is padding).
        ``channels_last``: hidden [B, W, C_in], last [B, 1, C_in] and outputs [B, W * stride, C_out]; then
        ``snake`` activates the inputs as ``forward_channels_last`` does (``last`` and the next one as they came).
        """
        dim = 1 if channels_last else -1
        if channels_last and self.takes_pairs_kernel(hidden):
            return (self._pairs_channels_last(hidden, last, starting, snake, hidden.shape[1]),
                    _input_at(last, hidden, valid))
        if (channels_last and starting is None and self.amx_weight is not None and hidden.device.type == "cpu"
                and hidden.shape[1] > 0):
            # AMX tiles read ``last`` as the left context (activated as the new inputs are): the inputs are not
            # concatenated (at 16 x 25 frames the small preset's last block copied 65 MB a call for it)
            return self._amx_channels_last(hidden, snake, last), _input_at(last, hidden, valid)
        extended = torch.cat((last, hidden), dim)
        # A copy (``contiguous`` would not copy a one-row batch): starting rows rewrite `extended` below.
        next_last = slide_window(extended, valid, 1, dim=dim).clone()
        if starting is not None:
            extended.narrow(dim, 0, extended.shape[dim] - 1)[starting] = hidden[starting]
        return (self.forward_channels_last(extended, snake) if channels_last else self.forward(extended)), next_last

    # -- channels-last path ---------------------------------------------------------------------------

    def forward_channels_last(self, hidden: torch.Tensor,
                              snake: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """[B, L, C_in] -> [B, output_length(L), C_out]: ``forward`` in the channels-last layout, of
        ``hidden + (sin(hidden alpha) scale)^2`` where ``snake`` = (alpha, scale) per channel (SnakeBeta: the AMX
        kernel activates the rows it reads, never storing them).

        One GEMM whose output rows are already channels-last output samples. Kernel == stride: input i's
        row times the weight gives samples ``i * stride ...``. Kernel == 2 * stride: kept block j needs
        inputs j and j + 1, so the GEMM reads the pair side by side (K = 2 * C_in) and no overlap-add
        pass is needed."""
        batch, length, channels = hidden.shape
        bias = self.conv.bias
        if (self.amx_weight is not None and hidden.device.type == "cpu" and length > self.amx_weight.taps - 1
                and self.trim in (0, self.stride)):
            # (two taps: the pairs of consecutive inputs are read in place, not concatenated)
            return self._amx_channels_last(hidden, snake)
        if self.takes_pairs_kernel(hidden):
            return self._pairs_channels_last(hidden, None, None, snake, max(length - 1, 0))
        if snake is not None:
            alpha, scale = snake
            hidden = hidden + (torch.sin(hidden * alpha) * scale) ** 2
        if self.trim not in (0, self.stride):
            return self.forward(hidden.transpose(1, 2)).transpose(1, 2)
        if self.trim:
            length = max(length - 1, 0)
            hidden = torch.cat((hidden[:, :-1], hidden[:, 1:]), dim=2) if length else hidden[:, :0]
            channels *= 2
        rows = hidden.reshape(-1, channels)
        weight = (derived(self, "_cl_gemm_weight", self.conv.weight, self._gemm_weight) if self.amx_weight is None
                  else derived(self, "_cl_gemm_weight", self.amx_weight.data, self._packed_gemm_weight))
        out = rows @ weight if bias is None else torch.addmm(bias.repeat(self.stride), rows, weight)
        return out.view(batch, length * self.stride, self.conv.out_channels)

    def _amx_channels_last(self, hidden: torch.Tensor, snake: tuple[torch.Tensor, torch.Tensor] | None,
                           left: torch.Tensor | None = None) -> torch.Tensor:
        """``forward_channels_last``'s GEMM on AMX tiles, after ``left`` [B, 1, C_in] (a stream's previous input,
        activated with the new ones) where given."""
        bias = self.conv.bias
        out = amx_kernels.conv(hidden, self.amx_weight, 1, None if bias is None else bias.repeat(self.stride),
                               left=left, snake=snake, snake_left=left is not None)
        return out.view(hidden.shape[0], out.shape[1] * self.stride, self.conv.out_channels)

    def _packed_gemm_weight(self, _: torch.Tensor) -> torch.Tensor:
        """``_gemm_weight`` from the AMX copy (``use_amx`` released the weight), in the layer's dtype: for
        inputs too short for the tiles (a stream's call without new inputs, a one-input two-tap call)."""
        gemm = amx_kernels.unpack(self.amx_weight).permute(0, 2, 1).reshape(self.amx_weight.outputs, -1)
        return gemm.t().to(self.conv.weight.dtype).contiguous()  # (the released weight keeps its dtype)

    def _gemm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """[C_in, C_out, kernel] -> [C_in * taps, stride * C_out], columns ordered (sample, channel); with two
        taps the first C_in rows are the earlier input's (its trailing ``stride`` kernel taps)."""
        channels, stride = weight.shape[0], self.stride
        taps = (weight[:, :, stride:], weight[:, :, :stride]) if self.trim else (weight,)
        return torch.cat([t.permute(0, 2, 1).reshape(channels, -1) for t in taps]).contiguous()

