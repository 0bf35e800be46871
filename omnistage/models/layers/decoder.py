"""Pre-norm decoder layers and a paged-KV decoder stack shared by the Thinker and the Talker."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from omnistage.attention.backend import AttentionMetadata, DecodeKernel, paged_attention
from omnistage.models.layers import cpu_kernels
from omnistage.models.layers.attention import AttendFn, SelfAttention
from omnistage.models.layers.fast_linear import pack_amx, pack_panels
from omnistage.models.layers.mlp import GatedMLP, check_activation
from omnistage.models.layers.moe import SparseMoE
from omnistage.models.layers.norm import RMSNorm
from omnistage.models.layers.quant import decoder_kernel_weight
from omnistage.models.layers.quant_layers import QuantExperts, QuantLinear
from omnistage.models.layers.rotary import (
    LengthScaling,
    RotaryEmbedding,
    length_scaling,
    rope_frequencies,
    rope_theta,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecoderConfig:
    """Shape of a Qwen3(-MoE) decoder, or a Qwen2 one (``qk_norm=False``, biased q/k/v only). ``sparse_layers``
    lists the layers whose MLP is a mixture of experts."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = True
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0
    # Layers attending only to the last ``sliding_window`` positions (a query and the window - 1 before it).
    sliding_layers: tuple[int, ...] = ()
    sliding_window: int | None = None
    hidden_act: str = "silu"  # the MLPs' (transformers' ``ACT2FN`` names); the decoder kernels apply SiLU
    # A scaled rope type's inverse frequencies and cos/sin scale (``rotary.rope_frequencies``); None: theta's.
    rope_inv_freq: tuple[float, ...] | None = None
    rope_scale: float = 1.0
    # Where the rope's frequencies follow the forward's length (``rotary.length_scaling``); None: fixed.
    rope_length: LengthScaling | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even, got {self.head_dim}")
        if any(not 0 <= i < self.num_layers for i in self.sparse_layers):
            raise ValueError(f"sparse_layers {self.sparse_layers} out of range for {self.num_layers} layers")
        if self.sparse_layers:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]"
                )
            if self.moe_intermediate_size <= 0:
                raise ValueError("moe_intermediate_size must be positive when the decoder has MoE layers")
        if len(self.sparse_layers) < self.num_layers and self.intermediate_size <= 0:
            raise ValueError("intermediate_size must be positive when the decoder has dense layers")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps and rope_theta must be positive")
        check_activation(self.hidden_act)
        if any(not 0 <= i < self.num_layers for i in self.sliding_layers):
            raise ValueError(f"sliding_layers {self.sliding_layers} out of range for {self.num_layers} layers")
        if self.sliding_layers and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be >= 1 for sliding layers, got {self.sliding_window}")

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window (None: it attends to every earlier position)."""
        return self.sliding_window if layer in self.sliding_layers else None

    @classmethod
    def from_hf(
        cls, cfg: Any, *, all_sparse: bool = False, shared_expert: bool = False, sliding: bool = False
    ) -> DecoderConfig:
        """Read a transformers text config.

        ``all_sparse``: every layer is MoE regardless of ``mlp_only_layers``/``decoder_sparse_step`` (the Talker's
        layers always are). Otherwise the Qwen3-MoE rule applies: MoE unless listed in ``mlp_only_layers``, when
        ``num_experts > 0`` and ``(i + 1) % decoder_sparse_step == 0``. ``sliding``: the model's attention honours
        ``layer_types`` (Qwen2.5-Omni's decoders, Qwen3-Omni's code predictor; Qwen3-Omni's Thinker and Talker
        ignore them): its ``sliding_attention`` layers attend within ``sliding_window``, as transformers' do.
        """
        num_layers = cfg.num_hidden_layers
        num_experts = getattr(cfg, "num_experts", 0) or 0
        if all_sparse:
            sparse = tuple(range(num_layers))
        else:
            mlp_only = set(getattr(cfg, "mlp_only_layers", None) or [])
            step = getattr(cfg, "decoder_sparse_step", 1) or 1
            sparse = tuple(
                i for i in range(num_layers) if i not in mlp_only and num_experts > 0 and (i + 1) % step == 0
            )
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        inv_freq, rope_scale = rope_frequencies(cfg, head_dim)
        window = getattr(cfg, "sliding_window", None) if sliding else None
        layer_types = list(getattr(cfg, "layer_types", None) or []) if window is not None else []
        sliding_layers = tuple(i for i, kind in enumerate(layer_types[:num_layers]) if kind == "sliding_attention")
        return cls(
            hidden_size=cfg.hidden_size,
            num_layers=num_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
            head_dim=head_dim,
            intermediate_size=getattr(cfg, "intermediate_size", 0) or 0,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=rope_theta(cfg),
            qkv_bias=bool(getattr(cfg, "attention_bias", False)),
            o_bias=bool(getattr(cfg, "attention_bias", False)),
            num_experts=num_experts,
            num_experts_per_tok=getattr(cfg, "num_experts_per_tok", 0) or 0,
            moe_intermediate_size=getattr(cfg, "moe_intermediate_size", 0) or 0,
            norm_topk_prob=bool(getattr(cfg, "norm_topk_prob", False)),
            sparse_layers=sparse,
            shared_expert_intermediate_size=(
                getattr(cfg, "shared_expert_intermediate_size", 0) or 0 if shared_expert else 0
            ),
            sliding_layers=sliding_layers,
            sliding_window=window if sliding_layers else None,
            hidden_act=getattr(cfg, "hidden_act", None) or "silu",
            rope_inv_freq=inv_freq,
            rope_scale=rope_scale,
            rope_length=length_scaling(cfg),
        )

    def rotary(self) -> RotaryEmbedding:
        """The decoder's rotary tables (theta's frequencies, or its scaled rope type's)."""
        return RotaryEmbedding(self.head_dim, self.rope_theta, self.rope_inv_freq, self.rope_scale, self.rope_length)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = SelfAttention(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.rms_norm_eps,
            qkv_bias=cfg.qkv_bias,
            o_bias=cfg.o_bias,
            qk_norm=cfg.qk_norm,
        )
        self.mlp: nn.Module
        if layer_idx in cfg.sparse_layers:
            self.mlp = SparseMoE(
                cfg.hidden_size,
                cfg.moe_intermediate_size,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                cfg.norm_topk_prob,
                cfg.shared_expert_intermediate_size,
                cfg.hidden_act,
            )
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


