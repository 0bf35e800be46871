"""Qwen2.5-Omni audio encoder (``thinker.audio_tower.*``) over a batch of clips.

Per clip: log-mel frames are cut into chunks of ``2 * n_window`` frames (200 in the released model); each chunk
goes through conv1 (kernel 3, stride 1) + GELU, is masked past its own length, then conv2 (kernel 3, stride 2)
+ GELU, and gets sinusoidal positions restarting at 0. Transformer layers attend bidirectionally within each
chunk (Qwen3-Omni's layers, with an unbiased key projection). The rows of a clip are then average-pooled in pairs (an odd last row is dropped), layer-normed and
projected to the Thinker's width: ``((frames - 1) // 2 + 1 - 2) // 2 + 1`` rows per clip.

Because conv1's output is masked before conv2 reads it, a chunk's valid rows do not depend on how far it is
padded: chunks of every clip in a call are padded to the longest one and convolved together, and each clip's
output is what it would be alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.models.qwen3_omni.audio_encoder import AudioLayer, sinusoids


def conv_rows(frames: int) -> int:
    """Rows a chunk (or a clip) of ``frames`` frames has after the stride-2 convolution."""
    return (frames - 1) // 2 + 1


def audio_token_count(frames: int) -> int:
    """Placeholder count of a clip of ``frames`` mel frames (``_get_feat_extract_output_lengths``)."""
    return (conv_rows(frames) - 2) // 2 + 1


class AudioEncoder(nn.Module):
    """Built from ``thinker_config.audio_config``; state-dict names equal the checkpoint's minus
    ``thinker.audio_tower.``. Same call as Qwen3-Omni's tower (the encoder cache drives both)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        dim, mel = int(cfg.d_model), int(cfg.num_mel_bins)
        self.num_mel_bins = mel
        self.chunk_frames = 2 * int(cfg.n_window)
        self.conv1 = nn.Conv1d(mel, dim, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(dim, dim, kernel_size=3, stride=2, padding=1)
        self.positional_embedding = nn.Buffer(sinusoids(cfg.max_source_positions, dim), persistent=False)
        # Stored in the checkpoint; transformers' forward does not read it either.
        self.audio_bos_eos_token = nn.Embedding(2, cfg.output_dim)
        self.layers = nn.ModuleList(
            AudioLayer(dim, cfg.encoder_attention_heads, cfg.encoder_ffn_dim, k_bias=False, act=cfg.activation_function)
            for _ in range(cfg.encoder_layers)
        )
        self.ln_post = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, cfg.output_dim)

    def forward(self, features: Sequence[torch.Tensor], pad_frames: Sequence[int] | None = None) -> list[torch.Tensor]:
        """features[i]: [mel, frames_i] -> one [audio_token_count(frames_i), output_dim] tensor per clip.

        ``pad_frames`` (Qwen3-Omni's chunk padding) does not change this tower's output and is ignored.
        """
        step = self.chunk_frames
        chunks: list[tuple[int, int, int]] = []  # (clip, first frame, frames)
        for i, feat in enumerate(features):
            total = feat.shape[-1]
            if feat.dim() != 2 or feat.shape[0] != self.num_mel_bins or total == 0:
                raise ValueError(f"clip {i}: expected [{self.num_mel_bins}, frames>0] features, got {tuple(feat.shape)}")
            chunks += [(i, s, min(step, total - s)) for s in range(0, total, step)]
        width = max(n for _, _, n in chunks)
        dtype = self.conv1.weight.dtype
        batch = features[0].new_zeros(len(chunks), self.num_mel_bins, width, dtype=dtype)
        for b, (i, s, n) in enumerate(chunks):
            batch[b, :, :n] = features[i][:, s : s + n]
        lengths = torch.tensor([n for _, _, n in chunks], device=batch.device)
        valid = (torch.arange(width, device=batch.device) < lengths[:, None]).unsqueeze(1).to(dtype)
        h = F.gelu(self.conv1(batch)) * valid
        h = F.gelu(self.conv2(h)).transpose(1, 2)
        h = h + self.positional_embedding[: h.shape[1]].to(h.dtype)
        windows = [conv_rows(n) for _, _, n in chunks]
        x = torch.cat([h[b, :w] for b, w in enumerate(windows)])  # chunks in clip order, then frame order
        for layer in self.layers:
            x = layer(x, windows)
        # Pairs of rows per clip (clip rows are contiguous: its chunks are consecutive).
        per_clip = [conv_rows(f.shape[-1]) for f in features]
        outs = []
        for rows in x.split(per_clip):
            n = rows.shape[0] // 2  # audio_token_count: ((rows - 2) // 2 + 1)
            pairs = rows[: 2 * n].view(n, 2, rows.shape[1])
            outs.append((pairs[:, 0] + pairs[:, 1]) / 2)
        return list(self.proj(self.ln_post(torch.cat(outs))).split([o.shape[0] for o in outs]))
