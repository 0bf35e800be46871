"""The ``fast`` kernel option: linear layers on weights packed once at load.

At decode batch sizes (a few to a few dozen rows) the default CPU GEMM re-packs each weight matrix on every
call. A weight packed once streams faster: in omnistage's panel layout (``cpu_kernels``: float32, and
bfloat16 on CPUs with AVX512-BF16 dot products; 1.2-2x faster than oneDNN at 1-16 rows, within a few percent at
prefill sizes, measured on this machine's AMD EPYC at 2 threads), else in oneDNN's blocked layout (up to ~2x
faster than the default GEMM); bfloat16 weights where oneDNN cannot pack them (AVX2 alone) on widened panels
(the released Thinker's output head at 1 / 16 rows, 2 threads: 18 / 87 ms, against torch's emulated bfloat16
GEMM's 53 / 558 and ``quant_kernels.dense_linear``'s 25 / 144, which serves where the panels do not build). The
price in float32 is a different summation order than the default GEMM's (and transformers'): outputs differ in
the last bits, so a near-tie between two logits can pick a different greedy token than the reference (the parity
tests hold with it on every test checkpoint). In bfloat16 the default CPU GEMM already is oneDNN, and
oneDNN-packed weights give the same bits.

``pack_linear_weights(module)`` switches every ``nn.Linear`` (and every module with a ``pack_weights``
method: stacked experts, the code predictor's heads) under ``module`` in place, for serving: each packed
weight's unpacked parameter is released (replaced by an empty one), so weight memory stays one copy; a
weight shared with another parameter (tied embeddings) stays unpacked. A packed module's ``state_dict()``
raises: its released weights would read as empty tensors.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.models.layers import amx_kernels, cpu_kernels, quant_kernels
from omnistage.models.layers.cpu_kernels import pack_bias, pack_linear
from omnistage.runtime_env import cpu_computes_bf16, release_free_heap

# Row count the packed layout is tuned for (decode batches); any row count runs correctly.
PACK_BATCH_HINT = 16
_PACKABLE = (torch.float32, torch.bfloat16)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN packs this weight: CPU, float32, or bfloat16 where the CPU has oneDNN's bfloat16 support
    (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; on AVX2 alone its reorder refuses bfloat16, and the layer keeps
    torch's own GEMM)."""
    if not (onednn_available() and weight.device.type == "cpu" and weight.dtype in _PACKABLE):
        return False
    return weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_weight(weight: torch.Tensor, batch_hint: int = PACK_BATCH_HINT) -> torch.Tensor:
    """[out, in] weight -> oneDNN's blocked layout (an opaque tensor only ``packed_linear`` reads)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)


@torch.library.custom_op("omnistage::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] times a ``pack_weight`` result. An opaque op to ``torch.compile``: inductor calls it as
    is (its own oneDNN fusion passes do not handle the pre-packed weight)."""
    return _onednn_linear(x, packed, bias)


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], packed.shape[0])


@torch.library.custom_op("omnistage::packed_linear_at", mutates_args=())
def packed_linear_at(x: torch.Tensor, packed: list[torch.Tensor], index: torch.Tensor) -> torch.Tensor:
    """``packed_linear(x, packed[index])`` for a 0-d ``index`` tensor: a loop compiled as ``torch.scan`` walks
    a list of packed weights (which cannot be stacked into one tensor) by a scanned index."""
    return _onednn_linear(x, packed[int(index)], None)


@packed_linear_at.register_fake
def _(x: torch.Tensor, packed: list[torch.Tensor], index: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], packed[0].shape[0])


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose forward reads its weight packed by ``pack_linear_weights``: ``panels`` (with
    ``panel_bias``) for ``cpu_kernels.linear``, else ``packed_weight`` for oneDNN; or by ``pack_amx``:
    ``amx_weight`` for ``amx_kernels.linear`` (float32 or bfloat16 rows; ``amx_part_rows``: its float32 rows
    summed part by part at every row count)."""

    panels: torch.Tensor | None
    panel_bias: torch.Tensor | None
    packed_weight: torch.Tensor | None
    amx_weight: amx_kernels.AmxWeight | None = None
    amx_part_rows: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.amx_weight is not None:
            return amx_kernels.linear(x, self.amx_weight, self.bias, self.amx_part_rows)
        if self.panels is not None and cpu_kernels.rows_take(x.dtype, self.panels.dtype):
            return cpu_kernels.linear(x, self.panels, self.panel_bias, self.out_features)
        packed = self.panels if self.panels is not None else self.packed_weight
        if x.dtype != packed.dtype:  # the unpacked weight is gone: compute in the weight's dtype
            return self.forward(x.to(packed.dtype)).to(x.dtype)
        if torch.compiler.is_compiling():
            return packed_linear(x, self.packed_weight, self.bias)
        return _onednn_linear(x, self.packed_weight, self.bias)  # (eager: without the custom op's dispatch)


def release_weight(owner: nn.Module, name: str) -> None:
    """Replace parameter ``name`` of ``owner`` by an empty one of the same dtype and device: its packed copy
    serves every call, and the unpacked tensor's memory is freed. ``owner.state_dict()`` then raises (it
    would list empty tensors under the checkpoint's names)."""
    old = getattr(owner, name)
    setattr(owner, name, nn.Parameter(old.detach().new_empty(0), requires_grad=False))
    if not getattr(owner, "_refuses_state_dict", False):
        owner.register_state_dict_pre_hook(_refuse_state_dict)
        owner._refuses_state_dict = True


