"""SiTU-GLU feed-forward block (K3_SPEC.md §7.2): the dense layer-0 FFN and the fused shared experts.

    y = down_proj( SiTU(gate_proj x) * cap(up_proj x) )

Shared experts are one SiTUGLUMLP of width ``num_shared_experts * m``: because SiTU-GLU acts
elementwise on the hidden units, splitting the hidden axis into blocks and summing the blocks'
outputs gives the same result, so two m-wide experts == one 2m-wide MLP (spec §16 item 9).
"""
from __future__ import annotations

import torch
from torch import nn

from megak3.ops.situ import situ_glu


class SiTUGLUMLP(nn.Module):
    """x [..., D] -> [..., D] through a SiTU-GLU hidden layer of width ``intermediate_size``.

    Parameters: ``gate_proj.weight`` [I, D], ``up_proj.weight`` [I, D], ``down_proj.weight`` [D, I].
    """

    def __init__(self, hidden_size: int, intermediate_size: int, beta1: float = 4.0, beta2: float = 25.0):
        super().__init__()
        if hidden_size <= 0 or intermediate_size <= 0:
            raise ValueError(f"SiTUGLUMLP: hidden_size={hidden_size} and intermediate_size={intermediate_size} "
                             "must be positive")
        self.beta1, self.beta2 = float(beta1), float(beta2)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = situ_glu(self.gate_proj(x), self.up_proj(x), self.beta1, self.beta2)
        return self.down_proj(h)

    def extra_repr(self) -> str:
        return f"beta1={self.beta1}, beta2={self.beta2}"
