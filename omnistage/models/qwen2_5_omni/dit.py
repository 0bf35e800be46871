"""Qwen2.5-Omni Token2Wav, part 1: the flow-matching DiT that turns codec tokens into a mel spectrogram.

Names follow the checkpoint under ``token2wav.code2wav_dit_model.``. The network, as transformers runs it:
- codes -> ``text_embed.codec_embed`` -> repeated ``repeats`` times along time (2 mel frames per code);
- ``input_embed.proj`` of [noisy mel x_t, speaker features ``spk_encoder(ref_mel)`` (ECAPA-TDNN), code
  embedding, speaker ``cond``], each per mel frame;
- ``transformer_blocks``: AdaLayerNorm-Zero modulated by the time embedding, attention over *blocks* of
  ``block_size`` mel frames (a layer sees its own block, plus one block back if listed in
  ``look_backward_layers``, plus one block ahead if listed in ``look_ahead_layers``; computed block by block,
  not as a masked T x T attention), rotary on the first head
  only (interleaved layout), GELU(tanh) MLP;
- ``norm_out`` + ``proj_out`` -> velocity [T, mel_dim].
Sampling integrates dx/dt from x_0 = noise over a swayed time grid with RK4 (3/8 rule), with classifier-free
guidance: every evaluation runs a conditioned and an unconditioned copy (speaker features, cond and codes
zeroed) and returns ``g + (g - u) * guidance_scale``.

Batching: windows of the same length run as one batch ([B, T, mel]); requests never share attention. The
speaker-dependent inputs do not change during the ODE, so their projection is computed once per decode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.models.layers.fast_linear import pack_amx_layers
from omnistage.models.layers.rotary import (
    RotaryEmbedding,
    apply_rotary,
    length_scaling,
    rope_frequencies,
    rope_theta,
)

_TIME_FREQ_DIM = 256
_TIME_SCALE = 1000.0


@dataclass(frozen=True)
class ODEConfig:
    """transformers' defaults for ``Qwen2_5OmniToken2WavModel.forward``."""

    num_steps: int = 10
    guidance_scale: float = 0.5
    sway_coefficient: float | None = -1.0

    def __post_init__(self) -> None:
        if self.num_steps < 2:
            raise ValueError(f"num_steps must be >= 2, got {self.num_steps}")

    def time_points(self, device: torch.device | str = "cpu") -> torch.Tensor:
        t = torch.linspace(0, 1, self.num_steps, device=device, dtype=torch.float32)
        if self.sway_coefficient is not None:
            t += self.sway_coefficient * (torch.cos(torch.pi / 2 * t) - 1 + t)
        return t


# ---- ECAPA-TDNN speaker encoder (run once per speaker) -----------------------------------------------------
class TimeDelayNetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation, padding="same", padding_mode="reflect")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class Res2NetBlock(nn.Module):
    def __init__(self, channels: int, scale: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.scale = scale
        width = channels // scale
        self.blocks = nn.ModuleList(TimeDelayNetBlock(width, width, kernel, dilation) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = list(torch.chunk(x, self.scale, dim=1))
        out = [parts[0]]
        prev = None
        for block, part in zip(self.blocks, parts[1:]):
            prev = block(part if prev is None else part + prev)
            out.append(prev)
        return torch.cat(out, dim=1)


def _pointwise(cin: int, cout: int) -> nn.Conv1d:
    return nn.Conv1d(cin, cout, 1, padding="same", padding_mode="reflect")


class SqueezeExcitationBlock(nn.Module):
    def __init__(self, channels: int, se_channels: int) -> None:
        super().__init__()
        self.conv1 = _pointwise(channels, se_channels)
        self.conv2 = _pointwise(se_channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * s


class SERes2NetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, scale: int, se_channels: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.tdnn1 = TimeDelayNetBlock(cin, cout, 1, 1)
        self.res2net_block = Res2NetBlock(cout, scale, kernel, dilation)
        self.tdnn2 = TimeDelayNetBlock(cout, cout, 1, 1)
        self.se_block = SqueezeExcitationBlock(cout, se_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x)))) + x


