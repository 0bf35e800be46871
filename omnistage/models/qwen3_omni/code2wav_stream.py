"""Stateful streaming Code2Wav: each request's codec frames decoded chunk by chunk, with no recomputed
context, batched across requests at different positions, and output equal to one-shot decoding.

Why the result equals one-shot decoding
    The network is causal end to end (see ``code2wav``), so one-shot output sample ``t`` is a function of
    the frames that precede it and of a bounded window of each layer's earlier inputs. A streaming call runs
    the same modules on the new frames only, and gives every windowed operator exactly the earlier inputs
    the one-shot pass would have shown it, carried over from the previous call:

    - attention: the sliding window lets a frame see itself and the ``window - 1`` frames before it, so
      the keys/values of the last ``window - 1`` frames are kept (keys rotated at their own absolute
      positions) and prepended; rotary positions continue from the request's frame count. Slots for
      positions before the stream start are masked out, as the one-shot causal mask does.
    - causal convolutions (stride 1, kernel k, dilation d: the ConvNeXt depthwise convolutions, the
      dilated residual-unit convolutions, the first and last convolutions): the last ``(k - 1) * d``
      inputs are kept and prepended; at the start of a stream they are zeros, the zeros ``forward`` pads
      with. Kernel-1 convolutions need nothing.
    - transposed convolutions with kernel ``2 * stride`` (one per decoder block): output block j needs
      inputs j and j + 1. The last input is kept; a call recomputes, from it and the first new input, the
      block that was pending (the overlap that needed the next frame), then the blocks of the new inputs
      except the last one, which waits for the next call. At the start of the layer's stream (the first
      call that brings it inputs: without pre-upsampling, a first chunk of one frame leaves the second block
      none) the first block is the one ``forward`` trims, so that row emits ``stride`` samples fewer.
      (Keeping the input rather than the pending overlap samples is smaller, ``in_channels`` vs
      ``out_channels * stride`` numbers, and computes each block in one piece as ``forward`` does.)
      Kernel == stride needs nothing.
    - everything else (embedding, norms, MLPs, SnakeBeta, clamp) is per position.

    Hence the concatenated stream is one-shot decoding of all frames, sample for sample and of the same
    length ``samples_for_frames(T)``: a call after ``p`` frames that brings ``n`` more returns
    ``samples_for_frames(p + n) - samples_for_frames(p)`` samples. Nothing needs flushing at the end: the
    last ``k`` samples (555 for the real model) need a frame that never comes, in one-shot decoding too.
    Differences to one-shot are float rounding only (other GEMM shapes, other softmax sums).
    transformers' ``chunked_decode`` (300-frame chunks, 25 frames of recomputed context) differs from
    one-shot decoding after frame 300 because the receptive field is longer than 25 frames; this stream
    does not.

Batching
    One call decodes one chunk for each of B requests, right-padded to the longest chunk: every module
    runs once over the batch (on CPU once per tile of rows, ``Code2Wav.cpu_tile_samples`` output samples
    each, like ``Code2Wav.decode``; small chunks put all rows in one tile). Causality keeps padding out of valid
    samples. Each row's next history is cut at its own last valid input (a gather when rows differ), so
    padding never enters a state; rows with no new frames get their state back unchanged. Rows whose inputs
    start a layer's stream shift their transposed-convolution inputs one place left (one indexed copy per decoder
    block). A call costs its new frames plus the carried window (71 frames of keys/values, a few inputs
    per convolution) plus one read of the weights, which batching shares across requests.

State layout (``Code2WavStreamState``)
    ``frames``: frames decoded so far (the next frame's rotary position). ``buffer``: one 1-D tensor in the
    model's dtype and device, the concatenation of ``Code2WavStreamer.slots`` in order, each flattened:
    per transformer layer the keys then the values ``[kv_heads, window - 1, head_dim]`` (oldest first);
    per causal convolution with history its last inputs ``[in_channels, (k - 1) * d]``; per transposed
    convolution with kernel ``2 * stride`` its last input ``[in_channels, 1]``. A new state is zeros.
    One flat buffer per request makes the batch's states one ``stack`` in and one [B, size] tensor out.
    The states a call returns are rows of that tensor (views), so a state kept alone holds the whole
    batch's buffer until its siblings move on; clone it to detach it. Real model: 1.30M numbers per request
    (5.2 MB in float32), 90% of them attention keys/values.

Calls are functional: input states are never modified, so a failed batch can be retried with the same
states.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from omnistage.models.layers.conv import CausalConv1d, CausalConvTranspose1d
from omnistage.models.qwen3_omni.code2wav import Attention, Code2Wav
from omnistage.models.qwen3_omni.stream_step import StreamStep


@dataclass(frozen=True)
class Code2WavStreamState:
    """One request's carried state (see the module docstring for the layout)."""

    frames: int
    buffer: torch.Tensor

    def __post_init__(self) -> None:
        if self.frames < 0:
            raise ValueError(f"frames must be >= 0, got {self.frames}")
        if self.buffer.dim() != 1:
            raise ValueError(f"buffer must be 1-D, got shape {tuple(self.buffer.shape)}")


