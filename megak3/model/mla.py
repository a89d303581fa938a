"""Gated Multi-head Latent Attention with NoPE (K3_SPEC.md §5; NEMO ``KimiMLAAttention``).

Queries and keys/values pass through low-rank latents with RMSNorms; the 64-wide "rope" slot is
kept but never rotated (K3 is NoPE: position comes only from KDA). A full-rank sigmoid gate on the
same normed input scales the attention output before o_proj. Softmax in fp32; packed sequences attend
causally within their own document (``megak3.ops.attention.attention`` with the per-token document
ids from SeqInfo; no [T, T] mask is built).
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..ops.attention import DEFAULT_K_CHUNK, DEFAULT_Q_CHUNK, attention
from .norm import RMSNorm
from .recompute import segment
from .seqinfo import SeqInfo


def document_ids(seq: SeqInfo, device) -> torch.Tensor | None:
    """[B, T] document id per token when some row holds more than one document, else None."""
    if not seq.packed or seq.cu_seqlens.numel() - 1 == seq.batch:  # one document per row
        return None
    return seq.doc_ids_BT.to(device)


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
        self.q_chunk, self.k_chunk = DEFAULT_Q_CHUNK, DEFAULT_K_CHUNK  # tokens per chunk (chunked path)

    def per_head_params(self) -> dict:
        return {"q_b_proj.weight": self.num_heads, "kv_b_proj.weight": self.num_heads}

    def forward(self, x_BTD: torch.Tensor, seq: SeqInfo) -> torch.Tensor:
        """Causal attention within each document of ``seq`` (no [T, T] mask is materialised).
        Under train.recompute=selective the projections and the output gate are recompute segments
        and the attention core keeps its own q, k, v, o, lse (megak3/model/recompute.py)."""
        if seq.cp is not None and seq.cp.balance:  # balanced CP: query blocks moved, K/V per key block
            q, latent = segment(self._q_latent, x_BTD)
            o = seq.cp.balanced_attention(q, latent, self._expand, self._expand_params(), self.softmax_scale,
                                          self.q_chunk, self.k_chunk)
            return segment(self._output, o, x_BTD)
        q, k, v = segment(self._qkv, x_BTD, seq)
        q_offset, doc = 0, document_ids(seq, x_BTD.device)
        if seq.cp is not None:  # keys are the gathered latents of [0, end of segment)
            q_offset, doc = seq.cp.offset, seq.cp.key_doc_ids_BT
        o = attention(q, k, v, self.softmax_scale, doc, q_chunk=self.q_chunk, k_chunk=self.k_chunk,
                      q_offset=q_offset)
        return segment(self._output, o, x_BTD)

    def _qkv(self, x_BTD: torch.Tensor, seq: SeqInfo):
        """q [B, H, T, nope+rope], k [B, H, Tk, nope+rope], v [B, H, Tk, v_dim], fp32."""
        q, latent = self._q_latent(x_BTD)
        if seq.cp is not None:  # context parallelism: keys are the gathered latents of [0, end of segment)
            latent = seq.cp.gather_keys(latent)
        return (q, *self._expand(latent))

    def _q_latent(self, x_BTD: torch.Tensor):
        """(q [B, H, T, nope+rope] fp32, latent [B, T, kv_lora_rank + rope]: kv_a_proj_with_mqa's output)."""
        B, T, _ = x_BTD.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD))).view(B, T, self.num_heads, self.q_head_dim)
        return q.transpose(1, 2).float(), self.kv_a_proj_with_mqa(x_BTD)

    def _expand(self, latent_BTL: torch.Tensor):
        """(k [B, H, Tk, nope+rope], v [B, H, Tk, v_dim]) fp32 of the latent [B, Tk, kv_lora_rank + rope]."""
        B, Tk, _ = latent_BTL.shape
        H = self.num_heads
        c_kv, k_pe = latent_BTL.split([self.kv_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c_kv)).view(B, Tk, H, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        # NoPE: the shared k_pe slot is broadcast over heads un-rotated (MQA-style).
        k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(B, Tk, H, self.rope)], dim=-1)
        return k.transpose(1, 2).float(), v.transpose(1, 2).float()  # [B, H, Tk, *], fp32 softmax

    def _expand_params(self) -> list:
        """the parameters :meth:`_expand` reads (their gradients come back from latent_attention)"""
        return [p for p in (*self.kv_a_layernorm.parameters(), *self.kv_b_proj.parameters()) if p.requires_grad]

    def _output(self, o, x_BTD: torch.Tensor):
        B, H, T, _ = o.shape
        o = o.transpose(1, 2).reshape(B, T, H * self.v_dim)
        o = o * torch.sigmoid(self.g_proj(x_BTD).float())
        return self.o_proj(o.to(x_BTD.dtype))