class AttentiveStatisticsPooling(nn.Module):
    _EPS = 1e-12

    def __init__(self, channels: int, attention_channels: int) -> None:
        super().__init__()
        self.tdnn = TimeDelayNetBlock(channels * 3, attention_channels, 1, 1)
        self.conv = _pointwise(attention_channels, channels)

    @classmethod
    def _stats(cls, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = (w * x).sum(2)
        std = torch.sqrt((w * (x - mean.unsqueeze(2)).pow(2)).sum(2).clamp(cls._EPS))
        return mean, std

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, C, T] -> [B, 2C, 1] (attention-weighted mean and std over time)."""
        t = x.shape[-1]
        uniform = x.new_full((x.shape[0], 1, t), 1.0 / t)
        mean, std = self._stats(x, uniform)
        ctx = torch.cat((x, mean.unsqueeze(2).expand(-1, -1, t), std.unsqueeze(2).expand(-1, -1, t)), dim=1)
        attn = F.softmax(self.conv(torch.tanh(self.tdnn(ctx))), dim=2)
        mean, std = self._stats(x, attn)
        return torch.cat((mean, std), dim=1).unsqueeze(2)


class SpeakerEncoder(nn.Module):
    """ECAPA-TDNN: reference mel [B, T, mel] -> speaker features [B, enc_dim]."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        ch, ks, dil = list(cfg.enc_channels), list(cfg.enc_kernel_sizes), list(cfg.enc_dilations)
        if not len(ch) == len(ks) == len(dil):
            raise ValueError("enc_channels, enc_kernel_sizes and enc_dilations must have the same length")
        self.blocks = nn.ModuleList([TimeDelayNetBlock(cfg.mel_dim, ch[0], ks[0], dil[0])])
        for i in range(1, len(ch) - 1):
            self.blocks.append(
                SERes2NetBlock(ch[i - 1], ch[i], cfg.enc_res2net_scale, cfg.enc_se_channels, ks[i], dil[i])
            )
        self.mfa = TimeDelayNetBlock(ch[-1], ch[-1], ks[-1], dil[-1])
        self.asp = AttentiveStatisticsPooling(ch[-1], cfg.enc_attention_channels)
        self.fc = _pointwise(ch[-1] * 2, cfg.enc_dim)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        h = mel.transpose(1, 2)
        outs = []
        for block in self.blocks:
            h = block(h)
            outs.append(h)
        h = self.mfa(torch.cat(outs[1:], dim=1))
        return self.fc(self.asp(h)).squeeze(-1)


# ---- DiT ----------------------------------------------------------------------------------------------------
class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.time_mlp = nn.ModuleList([nn.Linear(_TIME_FREQ_DIM, dim), nn.SiLU(), nn.Linear(dim, dim)])

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """t: [B] in [0, 1] -> [B, dim]."""
        half = _TIME_FREQ_DIM // 2
        step = math.log(10000) / (half - 1)
        freqs = torch.exp(torch.arange(half, device=t.device).float() * -step)
        arg = _TIME_SCALE * t.unsqueeze(1) * freqs.unsqueeze(0)
        h = torch.cat((arg.sin(), arg.cos()), dim=-1).type_as(t)
        for layer in self.time_mlp:
            h = layer(h)
        return h


