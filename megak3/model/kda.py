"""Kimi Delta Attention layer (K3_SPEC.md §4.1): projections, short convolutions, gates, output norm.

The recurrence itself lives in :mod:`megak3.ops.kda` (chunked pure-torch, or fla's Triton kernels
on CUDA). Parameter names follow the released checkpoint (q_proj, f_a_proj, A_log, ...).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..ops.kda import kda, kda_gate
from .norm import RMSNorm
from .recompute import segment
from .seqinfo import SeqInfo


class ShortConv(nn.Module):
    """Causal depthwise conv (kernel W, no bias) + SiLU, fp32, reset at document starts.

    ``weight`` [P, 1, W] as in nn.Conv1d; ``weight[:, 0, W-1]`` multiplies the current token.
    """

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.kernel = kernel
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=torch.float32))

    def init_param(self, name, param, gen, std) -> bool:
        bound = 1.0 / math.sqrt(self.kernel)  # nn.Conv1d's default (kaiming_uniform, a=sqrt(5)), fan_in = W
        param.data.uniform_(-bound, bound, generator=gen)
        return True

    def forward(self, x_BTP: torch.Tensor, seq: SeqInfo) -> torch.Tensor:
        T = x_BTP.shape[1]
        W = self.kernel
        xf = F.pad(x_BTP.float(), (0, 0, W - 1, 0))
        w_PW = self.weight[:, 0, :].float()
        out = None
        for j in range(W):  # tap j looks j tokens back
            term = xf[:, W - 1 - j: W - 1 - j + T] * w_PW[:, W - 1 - j]
            if j > 0 and seq.packed:
                term = term * (seq.pos_in_doc_BT >= j).unsqueeze(-1)
            out = term if out is None else out + term
        return F.silu(out)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        k = cfg.kda
        d, H, K = cfg.hidden_size, k.num_heads, k.head_dim
        P = H * K
        self.num_heads, self.head_dim = H, K
        self.lower_bound, self.chunk_size, self.use_fla = k.gate_lower_bound, k.chunk_size, k.use_fla
        self.q_proj = nn.Linear(d, P, bias=False)
        self.k_proj = nn.Linear(d, P, bias=False)
        self.v_proj = nn.Linear(d, P, bias=False)
        self.q_conv1d = ShortConv(P, k.conv_kernel)
        self.k_conv1d = ShortConv(P, k.conv_kernel)
        self.v_conv1d = ShortConv(P, k.conv_kernel)
        self.f_a_proj = nn.Linear(d, k.gate_rank, bias=False)   # low-rank decay gate
        self.f_b_proj = nn.Linear(k.gate_rank, P, bias=False)
        self.b_proj = nn.Linear(d, H, bias=False)               # beta, one scalar per head
        self.g_proj = nn.Linear(d, P, bias=False)               # full-rank output gate
        self.o_norm = RMSNorm(K, cfg.rms_norm_eps)     # per head over dv, fp32 input
        self.o_proj = nn.Linear(P, d, bias=False)
        self.A_log = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(P, dtype=torch.float32))

    def init_param(self, name, param, gen, std) -> bool:
        if name == "A_log":  # A ~ U(1, 16) (FLA / NEMO)
            param.data.uniform_(1.0, 16.0, generator=gen).log_()
            return True
        if name == "dt_bias":
            param.data.zero_()
            return True
        return False

    def per_head_params(self) -> dict:
        """Matrices whose rows are head-major blocks, for Per-Head Muon."""
        return {"q_proj.weight": self.num_heads, "k_proj.weight": self.num_heads,
                "v_proj.weight": self.num_heads}

    def forward(self, x_BTD: torch.Tensor, seq: SeqInfo) -> torch.Tensor:
        # three recompute segments under train.recompute=selective (megak3/model/recompute.py):
        # the core's inputs, the core, its output norm/gate/projection
        q, k, v, g, beta = segment(self._core_inputs, x_BTD, seq)
        o = segment(self._core, q, k, v, g, beta, seq)
        return segment(self._output, o, x_BTD)

    def _core_inputs(self, x_BTD: torch.Tensor, seq: SeqInfo):
        B, T, _ = x_BTD.shape
        H, K = self.num_heads, self.head_dim
        # under context parallelism (seq.cp, set from outside by parallel/context_parallel.py) the
        # convs take the previous rank's last tokens and the recurrence its incoming state
        conv = (lambda c, x: c(x, seq)) if seq.cp is None else seq.cp.causal_conv
        q = _l2norm(conv(self.q_conv1d, self.q_proj(x_BTD)).view(B, T, H, K))
        k = _l2norm(conv(self.k_conv1d, self.k_proj(x_BTD)).view(B, T, H, K))
        v = conv(self.v_conv1d, self.v_proj(x_BTD)).view(B, T, H, K)
        # [B, T, H, K] explicitly: a flat [B, 1, 1*K] (one head per rank, one token) would read as [..., H, K]
        g = kda_gate(self.f_b_proj(self.f_a_proj(x_BTD)).view(B, T, H, K), self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(self.b_proj(x_BTD).float())
        return q, k, v, g, beta

    def _core(self, q, k, v, g, beta, seq: SeqInfo):
        B, T, H, K = q.shape
        # the gate bound g was built with decides fla's safe_gate tiles (megak3.ops.kda.fla_safe_gate);
        # the host offsets spare fla a device read, and the same offset tensors every layer keep its cache
        opts = dict(chunk_size=self.chunk_size, use_fla=self.use_fla, lower_bound=self.lower_bound)
        if seq.cp is not None:  # the shard's group and local documents (parallel/context_parallel.py)
            return seq.cp.kda(q, k, v, g, beta, cu_seqlens_cpu=seq.cu_seqlens_host, **opts)
        if seq.packed:  # documents are delimited on the flattened stream; state resets per document
            flat = lambda t: t.reshape(1, B * T, *t.shape[2:])
            o, _ = kda(flat(q), flat(k), flat(v), flat(g), flat(beta), cu_seqlens=seq.cu_seqlens,
                       cu_seqlens_cpu=seq.cu_seqlens_host, **opts)
            return o.reshape(B, T, H, K)
        o, _ = kda(q, k, v, g, beta, **opts)
        return o

    def _output(self, o, x_BTD: torch.Tensor):
        B, T, H, K = o.shape
        gate = torch.sigmoid(self.g_proj(x_BTD).float()).view(B, T, H, K)
        o = (self.o_norm(o.float()) * gate).to(x_BTD.dtype)
        return self.o_proj(o.reshape(B, T, H * K))
