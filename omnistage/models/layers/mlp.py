"""Dense SwiGLU feed-forward and the two-layer projection MLP used by the Talker's input adapters."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.models.layers.compiled import eager_in_graphs
from omnistage.models.layers.fused import fuse_parts, stacked_rows


def check_activation(name: str) -> None:
    if name != "silu":
        raise ValueError(f"hidden_act {name!r} is not supported (only 'silu')")


@eager_in_graphs("swiglu")
def swiglu(gate_up: torch.Tensor, size: int) -> torch.Tensor:
    """silu(gate) * up of a fused [..., 2 * size] gate/up product (gate first)."""
    gate, up = gate_up.split(size, dim=-1)
    return F.silu(gate) * up


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up as one GEMM.

    Checkpoint names are unchanged (``gate_proj.weight``, ``up_proj.weight``, ``down_proj.weight``): the fused
    ``gate_up_proj`` loads and saves as its two halves (see ``fused.py``). Stacking the two weights leaves
    every output element's reduction unchanged, so the result equals two separate GEMMs bit for bit.
    """

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        fuse_parts(
            self,
            "gate_up_proj.weight",
            stacked_rows(("gate_proj.weight", "up_proj.weight"), (intermediate_size,) * 2),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_up_proj(x), self.intermediate_size))


class ResizeMLP(nn.Module):
    """fc2(silu(fc1(x))) with biases: maps Thinker-width rows to Talker width."""

    def __init__(self, in_size: int, intermediate_size: int, out_size: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(in_size, intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(intermediate_size, out_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))
