"""Quantized linear layers and stacked experts, and the rule that says which checkpoint weights become them.

``QuantScheme`` names the weights a stage quantizes by checkpoint name (relative to the part's prefix): a
format per name prefix (the longest matching prefix wins), routers and other excluded names kept in the serving
dtype. The same rule sizes the memory plan (from the checkpoint's headers) and drives loading, so the plan and
the loaded model agree.

``quantize_targets`` (called by the loader before any data is read) swaps every ``nn.Linear`` and
``StackedExperts`` whose weight the scheme quantizes for a ``QuantLinear`` / ``QuantExperts`` holding a
``QuantBuffer``, and maps each checkpoint tensor of those weights to the rows it fills. The float weights are
dropped before they are ever written (the model is built without initialising them), so loading holds the
quantized model plus the tensor being read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from omnistage.models.layers import quant_kernels
from omnistage.models.layers.mlp import gated_act
from omnistage.models.layers.moe import StackedExperts
from omnistage.models.layers.quant import (
    QuantBuffer,
    QuantFormat,
    QuantWeight,
    kernel_args,
    own_kernel_takes,
    packed_bytes,
    quant_matmul,
)


@dataclass(frozen=True)
class QuantScheme:
    """Which weights of one part are quantized: ``formats`` maps checkpoint-name prefixes (relative to the part,
    e.g. ``model.layers.``) to a format; names ending in one of ``exclude`` stay in the serving dtype."""

    formats: Mapping[str, QuantFormat]
    exclude: tuple[str, ...] = ("mlp.gate.weight", "mlp.shared_expert_gate.weight")
    # Whole names with their own format, before the prefixes and the exclusions: a pre-quantized checkpoint's
    # stored layers.
    exact: Mapping[str, QuantFormat] = field(default_factory=dict)
    _order: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for prefix, fmt in self.formats.items():
            if not isinstance(prefix, str) or not isinstance(fmt, QuantFormat):
                raise ValueError(f"formats must map name prefixes to QuantFormat, got {prefix!r}: {fmt!r}")
        object.__setattr__(self, "_order", tuple(sorted(self.formats, key=len, reverse=True)))

    def format_for(self, name: str, shape: tuple[int, ...]) -> QuantFormat | None:
        """The format of checkpoint tensor ``name`` (relative to the part) of ``shape``; None: not quantized."""
        if name in self.exact:
            return self.exact[name]
        if len(shape) != 2 or not name.endswith(".weight") or name.endswith(self.exclude):
            return None
        for prefix in self._order:
            if name.startswith(prefix):
                return self.formats[prefix].fitting(shape[1])
        return None

    def within(self, prefix: str) -> QuantScheme | None:
        """This scheme for the weights under ``prefix`` (e.g. a tower the part loads on its own), names relative
        to it; None where it quantizes nothing there."""
        formats = {k[len(prefix):]: f for k, f in self.formats.items() if k.startswith(prefix)}
        exact = {k[len(prefix):]: f for k, f in self.exact.items() if k.startswith(prefix)}
        return QuantScheme(formats, self.exclude, exact) if formats or exact else None

    def weight_bytes(self, name: str, shape: tuple[int, ...], scale_bytes: int, device: torch.device) -> int | None:
        """Bytes tensor ``name`` takes once quantized and packed on ``device`` (None: not quantized)."""
        fmt = self.format_for(name, shape)
        return None if fmt is None else packed_bytes(fmt, shape[0], shape[1], scale_bytes, device)


def _refuse_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    raise RuntimeError(f"{prefix.rstrip('.') or type(module).__name__}: weights quantized while loading have no "
                       "float values to save; load the checkpoint without quantization to read or save them")


class QuantLinear(nn.Module):
    """``nn.Linear`` on a quantized weight (``weight_q``); the bias, if any, stays in the serving dtype."""

    def __init__(self, linear: nn.Linear, fmt: QuantFormat, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_state_dict_pre_hook(_refuse_state_dict)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.dtype = dtype
        self.buffer: QuantBuffer | None = QuantBuffer((self.out_features, self.in_features), fmt,
                                                      linear.weight.device, dtype)
        self.weight_q: QuantWeight | None = None

    def buffers_to_pack(self) -> list[QuantBuffer]:
        return [] if self.buffer is None else [self.buffer]

    def pack(self) -> None:
        self.weight_q, self.buffer = self.buffer.pack(self.dtype), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_q is None:
            raise RuntimeError("QuantLinear used before its weight was loaded")
        return quant_matmul(x, self.weight_q, self.bias)

    def extra_repr(self) -> str:
        fmt = (self.weight_q or self.buffer).fmt
        return f"in_features={self.in_features}, out_features={self.out_features}, {fmt.name}"


class QuantExperts(nn.Module):
    """``StackedExperts`` on quantized weights: on the CPU the whole layer in one ``quant_kernels.moe`` call,
    else each expert's rows through its own two weight-only GEMMs."""

    # What the fast option's kernels look for on experts: no panel layout, no oneDNN copies.
    panels = None
    packed = None

    def __init__(self, experts: StackedExperts, fmt_gate_up: QuantFormat, fmt_down: QuantFormat,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.register_state_dict_pre_hook(_refuse_state_dict)
        self.num_experts, self.intermediate_size = experts.num_experts, experts.intermediate_size
        self.act = experts.act  # quant_kernels' expert phases apply SiLU: they serve only those
        self.dtype = dtype
        device = experts.gate_up_proj.device
        self.loading: dict[str, QuantBuffer] | None = {
            "gate_up_proj": QuantBuffer(tuple(experts.gate_up_proj.shape), fmt_gate_up, device, dtype),
            "down_proj": QuantBuffer(tuple(experts.down_proj.shape), fmt_down, device, dtype),
        }
        self.gate_up_q: QuantWeight | None = None
        self.down_q: QuantWeight | None = None

    def buffers_to_pack(self) -> list[QuantBuffer]:
        return [] if self.loading is None else list(self.loading.values())

    def pack(self) -> None:
        self.gate_up_q = self.loading["gate_up_proj"].pack(self.dtype)
        self.down_q = self.loading["down_proj"].pack(self.dtype)
        self.loading = None

    def serves_kernel(self, x: torch.Tensor, top_k: int) -> bool:
        """Whether ``kernel`` serves rows ``x`` (eager CPU calls our kernels take): routed in one call, no sorted
        copy of the rows, the slots weighted and summed in float32 inside it."""
        return (self.gate_up_q is not None and not torch.compiler.is_compiling() and self._own_kernels_take(x))

    def _own_kernels_take(self, x: torch.Tensor) -> bool:
        return self.act == "silu" and own_kernel_takes(x, self.gate_up_q) and own_kernel_takes(x, self.down_q)

    def kernel(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H], routing ids / weights [N, k] -> [N, H] (``quant_kernels.moe_routed``)."""
        return quant_kernels.moe_routed(x, ids, weights, kernel_args(self.gate_up_q), kernel_args(self.down_q))

    def _expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        h = gated_act(quant_matmul(x, self.gate_up_q.select(e)), self.intermediate_size, self.act)
        return quant_matmul(h, self.down_q.select(e))

    def forward(self, x: torch.Tensor, counts: torch.Tensor, grouped: bool | None = None) -> torch.Tensor:
        """x: [S, H] rows sorted by expert; counts: [E] rows per expert -> [S, H] (``grouped`` is ignored: one
        weight-only GEMM pair per expert with rows)."""
        if self.gate_up_q is None:
            raise RuntimeError("QuantExperts used before their weights were loaded")
        if self._own_kernels_take(x):
            return quant_kernels.moe(x, counts, kernel_args(self.gate_up_q), kernel_args(self.down_q))
        out = torch.empty_like(x)
        start = 0
        for e, count in enumerate(counts.tolist()):
            if count:
                out[start:start + count] = self._expert(x[start:start + count], e)
                start += count
        return out

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """Every expert over every row: [N, H] -> [E, N, H] (graph capture; dequantized per call)."""
        return torch.stack([self._expert(x, e) for e in range(self.num_experts)])


@dataclass(frozen=True)
class RowTarget:
    """Where one checkpoint tensor goes: rows ``start``.. of ``buffer``, owned by ``module``."""

    module: nn.Module
    buffer: QuantBuffer
    start: int


def quantize_targets(module: nn.Module, expected: Mapping[str, torch.Tensor], scheme: QuantScheme,
                     dtype: torch.dtype) -> dict[str, RowTarget]:
    """Swap the layers whose weights ``scheme`` quantizes (see the module docstring) and map each such checkpoint
    name in ``expected`` (``module.state_dict(keep_vars=True)``, taken before the swap: fused parts are views
    of their fused parameter) to the rows it fills. Raises ValueError naming a fused weight whose parts
    disagree (some quantized, some not, or in different formats)."""
    by_param: dict[int, tuple[nn.Module, str, str]] = {}
    for path, sub in module.named_modules():
        for leaf in (("weight",) if type(sub) is nn.Linear else ("gate_up_proj", "down_proj")
                     if isinstance(sub, StackedExperts) else ()):
            by_param[getattr(sub, leaf).untyped_storage().data_ptr()] = (sub, path, leaf)
    chosen: dict[tuple[str, str], QuantFormat | None] = {}
    rows: dict[str, tuple[tuple[str, str], int]] = {}
    for name, tensor in expected.items():
        owner = by_param.get(tensor.untyped_storage().data_ptr()) if tensor.numel() else None
        if owner is None:
            continue
        sub, path, leaf = owner
        param = getattr(sub, leaf)
        fmt = scheme.format_for(name, tuple(tensor.shape))
        key = (path, leaf)
        if key in chosen and chosen[key] != fmt:
            raise ValueError(f"{path}.{leaf}: its checkpoint parts are quantized differently ({name}: "
                             f"{'not quantized' if fmt is None else fmt.name})")
        chosen[key] = fmt
        offset = (tensor.data_ptr() - param.data_ptr()) // tensor.element_size()
        rows[name] = (key, offset // param.shape[-1])
    swapped: dict[tuple[str, str], tuple[nn.Module, QuantBuffer]] = {}
    for (path, leaf), fmt in chosen.items():
        if fmt is None or (path, leaf) in swapped:
            continue
        sub = module.get_submodule(path)
        if isinstance(sub, StackedExperts):
            other = "down_proj" if leaf == "gate_up_proj" else "gate_up_proj"
            formats = {leaf: fmt, other: chosen.get((path, other))}
            if formats["down_proj"] is None or formats["gate_up_proj"] is None:
                raise ValueError(f"{path}: gate/up and down experts must both be quantized or neither")
            new = QuantExperts(sub, formats["gate_up_proj"], formats["down_proj"], dtype)
            for part in ("gate_up_proj", "down_proj"):
                swapped[(path, part)] = (new, new.loading[part])
        else:
            new = QuantLinear(sub, fmt, dtype)
            swapped[(path, leaf)] = (new, new.buffer)
        parent, _, child = path.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, child, new)
    return {name: RowTarget(*swapped[key], start) for name, (key, start) in rows.items() if key in swapped}


def pack_if_complete(target: nn.Module) -> bool:
    """Pack a swapped layer's weights into their kernel layout once every row is in (frees the load buffer)."""
    buffers = target.buffers_to_pack()
    if buffers and all(b.complete for b in buffers):
        target.pack()
        return True
    return False
