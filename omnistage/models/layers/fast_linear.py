"""The ``fast`` kernel option: linear layers through oneDNN with weights packed once at load.

At decode batch sizes (a few to a few dozen rows) the default CPU GEMM re-packs each weight matrix on every
call; oneDNN reading a weight already in its blocked layout streams it up to ~2x faster (measured on
this machine's AMD EPYC at 1-2 threads, issue 10). The price in float32 is a different summation order than the default
GEMM's (and transformers'): outputs differ in the last bits, so a near-tie between two logits can pick a
different greedy token than the reference (the parity tests hold with it on every test checkpoint).
In bfloat16 the default CPU GEMM already is oneDNN and packing gives the same bits.

``pack_linear_weights(module)`` switches every ``nn.Linear`` (and every module with a ``pack_weights``
method: stacked experts, the code predictor's heads) under ``module`` in place, for serving: each packed
weight's unpacked parameter is released (replaced by an empty one), so weight memory stays one copy; a
weight shared with another parameter (tied embeddings) stays unpacked. A packed module's ``state_dict()``
raises: its released weights would read as empty tensors.
"""

from __future__ import annotations

from collections import Counter
from typing import TypeVar

import torch
from torch import nn

# Row count the packed layout is tuned for (decode batches); any row count runs correctly.
PACK_BATCH_HINT = 16
_PACKABLE = (torch.float32, torch.bfloat16)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def can_pack(weight: torch.Tensor) -> bool:
    return onednn_available() and weight.device.type == "cpu" and weight.dtype in _PACKABLE


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
    """An ``nn.Linear`` whose forward reads ``packed_weight`` (built by ``pack_linear_weights``)."""

    packed_weight: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.packed_weight.dtype:  # the unpacked weight is gone: compute in the weight's dtype
            return packed_linear(x.to(self.packed_weight.dtype), self.packed_weight, self.bias).to(x.dtype)
        return packed_linear(x, self.packed_weight, self.bias)


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
    """Switch every packable linear layer under ``module`` to packed oneDNN weights; returns how many.

    Call after the weights are loaded (a later load would leave the packed copies stale). No-op when oneDNN
    is unavailable or the weights are not on the CPU in float32/bfloat16.
    """
    count = 0
    uses = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
    for sub in module.modules():
        if type(sub) is nn.Linear and can_pack(sub.weight) and uses[id(sub.weight)] == 1:
            sub.register_buffer("packed_weight", pack_weight(sub.weight, batch_hint), persistent=False)
            sub.__class__ = PackedLinear
            release_weight(sub, "weight")
            count += 1
        elif hasattr(sub, "pack_weights") and callable(sub.pack_weights):
            count += sub.pack_weights(batch_hint)
    return count


M = TypeVar("M", bound=nn.Module)


def fast_kernels(module: M, fast: bool) -> M:
    """A model family's ``fast`` build option (``BuildContext.fast``) for one loaded module: its linear
    weights packed when ``fast``, untouched otherwise. Returns the module."""
    if fast:
        pack_linear_weights(module)
    return module
