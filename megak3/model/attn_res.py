"""Block Attention Residuals (K3_SPEC.md §6; ATTNRES, NEMO ``_apply_attn_res``).

Instead of a running residual sum, each sub-layer reads a softmax mix over *sources*: the
committed block sums ``b_0 = x0, b_1, ...`` plus the current block's partial sum. The mix has a
learned, input-independent pseudo-query ``w`` (``proj.weight``, zero-initialised so step 0 is a
uniform average) scored against RMSNorm-ed sources; no 1/sqrt(d) temperature.

Sources per site for block size ``bs`` (0-based layer l): attention input ``(l-1)//bs + 2``
(l >= 1; layer 0 reads x0 directly), FFN input ``l//bs + 2``, final mix ``(L-1)//bs + 2``.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .norm import RMSNorm


def attn_res_mix(partial_BTD: torch.Tensor, blocks: Sequence[torch.Tensor], query_D: torch.Tensor,
                 norm_weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """softmax_n( <rmsnorm(V_n) * norm_w, query> ) weighted sum of V_n, in fp32, cast back.

    ``blocks``: committed block sums, each shaped like ``partial_BTD``; sources are
    ``blocks + [partial]`` (partial last, matching the reference pseudo-code).
    """
    acc = torch.promote_types(partial_BTD.dtype, torch.float32)  # fp32 at least (fp64 for gradcheck)
    V_NBTD = torch.stack([*blocks, partial_BTD], dim=0).to(acc)
    keys = V_NBTD * torch.rsqrt(V_NBTD.pow(2).mean(-1, keepdim=True) + eps)
    # norm.weight and proj.weight only ever appear as a product (llama.cpp fuses them).
    logits_NBT = (keys * (norm_weight_D.to(acc) * query_D.to(acc))).sum(-1)
    p_NBT = logits_NBT.softmax(dim=0)
    return (p_NBT.unsqueeze(-1) * V_NBTD).sum(0).to(partial_BTD.dtype)


class AttnResMix(nn.Module):
    """One AttnRes site: ``norm`` (RMSNorm weight, init 1) and ``proj`` (Linear d->1, init 0)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.norm = RMSNorm(hidden_size, eps)
        self.proj = nn.Linear(hidden_size, 1, bias=False)
        self.proj.init_param = _zero_init  # zero pseudo-query: uniform average at step 0

    def forward(self, partial_BTD: torch.Tensor, blocks: Sequence[torch.Tensor]) -> torch.Tensor:
        return attn_res_mix(partial_BTD, blocks, self.proj.weight[0], self.norm.weight, self.eps)


def _zero_init(name, param, gen, std) -> bool:
    param.data.zero_()
    return True
