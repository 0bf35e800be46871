"""Qwen3-Omni code predictor: fills in code groups 1..Q-1 of a codec frame from the Talker's hidden state.

Names follow the checkpoint with ``talker.code_predictor.`` stripped: ``model.layers.N.*``, ``model.norm``,
``model.codec_embedding.{0..Q-2}`` (embeds code group g+1) and ``lm_head.{0..Q-2}`` (predicts group g+1).

One call runs all requests of a step in lockstep: a 2-row prefill ``[talker hidden, embed(code0)]`` at
positions 0, 1, then Q-2 single-row steps, each attending to a small contiguous per-call KV cache.

Two entry points share that loop:
- ``predict``: a ``sample(logits, group)`` callback picks each group (and ``forced_codes`` can teacher-force);
  tests and reference comparisons use it.
- ``complete_frames``: the serving path. Each row is greedy (argmax) or sampled with transformers' residual
  settings (top-k 50, top-p 0.8, temperature 1) from exponential noise drawn up front from the request's own
  generator — the same number of draws per frame whatever the batch, so a request's random stream never
  depends on its batch mates. On CPU each group's draws for the batch are one ``cpu_kernels.residual_draws``
  call in every kind of frame (equal logits rank in index order; torch's topk leaves their order to its
  selection), elsewhere torch's ops. With the noise fixed, the whole frame (all Q-1 passes and picks) is one pure
  function of tensors, which ``frame_compiler`` compiles into one graph for every batch size (the batch
  dimension is symbolic); norms, activations and sums keep their eager bits in it (``eager_in_graphs``).
  Under ``fast`` on a CPU where omnistage's kernels build, each pass's decoder layers run as one
  ``cpu_kernels.DecoderPass`` call instead (same passes, picks and random streams; no graph to compile).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._higher_order_ops.scan import scan

from omnistage.models.layers import cpu_kernels
from omnistage.models.layers.attention import AttendFn
from omnistage.models.layers.compiled import LazyCompiled, eager_in_graphs
from omnistage.models.layers.decoder import DecoderConfig, DecoderLayer, dense_linears, kernel_layers
from omnistage.models.layers.fast_linear import (
    can_pack,
    pack_amx,
    pack_panels,
    pack_weight,
    packed_linear_at,
    release_weight,
)
from omnistage.models.layers.fused import fuse_parts
from omnistage.models.layers.norm import RMSNorm

# sample(logits [B, V], group) -> codes [B]; group runs 1..Q-1.
SampleFn = Callable[[torch.Tensor, int], torch.Tensor]

# transformers' talker generate samples the residual codes with these (when the talker samples at all).
RESIDUAL_TOP_K = 50
RESIDUAL_TOP_P = 0.8


@dataclass(frozen=True)
class CodePredictorConfig:
    decoder: DecoderConfig
    vocab_size: int
    num_code_groups: int

    def __post_init__(self) -> None:
        if self.num_code_groups < 2:
            raise ValueError(f"num_code_groups must be >= 2, got {self.num_code_groups}")
        if self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")
        if self.decoder.sparse_layers:
            raise ValueError("the code predictor is a dense decoder")

    @classmethod
    def from_hf(cls, cfg: Any) -> CodePredictorConfig:
        return cls(DecoderConfig.from_hf(cfg, sliding=True), cfg.vocab_size, cfg.num_code_groups)


class _FrameCache:
    """K/V of one frame's Q positions per layer, [B, Q, kv_heads, dim], zero-initialised.

    A pass writes its rows' K/V at their positions and attends to every cached position up to its own
    through a mask over all Q slots, so every pass has the same shapes: one loop body (and one compiled
    graph) serves all of them. Unwritten slots are masked out (and zero, so they add exact zeros).
    ``math``: attention as broadcast products, sums and a softmax in float32, which a compiled graph fuses into
    a few loops (the ``fast`` option in bfloat16, where the CPU flash kernel is ~3x slower at these few keys and
    batched matmuls cost a call per product; in float32 the flash kernel is as fast), else
    ``scaled_dot_product_attention``.
    """

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], math: bool = False) -> None:
        self.k, self.v, self.math = k, v, math

    @classmethod
    def zeros(cls, num_layers: int, batch: int, length: int, kv_heads: int, dim: int, like: torch.Tensor,
              math: bool = False) -> _FrameCache:
        shape = (batch, length, kv_heads, dim)
        return cls([like.new_zeros(shape) for _ in range(num_layers)], [like.new_zeros(shape) for _ in range(num_layers)],
                   math)

    def attend_fn(self, layer: int, positions: torch.Tensor, mask: torch.Tensor) -> AttendFn:
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
            # q: [B, T, heads, dim]; k, v: [B, T, kv_heads, dim] at ``positions`` [T].
            self.k[layer] = self.k[layer].index_copy(1, positions, k)
            self.v[layer] = self.v[layer].index_copy(1, positions, v)
            kb, vb = self.k[layer], self.v[layer]
            if self.math:
                return _math_attention(q, kb, vb, mask, scale)
            # Every request sits at the same positions, so one mask [T, Q] serves the batch; grouped-query
            # heads share their key/value head inside the kernel (no repeated copies).
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2), attn_mask=mask, scale=scale,
                enable_gqa=q.shape[2] != kb.shape[2],
            )
            return out.transpose(1, 2)

        return attend


def _math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, T, H, D] over k, v [B, Q, KVH, D] with mask [T, Q] -> [B, T, H, D], as broadcast products and sums
    (a compiled graph turns each into one loop, where batched matmuls of these few keys cost a call per
    product); the H // KVH query heads of a key/value head share it without copies. Sums in float32."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    rows = q.reshape(b, t, kvh, h // kvh, 1, d).float()
    keys = k.permute(0, 2, 1, 3)[:, None, :, None].float()  # [B, 1, KVH, 1, Q, D]
    scores = (rows * keys).sum(-1) * scale  # [B, T, KVH, group, Q]
    scores = scores.masked_fill(~mask[None, :, None, None, :], float("-inf"))
    values = v.permute(0, 2, 1, 3)[:, None, :, None].float()
    out = (scores.softmax(-1)[..., None] * values).sum(-2)  # [B, T, KVH, group, D]
    return out.reshape(b, t, h, d).to(q.dtype)


class StackedTables(nn.Module):
    """``n`` same-shape matrices in one [n, rows, cols] parameter, loaded and saved as ``{i}.weight`` (the
    checkpoint's ``lm_head.{i}.weight`` / ``codec_embedding.{i}.weight``), so a loop over code groups can
    walk them as one tensor."""

    def __init__(self, n: int, rows: int, cols: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, rows, cols))
        fuse_parts(self, "weight", [(f"{i}.weight", (i,)) for i in range(n)])

    def __len__(self) -> int:
        return self.weight.shape[0]


class CodePredictorModel(nn.Module):
    def __init__(self, cfg: CodePredictorConfig) -> None:
        super().__init__()
        d = cfg.decoder
        self.num_positions = cfg.num_code_groups
        self.layers = nn.ModuleList(DecoderLayer(d, i) for i in range(d.num_layers))
        self.norm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.windows = tuple(d.window(i) for i in range(d.num_layers))  # sliding-window layers' windows
        # Rotary tables of the frame's Q positions, computed once in float32 (the values a per-pass
        # computation gives): a compiled graph indexes them instead of computing cos/sin with its own
        # kernels, whose last bits differ from eager torch's. Each frame is a generate of its own in
        # transformers: positions 0 and 1 its prefill, each later one a decode forward (a rope that follows the
        # forward's length: ``rotary.LengthScaling``).
        rotary = d.rotary()
        lengths = [max(p + 1, 2) for p in range(cfg.num_code_groups)]
        cos, sin = rotary(torch.arange(cfg.num_code_groups), torch.float32, rotary.row_frequencies(lengths))
        self.rope_cos = nn.Buffer(cos, persistent=False)
        self.rope_sin = nn.Buffer(sin, persistent=False)
        self.codec_embedding = StackedTables(cfg.num_code_groups - 1, cfg.vocab_size, d.hidden_size)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, cache: _FrameCache) -> torch.Tensor:
        """h: [B, T, H] rows at ``positions`` [T] (a tensor: the same code for every pass) -> normed [B, T, H]."""
        cos, sin = self.rope_cos[positions].to(h.dtype), self.rope_sin[positions].to(h.dtype)
        slots = torch.arange(self.num_positions, device=h.device)
        mask = slots[None, :] <= positions[:, None]  # [T, Q]: causal over the frame's positions
        for i, layer in enumerate(self.layers):
            window = self.windows[i]
            near = mask if window is None else mask & (slots[None, :] > positions[:, None] - window)
            h = layer(h, cos, sin, cache.attend_fn(i, positions, near))
        return self.norm(h)


def pick_residual_codes(
    logits: torch.Tensor, sampled: torch.Tensor | None = None, noise: torch.Tensor | None = None
) -> torch.Tensor:
    """One code per row: the argmax, or where ``sampled`` a draw from the top-k / top-p distribution.

    logits: [B, V]; sampled: [B] bool (None: every row greedy); noise: [B, k] exponential draws, one per
    top-k candidate. The race ``argmax(p / noise)`` over the kept candidates is an exact draw from their
    renormalised probabilities (as the runner's sampler draws over the whole vocabulary). A compiled frame
    always draws (greedy rows keep their argmax): one graph serves every batch, with no data-dependent branch
    that a symbolic batch size could break.
    """
    logits = logits.float()
    best = logits.argmax(-1)
    if sampled is None or noise is None:
        return best
    return _draw_residual_codes(logits, sampled, noise, best)


def _draw_residual_codes(logits: torch.Tensor, sampled: torch.Tensor, noise: torch.Tensor,
                         best: torch.Tensor) -> torch.Tensor:
    """On CPU one kernel call for the batch (an opaque op inside a graph, so every frame draws alike), else
    torch's ops."""
    if logits.device.type != "cpu":
        return _torch_draws(logits, sampled, noise, best)
    if torch.compiler.is_compiling():
        return residual_draws_op(logits, sampled, noise, best)
    return _cpu_draws(logits, sampled, noise, best)


def _cpu_draws(logits: torch.Tensor, sampled: torch.Tensor, noise: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    # (torch's ops took ~0.6 ms per 16-row group, most of it in topk; the kernel ~0.1 ms with its call)
    if cpu_kernels.available():
        return cpu_kernels.residual_draws(logits, sampled, noise, best, RESIDUAL_TOP_P)
    return _torch_draws(logits, sampled, noise, best)


@torch.library.custom_op("omnistage::residual_draws", mutates_args=())
def residual_draws_op(logits: torch.Tensor, sampled: torch.Tensor, noise: torch.Tensor,
                      best: torch.Tensor) -> torch.Tensor:
    """``_cpu_draws`` as one opaque op to ``torch.compile``."""
    return _cpu_draws(logits, sampled, noise, best)


@residual_draws_op.register_fake
def _(logits: torch.Tensor, sampled: torch.Tensor, noise: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(best)


def _torch_draws(logits: torch.Tensor, sampled: torch.Tensor, noise: torch.Tensor,
                 best: torch.Tensor) -> torch.Tensor:
    top, ids = logits.topk(noise.shape[-1], dim=-1)  # sorted, descending
    drawn = ids.gather(-1, (top_p_probs(top) / noise).argmax(-1, keepdim=True))[:, 0]
    return torch.where(sampled, drawn, best)


# Softmax and sums keep their eager numerics in a compiled frame: a last-bit difference could change a draw.
@eager_in_graphs("residual_top_p")
def top_p_probs(top: torch.Tensor) -> torch.Tensor:
    """Sorted top-k logits [B, k] -> probabilities of the smallest prefix whose mass reaches top-p (the first
    candidate always survives), renormalised; 0 for the dropped candidates."""
    probs = top.softmax(-1)
    drop = (probs.cumsum(-1) - probs) >= RESIDUAL_TOP_P
    drop[:, 0] = False
    kept = probs.masked_fill(drop, 0.0)
    return kept / kept.sum(-1, keepdim=True)


@eager_in_graphs("code_embedding_sum")
def embedding_sum(embeds: torch.Tensor) -> torch.Tensor:
    """[B, Q, H] -> [B, H]: one reduction over the frame's code embeddings (the reference's order)."""
    return embeds.sum(dim=1)


def draw_residual_noise(
    generators: Sequence[torch.Generator | None], groups: int, k: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sampled [B] bool, noise [B, groups, k]) for one frame: each row with a generator draws
    ``groups * k`` exponential values from it, in one call; greedy rows (None) get ones and draw nothing."""
    sampled = [g is not None for g in generators]
    noise = torch.ones(len(generators), groups, k, device=device)
    for i, g in enumerate(generators):  # one draw per sampled request: generators cannot be batched
        if g is not None:
            noise[i].exponential_(generator=g)
    return torch.tensor(sampled, device=device), noise


def python_scan(body: Callable, carry: Any, xs: tuple[torch.Tensor, ...]) -> tuple[Any, Any]:
    """``torch.scan``'s semantics as a Python loop: ``body(carry, x_i)`` over dim 0 of ``xs``, outputs stacked."""
    outs = []
    for i in range(xs[0].shape[0]):
        carry, out = body(carry, tuple(x[i] for x in xs))
        outs.append(out)
    return carry, tuple(torch.stack(parts) for parts in zip(*outs, strict=True))


@dataclass
class _FramePasses:
    """``CodePredictor._kernel_frame``'s kept buffers and passes for one batch size (see ``_passes``)."""

    first: torch.Tensor  # [B, 2, H]: the first pass's rows
    rows: torch.Tensor  # [B, 1, H]: a later pass's row
    codes: torch.Tensor  # [Q - 1, B] int64: the frame's picks
    first_pass: cpu_kernels.DecoderPass
    later: cpu_kernels.DecoderPass
    caches: list[torch.Tensor]  # the passes' keys and values (their table points at them)


class CodePredictor(nn.Module):
    def __init__(self, config: Any) -> None:
        """config: transformers' ``talker_config.code_predictor_config`` (or a CodePredictorConfig)."""
        super().__init__()
        self.cfg = config if isinstance(config, CodePredictorConfig) else CodePredictorConfig.from_hf(config)
        self.num_code_groups = self.cfg.num_code_groups
        self.model = CodePredictorModel(self.cfg)
        self.lm_head = StackedTables(self.num_code_groups - 1, self.cfg.vocab_size, self.cfg.decoder.hidden_size)
        self.top_k = min(RESIDUAL_TOP_K, self.cfg.vocab_size)
        # The output heads packed once ``pack_weights`` ran (the ``fast`` option): stacked panels
        # (``cpu_kernels``) or a list of oneDNN-packed weights.
        self.packed_heads: torch.Tensor | list[torch.Tensor] | None = None
        # The decoder layers' weights as ``cpu_kernels.DecoderPass`` reads them, per layer, once the ``fast``
        # option packed them ([] when the kernel cannot serve this predictor; None: not looked at yet).
        self._pass_layers: list[cpu_kernels.LayerWeights] | None = None
        # Per batch size, dtype and thread: the decoder-pass kernel's passes over kept buffers, built once (kept:
        # every pass writes its rows' keys and values before any row reads them, so a frame needs no zeroed caches).
        self._frame_passes: dict[tuple[int, torch.dtype, int], _FramePasses] = {}
        # One graph for every batch size (the batch dimension is symbolic); eager when off or failed.
        self.frame_compiler = LazyCompiled(
            self._frame, name="code predictor frame", dynamic_batch=True, eager=self._eager_frame,
        )

    def embed_group(self, codes: torch.Tensor, group: int) -> torch.Tensor:
        """Embedding of code group ``group`` (1..Q-1); group 0 is embedded by the Talker's codec table."""
        return F.embedding(codes, self.model.codec_embedding.weight[group - 1])

    def pack_weights(self, batch_hint: int) -> int:
        """The ``fast`` option: the output heads packed (``fast_linear``'s choice of kernel; the decoder's linears
        are packed as ``nn.Linear``s) and the compiled frame free to fuse norms and activations its own way."""
        weight = self.lm_head.weight.detach()
        # Without AVX512-BF16, a bfloat16 predictor's passes take the pass kernel on widened panels too (small
        # preset, AMD EPYC Zen 3, 2 threads: a frame 54 -> 9.7 ms at 1 row, 172 -> 83 ms at 16, against its layers
        # one by one on quant_kernels' dense kernel).
        widened = weight.dtype == torch.bfloat16 and cpu_kernels.widened_bf16_decoders()
        if cpu_kernels.supports_linear(weight[0]) or widened:
            d = self.cfg.decoder
            linears = [linear for layer in self.model.layers for linear in dense_linears(layer)
                       if type(linear) is nn.Linear]
            # The pass kernel reads the head and the layers' panels in one dtype: float32 weights kept as bfloat16
            # pairs (cpu_kernels.keeps_float32_as_pairs) for all of them or for none.
            pairs = all(cpu_kernels.keeps_float32_as_pairs(w) for w in (weight, *(x.weight for x in linears)))
            self.packed_heads = cpu_kernels.pack_linear(weight, float32_pairs=pairs)
            if cpu_kernels.supports_decoder_layers(weight.dtype, d.hidden_size, d.head_dim):
                # Dense layers on AMX tiles where they take them (inputs a multiple of 32: the kernel's panel tiles
                # read the same weights at few rows), the others on panels of the head's dtype.
                for linear in linears:
                    if not (linear.bias is None and linear.in_features % 32 == 0 and pack_amx(linear)):
                        pack_panels(linear, float32_pairs=pairs)
        elif can_pack(weight):
            self.packed_heads = [pack_weight(w, batch_hint) for w in weight]
        else:
            return 0
        release_weight(self.lm_head, "weight")
        self.frame_compiler.exact = False
        return len(weight)

    def logits(self, hidden: torch.Tensor, group: int) -> torch.Tensor:
        """Logits for code group ``group`` (1..Q-1) from the predictor's last hidden row."""
        return self._head_logits(
            hidden, self.lm_head.weight[group - 1] if self.packed_heads is None else torch.tensor(group - 1))

    def _head_logits(self, hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """``head``: a head's weight [V, H], or with packed heads a 0-d index into them (a scan walks either)."""
        if isinstance(self.packed_heads, torch.Tensor):
            return cpu_kernels.linear_at(hidden, self.packed_heads, head, self.cfg.vocab_size)
        if self.packed_heads is not None:
            return packed_linear_at(hidden, self.packed_heads, head)
        return F.linear(hidden, head)

    def pass_layers(self) -> list[cpu_kernels.LayerWeights]:
        """The decoder layers' weights for ``cpu_kernels.DecoderPass`` ([] where it cannot serve: weights not
        packed into panels, another dtype or device, biases, no q/k norms)."""
        if not isinstance(self.packed_heads, torch.Tensor):  # not packed (yet), or packed for oneDNN
            return []
        if self._pass_layers is None:
            self._pass_layers = kernel_layers(self.model.layers, self.cfg.decoder, self.model.norm.weight.dtype)
        return self._pass_layers

    def _passes(self, batch: int, dtype: torch.dtype) -> _FramePasses:
        """The frame's two ``DecoderPass``es (the first over [talker hidden, code0 embedding], the later ones over
        one row) on buffers kept for ``batch`` rows of ``dtype``, built once per thread (their scratch is the
        thread's): building them per frame took ~0.25 ms of a 16-row float32 frame's ~12 ms."""
        key = (batch, dtype, threading.get_ident())
        if key not in self._frame_passes:
            d = self.cfg.decoder
            groups = self.num_code_groups
            caches = [torch.empty(batch, groups, d.num_kv_heads, d.head_dim, dtype=dtype)
                      for _ in range(2 * d.num_layers)]
            table = cpu_kernels.decoder_table(self.pass_layers(), list(zip(caches[::2], caches[1::2])))
            shape = (d.num_heads, d.num_kv_heads, d.head_dim, groups)
            # The values the model uses (rounded to its dtype), in float32.
            rope = tuple(t.to(dtype).float() for t in (self.model.rope_cos, self.model.rope_sin))
            # Each pass ends with the final norm, its group's head and the argmax, in the same call.
            head = (self.model.norm.weight.detach().float(), self.packed_heads.dtype, self.cfg.vocab_size)
            first = torch.empty(batch, 2, d.hidden_size, dtype=dtype)
            rows = torch.empty(batch, 1, d.hidden_size, dtype=dtype)  # each pass overwrites its rows
            self._frame_passes[key] = _FramePasses(
                first, rows, torch.empty(groups - 1, batch, dtype=torch.int64),
                cpu_kernels.DecoderPass(first, table, shape, rope, d.rms_norm_eps, head),
                cpu_kernels.DecoderPass(rows, table, shape, rope, d.rms_norm_eps, head), caches)
        return self._frame_passes[key]

    def _kernel_frame(
        self, talker_hidden: torch.Tensor, code0_embed: torch.Tensor, sampled: torch.Tensor, noise: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``_frame``'s passes with every pass's decoder layers in one ``cpu_kernels.DecoderPass`` call (the
        ``fast`` option on CPU): the same rows, positions, heads, picks and embedding sum. The codes returned
        ([B, Q - 1], a view of the kept buffer) are valid until the next frame of this batch size."""
        p = self._passes(talker_hidden.shape[0], talker_hidden.dtype)
        tables = self.model.codec_embedding.weight  # [Q - 1, V, H]
        any_sampled = bool(sampled.any())  # a greedy batch skips the draws
        torch.stack((talker_hidden, code0_embed), dim=1, out=p.first)
        step, rows = p.first_pass, p.rows.view(p.rows.shape[0], -1)
        for group in range(1, self.num_code_groups):
            codes = p.codes[group - 1]
            logits = step.run(0 if group == 1 else group, self.packed_heads[group - 1], codes)
            if any_sampled:
                # (in place: the kernel reads each row's argmax before it writes that row's code)
                cpu_kernels.residual_draws(logits, sampled, noise[:, group - 1], codes, RESIDUAL_TOP_P, out=codes)
            if group + 1 < self.num_code_groups:  # the next pass's row: this group's code embedding
                torch.index_select(tables[group - 1], 0, codes, out=rows)
                step = p.later
        # Every group's embedding at once (embed_group's rows), summed in the reference's order.
        picked = tables[torch.arange(self.num_code_groups - 1)[:, None], p.codes]  # [Q - 1, B, H]
        return p.codes.t(), embedding_sum(torch.cat((code0_embed[:, None], picked.transpose(0, 1)), dim=1))

    def new_cache(self, batch: int, like: torch.Tensor) -> _FrameCache:
        d = self.cfg.decoder
        return _FrameCache.zeros(d.num_layers, batch, self.num_code_groups, d.num_kv_heads, d.head_dim, like,
                                 math=self.packed_heads is not None and like.dtype != torch.float32)

    def _first_pass(
        self, talker_hidden: torch.Tensor, code0_embed: torch.Tensor, cache: _FrameCache
    ) -> torch.Tensor:
        """Rows [talker hidden, embed(code0)] at positions 0, 1 -> the hidden that predicts group 1 [B, H]."""
        x = torch.stack((talker_hidden, code0_embed), dim=1)
        return self.model(x, torch.arange(2, device=x.device), cache)[:, -1]

    def _next_pass(self, embed: torch.Tensor, position: torch.Tensor, cache: _FrameCache) -> torch.Tensor:
        """One row (the previous group's code embedding) at ``position`` [1] -> hidden [B, H]."""
        return self.model(embed[:, None], position, cache)[:, 0]

    def predict(
        self,
        talker_hidden: torch.Tensor,
        code0: torch.Tensor,
        code0_embed: torch.Tensor,
        sample: SampleFn,
        forced_codes: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fill a frame for B requests at once, ``sample`` picking each group (a Python loop over groups).

        talker_hidden: [B, H] the Talker's final-normed hidden of the previous step; code0: [B] the layer-0 code
        sampled from it; code0_embed: [B, H] the Talker's codec embedding of code0. ``forced_codes`` [B, Q-1]
        (teacher forcing, tests) feeds given codes instead of the sampled ones; ``sample`` still sees the logits.
        Returns (codes [B, Q] with code0 first, embed_sum [B, H] = sum of all Q code embeddings, which is what
        the Talker adds to the next step's input).
        """
        self._check(talker_hidden, code0)
        cache = self.new_cache(talker_hidden.shape[0], talker_hidden)
        code0_embed = code0_embed.to(talker_hidden.dtype)
        codes, embeds = [code0], [code0_embed]
        h = self._first_pass(talker_hidden, code0_embed, cache)
        for group in range(1, self.num_code_groups):
            if group > 1:
                h = self._next_pass(embeds[-1], torch.tensor([group], device=h.device), cache)
            picked = sample(self.logits(h, group), group)
            if forced_codes is not None:
                picked = forced_codes[:, group - 1]
            codes.append(picked)
            embeds.append(self.embed_group(picked, group))
        # One stacked sum (not a running sum): the same reduction the reference uses, so float32 bits agree.
        return torch.stack(codes, dim=1), embedding_sum(torch.stack(embeds, dim=1))

    def _eager_frame(
        self, talker_hidden: torch.Tensor, code0_embed: torch.Tensor, sampled: torch.Tensor, noise: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``_frame`` without a graph: a Python loop over the passes, and a greedy batch skips the draws."""
        return self._frame(talker_hidden, code0_embed, sampled, noise, loop=python_scan,
                           draw=bool(sampled.any()))

    def _frame(
        self,
        talker_hidden: torch.Tensor,
        code0_embed: torch.Tensor,
        sampled: torch.Tensor,
        noise: torch.Tensor,
        loop: Callable = scan,
        draw: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole frame as one pure function of tensors (what gets compiled): (codes [B, Q-1], embed_sum [B, H]).

        The same passes as ``predict`` with ``pick_residual_codes`` as the sampler; groups 2..Q-1 run as one
        loop body over the stacked output heads, embedding tables and noise: ``torch.scan`` when compiled
        (the graph holds one pass, not Q-2 unrolled copies, so compile time does not grow with Q), a plain
        Python loop over the same body when eager (``python_scan``).
        """
        sampled = sampled if draw else None
        cache = self.new_cache(talker_hidden.shape[0], talker_hidden)
        h = self._first_pass(talker_hidden, code0_embed, cache)
        first = pick_residual_codes(self.logits(h, 1), sampled, noise[:, 0])
        first_embed = self.embed_group(first, 1)
        if self.num_code_groups == 2:
            return first[:, None], embedding_sum(torch.stack((code0_embed, first_embed), dim=1))
        layers = len(cache.k)

        def body(carry, xs):
            embed, position, *kv = carry
            head, table, group_noise = xs
            step_cache = _FrameCache(list(kv[:layers]), list(kv[layers:]), cache.math)
            hidden = self._next_pass(embed, position, step_cache)
            code = pick_residual_codes(self._head_logits(hidden, head), sampled, group_noise)
            code_embed = F.embedding(code, table)
            # The scanned output is a copy: a loop body may not return one tensor twice.
            return (code_embed, position + 1, *step_cache.k, *step_cache.v), (code, code_embed.clone())

        start = (first_embed, torch.tensor([2], device=h.device), *cache.k, *cache.v)
        groups = self.num_code_groups - 1
        heads = self.lm_head.weight[1:] if self.packed_heads is None else torch.arange(1, groups, device=h.device)
        steps = (heads, self.model.codec_embedding.weight[1:], noise.transpose(0, 1)[1:])
        _, (codes, embeds) = loop(body, start, steps)  # codes [Q-2, B], embeds [Q-2, B, H]
        all_embeds = torch.cat((code0_embed[:, None], first_embed[:, None], embeds.transpose(0, 1)), dim=1)
        return torch.cat((first[:, None], codes.transpose(0, 1)), dim=1), embedding_sum(all_embeds)

    def complete_frames(
        self,
        talker_hidden: torch.Tensor,
        code0: torch.Tensor,
        code0_embed: torch.Tensor,
        generators: Sequence[torch.Generator | None],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Serving path: ``generators[i]`` None = greedy row, else row i samples from that generator.

        Returns (codes [B, Q] with code0 first, embed_sum [B, H]), like ``predict``. A single row is padded to
        two (a zero row, dropped again) so every batch size runs the one graph with a symbolic batch.
        """
        self._check(talker_hidden, code0)
        batch = talker_hidden.shape[0]
        if len(generators) != batch:
            raise ValueError(f"{len(generators)} generators for {batch} rows")
        sampled, noise = draw_residual_noise(generators, self.num_code_groups - 1, self.top_k, talker_hidden.device)
        args = [talker_hidden, code0_embed.to(talker_hidden.dtype), sampled, noise]
        if (self.pass_layers() and talker_hidden.dtype == self.model.norm.weight.dtype
                and talker_hidden.device.type == "cpu"):
            with torch.inference_mode():
                residual, embed_sum = self._kernel_frame(*args)
            return torch.cat((code0[:, None], residual), dim=1), embed_sum
        with torch.inference_mode():
            if batch == 1:
                args = [torch.cat((a, a.new_ones(1, *a.shape[1:]) if a is noise else a.new_zeros(1, *a.shape[1:])))
                        for a in args]
            # Every input an inference tensor, whoever made it: dynamo guards on the dispatch keys, so a mix of
            # inference and normal tensors would compile one graph per combination.
            args = [a if a.is_inference() else a.clone() for a in args]
            residual, embed_sum = self.frame_compiler(*args)
        return torch.cat((code0[:, None], residual[:batch]), dim=1), embed_sum[:batch]

    def warm_up(self) -> None:
        """Compile the frame now (at load) rather than inside the first audio request's step, where every
        request of the stage would wait for it. No-op when compiling is off or has failed."""
        if not self.frame_compiler.active or self.frame_compiler.compile_seconds is not None or self.pass_layers():
            return  # (frames whose passes take the decoder-pass kernel need no graph)
        # Two separate tensors, as real calls pass: dynamo guards on aliasing and storage offsets, and a shared
        # or sliced one would compile a graph that real calls never reuse.
        hidden, code0_embed = (self.lm_head.weight.new_zeros(2, self.cfg.decoder.hidden_size) for _ in range(2))
        code0 = torch.zeros(2, dtype=torch.long, device=hidden.device)
        self.complete_frames(hidden, code0, code0_embed, [None, None])

    @staticmethod
    def _check(talker_hidden: torch.Tensor, code0: torch.Tensor) -> None:
        if talker_hidden.dim() != 2 or code0.shape != talker_hidden.shape[:1]:
            raise ValueError(
                f"expected talker_hidden [B, H] and code0 [B], got {talker_hidden.shape}, {code0.shape}"
            )
