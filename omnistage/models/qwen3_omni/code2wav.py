"""Qwen3-Omni Code2Wav: codec frames [B, Q, T] -> 24 kHz waveform.

Network: per-group code embeddings (offset per quantizer, averaged) -> sliding-window causal transformer
-> 2 upsampling stages (transposed conv + ConvNeXt block) -> causal conv -> decoder blocks (SnakeBeta,
transposed conv, 3 dilated residual units) -> SnakeBeta -> causal conv -> clamp to [-1, 1].

Parameter names follow transformers' ``Qwen3OmniMoeCode2Wav`` so ``code2wav.*`` checkpoint tensors load with
the prefix stripped.

Every part is causal: attention is causal with a sliding window, the convolutions pad only on the left and
the transposed convolutions drop the trailing samples that would need a later frame. Hence a prefix of the
frames determines a prefix of the waveform and right-padded batches are exact; ``n`` frames give
``samples_for_frames(n) = n * samples_per_frame - k`` samples (k = 555 for the real model). transformers'
``chunked_decode`` (300-frame chunks, 25 of recomputed context) loses those ``k`` samples at every chunk end
and deviates near each boundary; ``code2wav_stream`` decodes chunks of any size with no recomputation and no
loss: every module below takes an optional ``stream`` (one streaming call's carried state) and then runs on
new frames only.

Kernels: on CPU the decoder (most of the FLOPs) runs on [B, T, C] signals by default: oneDNN channels-last
convolutions, pointwise and transposed convolutions as GEMMs whose outputs already have the next layer's
layout, SnakeBeta as one pass of the CPU kernels that also prepends the next convolution's left context (on AMX
CPUs each convolution's kernel activates the rows it reads instead; elsewhere, in float32, the transposed
convolutions' ``cpu_kernels.conv_pairs`` does). Measured on
the small preset (batch 16, 25-frame chunks, 1 thread, AMD EPYC): 1.44x float32, 1.8x bfloat16 over
``reference_kernels`` (torch's [B, C, T] convolutions, transformers' layout), which stays as the reference
the fast path is tested against; outputs differ by float rounding only (~5e-6 in float32).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig

from omnistage.models.layers import amx_kernels, cpu_kernels, dft_conv
from omnistage.models.layers.conv import CausalConv1d, CausalConvTranspose1d, LengthT, derived
from omnistage.models.layers.fast_linear import pack_amx_layers, pack_embedding
from omnistage.models.layers.mlp import activation
from omnistage.models.layers.rotary import (
    RotaryEmbedding,
    length_scaling,
    rope_frequencies,
    rope_kind,
    rope_theta,
)

if TYPE_CHECKING:
    from omnistage.models.qwen3_omni.stream_step import StreamStep

DEFAULT_SAMPLE_RATE = 24000

# The longest forward transformers' generate runs Code2Wav with: ``chunked_decode``'s 300 frames + 25 of context.
LONGEST_REFERENCE_FORWARD = 325


@dataclass(frozen=True)
class Code2WavConfig:
    codebook_size: int = 2048
    num_quantizers: int = 16
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int | None = None
    attention_bias: bool = False
    sliding_window: int | None = 72
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    layer_scale_initial_scale: float = 0.01
    rope_theta: float = 10000.0
    # A scaled rope type's inverse frequencies and cos/sin scale (``rotary.rope_frequencies``); None: theta's.
    rope_inv_freq: tuple[float, ...] | None = None
    rope_scale: float = 1.0
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    upsampling_ratios: tuple[int, ...] = (2, 2)
    decoder_dim: int = 1536
    sample_rate: int = DEFAULT_SAMPLE_RATE
    resolved_head_dim: int = field(init=False)

    def __post_init__(self) -> None:
        positive = {
            "codebook_size": self.codebook_size,
            "num_quantizers": self.num_quantizers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "decoder_dim": self.decoder_dim,
            "sample_rate": self.sample_rate,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.num_hidden_layers < 0:
            raise ValueError(f"num_hidden_layers must be >= 0, got {self.num_hidden_layers}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        head_dim = (
            self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads
        )
        if head_dim <= 0 or head_dim % 2:
            raise ValueError(f"head_dim must be a positive even number (rotary), got {head_dim}")
        object.__setattr__(self, "resolved_head_dim", head_dim)
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be > 0 or None, got {self.sliding_window}")
        activation(self.hidden_act)  # raises naming an activation transformers does not know
        object.__setattr__(self, "upsample_rates", tuple(int(r) for r in self.upsample_rates))
        object.__setattr__(self, "upsampling_ratios", tuple(int(r) for r in self.upsampling_ratios))
        if any(r <= 0 for r in self.upsample_rates + self.upsampling_ratios):
            raise ValueError("upsample_rates and upsampling_ratios must be positive")
        if self.decoder_dim // 2 ** len(self.upsample_rates) < 1:
            raise ValueError(
                f"decoder_dim ({self.decoder_dim}) leaves no channel after {len(self.upsample_rates)} decoder blocks "
                "(each halves the channels, rounding down as transformers does)"
            )

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.upsample_rates + self.upsampling_ratios)

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path) -> Code2WavConfig:
        """The ``code2wav_config`` section of a Qwen3-Omni checkpoint's config.json."""
        raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
        if "code2wav_config" not in raw:
            raise ValueError(f"{model_dir}/config.json has no code2wav_config section")
        return cls.from_hf(raw["code2wav_config"])

    @classmethod
    def from_hf(cls, hf_config: Any) -> Code2WavConfig:
        """From transformers' ``Qwen3OmniMoeCode2WavConfig`` or the ``code2wav_config`` dict of config.json."""

        def get(name: str, default: Any = None) -> Any:
            if isinstance(hf_config, Mapping):
                return hf_config.get(name, default)
            return getattr(hf_config, name, default)

        scaled: dict[str, Any] = {}
        if rope_kind(hf_config) != "default":  # computed as transformers does
            hf = Qwen3OmniMoeCode2WavConfig(**hf_config) if isinstance(hf_config, Mapping) else hf_config
            head_dim = get("head_dim") or get("hidden_size") // get("num_attention_heads")
            scaled["rope_inv_freq"], scaled["rope_scale"] = rope_frequencies(hf, head_dim)
            length = length_scaling(hf)
            if length is not None and length.original < LONGEST_REFERENCE_FORWARD:
                # transformers' generate decodes chunks of up to 325 frames: at or below the original length
                # a rope that follows the forward's length keeps its base frequencies, which a stream can use;
                # past it they would follow a chunk's length, which a stream does not know.
                raise ValueError(
                    f"code2wav_config: rope_type {length.kind!r} with an original length of {length.original:g} "
                    f"frames scales with the length of each decoded chunk (up to {LONGEST_REFERENCE_FORWARD} "
                    "frames in transformers): not supported for streaming; it needs at least "
                    f"{LONGEST_REFERENCE_FORWARD}")
        missing = object()
        kwargs = {}
        for name, spec in cls.__dataclass_fields__.items():
            if not spec.init or name in ("rope_theta", "rope_inv_freq", "rope_scale"):
                continue
            value = get(name, missing)
            # None means "use the default", except for sliding_window where None means full causal.
            if value is not missing and (value is not None or name == "sliding_window"):
                kwargs[name] = value
        return cls(rope_theta=rope_theta(hf_config, default=10000.0), **scaled, **kwargs)