def kernel_layer(layer: DecoderLayer, dtype: torch.dtype) -> cpu_kernels.LayerWeights | None:
    """``layer``'s weights as ``cpu_kernels``' decoder kernels read them, once the ``fast`` option packed them
    (quantized ones as they were loaded); None where they cannot (a linear layer neither in panel layout nor
    quantized for omnistage's kernels, a bias, no q/k norms, experts without panels)."""
    attn, mlp = layer.self_attn, layer.mlp
    if attn.q_norm is None:
        return None

    def panels(linear: nn.Module | None) -> cpu_kernels.Weight | None:
        if getattr(linear, "bias", None) is not None:
            return None
        if isinstance(linear, QuantLinear):
            return decoder_kernel_weight(linear.weight_q, dtype)
        return getattr(linear, "amx_weight", None) or getattr(linear, "panels", None)

    norms = [n.weight.detach().float().contiguous()
             for n in (layer.input_layernorm, attn.q_norm, attn.k_norm, layer.post_attention_layernorm)]
    parts: dict[str, Any] = dict(input_norm=norms[0], qkv=panels(attn.qkv_proj), q_norm=norms[1], k_norm=norms[2],
                                 o=panels(attn.o_proj), post_norm=norms[3])
    dense = mlp.shared_expert if isinstance(mlp, SparseMoE) else mlp
    if dense is not None:
        parts.update(gate_up=panels(dense.gate_up_proj), down=panels(dense.down_proj),
                     intermediate=dense.intermediate_size)
    if isinstance(mlp, SparseMoE):
        experts = mlp.experts
        if isinstance(experts, QuantExperts):
            pair = tuple(decoder_kernel_weight(w, dtype) for w in (experts.gate_up_q, experts.down_q))
            if None in pair:
                return None
        elif experts.panels is None or experts.packed is not None:  # no panels, or not for every batch
            return None
        else:
            pair = experts.panels
        parts.update(router=panels(mlp.gate), experts=pair, num_experts=mlp.num_experts, top_k=mlp.top_k,
                     norm_topk=mlp.norm_topk_prob,
                     experts_on_amx=cpu_kernels.experts_take_amx(dtype, pair, mlp.gate.in_features, mlp.num_experts,
                                                                 mlp.top_k))
        if dense is not None:
            parts["shared_gate"] = panels(mlp.shared_expert_gate)
        if not isinstance(parts["router"], torch.Tensor) or (
                dense is not None and not isinstance(parts["shared_gate"], torch.Tensor)):
            return None
    if any(parts[name] is None for name in ("qkv", "o")) or (dense is not None and None in (parts["gate_up"],
                                                                                              parts["down"])):
        return None
    return cpu_kernels.LayerWeights(**parts)