def _refuse_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    raise RuntimeError(
        f"{prefix.rstrip('.') or type(module).__name__}: weights packed for serving (the fast option) no longer "
        "hold their unpacked values; load the checkpoint with fast=False to read or save its weights"
    )


def pack_linear_weights(module: nn.Module, batch_hint: int = PACK_BATCH_HINT) -> int:
    """Switch every packable linear layer under ``module`` to packed weights (panels where
    ``cpu_kernels.supports_linear``, else oneDNN's layout); returns how many.

    Call after the weights are loaded (a later load would leave the packed copies stale). No-op when neither
    kernel is available or the weights are not on the CPU in float32/bfloat16.
    """
    count, released = 0, 0
    uses = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
    for sub in module.modules():
        deep = hasattr(sub, "pack_weights")  # (a module's own packing may release its children's weights)
        before = _weight_bytes(sub, deep)
        if type(sub) is nn.Linear and uses[id(sub.weight)] == 1 and _pack_linear(sub, batch_hint):
            count += 1
        elif hasattr(sub, "pack_weights") and callable(sub.pack_weights):
            count += sub.pack_weights(batch_hint)
        released += before - _weight_bytes(sub, deep)
        if released >= _TRIM_EVERY_BYTES:  # the unpacked copies go back to the system as packing goes
            release_free_heap()
            released = 0
    if released:
        release_free_heap()
    return count


_TRIM_EVERY_BYTES = 256 << 20


def _weight_bytes(module: nn.Module, recurse: bool) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters(recurse=recurse))


class DenseBf16Linear(nn.Linear):
    """A bfloat16 linear layer through ``quant_kernels.dense_linear`` (its weight as loaded: no copy), for CPUs
    where oneDNN cannot pack bfloat16 and torch's bfloat16 GEMM is emulated."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        return quant_kernels.dense_linear(rows, self.weight, self.bias).view(*x.shape[:-1], self.out_features)


def _pack_linear(linear: nn.Linear, batch_hint: int) -> bool:
    """Turn ``linear`` into a PackedLinear (its weight released), or a DenseBf16Linear; False where no kernel
    takes the weight. A bfloat16 weight that oneDNN cannot pack (AVX2 alone) goes to widened panels
    (``cpu_kernels.takes_widened``): 1.4-3.4x faster than ``quant_kernels.dense_linear`` from 4 to 2048 rows (AMD
    EPYC Zen 3, 2 threads; the released Thinker's output head, 16 rows: 144 -> 87 ms); at 1 row faster on large
    layers (that head: 25 -> 18 ms), slower on small ones (2048 x 2048: 0.25 -> 0.27 ms)."""
    weight = linear.weight.detach()
    panels = pack_linear(weight, float32_pairs=True) if cpu_kernels.supports_linear(weight) else None
    if panels is None and not can_pack(weight):
        if cpu_kernels.takes_widened(weight):
            panels = pack_linear(weight)
        elif quant_kernels.takes_dense(weight) and not cpu_computes_bf16():
            linear.__class__ = DenseBf16Linear
            return True
        else:
            return False
    _to_packed(linear, panels, None if panels is not None else pack_weight(weight, batch_hint))
    return True


def pack_panels(linear: nn.Module, float32_pairs: bool = False) -> int:
    """An ``nn.Linear`` turned into a PackedLinear on panels whatever ``supports_linear`` prefers, for a decoder
    kernel that reads only panels (a quantized decoder's bfloat16 router where its panels are widened; the code
    predictor's layers, whose panels must be of its head's dtype); 1, or 0 where it is not an unpacked CPU linear
    layer or the kernels are off. ``float32_pairs``: as ``cpu_kernels.pack_linear``'s."""
    if type(linear) is not nn.Linear or linear.weight.device.type != "cpu" or not cpu_kernels.panels_preferred():
        return 0
    _to_packed(linear, pack_linear(linear.weight.detach(), float32_pairs=float32_pairs), None)
    return 1


def pack_amx(linear: nn.Module, part_rows: bool = False) -> int:
    """An ``nn.Linear`` turned into a PackedLinear on an AMX weight (``amx_kernels``: AMX CPUs, bfloat16-valued
    weights; its weight released), for layers that always see many rows or run inside the decoder kernels; 1, or 0
    where AMX does not take it. ``part_rows`` (no bias): ``amx_kernels.linear``'s part-by-part sums at every row
    count."""
    if type(linear) is not nn.Linear or not amx_kernels.takes(linear.weight) or (part_rows and linear.bias is not None):
        return 0
    _to_packed(linear, None, None, amx_kernels.pack(linear.weight.detach()))
    linear.amx_part_rows = part_rows
    return 1


def _to_packed(linear: nn.Linear, panels: torch.Tensor | None, packed_weight: torch.Tensor | None,
               amx_weight: amx_kernels.AmxWeight | None = None) -> None:
    linear.register_buffer("panels", panels, persistent=False)
    linear.register_buffer("panel_bias", None if panels is None else pack_bias(linear.bias, linear.out_features),
                           persistent=False)
    linear.register_buffer("packed_weight", packed_weight, persistent=False)
    linear.amx_weight = amx_weight
    linear.__class__ = PackedLinear
    release_weight(linear, "weight")


def pack_output_head(head: nn.Module, embedding: nn.Module) -> int:
    """A model's output head (an ``nn.Linear`` over the vocabulary without a bias, not tied to ``embedding``) on AMX
    tiles (``pack_amx``, float32 rows summed part by part) at every batch size, for ``pack_weights`` of the models
    that own one; 1, or 0 where it stays for the panels. On panels 16 rows of it are compute-bound (AVX512-BF16 dot
    products, float32 FMAs); on AMX they stream at the weight's read rate. The released Thinker's head (152064 x
    2048), 2 threads, Xeon Emerald Rapids, alternating runs: bfloat16 16 rows 62-100 -> 23-44 ms, 1 row 25-30
    (panels) vs 26-33 ms; float32 (pair panels -> AMX part rows, medians) 16 rows 41.5 -> 26.4 ms, 4 rows 22.6 ->
    20.7, 1 row 19.8 -> 20.2."""
    if type(head) is not nn.Linear or head.bias is not None or head.weight is embedding.weight:
        return 0
    return pack_amx(head, part_rows=True)


class Bf16StoredEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose float32 weight holds bfloat16 values, kept as those values (``pack_embedding``):
    half the bytes, the same float32 rows (widened exactly as they are looked up)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.stored_weight, self.padding_idx).float()


