"""Dense SwiGLU feed-forward and the two-layer projection MLP used by the Talker's input adapters."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def check_activation(name: str) -> None:
    if name != "silu":
        raise ValueError(f"hidden_act {name!r} is not supported (only 'silu')")


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); parameter names match the checkpoint (gate_proj/up_proj/down_proj)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ResizeMLP(nn.Module):
    """fc2(silu(fc1(x))) with biases: maps Thinker-width rows to Talker width."""

    def __init__(self, in_size: int, intermediate_size: int, out_size: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(in_size, intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(intermediate_size, out_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))