def quantized(layer: DecoderLayer) -> bool:
    """Whether ``layer``'s projections are quantized (a quantizing load quantizes its MLP or experts with them)."""
    return isinstance(layer.self_attn.qkv_proj, QuantLinear)


def dense_linears(layer: DecoderLayer) -> list[nn.Module]:
    """``layer``'s dense linear layers as the decoder kernels read them: q/k/v, o, and its dense MLP's (or shared
    expert's) gate/up and down."""
    attn, mlp = layer.self_attn, layer.mlp
    dense = mlp.shared_expert if isinstance(mlp, SparseMoE) else mlp
    found = [attn.qkv_proj, attn.o_proj, getattr(dense, "gate_up_proj", None), getattr(dense, "down_proj", None)]
    return [linear for linear in found if linear is not None]


def _kernels_take(layer: DecoderLayer) -> bool:
    """Whether the decoder kernels could take ``layer``'s dense layers (q/k norms, no q/k/v bias)."""
    return layer.self_attn.q_norm is not None and getattr(layer.self_attn.qkv_proj, "bias", None) is None


def pack_widened_panels(layers: nn.ModuleList) -> int:
    """Where bfloat16 decoder kernels read widened panels (``cpu_kernels.widened_bf16_decoders``), a quantized layer's
    bfloat16 router and shared-expert gate go to panels, the one layout the kernels read them in, even where oneDNN
    packs bfloat16. (A plain bfloat16 layer's linear layers: ``fast_linear`` gives them these panels where oneDNN
    has no bfloat16; where it has, its routed experts keep per-expert oneDNN copies, which the decode-step kernel
    does not take, so they keep oneDNN's GEMMs.) Returns how many."""
    if not cpu_kernels.widened_bf16_decoders():
        return 0
    return sum(pack_panels(linear) for layer in layers if quantized(layer) and isinstance(layer.mlp, SparseMoE)
               for linear in (layer.mlp.gate, layer.mlp.shared_expert_gate)
               if linear is not None and linear.weight.dtype == torch.bfloat16)


def pack_dense_amx(layers: nn.ModuleList, cfg: DecoderConfig, dtype: torch.dtype) -> int:
    """Where the decoder kernels serve these layers, their dense linear layers (q/k/v, o, a dense MLP or the shared
    expert) on AMX tiles where AMX takes them (``pack_amx``: bfloat16-valued weights, inputs a multiple of 32); the
    kernels' AMX phase then sums them at every row count (float32 rows part by part), so a row's result does not
    depend on its batch. A decode batch of 16 rows is compute-bound on the panels' dot products, not on AMX;
    released widths, 2 layers, 16 requests, the two engines alternating in one process (forward time, prefills
    included): bfloat16 Talker 0.83x, Thinker 0.84x; float32 0.96x, 0.93x; 1 request: bfloat16 1.03x, float32
    1.00x. Returns how many."""
    if not cpu_kernels.supports_decoder_layers(dtype, cfg.hidden_size, cfg.head_dim) or not all(
            _kernels_take(layer) for layer in layers):  # (layers the kernels would not take keep their panels)
        return 0
    return sum(pack_amx(linear) for layer in layers for linear in dense_linears(layer)
               if type(linear) is nn.Linear and linear.bias is None and linear.in_features % 32 == 0)


def kernel_layers(layers: nn.ModuleList, cfg: DecoderConfig, dtype: torch.dtype) -> list[cpu_kernels.LayerWeights]:
    """Every layer's ``kernel_layer`` weights, or [] where the decoder kernels cannot serve all of them."""
    if cfg.sliding_layers or cfg.hidden_act != "silu":
        log.info("decoder kernels do not serve a %d-layer decoder with sliding-window layers %s or hidden_act %r: "
                 "it runs layer by layer", len(layers), list(cfg.sliding_layers), cfg.hidden_act)
        return []
    if not cpu_kernels.supports_decoder_layers(dtype, cfg.hidden_size, cfg.head_dim):
        reason = ("panel kernels off or not built" if not cpu_kernels.panels_preferred() else
                  f"hidden {cfg.hidden_size} (a multiple of {cpu_kernels.DOWN_PANEL}), head_dim {cfg.head_dim}, {dtype}")
        log.info("decoder kernels do not serve a %d-layer decoder (%s): it runs layer by layer", len(layers), reason)
        return []
    found = [kernel_layer(layer, dtype) for layer in layers]
    dtypes = {t.dtype for f in found if f is not None for t in f.panels()}
    if len(dtypes) > 1:  # (a float32 decoder whose weights are bfloat16 values in some layers only)
        log.info("decoder kernels do not serve a %d-layer decoder whose panels mix %s: it runs layer by layer",
                 len(layers), sorted(map(str, dtypes)))
        return []
    if found and all(found):
        return found
    log.info("decoder kernels do not serve layer(s) %s of a %d-layer decoder (weights not in panels, biases or no "
             "q/k norms): it runs layer by layer", [i for i, f in enumerate(found) if f is None], len(layers))
    return []


