"""StreamStep: one streaming Code2Wav call's view of the batch (carried histories in, updated ones out, valid
lengths per row), handed down through the vocoder's modules. Its own module so that ``code2wav`` (whose modules
take it) and ``code2wav_stream`` (which builds it) both depend on it and not on each other."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from omnistage.models.layers.conv import CausalConv1d, CausalConvTranspose1d, slide_window


class StreamStep:
    """One streaming call's view of the batch, handed down through the modules.

    Holds the batched histories of every stateful module, collects their updated histories, and tracks
    each row's count of valid positions at the current sample rate (frames, then samples after each
    upsampling).
    """

    def __init__(
        self,
        histories: dict[nn.Module, torch.Tensor],
        frames: Sequence[int],
        new_frames: Sequence[int],
        device: torch.device,
    ) -> None:
        self.histories = histories
        self.updated: dict[nn.Module, torch.Tensor] = {}
        self.device = device
        self.frames = torch.tensor(list(frames), device=device)
        # Each row's count of inputs before this call at the current rate (its one-shot length for ``frames``): a
        # transposed convolution's stream starts at the first call that brings it inputs, which need not be the
        # stream's first call (without pre-upsampling, a first chunk of one frame leaves the second block none).
        self.before = list(frames)
        self._set_lengths(list(new_frames))

    def _set_lengths(self, lengths: list[int]) -> None:
        self.lengths = lengths
        uniform = all(n == lengths[0] for n in lengths)
        self.valid: int | torch.Tensor = lengths[0] if uniform else torch.tensor(lengths, device=self.device)

    # -- transformer ---------------------------------------------------------------------------------------

    def frame_positions(self, width: int) -> torch.Tensor:
        """[B, width] absolute frame positions of this call's (padded) frames."""
        return self.frames[:, None] + torch.arange(width, device=self.device)

    def attention_mask(self, width: int, window: int) -> torch.Tensor:
        """[B, 1, width, window - 1 + width], True = may attend. Keys are the ``window - 1`` carried ones
        then the new ones; query i sits at key index ``window - 1 + i``."""
        history = window - 1
        keys = torch.arange(history + width, device=self.device)
        offset = torch.arange(width, device=self.device)[:, None] + history - keys  # query minus key position
        band = (offset >= 0) & (offset < window)
        exists = keys >= history - self.frames[:, None]  # carried slots before the stream start are empty
        return band[None, None] & exists[:, None, None, :]

    def extend(self, key: nn.Module, new: torch.Tensor, dim: int) -> torch.Tensor:
        """History of ``key`` followed by ``new`` along ``dim``; keeps the window ending at each row's
        last valid position as the next history."""
        history = self.histories[key]
        extended = torch.cat((history, new), dim)
        self.updated[key] = slide_window(extended, self.valid, history.shape[dim], dim)
        return extended

    # -- convolutions --------------------------------------------------------------------------------------

    def conv(self, conv: CausalConv1d, x: torch.Tensor) -> torch.Tensor:
        out, self.updated[conv] = conv.forward_stream(x, self.histories[conv], self.valid)
        return out

    def conv_transpose(self, conv: CausalConvTranspose1d, x: torch.Tensor, channels_last: bool = False,
                       snake: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``channels_last``: x and the result are [B, T, C] signals (the state keeps its [C, history] layout), and
        ``snake`` activates the inputs (``CausalConvTranspose1d.forward_channels_last``; the state keeps them as
        they came)."""
        starts = [before == 0 and n > 0 for before, n in zip(self.before, self.lengths)]
        if conv.history_size == 0:
            out = conv.forward_channels_last(x, snake) if channels_last else conv(x)
        else:
            history = self.histories[conv]
            rows = [b for b, start in enumerate(starts) if start]
            out, last = conv.forward_stream(
                x, history.transpose(1, 2) if channels_last else history, self.valid,
                torch.tensor(rows, device=self.device) if rows else None, channels_last=channels_last, snake=snake,
            )
            self.updated[conv] = last.transpose(1, 2) if channels_last else last
        self._set_lengths([conv.stream_output_length(n, s) for n, s in zip(self.lengths, starts)])
        self.before = [conv.output_length(before) for before in self.before]
        return out

    # -- channels-last convolutions ([B, T, C] signals; the state keeps its [C, history] layout) --------

    def history_channels_last(self, conv: CausalConv1d) -> torch.Tensor:
        """[B, history_size, C_in]: ``conv``'s carried inputs, copied out of the state rows (a few numbers per
        channel; a transposed view of that copy)."""
        return self.histories[conv].contiguous().transpose(1, 2)

    def keep_channels_last(self, conv: CausalConv1d, extended: torch.Tensor) -> None:
        """Next history of ``conv`` from its inputs [B, history_size + W, C_in] (history then new); a copy,
        so the large ``extended`` is freed (and its memory reused) as soon as the convolution is done."""
        kept = slide_window(extended, self.valid, conv.history_size, dim=1)
        self.updated[conv] = (kept.clone() if isinstance(self.valid, int) else kept).transpose(1, 2)

    def keep(self, conv: CausalConv1d, kept: torch.Tensor) -> None:
        """``conv``'s next history from its kept inputs [B, history_size, C_in] (made by the caller)."""
        self.updated[conv] = kept.transpose(1, 2)

    def keep_activated_channels_last(self, conv: CausalConv1d, history: torch.Tensor, x: torch.Tensor,
                                     snake: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        """``keep_channels_last`` for inputs that were never stored: the history [B, H, C_in] followed by
        ``snake(x)`` (x [B, W, C_in]); only the H kept rows of each are gathered and activated."""
        size = conv.history_size
        batch, _, channels = x.shape
        idx = torch.as_tensor(self.valid, device=x.device).reshape(-1, 1).expand(batch, 1) + torch.arange(
            size, device=x.device)  # [B, H]: the kept rows' places in history + new
        new = x.gather(1, (idx - size).clamp(min=0)[..., None].expand(-1, -1, channels))
        old = history.gather(1, idx.clamp(max=size - 1)[..., None].expand(-1, -1, channels))
        self.keep(conv, torch.where((idx >= size)[..., None], new if snake is None else snake(new), old))