class CodecEmbedding(nn.Module):
    def __init__(self, num_embeds: int, dim: int, repeats: int) -> None:
        super().__init__()
        self.repeats = repeats
        self.codec_embed = nn.Embedding(num_embeds + 1, dim)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, N] -> [B, N * repeats, dim]."""
        return torch.repeat_interleave(self.codec_embed(codes), self.repeats, dim=1)


class ColumnSplitLinear(nn.Linear):
    """An ``nn.Linear`` whose weight is read in column blocks (``InputEmbedding``): not a plain ``nn.Linear``, so
    the ``fast`` kernels never pack (and release) its weight."""


class InputEmbedding(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.mel_dim = cfg.mel_dim
        self.proj = ColumnSplitLinear(cfg.mel_dim + cfg.enc_dim + cfg.enc_emb_dim + cfg.emb_dim, cfg.hidden_size)
        self.spk_encoder = SpeakerEncoder(cfg)

    def constant_part(self, spk: torch.Tensor, code: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """proj's contribution of everything but x_t (+ bias): spk [B, enc_dim], code [B, T, emb], cond
        [B, enc_emb_dim] -> [B, T, hidden]. Constant over the ODE."""
        t = code.shape[1]
        w = self.proj.weight[:, self.mel_dim :]
        rest = torch.cat((spk.unsqueeze(1).expand(-1, t, -1), code, cond.unsqueeze(1).expand(-1, t, -1)), dim=-1)
        return F.linear(rest, w, self.proj.bias)

    def forward(self, x: torch.Tensor, constant: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.proj.weight[:, : self.mel_dim]) + constant


class AdaLayerNormZero(nn.Module):
    def __init__(self, dim: int, chunks: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim * chunks)
        self.chunks = chunks

    def modulation(self, t_emb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.chunk(self.linear(F.silu(t_emb)), self.chunks, dim=1)


def _norm(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], eps=1e-6)


class DiTAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(hidden, inner)
        self.to_k = nn.Linear(hidden, inner)
        self.to_v = nn.Linear(hidden, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, hidden), nn.Identity()])  # [1] was dropout

    @staticmethod
    def _rotate_first_head(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # Only head 0 is rotated (as trained); its dims are interleaved pairs, regrouped into halves first.
        head0 = x[:, :1]
        head0 = torch.cat((head0[..., 0::2], head0[..., 1::2]), dim=-1)
        return torch.cat((apply_rotary(head0.transpose(1, 2), cos, sin).transpose(1, 2), x[:, 1:]), dim=1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, blocks: BlockSpan) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.heads, self.head_dim).transpose(1, 2) for p in (self.to_q, self.to_k, self.to_v))
        q = self._rotate_first_head(q, cos, sin)
        k = self._rotate_first_head(k, cos, sin)
        out = block_attention(q, k, v, blocks)
        return self.to_out[0](out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


@dataclass(frozen=True)
class BlockSpan:
    """Which frames a layer's queries see: their own block of ``size`` frames, ``back`` blocks before it and
    ``ahead`` after it (the reference's mask ``-back <= key block - query block <= ahead``), in a window of
    ``frames`` frames; ``valid`` [blocks, slots] marks the key slots that hold a frame (None: all do)."""

    size: int
    back: int
    ahead: int
    frames: int
    valid: torch.Tensor | None

    @classmethod
    def of(cls, size: int, back: int, ahead: int, frames: int, device: torch.device) -> BlockSpan:
        n = -(-frames // size)
        offsets = torch.arange(-back, ahead + 1, device=device)
        first = (torch.arange(n, device=device)[:, None] + offsets[None, :]) * size  # [n, span]: slot's first frame
        key = (first[:, :, None] + torch.arange(size, device=device)).reshape(n, -1)  # [n, span * size]
        valid = (key >= 0) & (key < frames)
        return cls(size, back, ahead, frames, None if bool(valid.all()) else valid)


def _shift_blocks(x: torch.Tensor, offset: int) -> torch.Tensor:
    """x [B, H, n, size, D] -> the same with block i holding block i + offset (zeros past either end)."""
    if offset == 0:
        return x
    n = x.shape[2]
    fill = x.new_zeros(*x.shape[:2], min(abs(offset), n), *x.shape[3:])
    if offset < 0:
        return torch.cat((fill, x[:, :, : max(0, n + offset)]), dim=2)
    return torch.cat((x[:, :, offset:], fill), dim=2)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: BlockSpan) -> torch.Tensor:
    """Attention of q, k, v [B, H, T, D] under the block mask, computed block by block: each block's queries
    against only the (1 + back + ahead) blocks of keys they may see, instead of all T x T pairs with the rest
    masked out (the same softmax over the same keys; the work grows with T instead of T^2)."""
    b, h, t, d = q.shape
    size = blocks.size
    n = -(-t // size)
    if n * size != t:  # the last block padded; its missing keys are masked by ``valid``
        q, k, v = (F.pad(z, (0, 0, 0, n * size - t)) for z in (q, k, v))
    q, k, v = (z.reshape(b, h, n, size, d) for z in (q, k, v))
    offsets = range(-blocks.back, blocks.ahead + 1)
    if len(offsets) > 1:
        k, v = (torch.cat([_shift_blocks(z, o) for o in offsets], dim=3) for z in (k, v))
    mask = None
    if blocks.valid is not None:  # [n, keys] -> [H * n, 1, keys], broadcast over batch and query rows
        mask = blocks.valid.repeat(h, 1)[:, None, :]
    out = F.scaled_dot_product_attention(
        q.reshape(b, h * n, size, d), k.reshape(b, h * n, -1, d), v.reshape(b, h * n, -1, d), attn_mask=mask
    )
    return out.reshape(b, h, n * size, d)[:, :, :t]


class DiTMLP(nn.Module):
    def __init__(self, dim: int, mult: int) -> None:
        super().__init__()
        # Indices as in the checkpoint (ff.0 / ff.3); [2] was dropout.
        self.ff = nn.ModuleList(
            [nn.Linear(dim, dim * mult), nn.GELU(approximate="tanh"), nn.Identity(), nn.Linear(dim * mult, dim)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.ff:
            x = layer(x)
        return x


class DiTBlock(nn.Module):
    def __init__(self, cfg: Any, look_back: int, look_ahead: int) -> None:
        super().__init__()
        self.look_back = look_back
        self.look_ahead = look_ahead
        self.attn_norm = AdaLayerNormZero(cfg.hidden_size, 6)
        self.attn = DiTAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim)
        self.ff = DiTMLP(cfg.hidden_size, cfg.ff_mult)

    def forward(
        self, x: torch.Tensor, t_emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, blocks: BlockSpan
    ) -> torch.Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm.modulation(t_emb)
        h = _norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        x = x + gate_msa.unsqueeze(1) * self.attn(h, cos, sin, blocks)
        h = _norm(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        return x + gate_mlp.unsqueeze(1) * self.ff(h)


class FinalNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim * 2)

    def forward(self, x: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
        scale, shift = torch.chunk(self.linear(F.silu(t_emb)), 2, dim=1)
        return _norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]


@dataclass
class DiTConditioning:
    """What stays fixed over one batched ODE solve: per-row constant input projections (conditioned rows then
    unconditioned rows, [2B, T, hidden]), rotary tables and each layer's block span."""

    constant: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    spans: list[BlockSpan]


class DiT(nn.Module):
    """Built from ``token2wav_config.dit_config``."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.mel_dim = int(cfg.mel_dim)
        self.repeats = int(cfg.repeats)
        self.block_size = int(cfg.block_size)
        self.num_embeds = int(cfg.num_embeds)
        self.max_positions = int(cfg.max_position_embeddings)
        if self.block_size % self.repeats:
            raise ValueError(f"block_size {self.block_size} must be a multiple of repeats {self.repeats}")
        self.time_embed = TimestepEmbedding(cfg.hidden_size)
        self.text_embed = CodecEmbedding(cfg.num_embeds, cfg.emb_dim, cfg.repeats)
        self.input_embed = InputEmbedding(cfg)
        self.rotary = RotaryEmbedding(cfg.head_dim, rope_theta(cfg), *rope_frequencies(cfg, cfg.head_dim),
                                      length=length_scaling(cfg))
        ahead, back = set(cfg.look_ahead_layers), set(cfg.look_backward_layers)
        self.transformer_blocks = nn.ModuleList(
            DiTBlock(cfg, int(i in back), int(i in ahead)) for i in range(cfg.num_hidden_layers)
        )
        self.norm_out = FinalNorm(cfg.hidden_size)
        self.proj_out = nn.Linear(cfg.hidden_size, cfg.mel_dim)

    def pack_weights(self, batch_hint: int) -> int:
        """The ``fast`` option's part here (``fast_linear.pack_linear_weights`` calls it before the layers): the
        transformer blocks' linear layers on AMX tiles where the CPU has them and the weights are bfloat16 values
        (``amx_kernels``: float32 rows as three exact parts). Every evaluation runs all of a batch's mel frames
        twice (conditioned and not): hundreds to thousands of rows, where the tiles beat the panel kernels.
        Returns how many; the others keep the panel kernels."""
        return pack_amx_layers(self.transformer_blocks)

    @property
    def receptive_blocks(self) -> tuple[int, int]:
        """Blocks (back, ahead) one function evaluation looks across; an ODE solve compounds this per evaluation."""
        return (
            sum(b.look_back for b in self.transformer_blocks),
            sum(b.look_ahead for b in self.transformer_blocks),
        )

    def conditioning(
        self, codes: torch.Tensor, spk: torch.Tensor, spk_uncond: torch.Tensor, cond: torch.Tensor
    ) -> DiTConditioning:
        """codes [B, N] (in the code table), spk / spk_uncond [B, enc_dim] speaker features of the reference mel
        and of a zero mel, cond [B, enc_emb_dim]."""
        b, n = codes.shape
        t = n * self.repeats
        if t > self.max_positions:
            raise ValueError(f"mel length {t} exceeds dit max_position_embeddings {self.max_positions}")
        code_emb = self.text_embed(codes)
        null_emb = self.text_embed(torch.zeros_like(codes))  # unconditioned rows: every code -> id 0
        constant = torch.cat(
            (
                self.input_embed.constant_part(spk, code_emb, cond),
                self.input_embed.constant_part(spk_uncond, null_emb, torch.zeros_like(cond)),
            )
        )
        # (one forward over the t mel frames, as in transformers: a rope that follows the forward's length)
        freqs = self.rotary.frequencies_for(t).to(codes.device)
        cos, sin = self.rotary(torch.arange(t, device=codes.device), constant.dtype, freqs)
        spans: dict[tuple[int, int], BlockSpan] = {}
        for blk in self.transformer_blocks:
            key = (blk.look_back, blk.look_ahead)
            if key not in spans:
                spans[key] = BlockSpan.of(self.block_size, *key, t, codes.device)
        return DiTConditioning(constant, cos, sin, [spans[(b.look_back, b.look_ahead)] for b in self.transformer_blocks])

    def velocity(self, x: torch.Tensor, t: torch.Tensor, c: DiTConditioning) -> torch.Tensor:
        """One network evaluation on the doubled batch: x [2B, T, mel], t 0-d -> [2B, T, mel]."""
        t_emb = self.time_embed(t.reshape(1).expand(x.shape[0]))
        h = self.input_embed(x, c.constant)
        for block, span in zip(self.transformer_blocks, c.spans):
            h = block(h, t_emb, c.cos, c.sin, span)
        return self.proj_out(self.norm_out(h, t_emb))

    def sample(self, noise: torch.Tensor, c: DiTConditioning, ode: ODEConfig) -> torch.Tensor:
        """Integrate from x_0 = noise [B, T, mel] to t = 1; returns the mel [B, mel, T]."""

        def guided(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            cond, uncond = torch.chunk(self.velocity(torch.cat((x, x)), t, c), 2, dim=0)
            return cond + (cond - uncond) * ode.guidance_scale

        x = noise
        points = ode.time_points(noise.device)
        third = 1 / 3
        for t0, t1 in zip(points[:-1], points[1:]):
            dt = t1 - t0
            # RK4 with the 3/8 rule, in the reference's operation order.
            k1 = guided(t0, x)
            k2 = guided(t0 + dt * third, x + dt * k1 * third)
            k3 = guided(t0 + dt * (2 / 3), x + dt * (k2 - k1 * third))
            k4 = guided(t1, x + dt * (k1 - k2 + k3))
            x = x + (k1 + 3 * (k2 + k3) + k4) * dt / 8
        return x.permute(0, 2, 1)
