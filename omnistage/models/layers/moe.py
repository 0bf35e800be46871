"""Top-k softmax-routed mixture of SwiGLU experts, optionally with a sigmoid-gated shared expert.

Expert weights are stacked (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I], the
layout transformers keeps in memory) but load and save under the checkpoint's per-expert names
(``experts.N.gate_proj.weight`` ...; see ``fused.py``). Rows are sorted by expert once; each expert's rows
go through its gate/up and down GEMMs, as one grouped GEMM for all experts (``torch._grouped_mm``: no host
sync, one call) or as a loop of per-expert GEMMs (also oneDNN-packed ones, under ``fast`` without its
kernel). Both give the same bits; on CPU their speed is within a few percent of each other from decode to
prefill row counts (``benchmarks/moe_kernels.py``), so the grouped call is used wherever it exists. Slot outputs are weighted
and summed per token in top-k order, as transformers' grouped-GEMM path does.

The ``fast`` option (CPU, float32/bfloat16) serves the routed experts with one call per layer of its own
kernel (``cpu_kernels.py``): it reads each expert's weights once per call while all of the expert's rows take
their dot products, where GEMM libraries stream a few rows' weights at a fraction of the read bandwidth and
cost a call per expert (measured on 2 threads of an AMD EPYC, stacks of the small preset's layers, 16 tokens,
16 experts, top-4, float32: 1.8-2.7x faster than a packed oneDNN GEMM per expert, and at least 1.6x faster
than the dense two-GEMM path it replaced; ``benchmarks/moe_kernels.py``). In float32 it also beats the per-expert
GEMMs at prefill row counts, and so does bfloat16 on CPUs with AVX512-BF16 dot products, so its panel layout
is the only copy of the weights. Without those dot products the kernel widens bfloat16 weights to float32 and
oneDNN wins from about 16 rows per expert: there the per-expert packed copy serves the larger batches. Its
rounding differs from the GEMMs' (other summation order). Without a C compiler the kernel is
unavailable and the ``fast`` option packs a oneDNN GEMM per expert instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.models.layers import cpu_kernels
from omnistage.models.layers.fast_linear import can_pack, pack_weight, packed_linear, release_weight
from omnistage.models.layers.fused import fuse_parts
from omnistage.models.layers.mlp import GatedMLP, check_activation, gated_act


def _grouped_mm_takes(x: torch.Tensor, inputs: int, intermediate: int) -> bool:
    """Whether ``torch._grouped_mm`` takes rows ``x`` through experts of ``inputs`` -> ``intermediate`` -> ``inputs``:
    the op exists, and every operand's row stride is a multiple of 16 bytes (it raises otherwise: hidden 100 in
    bfloat16, 200 bytes)."""
    size = x.element_size()
    return hasattr(torch, "_grouped_mm") and (inputs * size) % 16 == 0 and (intermediate * size) % 16 == 0


# Largest average rows per expert the kernel serves in bfloat16 on CPUs without AVX512-BF16 dot products (it
# widens the weights to float32 there; measured with the widened variant on stacks of the small preset's layers,
# 2 threads: even with oneDNN's per-expert GEMMs at 16 rows per expert, 1.2-1.6x slower at 64). Such CPUs keep
# the per-expert packed copy for larger batches. float32 and the dot-product variant have no limit: faster or
# equal at every row count measured (1-2048 tokens x top-4 over 16 experts).
WIDENED_BF16_MAX_ROWS_PER_EXPERT = 16


class StackedExperts(nn.Module):
    """All experts' SwiGLU weights in two 3-D tensors; ``forward`` runs expert-sorted rows through them."""

    packs_alone = True  # its packing reads only its own weights (``fast_linear.pack_on_load`` packs it at load)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str = "silu") -> None:
        super().__init__()
        check_activation(act)
        self.act = act  # the expert kernel's is SiLU: it serves only those
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        i = intermediate_size
        fuse_parts(self, "gate_up_proj", [
            part for e in range(num_experts)
            for part in ((f"{e}.gate_proj.weight", (e, slice(0, i))), (f"{e}.up_proj.weight", (e, slice(i, 2 * i))))
        ])
        fuse_parts(self, "down_proj", [(f"{e}.down_proj.weight", (e,)) for e in range(num_experts)])
        # The fast option's copies: the expert kernel's panels (``cpu_kernels.pack_experts``), and per-expert
        # oneDNN-packed (gate_up, down) where the kernel is unavailable or (widened bfloat16) for large batches.
        self.panels: tuple[torch.Tensor, torch.Tensor] | None = None
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def pack_weights(self, batch_hint: int) -> int:
        """The ``fast`` option's layouts (see the module docstring); returns how many weight copies were made.
        The unpacked weights are released; 0 when already packed."""
        if self.panels is not None or self.packed is not None:
            return 0
        weight = self.gate_up_proj
        use_kernel = cpu_kernels.supports(weight) and cpu_kernels.available() and self.act == "silu"
        per_expert = can_pack(weight) and not (
            use_kernel and cpu_kernels.serves_any_batch(weight.dtype, weight.shape[-1]))
        if not (use_kernel or per_expert):
            return 0
        if use_kernel:
            self.panels = cpu_kernels.pack_experts(self.gate_up_proj.detach(), self.down_proj.detach(),
                                                   float32_pairs=True)
        if per_expert:
            self.packed = [
                (pack_weight(self.gate_up_proj[e], batch_hint), pack_weight(self.down_proj[e], batch_hint))
                for e in range(self.num_experts)
            ]
        release_weight(self, "gate_up_proj")
        release_weight(self, "down_proj")
        return (2 if self.panels is not None else 0) + (2 * len(self.packed) if self.packed is not None else 0)

    def serves_kernel(self, x: torch.Tensor, top_k: int) -> bool:
        """Whether the expert kernel may serve rows ``x`` [N, H] selecting ``top_k`` experts each."""
        if self.panels is None or not cpu_kernels.rows_take(x.dtype, self.panels[0].dtype) or x.device.type != "cpu":
            return False
        return self.packed is None or x.shape[0] * top_k <= WIDENED_BF16_MAX_ROWS_PER_EXPERT * self.num_experts

    def kernel(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H], ids / weights [N, k] (routing) -> [N, H]: the selected experts' outputs, weighted and summed
        per row in slot order, by the expert kernel."""
        if self.panels is None:
            raise RuntimeError("the expert kernel needs the fast option's panel layout (fast=True, on the CPU)")
        return cpu_kernels.moe_experts(x, ids, weights, self.panels)

    def _expert(self, x: torch.Tensor, expert_id: int) -> torch.Tensor:
        if self.packed is not None and x.dtype == self.gate_up_proj.dtype:
            gate_up, down = self.packed[expert_id]
            return packed_linear(self._act(packed_linear(x, gate_up)), down)
        return F.linear(self._act(F.linear(x, self.gate_up_proj[expert_id])), self.down_proj[expert_id])

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        return gated_act(gate_up, self.intermediate_size, self.act)

    def forward(self, x: torch.Tensor, counts: torch.Tensor, grouped: bool | None = None) -> torch.Tensor:
        """x: [S, H] rows sorted by expert; counts: [E] rows per expert -> [S, H] expert outputs.

        ``grouped``: one grouped GEMM (True) or a loop over experts with rows (False); default: grouped where
        the op takes the rows (CPU, row strides of 16 bytes; CUDA's needs bfloat16 on recent GPUs), unless the
        weights are packed (``fast``).
        """
        if self.packed is None and self.panels is not None:
            raise RuntimeError("these experts' weights are packed for the expert kernel only (the fast option): "
                               "SparseMoE serves them with kernel=True")
        if grouped is None:
            grouped = (not x.is_cuda and self.packed is None
                       and _grouped_mm_takes(x, self.gate_up_proj.shape[-1], self.intermediate_size))
        if grouped:
            offsets = torch.cumsum(counts, 0, dtype=torch.int32)
            h = self._act(torch._grouped_mm(x, self.gate_up_proj.transpose(1, 2), offs=offsets))
            return torch._grouped_mm(h, self.down_proj.transpose(1, 2), offs=offsets)
        out = torch.empty_like(x)
        start = 0
        for expert_id, count in enumerate(counts.tolist()):
            if count:
                rows = slice(start, start + count)
                out[rows] = self._expert(x[rows], expert_id)
                start += count
        return out

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """Every expert over every row: [N, H] -> [E, N, H] (no data-dependent shapes; graph capture)."""
        h = self._act(torch.matmul(x, self.gate_up_proj.transpose(1, 2)))
        return torch.matmul(h, self.down_proj.transpose(1, 2))


class SparseMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        shared_expert_intermediate_size: int = 0,
        act: str = "silu",
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = StackedExperts(num_experts, hidden_size, moe_intermediate_size, act)
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared_expert_intermediate_size > 0:
            self.shared_expert = GatedMLP(hidden_size, shared_expert_intermediate_size, act)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def uses_kernel(self, x: torch.Tensor) -> bool:
        """Whether rows ``x`` [N, H] take the ``fast`` expert kernel by default."""
        return self.experts.serves_kernel(x, self.top_k)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, H] -> (weights [N, k] in x.dtype, expert ids [N, k]). Softmax in float32, then top-k."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(
        self, x: torch.Tensor, static: bool | None = None, grouped: bool | None = None, kernel: bool | None = None
    ) -> torch.Tensor:
        """``static``: route without reading anything back to the host (every expert runs over every row,
        unselected rows weighted 0) — what CUDA graph capture needs. Default: only while capturing.
        ``grouped``: force the grouped-GEMM (True) or per-expert loop (False) sparse path (tests).
        ``kernel``: force (True) or forbid (False) the ``fast`` expert kernel; default: where it serves (above)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.route(x)
        if static is None:
            static = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if kernel is None:
            kernel = grouped is None and not static and self.uses_kernel(x)
        if static:
            out = self._static_experts(x, weights, ids)
        elif kernel:
            out = self.experts.kernel(x, ids, weights)
        else:
            out = self._sparse_experts(x, weights, ids, grouped)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)

    def _static_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        every = self.experts.dense(x)  # [E, N, H]
        picked = every[ids, torch.arange(x.shape[0], device=x.device)[:, None]]  # [N, k, H]
        return (picked * weights[..., None]).sum(dim=1)

    def _sparse_experts(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, grouped: bool | None
    ) -> torch.Tensor:
        # Sort the (token, slot) pairs by expert once, so each expert runs once over all its rows.
        flat_ids = ids.flatten()
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts)
        y = self.experts(x[order // self.top_k], counts, grouped) * weights.flatten()[order, None]
        # Back to (token, slot) order, then the per-token sum over slots in top-k order (transformers' order).
        slots = torch.empty_like(y)
        slots[order] = y
        return slots.view(x.shape[0], self.top_k, -1).sum(dim=1)
