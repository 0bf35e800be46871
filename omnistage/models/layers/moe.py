"""Top-k softmax-routed mixture of SwiGLU experts, optionally with a sigmoid-gated shared expert.

Experts are kept as one module per expert because that is how the hub checkpoint stores them
(``experts.N.gate_proj.weight``); transformers fuses them in memory but we load from disk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.models.layers.mlp import GatedMLP


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
        self.experts = nn.ModuleList(GatedMLP(hidden_size, moe_intermediate_size) for _ in range(num_experts))
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared_expert_intermediate_size > 0:
            self.shared_expert = GatedMLP(hidden_size, shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, H] -> (weights [N, k] in x.dtype, expert ids [N, k]). Softmax in float32, then top-k."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor, static: bool | None = None) -> torch.Tensor:
        """``static``: route without reading anything back to the host (every expert runs over every row,
        unselected rows weighted 0) — what CUDA graph capture needs. Default: only while capturing."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.route(x)
        if static is None:
            static = x.is_cuda and torch.cuda.is_current_stream_capturing()
        out = self._static_experts(x, weights, ids) if static else self._sparse_experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)

    def _static_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype, device=x.device)
        dense.scatter_(1, ids, weights)
        out = torch.zeros_like(x)
        for expert_id, expert in enumerate(self.experts):  # ascending, like the sparse path
            out += expert(x) * dense[:, expert_id, None]
        return out

    def _sparse_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        # Group (token, slot) pairs by expert with one sort, so each expert runs once over all its rows.
        flat_ids = ids.flatten()
        order = torch.argsort(flat_ids, stable=True)
        rows_sorted = order // self.top_k
        weights_sorted = weights.flatten()[order]
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        start = 0
        # Ascending expert order: the same accumulation order as the reference, so float32 sums agree.
        for expert_id, count in enumerate(counts):
            if count == 0:
                continue
            rows = rows_sorted[start : start + count]
            y = self.experts[expert_id](x[rows]) * weights_sorted[start : start + count, None]
            out.index_add_(0, rows, y.to(out.dtype))
            start += count
        return out
