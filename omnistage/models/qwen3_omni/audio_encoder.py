"""Qwen3-Omni audio encoder (``thinker.audio_tower.*``) over a batch of clips.

Per clip: log-mel frames are cut into chunks of ``2 * n_window`` (100) frames; every chunk is zero-padded to
``pad_frames`` (transformers pads to the longest chunk among the clips it encodes together, which for one
request is 100 unless all of its clips are shorter; the padding changes the last outputs of a short chunk,
because the first convolution turns padded zeros into GELU(bias) that the next convolutions read); three
stride-2 3x3 convolutions with GELU; a linear projection; sinusoidal positions restarting at 0 in every
chunk; then the valid rows of all chunks of the clip are concatenated and go through transformer layers that
attend bidirectionally within windows of ``chunk_rows * (n_window_infer // (2 * n_window))`` rows; finally
ln_post -> proj1 -> GELU -> proj2.

Clips of different requests are encoded in one call: each clip carries its own chunk padding, so a clip's
output does not depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from omnistage.models.layers.mlp import activation
from omnistage.models.layers.segment_attention import segment_attention


def conv_out_length(frames: int) -> int:
    """Rows one chunk of ``frames`` frames yields after the three stride-2 convolutions."""
    for _ in range(3):
        frames = (frames - 1) // 2 + 1
    return frames


def audio_token_count(frames: int, n_window: int = 50) -> int:
    """Placeholder count of a clip of ``frames`` mel frames (transformers' ``_get_feat_extract_output_lengths``)."""
    chunk = 2 * n_window
    tail = conv_out_length(frames % chunk) if frames % chunk else 0
    return tail + (frames // chunk) * conv_out_length(chunk)


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    if channels % 2:
        raise ValueError(f"sinusoidal positions need an even width, got {channels}")
    increment = np.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-increment * torch.arange(channels // 2).float())
    scaled = torch.arange(length)[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)


class AudioAttention(nn.Module):
    """Bidirectional attention within segments (q/k/v/out projections; Qwen2.5-Omni's k has no bias)."""

    def __init__(self, dim: int, heads: int, k_bias: bool = True) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"audio d_model {dim} must divide by {heads} heads")
        self.heads, self.head_dim = heads, dim // heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim, bias=k_bias)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, windows: Sequence[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (p(x).view(n, self.heads, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = segment_attention(q, k, v, windows, self.head_dim**-0.5)
        return self.out_proj(out.reshape(n, -1))


class AudioLayer(nn.Module):
    """Pre-norm transformer layer of both families' audio towers."""

    def __init__(self, dim: int, heads: int, ffn: int, k_bias: bool = True, act: str = "gelu") -> None:
        super().__init__()
        self.act = activation(act)
        self.self_attn = AudioAttention(dim, heads, k_bias)
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, ffn)
        self.fc2 = nn.Linear(ffn, dim)
        self.final_layer_norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, windows: Sequence[int]) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), windows)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    """Built from ``thinker_config.audio_config``; state-dict names equal the checkpoint's minus
    ``thinker.audio_tower.``."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.act = activation(cfg.activation_function)  # the layers' and the output projection's (convs: GELU)
        # ``scale_embedding``: transformers' tower computes an embedding scale from it and never applies it.
        self.n_window = int(cfg.n_window)
        self.window_ratio = int(cfg.n_window_infer) // (2 * self.n_window)
        if self.window_ratio < 1:
            raise ValueError(f"n_window_infer {cfg.n_window_infer} must be at least 2 * n_window = {2 * self.n_window}")
        dim, mel, ds = cfg.d_model, cfg.num_mel_bins, cfg.downsample_hidden_size
        self.num_mel_bins = mel
        self.conv2d1 = nn.Conv2d(1, ds, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(ds, ds, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(ds, ds, 3, 2, padding=1)
        self.conv_out = nn.Linear(ds * conv_out_length(mel), dim, bias=False)
        self.positional_embedding = nn.Buffer(sinusoids(cfg.max_source_positions, dim), persistent=False)
        self.layers = nn.ModuleList(
            AudioLayer(dim, cfg.encoder_attention_heads, cfg.encoder_ffn_dim, act=cfg.activation_function)
            for _ in range(cfg.encoder_layers)
        )
        self.ln_post = nn.LayerNorm(dim)
        self.proj1 = nn.Linear(dim, dim)
        self.proj2 = nn.Linear(dim, cfg.output_dim)

    @property
    def chunk_frames(self) -> int:
        return 2 * self.n_window

    def _chunk_rows(self, chunks: torch.Tensor) -> torch.Tensor:
        """[n, mel, L] zero-padded chunks -> [n, rows(L), d_model] (convolutions, projection, positions)."""
        h = F.gelu(self.conv2d1(chunks.unsqueeze(1)))
        h = F.gelu(self.conv2d2(h))
        h = F.gelu(self.conv2d3(h))
        n, c, f, t = h.shape
        h = self.conv_out(h.permute(0, 3, 1, 2).reshape(n, t, c * f))
        return h + self.positional_embedding[:t].to(h.dtype)

    def forward(self, features: Sequence[torch.Tensor], pad_frames: Sequence[int]) -> list[torch.Tensor]:
        """features[i]: [mel, frames_i]; pad_frames[i]: the length clip i's chunks are padded to.

        Returns one [audio_token_count(frames_i), output_dim] tensor per clip.
        """
        if len(features) != len(pad_frames):
            raise ValueError("one pad length per clip")
        step = self.chunk_frames
        # (clip, start, frames) per chunk, grouped by pad length: one convolution batch per length.
        groups: dict[int, list[tuple[int, int, int]]] = {}
        for i, (feat, pad) in enumerate(zip(features, pad_frames)):
            total = feat.shape[-1]
            if feat.dim() != 2 or feat.shape[0] != self.num_mel_bins or total == 0:
                raise ValueError(f"clip {i}: expected [{self.num_mel_bins}, frames>0] features, got {tuple(feat.shape)}")
            for s in range(0, total, step):
                n = min(step, total - s)
                if n > pad:
                    raise ValueError(f"clip {i}: a {n}-frame chunk cannot be padded to {pad} frames")
                groups.setdefault(int(pad), []).append((i, s, n))
        pieces: list[list[tuple[int, torch.Tensor]]] = [[] for _ in features]
        for pad, chunks in groups.items():
            batch = features[chunks[0][0]].new_zeros(len(chunks), self.num_mel_bins, pad)
            for b, (i, s, n) in enumerate(chunks):
                batch[b, :, :n] = features[i][:, s : s + n]
            rows = self._chunk_rows(batch.to(self.conv2d1.weight.dtype))
            for b, (i, s, n) in enumerate(chunks):
                pieces[i].append((s, rows[b, : conv_out_length(n)]))
        clips = [torch.cat([r for _, r in sorted(p, key=lambda x: x[0])]) for p in pieces]
        windows: list[int] = []
        for clip, pad in zip(clips, pad_frames):
            width = conv_out_length(min(int(pad), step)) * self.window_ratio
            full, rest = divmod(clip.shape[0], width)
            windows += [width] * full + ([rest] if rest else [])
        h = torch.cat(clips)
        for layer in self.layers:
            h = layer(h, windows)
        h = self.proj2(self.act(self.proj1(self.ln_post(h))))
        return list(h.split([c.shape[0] for c in clips]))