def pack_embedding(embedding: nn.Module, head: nn.Module | None) -> int:
    """A float32 ``nn.Embedding`` whose weight holds bfloat16 values (a checkpoint stored in bfloat16, served in
    float32) kept as bfloat16 (``Bf16StoredEmbedding``; the float32 weight released), for ``pack_weights`` of the
    models that own one; not where ``head`` (None: the model has none) shares the weight (call after
    ``pack_output_head``). 1, or 0 where it stays. The released Thinker's vocabulary (152064 x 2048): 1.25 ->
    0.62 GB."""
    if (type(embedding) is not nn.Embedding or embedding.weight.dtype != torch.float32 or embedding.max_norm is not None
            or getattr(head, "weight", None) is embedding.weight or not amx_kernels.bf16_exact(embedding.weight)):
        return 0
    embedding.register_buffer("stored_weight", embedding.weight.detach().to(torch.bfloat16), persistent=False)
    embedding.__class__ = Bf16StoredEmbedding
    release_weight(embedding, "weight")
    return 1


M = TypeVar("M", bound=nn.Module)


def pack_amx_layers(module: nn.Module) -> int:
    """Every ``nn.Linear`` under ``module`` (its weight not shared) on AMX tiles where AMX takes it
    (``pack_amx``), for parts whose every call sees many rows (media towers, a vocoder's frames, a DiT's mel
    frames), where the tiles run several times the panel kernels' rate; returns how many."""
    uses = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
    count = sum(pack_amx(m) for m in list(module.modules()) if type(m) is nn.Linear and uses[id(m.weight)] == 1)
    if count:
        release_free_heap()
    return count


def pack_on_load(fast: bool) -> Callable[[nn.Module], None] | None:
    """``load_into``'s ``loaded`` hook for a ``fast`` build (None otherwise): a module whose packing needs
    only its own weights (``packs_alone``: a layer's stacked experts) is packed the moment its tensors are in,
    and its unpacked copy handed back before the next layer is read; ``fast_kernels`` packs the rest after the
    load and skips what is packed. Without it a load held every layer's unpacked experts until the end (a
    float32 model's twice the bytes of its bfloat16 pairs). Measured at the released widths with 2 layers per
    stack, a fresh process's anonymous peak while loading, with the packing's own temporaries gone too
    (``cpu_kernels.pack_experts`` / ``pack_linear`` write into the packed tensor in pieces): float32 13.1 ->
    7.9 GB for 7.6 GB resident after the load, bfloat16 8.0 -> 6.25 GB for 6.2 GB."""
    if not fast:
        return None
    released = 0

    def loaded(module: nn.Module) -> None:
        nonlocal released
        if not getattr(module, "packs_alone", False):
            return
        before = _weight_bytes(module, True)
        module.pack_weights(PACK_BATCH_HINT)
        released += before - _weight_bytes(module, True)
        if released >= _TRIM_EVERY_BYTES:
            release_free_heap()
            released = 0

    return loaded


def fast_kernels(module: M, fast: bool, many_rows: bool = False) -> M:
    """A model family's ``fast`` build option (``BuildContext.fast``) for one loaded module: its linear
    weights packed when ``fast``, untouched otherwise; ``many_rows``: on AMX tiles first (``pack_amx_layers``).
    Returns the module."""
    if fast:
        if many_rows:
            pack_amx_layers(module)
        pack_linear_weights(module)
    return module