# ----------------------------------------------------------------------------------------------------------
# Transformer part


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), float(init)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: Code2WavConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.resolved_head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        stream: StreamStep | None = None,
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = _apply_rotary(q, cos, sin)
        k = _apply_rotary(k, cos, sin)
        if stream is not None:  # prepend the window's earlier keys/values (rotated at their own positions)
            k = stream.extend(self.k_proj, k, dim=2)
            v = stream.extend(self.v_proj, v, dim=2)
        if self.num_kv_heads != self.num_heads:
            group = self.num_heads // self.num_kv_heads
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class Mlp(nn.Module):
    def __init__(self, config: Code2WavConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class TransformerLayer(nn.Module):
    def __init__(self, config: Code2WavConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = Mlp(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(config.hidden_size, config.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(config.hidden_size, config.layer_scale_initial_scale)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        stream: StreamStep | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, mask, stream))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


def sliding_causal_mask(length: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Boolean [T, T] mask, True = may attend: key j <= query i and i - j < window."""
    pos = torch.arange(length, device=device)
    offset = pos[:, None] - pos[None, :]
    mask = offset >= 0
    if window is not None:
        mask &= offset < window
    return mask


class Code2WavTransformer(nn.Module):
    def __init__(self, config: Code2WavConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.resolved_head_dim, config.rope_theta, config.rope_inv_freq,
                                          config.rope_scale)
        self.window = config.sliding_window

    def forward(self, x: torch.Tensor, stream: StreamStep | None = None) -> torch.Tensor:
        """x: [B, T, hidden]. Without ``stream`` every row starts at position 0 (right padding only); with
        it, row b continues its request at frame ``stream.frames[b]``."""
        length = x.shape[1]
        if stream is None:
            cos, sin = self.rotary_emb(torch.arange(length, device=x.device), x.dtype)
            mask = sliding_causal_mask(length, self.window, x.device)
        else:
            cos, sin = self.rotary_emb(stream.frame_positions(length), x.dtype)
            cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
            mask = stream.attention_mask(length, self.window)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, stream)
        return self.norm(x)


# ----------------------------------------------------------------------------------------------------------
# Convolutional part


def _conv(conv: CausalConv1d, x: torch.Tensor, stream: StreamStep | None) -> torch.Tensor:
    return conv(x) if stream is None or conv.history_size == 0 else stream.conv(conv, x)


def _conv_transpose(conv: CausalConvTranspose1d, x: torch.Tensor, stream: StreamStep | None) -> torch.Tensor:
    return conv(x) if stream is None else stream.conv_transpose(conv, x)


KeptRows = Callable[[torch.Tensor, torch.Tensor, Any, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]


def _activated_left(
    conv: CausalConv1d, x: torch.Tensor, stream: StreamStep | None, snake: SnakeBeta | None, kept: KeptRows
) -> torch.Tensor | None:
    """The left context a kernel that activates its rows (AMX, ``cpu_kernels.snake_conv``) reads as it is ([B, H,
    C], None for none): zeros, or a stream's carried inputs, whose next history is kept here, activated by the
    kernel's ``kept`` function (``amx_kernels.snake_kept``, ``cpu_kernels.snake_kept``: the kernel's arithmetic,
    so the next chunk reads what one-shot decoding does)."""
    context = conv.history_size
    if not context:
        return None
    if stream is None:
        return x.new_zeros((x.shape[0], context, x.shape[2]))
    left = stream.history_channels_last(conv).contiguous()
    if snake is not None:
        stream.keep(conv, kept(left, x, stream.valid, snake.kernel_parameters()))
    else:
        stream.keep_activated_channels_last(conv, left, x, None)
    return left


def _conv_channels_last(
    conv: CausalConv1d,
    x: torch.Tensor,
    stream: StreamStep | None,
    snake: SnakeBeta | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal convolution (stride 1) of ``snake(x)`` (or ``x``) on [B, T, C] signals, plus ``residual``.

    The convolution's left context (the zeros of one-shot decoding or a stream's carried inputs) is
    prepended by the pass that computes SnakeBeta, or by the copy that converts ``x``'s layout when ``x``
    is a [B, C, T] signal viewed as [B, T, C]."""
    context = conv.history_size
    if conv.amx_weight is not None and x.device.type == "cpu" and (context or snake is not None):
        # AMX tiles: the kernel activates and splits the rows it reads; only the next history is kept
        return conv.amx_channels_last(x, _activated_left(conv, x, stream, snake, amx_kernels.snake_kept),
                                      None if snake is None else snake.kernel_parameters(), residual)
    c = conv.conv
    if (snake is not None and residual is None and conv.stride == 1 and c.groups == 1
            and cpu_kernels.supports_snake_conv(x, c.out_channels)):
        # A few outputs (the decoder's last convolution): SnakeBeta and the convolution in one pass over x
        left = _activated_left(conv, x, stream, snake, cpu_kernels.snake_kept)
        return cpu_kernels.snake_conv(x, left, *snake.kernel_parameters(), c.weight, c.bias, c.dilation[0])
    if (snake is not None and context and conv.stride == 1 and c.groups == 1
            and dft_conv.takes(x, c.weight, c.dilation[0], x.shape[1])):
        # A wide convolution as products of small DFTs, SnakeBeta applied as its blocks read the rows
        left = _activated_left(conv, x, stream, snake, cpu_kernels.snake_kept)
        return dft_conv.conv(x, c.weight, c.bias, c.dilation[0], residual, left, snake.kernel_parameters())
    if context == 0:
        return conv.apply_padded_channels_last(x if snake is None else snake.forward_channels_last(x), residual)
    batch, _, channels = x.shape
    if stream is None:
        left = x.new_zeros((batch, context, channels))
    else:
        left = stream.history_channels_last(conv)
    extended = torch.cat((left, x), 1) if snake is None else snake.forward_channels_last(x, left)
    if stream is not None:
        stream.keep_channels_last(conv, extended)
    return conv.apply_padded_channels_last(extended, residual)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, kernel_size=7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor, stream: StreamStep | None = None) -> torch.Tensor:
        h = _conv(self.dwconv, x, stream).transpose(1, 2)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)