@dataclass(frozen=True)
class StreamSlot:
    """Where one module's carried tensor lives in a state buffer."""

    name: str
    module: nn.Module
    shape: tuple[int, ...]
    offset: int

    @property
    def size(self) -> int:
        return int(torch.Size(self.shape).numel())


@dataclass(frozen=True)
class Code2WavStreamOutput:
    """wave [B, S_max] (zero past each row's end), wave_lengths [B], and each request's next state."""

    wave: torch.Tensor
    wave_lengths: torch.Tensor
    states: tuple[Code2WavStreamState, ...]


class Code2WavStreamer:
    """Streaming decoder over a loaded ``Code2Wav`` (shares its weights; holds no request state)."""

    def __init__(self, model: Code2Wav) -> None:
        window = model.config.sliding_window
        if window is None:
            raise ValueError("streaming needs a sliding attention window (full causal attention has no bound)")
        self.model = model
        slots: list[StreamSlot] = []
        offset = 0
        for name, module in model.named_modules():
            if isinstance(module, Attention):
                shape = (module.num_kv_heads, window - 1, module.head_dim)
                carried = [(f"{name}.k_proj", module.k_proj, shape), (f"{name}.v_proj", module.v_proj, shape)]
            elif isinstance(module, (CausalConv1d, CausalConvTranspose1d)) and module.history_size:
                carried = [(name, module, (module.conv.in_channels, module.history_size))]
            else:
                continue
            for slot_name, key, slot_shape in carried:
                slots.append(StreamSlot(slot_name, key, slot_shape, offset))
                offset += slots[-1].size
        self.slots = tuple(slots)
        self.state_size = offset

    @property
    def _weight(self) -> torch.Tensor:
        return self.model.code_embedding.weight

    @staticmethod
    def _view(buffers: torch.Tensor, slot: StreamSlot) -> torch.Tensor:
        """[B, *slot.shape] view of one slot in a batch of state buffers [B, state_size]."""
        return buffers[:, slot.offset : slot.offset + slot.size].view(buffers.shape[0], *slot.shape)

    def initial_state(self) -> Code2WavStreamState:
        return Code2WavStreamState(
            0, torch.zeros(self.state_size, dtype=self._weight.dtype, device=self._weight.device)
        )

    def _check_state(self, state: Code2WavStreamState | None) -> Code2WavStreamState:
        if state is None:
            return self.initial_state()
        buffer = state.buffer
        if buffer.shape != (self.state_size,) or buffer.dtype != self._weight.dtype:
            raise ValueError(
                f"state buffer must be [{self.state_size}] {self._weight.dtype}, got "
                f"{tuple(buffer.shape)} {buffer.dtype}"
            )
        if buffer.device != self._weight.device:
            raise ValueError(f"state buffer is on {buffer.device}, the model on {self._weight.device}")
        return state

    def decode(
        self,
        codes: torch.Tensor,
        lengths: torch.Tensor | Sequence[int],
        states: Sequence[Code2WavStreamState | None],
    ) -> Code2WavStreamOutput:
        """Decode the next chunk of each of B requests in one batched pass.

        codes [B, Q, W]: row b's new frames in its first ``lengths[b]`` columns (0 allowed; the rest is
        padding, any value). ``states[b]``: the state the previous call returned for that request, or None
        on its first chunk. Returns the new samples of each request, left-aligned, their counts
        ``samples_for_frames(frames + lengths) - samples_for_frames(frames)``, and the next states.
        """
        model = self.model
        model._check_codes_shape_only(codes)
        batch = codes.shape[0]
        counts = [int(n) for n in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
        if len(counts) != batch or len(states) != batch:
            raise ValueError(f"need one length and one state per row: {batch} rows, {len(counts)} lengths, "
                             f"{len(states)} states")
        if any(n < 0 or n > codes.shape[-1] for n in counts):
            raise ValueError(f"lengths must lie in [0, {codes.shape[-1]}], got {counts}")
        checked = [self._check_state(s) for s in states]
        device = self._weight.device
        width = max(counts, default=0)
        if width == 0:
            empty = torch.zeros((batch, 0), dtype=self._weight.dtype, device=device)
            return Code2WavStreamOutput(empty, torch.zeros(batch, dtype=torch.long, device=device), tuple(checked))

        codes = model._fill_padding(codes[..., :width].to(device), torch.tensor(counts, device=device))
        frames = [s.frames for s in checked]
        stacked = torch.stack([s.buffer for s in checked])
        packed = torch.empty_like(stacked)
        sizes = [model.samples_for_frames(p + n) - model.samples_for_frames(p) for p, n in zip(frames, counts)]
        wave = stacked.new_empty((batch, max(sizes)))
        # Rows are independent: on CPU, tiles of rows sized for the decoder's kernels (as Code2Wav.decode does).
        tile = batch if codes.is_cuda else max(1, model.cpu_tile_samples // (width * model.samples_per_frame))
        with torch.no_grad():
            for start in range(0, batch, tile):
                rows = slice(start, start + tile)
                self._decode_rows(codes[rows], frames[rows], counts[rows], stacked[rows], packed[rows], wave[rows])
        next_states = tuple(
            Code2WavStreamState(s.frames + n, buffer) for s, n, buffer in zip(checked, counts, packed.unbind(0))
        )
        wave_lengths = torch.tensor(sizes, device=device)
        return Code2WavStreamOutput(wave, wave_lengths, next_states)

    def _decode_rows(
        self,
        codes: torch.Tensor,
        frames: list[int],
        counts: list[int],
        states: torch.Tensor,
        next_states: torch.Tensor,
        wave: torch.Tensor,
    ) -> None:
        """One batched pass over some rows: fills their next state buffers and their wave rows."""
        width = max(counts)
        if width == 0:
            next_states.copy_(states)
            wave.zero_()
            return
        step = StreamStep({slot.module: self._view(states, slot) for slot in self.slots}, frames, counts,
                          codes.device)
        out = self.model._synthesize(codes[..., :width], step)[:, 0]
        for slot in self.slots:
            self._view(next_states, slot).copy_(step.updated[slot.module])
        out = out[:, : wave.shape[-1]]
        lengths = torch.tensor(step.lengths, device=out.device)
        valid = torch.arange(out.shape[-1], device=out.device)[None, :] < lengths[:, None]
        torch.mul(out, valid, out=wave[:, : out.shape[-1]])
        wave[:, out.shape[-1] :] = 0
