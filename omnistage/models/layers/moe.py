"""Top-k softmax-routed mixture of SwiGLU experts, optionally with a sigmoid-gated shared expert.

Expert weights are stacked (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I], the
layout transformers keeps in memory) but load and save under the checkpoint's per-expert names
(``experts.N.gate_proj.weight`` ...; see ``fused.py``). Rows are sorted by expert once; each expert's rows
go through its gate/up and down GEMMs, as one grouped GEMM for all experts (``torch._grouped_mm``: no host
sync, one call) or as a loop of per-expert GEMMs (the packed-weight ``fast`` path). Both give the same bits;
on CPU their speed is within a few percent of each other from decode to prefill row counts
(``benchmarks/moe_kernels.py``), so the grouped call is used wherever it exists. Slot outputs are weighted
and summed per token in top-k order, as transformers' grouped-GEMM path does.

The ``fast`` option adds a dense path for decode-sized batches when experts are few per routed slot
(``num_experts <= 4 * top_k``): a few rows spread over most experts make many GEMMs of 1-4 rows, which
stream their weights at a fraction of the machine's bandwidth. Instead every expert runs over every row as
two GEMMs on all experts' weights packed side by side (gate/up ``[E * 2I, H]``, down ``[H, E * I]``), each
row's unselected experts weighted 0 before the down projection, so the down GEMM also sums the selected
experts (measured on 2 threads of an AMD EPYC, a stack of the small preset's Talker layers, 16 rows, 16
experts, top-4: 1.5x faster in float32, 1.9x in bfloat16; ``benchmarks/moe_kernels.py``). It costs
``num_experts / top_k`` times the FLOPs, which is why it serves only batches of at most ``DENSE_MAX_ROWS``
rows that cover most experts, and a second packed copy of the experts' weights (the per-expert copy serves
prefill). Its rounding differs from the sparse path's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.models.layers.fast_linear import can_pack, pack_weight, packed_linear, release_weight
from omnistage.models.layers.fused import fuse_parts
from omnistage.models.layers.mlp import GatedMLP, swiglu


def _grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


# Dense path limits (``fast``): the FLOP factor it may spend, and the largest batch it serves per dtype. Measured
# on a stack of the small preset's layers (weights streamed from memory, not cache-hot), 2 threads: in float32
# dense was faster up to 16 rows for both the Thinker's and the Talker's experts, slower for the Thinker's
# at 24; in bfloat16 faster up to 32 rows for both, slower for the Thinker's at 48.
DENSE_MAX_FLOP_FACTOR = 4
DENSE_MAX_ROWS = {torch.float32: 16, torch.bfloat16: 32}


class StackedExperts(nn.Module):
    """All experts' SwiGLU weights in two 3-D tensors; ``forward`` runs expert-sorted rows through them."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, dense_packing: bool = False
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.dense_packing = dense_packing
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        i = intermediate_size
        fuse_parts(self, "gate_up_proj", [
            part for e in range(num_experts)
            for part in ((f"{e}.gate_proj.weight", (e, slice(0, i))), (f"{e}.up_proj.weight", (e, slice(i, 2 * i))))
        ])
        fuse_parts(self, "down_proj", [(f"{e}.down_proj.weight", (e,)) for e in range(num_experts)])
        # Per-expert oneDNN-packed weights (gate_up, down) once ``pack_weights`` ran (the ``fast`` option),
        # and with ``dense_packing`` all experts' weights side by side (gate_up [E*2I, H], down [H, E*I]).
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.packed_dense: tuple[torch.Tensor, torch.Tensor] | None = None

    def pack_weights(self, batch_hint: int) -> int:
        """Pack every expert's two weights for oneDNN (see fast_linear.py), and with ``dense_packing`` the
        side-by-side copies too; returns how many were packed."""
        if not can_pack(self.gate_up_proj):
            return 0
        self.packed = [
            (pack_weight(self.gate_up_proj[e], batch_hint), pack_weight(self.down_proj[e], batch_hint))
            for e in range(self.num_experts)
        ]
        if self.dense_packing:
            hidden = self.gate_up_proj.shape[-1]
            self.packed_dense = (
                pack_weight(self.gate_up_proj.reshape(-1, hidden), batch_hint),
                pack_weight(self.down_proj.permute(1, 0, 2).reshape(hidden, -1), batch_hint),
            )
        release_weight(self, "gate_up_proj")
        release_weight(self, "down_proj")
        return 2 * len(self.packed) + (2 if self.packed_dense is not None else 0)

    def serves_dense(self, x: torch.Tensor) -> bool:
        """Whether ``weighted_dense`` may serve these rows (packed side by side, batch within its limit)."""
        return (
            self.packed_dense is not None
            and x.dtype == self.gate_up_proj.dtype
            and x.shape[0] <= DENSE_MAX_ROWS.get(x.dtype, 0)
        )

    def weighted_dense(self, x: torch.Tensor, expert_weights: torch.Tensor) -> torch.Tensor:
        """x: [N, H], expert_weights: [N, E] (0 for an expert a row did not select) -> [N, H]: every expert
        over every row, weighted and summed over experts by the down GEMM itself."""
        if self.packed_dense is None:
            raise RuntimeError("the dense expert path needs the fast option's side-by-side packed weights")
        gate_up, down = self.packed_dense
        n = x.shape[0]
        h = self._swiglu(packed_linear(x, gate_up).view(n, self.num_experts, -1)) * expert_weights[..., None]
        return packed_linear(h.view(n, -1), down)

    def _expert(self, x: torch.Tensor, expert_id: int) -> torch.Tensor:
        if self.packed is not None and x.dtype == self.gate_up_proj.dtype:
            gate_up, down = self.packed[expert_id]
            return packed_linear(self._swiglu(packed_linear(x, gate_up)), down)
        return F.linear(self._swiglu(F.linear(x, self.gate_up_proj[expert_id])), self.down_proj[expert_id])

    def _swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return swiglu(gate_up, self.intermediate_size)

    def forward(self, x: torch.Tensor, counts: torch.Tensor, grouped: bool | None = None) -> torch.Tensor:
        """x: [S, H] rows sorted by expert; counts: [E] rows per expert -> [S, H] expert outputs.

        ``grouped``: one grouped GEMM (True) or a loop over experts with rows (False); default: grouped where
        the op exists (CPU; CUDA's needs bfloat16 on recent GPUs), unless the weights are packed (``fast``).
        """
        if grouped is None:
            grouped = _grouped_mm_available() and not x.is_cuda and self.packed is None
        if grouped:
            offsets = torch.cumsum(counts, 0, dtype=torch.int32)
            h = self._swiglu(torch._grouped_mm(x, self.gate_up_proj.transpose(1, 2), offs=offsets))
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
        h = self._swiglu(torch.matmul(x, self.gate_up_proj.transpose(1, 2)))
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
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        dense_packing = num_experts <= DENSE_MAX_FLOP_FACTOR * top_k
        self.experts = StackedExperts(num_experts, hidden_size, moe_intermediate_size, dense_packing)
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared_expert_intermediate_size > 0:
            self.shared_expert = GatedMLP(hidden_size, shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def uses_dense(self, x: torch.Tensor) -> bool:
        """Whether rows ``x`` [N, H] take the ``fast`` dense path by default: enough rows to select most experts
        (each picks top_k) and few enough for the dense GEMMs to pay."""
        return x.shape[0] * self.top_k >= self.num_experts and self.experts.serves_dense(x)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, H] -> (weights [N, k] in x.dtype, expert ids [N, k]). Softmax in float32, then top-k."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(
        self, x: torch.Tensor, static: bool | None = None, grouped: bool | None = None, dense: bool | None = None
    ) -> torch.Tensor:
        """``static``: route without reading anything back to the host (every expert runs over every row,
        unselected rows weighted 0) — what CUDA graph capture needs. Default: only while capturing.
        ``grouped``: force the grouped-GEMM (True) or per-expert loop (False) sparse path (tests).
        ``dense``: force (True) or forbid (False) the ``fast`` dense path; default: where it pays (see above)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.route(x)
        if static is None:
            static = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if dense is None:
            dense = grouped is None and self.uses_dense(x)
        if static:
            out = self._static_experts(x, weights, ids)
        elif dense:
            expert_weights = torch.zeros(x.shape[0], self.num_experts, dtype=x.dtype, device=x.device)
            out = self.experts.weighted_dense(x, expert_weights.scatter_(1, ids, weights))
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