class SnakeBeta(nn.Module):
    """x + sin^2(x * e^alpha) / e^beta, per channel; parameters are stored in log scale."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.exp()[None, :, None]
        beta = self.beta.exp()[None, :, None]
        # One temporary, then in place: these tensors are [B, C, samples] at up to 24 kHz, so every extra
        # pass over memory shows. The 1e-9 guard matches the reference numerics.
        y = torch.sin(x * alpha)
        y.mul_(y).div_(beta + 1e-9).add_(x)
        return y

    def kernel_parameters(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(alpha, scale): ``(sin(x * alpha) * scale)^2 + x``, as the CPU kernels apply it (``amx_kernels.conv``,
        ``cpu_kernels.snake_pointwise``)."""
        return self.alpha.exp(), (self.beta.exp() + 1e-9).rsqrt()

    def forward_channels_last(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """The same function on [B, T, C] in one pass (``cpu_kernels.snake``: the CPU kernels' arithmetic, nothing
        to compile; else eager torch): ``(sin(x * alpha) / sqrt(beta))^2 + x``. With ``context`` [B, H, C]:
        returns [B, H + T, C], the context followed by the result (a causal convolution's input, made without
        a separate concatenation pass)."""
        alpha, scale = self.kernel_parameters()
        if cpu_kernels.supports_snake(x):
            return cpu_kernels.snake(x, alpha, scale, context)
        if context is None:
            return _snake_eager(x, alpha, scale, out=torch.empty_like(x))  # (x's dtype, whatever the parameters')
        return _snake_after_eager(context, x, alpha, scale)


def _snake_eager(
    x: torch.Tensor, alpha: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """SnakeBeta in torch (no CPU kernels here), in four passes and no temporary beyond the result (written to
    ``out``)."""
    y = torch.mul(x, alpha, out=out) if out is not None else x * alpha
    torch.sin(y, out=y)
    y.mul_(scale)
    return torch.addcmul(x, y, y, out=y)


def _snake_after_eager(
    context: torch.Tensor, x: torch.Tensor, alpha: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    batch, length, channels = x.shape
    out = x.new_empty((batch, context.shape[1] + length, channels))
    out[:, : context.shape[1]] = context
    _snake_eager(x, alpha, scale, out=out[:, context.shape[1] :])
    return out


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, kernel_size=7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, kernel_size=1)

    def forward(self, x: torch.Tensor, stream: StreamStep | None = None) -> torch.Tensor:
        return x + _conv(self.conv2, self.act2(_conv(self.conv1, self.act1(x), stream)), stream)

    def forward_channels_last(self, x: torch.Tensor, stream: StreamStep | None = None) -> torch.Tensor:
        """[B, T, C] -> [B, T, C]; ``x`` may be overwritten (it becomes the result). With both convolutions on
        AMX tiles, where the rows give every thread a job, the whole unit is one kernel pass
        (``amx_kernels.residual_unit``: the same bits, the first convolution's output never stored; 2 threads,
        16 x 12000 rows, 96 channels: bfloat16 ~45 -> ~38 ms, float32 ~112 -> ~85 ms; no change measured from
        192 channels up, nor for a whole Code2Wav call within this VM's noise); else each convolution on its own.
        On CPU in float32 without AMX the second SnakeBeta, the kernel-1 convolution and the residual run as one
        pass (``cpu_kernels.snake_pointwise``)."""
        first, second = self.conv1.amx_weight, self.conv2.amx_weight
        if (first is not None and second is not None and x.device.type == "cpu"
                and x.shape[0] * -(-x.shape[1] // amx_kernels.ROW_CHUNK) >= torch.get_num_threads()):
            return amx_kernels.residual_unit(
                x, _activated_left(self.conv1, x, stream, self.act1, amx_kernels.snake_kept),
                self.conv1.conv.dilation[0],
                (first, self.conv1.conv.bias, self.act1.kernel_parameters()),
                (second, self.conv2.conv.bias, self.act2.kernel_parameters()))
        h = _conv_channels_last(self.conv1, x, stream, self.act1)
        conv = self.conv2.conv
        if (self.conv2.amx_weight is None and conv.bias is not None and x.is_contiguous()
                and cpu_kernels.supports_snake_pointwise(x)):
            panels = derived(self.conv2, "_cl_panels", conv.weight, lambda w: cpu_kernels.pack_linear(w[:, :, 0]))
            return cpu_kernels.snake_pointwise(h, *self.act2.kernel_parameters(), panels, conv.bias, x)
        return _conv_channels_last(self.conv2, h, stream, self.act2, residual=x)


class DecoderBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, rate: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [SnakeBeta(in_dim), CausalConvTranspose1d(in_dim, out_dim, 2 * rate, rate)]
        layers += [ResidualUnit(out_dim, dilation) for dilation in (1, 3, 9)]
        self.block = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, stream: StreamStep | None = None) -> torch.Tensor:
        x = _conv_transpose(self.block[1], self.block[0](x), stream)
        for unit in self.block[2:]:
            x = unit(x, stream)
        return x

    def forward_channels_last(self, x: torch.Tensor, stream: StreamStep | None = None) -> torch.Tensor:
        up, snake = self.block[1], None
        if up.activates_inputs(x):  # the kernel activates the rows it reads
            snake = self.block[0].kernel_parameters()
        else:
            x = self.block[0].forward_channels_last(x)
        if stream is None:
            x = up.forward_channels_last(x, snake)
        else:
            x = stream.conv_transpose(up, x, channels_last=True, snake=snake)
        for unit in self.block[2:]:
            x = unit.forward_channels_last(x, stream)
        return x


# ----------------------------------------------------------------------------------------------------------
# The model


class Code2Wav(nn.Module):
    """Codec frames -> waveform. ``forward`` matches the reference; ``decode*`` are the batched stage APIs."""

    def __init__(self, config: Code2WavConfig | Any, reference_kernels: bool = False) -> None:
        """``reference_kernels``: run the decoder with torch's [B, C, T] convolutions, as transformers does,
        instead of the channels-last kernels (same function, other float rounding; 1.4-1.9x slower on CPU).
        Kept as the reference the fast path is tested and benchmarked against, and always used off the CPU."""
        super().__init__()
        if not isinstance(config, Code2WavConfig):
            config = Code2WavConfig.from_hf(config)
        self.config = config
        self.reference_kernels = reference_kernels
        self.sample_rate = config.sample_rate
        self.samples_per_frame = config.samples_per_frame
        hidden = config.hidden_size

        self.pre_transformer = Code2WavTransformer(config)
        self.code_embedding = nn.Embedding(config.codebook_size * config.num_quantizers, hidden)
        # Each quantizer group owns its own slice of the shared embedding table.
        offsets = torch.arange(config.num_quantizers).view(1, -1, 1) * config.codebook_size
        self.register_buffer("code_offset", offsets, persistent=False)

        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalConvTranspose1d(hidden, hidden, factor, factor), ConvNeXtBlock(hidden)])
            for factor in config.upsampling_ratios
        )
        decoder: list[nn.Module] = [CausalConv1d(hidden, config.decoder_dim, 7)]
        for i, rate in enumerate(config.upsample_rates):
            decoder.append(DecoderBlock(config.decoder_dim // 2**i, config.decoder_dim // 2 ** (i + 1), rate))
        out_dim = config.decoder_dim // 2 ** len(config.upsample_rates)
        decoder += [SnakeBeta(out_dim), CausalConv1d(out_dim, 1, 7)]
        self.decoder = nn.ModuleList(decoder)

    # -- lengths ---------------------------------------------------------------------------------------

    def _walk_length(self, frames: LengthT) -> LengthT:
        length = frames
        for stage in self.upsample:
            length = stage[0].output_length(length)
        for layer in self.decoder:
            if isinstance(layer, DecoderBlock):
                length = layer.block[1].output_length(length)
            elif isinstance(layer, CausalConv1d):
                length = layer.output_length(length)
        return length

    def samples_for_frames(self, frames: int) -> int:
        """Samples one call on ``frames`` frames produces (real model: 1920 * frames - 555; 0 for 0)."""
        if frames < 0:
            raise ValueError(f"frames must be >= 0, got {frames}")
        return int(self._walk_length(int(frames)))

    # -- reference-equivalent forward -------------------------------------------------------------------

    def _check_codes(self, codes: torch.Tensor) -> None:
        if codes.dim() != 3 or codes.shape[1] != self.config.num_quantizers:
            raise ValueError(f"codes must be [B, {self.config.num_quantizers}, T], got {tuple(codes.shape)}")
        if codes.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"codes must be an integer tensor, got {codes.dtype}")
        if codes.numel() and (codes.min() < 0 or codes.max() >= self.config.codebook_size):
            raise ValueError(
                f"codes must lie in [0, {self.config.codebook_size}), got range "
                f"[{int(codes.min())}, {int(codes.max())}]"
            )

    def _synthesize(self, codes: torch.Tensor, stream: StreamStep | None = None) -> torch.Tensor:
        if stream is None and self.samples_for_frames(codes.shape[-1]) == 0:
            # Too few frames for one sample (without pre-upsampling, one frame leaves the second decoder block no
            # input, and a convolution no input to pad): nothing to compute, as a stream of them gives nothing.
            weight = self.code_embedding.weight
            return weight.new_zeros((codes.shape[0], 1, 0))
        hidden = self.code_embedding(codes.long() + self.code_offset).mean(1)
        hidden = self.pre_transformer(hidden, stream).transpose(1, 2)  # [B, hidden, T]
        for upsample, convnext in self.upsample:
            hidden = convnext(_conv_transpose(upsample, hidden, stream), stream)
        if self.uses_fast_kernels(hidden.device):
            return self._decode_channels_last(hidden, stream)
        for layer in self.decoder:
            if isinstance(layer, CausalConv1d):
                hidden = _conv(layer, hidden, stream)
            elif isinstance(layer, DecoderBlock):
                hidden = layer(hidden, stream)
            else:
                hidden = layer(hidden)
        return hidden.clamp(-1.0, 1.0)

    def _decode_channels_last(self, hidden: torch.Tensor, stream: StreamStep | None) -> torch.Tensor:
        """The decoder (first conv, decoder blocks, SnakeBeta, last conv) on [B, T, C] signals; hidden
        [B, C, T] -> wave [B, 1, samples]."""
        first, *blocks, snake, last = self.decoder
        x = _conv_channels_last(first, hidden.transpose(1, 2), stream)
        for block in blocks:
            x = block.forward_channels_last(x, stream)
        x = _conv_channels_last(last, x, stream, snake)  # [B, samples, 1]
        return x.transpose(1, 2).clamp(-1.0, 1.0)

    # On CPU the reference decoder's [rows, channels, samples] activations fall out of cache when many rows
    # run at once (per-row cost rises ~1.6x beyond ~100k output samples per call); rows are independent, so
    # a large batch runs as consecutive tiles. The channels-last kernels do not slow down that way and gain
    # from larger GEMMs and fewer calls (measured at batch 16, 25-frame chunks, 1 thread: 1.1-1.15x from
    # 128k to 1M samples per tile, float32 and bfloat16). GPUs take the whole batch.
    REFERENCE_CPU_TILE_SAMPLES = 1 << 17
    FAST_CPU_TILE_SAMPLES = 1 << 20

    @property
    def cpu_tile_samples(self) -> int:
        return self.REFERENCE_CPU_TILE_SAMPLES if self.reference_kernels else self.FAST_CPU_TILE_SAMPLES

    def _synthesize_tiled(self, codes: torch.Tensor) -> torch.Tensor:
        if codes.is_cuda or codes.shape[0] <= 1:
            return self._synthesize(codes)
        rows = max(1, self.cpu_tile_samples // max(1, codes.shape[-1] * self.samples_per_frame))
        return torch.cat([self._synthesize(part) for part in codes.split(rows)])

    def pack_weights(self, batch_hint: int) -> int:
        """The ``fast`` option's part here (``fast_linear.pack_linear_weights`` calls it before the linear layers):
        the decoder's convolutions, and the pre-transformer's and the upsampling ConvNeXt blocks' linear layers,
        on AMX tiles where the CPU has them and the weights are bfloat16 values (``amx_kernels``; their layouts
        for the other kernels are then never made). Those linear layers always see a batch's frames (hundreds
        to thousands of rows), where the tiles run several times the panel kernels' rate (released widths,
        16 x 25 frames, 2 threads: ~140 GFLOP/s in bfloat16 on panels). A float32 model's code embedding of
        bfloat16 values is kept as them (``pack_embedding``: the released table 134 -> 67 MB, the same rows).
        Returns how many."""
        convs = (m for m in self.decoder.modules() if isinstance(m, (CausalConv1d, CausalConvTranspose1d)))
        return (sum(conv.use_amx() for conv in convs) + pack_amx_layers(self.pre_transformer)
                + pack_amx_layers(self.upsample) + pack_embedding(self.code_embedding, None))

    def uses_fast_kernels(self, device: torch.device) -> bool:
        """The channels-last kernels are CPU kernels (oneDNN, inductor's C++); other devices keep the reference
        kernels, whose results the CUDA tests check."""
        return not self.reference_kernels and device.type == "cpu"

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, Q, T] (all T frames valid) -> wave [B, 1, samples_for_frames(T)]."""
        self._check_codes(codes)
        return self._synthesize(codes)

    # -- batched stage API -------------------------------------------------------------------------------

    def _check_codes_shape_only(self, codes: torch.Tensor) -> None:
        if codes.dim() != 3 or codes.shape[1] != self.config.num_quantizers:
            raise ValueError(f"codes must be [B, {self.config.num_quantizers}, T], got {tuple(codes.shape)}")

    def _check_lengths(self, codes: torch.Tensor, lengths: torch.Tensor) -> None:
        if lengths.dim() != 1 or lengths.shape[0] != codes.shape[0]:
            raise ValueError(f"lengths must be [B={codes.shape[0]}], got {tuple(lengths.shape)}")
        if lengths.numel() and (lengths.min() < 1 or lengths.max() > codes.shape[-1]):
            raise ValueError(f"lengths must lie in [1, {codes.shape[-1]}], got {lengths.tolist()}")

    def _fill_padding(self, codes: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Checked codes with positions >= lengths[b] set to 0: padding may hold anything (e.g. -1), and
        causality keeps it out of valid samples."""
        valid = torch.arange(codes.shape[-1], device=codes.device)[None, :] < lengths[:, None]  # [B, T]
        codes = codes.masked_fill(~valid[:, None, :], 0)
        self._check_codes(codes)
        return codes

    def decode(self, codes: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One batched call over right-padded requests.

        codes: [B, Q, T] (positions >= lengths[b] are padding, any value); lengths: [B] frame counts.
        Returns wave [B, S_max] (zero past each request's end) and wave_lengths [B] =
        samples_for_frames(lengths). Each row equals decoding that request alone.
        """
        self._check_codes_shape_only(codes)
        lengths = lengths.to(device=codes.device, dtype=torch.long)
        self._check_lengths(codes, lengths)
        frames = int(lengths.max()) if lengths.numel() else 0
        codes = self._fill_padding(codes[..., :frames], lengths)
        wave_lengths = self._walk_length(lengths)
        if frames == 0:
            return codes.new_zeros((codes.shape[0], 0), dtype=self.code_embedding.weight.dtype), wave_lengths
        wave = self._synthesize_tiled(codes)[:, 0]
        wave = wave[:, : int(wave_lengths.max())]
        in_range = torch.arange(wave.shape[-1], device=wave.device)[None, :] < wave_lengths[:, None]
        return wave * in_range, wave_lengths
