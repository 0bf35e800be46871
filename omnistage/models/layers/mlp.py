"""Dense gated feed-forward (SwiGLU; any ``hidden_act`` transformers knows) and the two-layer projection MLP used by
the Talker's input adapters."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from omnistage.models.layers.compiled import eager_in_graphs
from omnistage.models.layers.fused import fuse_parts, stacked_rows

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "swish": F.silu}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The ``hidden_act`` function transformers applies (``ACT2FN``); SiLU is torch's own, as the kernels'.
    (A plain dict keeps each one: compiled graphs trace through this lookup.)"""
    fn = _ACTIVATIONS.get(name)
    if fn is None:
        if name not in ACT2FN:
            raise ValueError(f"hidden_act {name!r} is not an activation transformers knows")
        fn = _ACTIVATIONS[name] = ACT2FN[name]
    return fn


def check_activation(name: str) -> None:
    activation(name)


@eager_in_graphs("gated_act")
def gated_act(gate_up: torch.Tensor, size: int, act: str) -> torch.Tensor:
    """act(gate) * up of a fused [..., 2 * size] gate/up product (gate first); ``act`` a ``hidden_act`` name."""
    gate, up = gate_up.split(size, dim=-1)
    return activation(act)(gate) * up


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up as one GEMM (``act``: a ``hidden_act`` name, SiLU by default).

    Checkpoint names are unchanged (``gate_proj.weight``, ``up_proj.weight``, ``down_proj.weight``): the fused
    ``gate_up_proj`` loads and saves as its two halves (see ``fused.py``). Stacking the two weights leaves
    every output element's reduction unchanged, so the result equals two separate GEMMs bit for bit.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu") -> None:
        super().__init__()
        check_activation(act)
        self.intermediate_size = intermediate_size
        self.act = act
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        fuse_parts(
            self,
            "gate_up_proj.weight",
            stacked_rows(("gate_proj.weight", "up_proj.weight"), (intermediate_size,) * 2),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_act(self.gate_up_proj(x), self.intermediate_size, self.act))


class ResizeMLP(nn.Module):
    """fc2(act(fc1(x))) with biases: maps Thinker-width rows to Talker width."""

    def __init__(self, in_size: int, intermediate_size: int, out_size: int, act: str = "silu") -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(in_size, intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(intermediate_size, out_size, bias=True)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))