class PagedDecoder(nn.Module):
    """``layers`` + final ``norm`` over flattened token rows with one paged KV cache per layer.

    Subclasses add their own embedding table under the checkpoint's name.
    """

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = cfg.rotary()
        # Attention's arithmetic dtype when not the model's: float32 for a bfloat16 model on CPU under ``fast``.
        self.attention_dtype: torch.dtype | None = None
        # The ``fast`` option's decode attention (``cpu_kernels.decode_attention``), set by ``pack_weights``.
        self.decode_kernel: DecodeKernel | None = None
        # The ``fast`` option's whole-step kernel: its layers (None: not looked at yet) and its table for the
        # stage's caches (rebuilt if they move).
        self._kernel_layers: list[cpu_kernels.LayerWeights] | None = []
        self._table: tuple[tuple[int, ...], cpu_kernels.LayerTable] | None = None
        self._parts: dict[tuple[int, int], cpu_kernels.LayerTable] = {}  # the table's spans, kept with it
        self._final_norm: torch.Tensor | None = None  # the final norm's weight as the kernel reads it (float32)

    def pack_weights(self, batch_hint: int) -> int:
        """The ``fast`` option's part here (``fast_linear.pack_linear_weights`` calls it before the layers; it
        packs what ``pack_widened_panels`` and ``pack_dense_amx`` pack): a bfloat16 decoder on CPU attends in
        float32. torch's CPU attention kernel is several times slower in bfloat16 than in float32 at decode shapes
        (measured 16 requests, 8 heads, 64-200 keys: 2-7x), and the float32 result is the more precise one. Decode
        rows on CPU take ``cpu_kernels.decode_attention`` (float32 arithmetic too), which reads the paged cache in
        place instead of gathering each request's context into a padded batch first."""
        weight = self.norm.weight
        if weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16):
            self.attention_dtype = torch.float32
        if cpu_kernels.supports_decode_attention(weight.dtype, self.cfg.head_dim, weight.device):
            self.decode_kernel = cpu_kernels.decode_attention
            self._kernel_layers = None  # looked at on first use: the layers below are packed after this call
        return pack_widened_panels(self.layers) + pack_dense_amx(self.layers, self.cfg, weight.dtype)

    def kernel_layers(self) -> list[cpu_kernels.LayerWeights]:
        """Every layer's weights for ``cpu_kernels.decoder_step`` (the ``fast`` option on CPU), or [] where it
        cannot serve this decoder."""
        if self._kernel_layers is None:
            self._kernel_layers = kernel_layers(self.layers, self.cfg, self.norm.weight.dtype)
            self._final_norm = self.norm.weight.detach().float().contiguous() if self._kernel_layers else None
        return self._kernel_layers

    def _kernel_table(self, kv_caches: list[torch.Tensor], start: int, stop: int) -> cpu_kernels.LayerTable:
        """The kernel's table of layers ``start`` .. ``stop - 1`` over these caches (kept: a step's lookup)."""
        key = tuple(cache.data_ptr() for cache in kv_caches)
        if self._table is None or self._table[0] != key:
            self._table = (key, cpu_kernels.decoder_table(self.kernel_layers(), [(c[0], c[1]) for c in kv_caches]))
            self._parts = {}
        part = self._parts.get((start, stop))
        if part is None:
            part = self._parts[start, stop] = self._table[1].part(start, stop)
        return part

    def run_span(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: list[torch.Tensor],
        attn_meta: AttentionMetadata, start: int, stop: int, final_norm: bool = False,
        head: tuple[torch.Tensor, int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layers ``start`` .. ``stop - 1`` over rows h [N, H] (h itself is left as it is), then with
        ``final_norm`` the decoder's final norm: (rows, logits). A decode step (one query row per request, every
        row real) on CPU under ``fast`` runs them in one ``cpu_kernels.decoder_step`` call, with ``head`` =
        (panels, vocabulary size) every row's logits too where the kernel reads those panels; anything else
        layer by layer, and logits None."""
        groups = attn_meta.groups
        if (stop > start and len(groups) == 1 and groups[0].max_q == 1 and groups[0].token_rows.numel() == h.shape[0]
                and h.device.type == "cpu" and kv_caches[0].dtype == h.dtype and self.kernel_layers()):
            g, cfg = groups[0], self.cfg
            table = self._kernel_table(kv_caches, start, stop)
            if not (final_norm and head is not None and cpu_kernels.head_takes(table, h.dtype, head[0])):
                head = None
            out = cpu_kernels.decoder_step(
                h.contiguous().clone(), table, (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim), (cos, sin),
                attn_meta.slot_mapping, g.token_req, g.seq_lens, g.kv_slots, cfg.rms_norm_eps,
                self._final_norm if final_norm else None, head)
            return out if head is not None else (out, None)
        for i in range(start, stop):
            h = self.layers[i](h, cos, sin, self.attend(kv_caches[i], attn_meta, self.cfg.window(i)))
        return self.norm(h) if final_norm else h, None

    def attend(self, kv_cache: torch.Tensor, meta: AttentionMetadata, window: int | None = None) -> AttendFn:
        """Bind one layer's paged cache, the step's metadata and the layer's sliding window (None: none) into an
        ``attend`` callable."""
        dtype, decode_kernel = self.attention_dtype, self.decode_kernel

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
            return paged_attention(q, k, v, kv_cache, meta, scale, dtype, decode_kernel, window)

        return attend

    def run_layers(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_meta: AttentionMetadata,
        capture_layer: int | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        rope_freqs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h: [N, H] layer-0 input -> (final-normed [N, H], hidden entering layer ``capture_layer`` or None).

        ``capture_layer == num_layers`` captures the final-normed output (what transformers reports last).
        ``rope``: the rows' (cos, sin) when the caller computes them (default: ``self.rotary`` at ``positions``,
        with each row's frequencies ``rope_freqs`` where given: ``RotaryEmbedding.row_frequencies``).
        """
        h, captured, _ = self._layers(h, positions, kv_caches, attn_meta, capture_layer, rope, None, rope_freqs)
        return h, captured

    def run_layers_with_head(
        self, h: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], attn_meta: AttentionMetadata,
        head: tuple[torch.Tensor, int], rope_freqs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``run_layers`` without a capture: (final-normed [N, H], every row's logits through ``head`` = (an output
        head's ``pack_linear`` panels, vocabulary size), computed in the decode step's kernel call, or None where
        the step does not run there: the caller applies the head then). A separate head call after the kernel's
        step starts cold (a 1-row Talker step's codec head took 0.38 ms for 6.3 MB). Released widths, forward and
        logits per Talker step, alternating in one engine: 1 request bfloat16 2.53 -> 2.47 ms, float32 2.57 ->
        2.48 ms; 16 requests 0.98x / 0.99x."""
        h, _, logits = self._layers(h, positions, kv_caches, attn_meta, None, None, head, rope_freqs)
        return h, logits

    def _layers(
        self, h: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], attn_meta: AttentionMetadata,
        capture_layer: int | None, rope: tuple[torch.Tensor, torch.Tensor] | None,
        head: tuple[torch.Tensor, int] | None, rope_freqs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        num_layers = len(self.layers)
        if len(kv_caches) != num_layers:
            raise ValueError(f"got {len(kv_caches)} KV caches for {num_layers} layers")
        if positions.shape[0] != h.shape[0]:
            raise ValueError(f"positions has {positions.shape[0]} rows, hidden has {h.shape[0]}")
        cos, sin = self.rotary(positions, h.dtype, rope_freqs) if rope is None else rope
        split = capture_layer if capture_layer is not None and capture_layer < num_layers else num_layers
        captured, start = None, 0
        if split < num_layers:
            captured, _ = self.run_span(h, cos, sin, kv_caches, attn_meta, 0, split)
            h, start = captured, split
        h, logits = self.run_span(h, cos, sin, kv_caches, attn_meta, start, num_layers, final_norm=True, head=head)
        if capture_layer == num_layers:
            captured = h
        return h, captured, logits
