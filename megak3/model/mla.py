"""Gated Multi-head Latent Attention with NoPE (K3_SPEC.md §5; NEMO ``KimiMLAAttention``).

Queries and keys/values pass through low-rank latents with RMSNorms; the 64-wide "rope" slot is
kept but never rotated (K3 is NoPE: position comes only from KDA). A full-rank sigmoid gate on the
same normed input scales the attention output before o_proj. Softmax in fp32; per-document
causal mask for packed sequences.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .norm import RMSNorm
from .seqinfo import SeqInfo


def attention_mask(seq: SeqInfo, device) -> torch.Tensor | None:
    """[B, 1, T, T] bool mask: causal and same-document; None means plain causal."""
    if not seq.packed:
        return None
    doc = seq.doc_ids_BT.to(device)
    T = seq.seqlen
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    return (doc[:, :, None] == doc[:, None, :]).logical_and(causal).unsqueeze(1)


class GatedMLA(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.mla
        d, H = cfg.hidden_size, m.num_heads
        self.num_heads = H
        self.nope, self.rope, self.v_dim, self.kv_rank = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
        self.q_head_dim = self.nope + self.rope
        self.softmax_scale = self.q_head_dim ** -0.5
        self.q_a_proj = nn.Linear(d, m.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(m.q_lora_rank, m.latent_norm_eps)
        self.q_b_proj = nn.Linear(m.q_lora_rank, H * self.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, m.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, m.latent_norm_eps)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, H * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, d, bias=False)
        self.g_proj = nn.Linear(d, H * self.v_dim, bias=False)

    def per_head_params(self) -> dict:
        return {"q_b_proj.weight": self.num_heads, "kv_b_proj.weight": self.num_heads}

    def forward(self, x_BTD: torch.Tensor, seq: SeqInfo, mask=None) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        H = self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD))).view(B, T, H, self.q_head_dim)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x_BTD).split([self.kv_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c_kv)).view(B, T, H, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        # NoPE: the shared k_pe slot is broadcast over heads un-rotated (MQA-style).
        k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(B, T, H, self.rope)], dim=-1)
        q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))  # [B, H, T, *], fp32 softmax
        if mask is None and seq.packed:
            mask = attention_mask(seq, x_BTD.device)
        if mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale)
        o = o.transpose(1, 2).reshape(B, T, H * self.v_dim)
        o = o * torch.sigmoid(self.g_proj(x_BTD).float())
        return self.o_proj(o.to(x_BTD.dtype))
