"""The model runner: incremental K3 forward over a paged cache (the tensor side of megak3/inference).

It reads the training model's own modules (megak3/model/k3.py) and calls the existing ops, so the
weights, norms, Block AttnRes, routing (with the QB correction bias) and any QAT fake-quantisation
are the training forward's. What changes is only how the token mixers see the past:

* KDA layers carry, per sequence, the fp32 recurrent state ``S [H, K, V]`` and the short
  convolutions' tails (the last ``W - 1`` pre-convolution projections of q, k and v). A chunk of
  T tokens runs ``megak3.ops.kda.kda`` from that state (T = 1: the exact recurrent step).
* MLA layers cache, per token, the normed compressed latent ``c_kv`` and the shared ``k_pe`` slot
  (``kv_lora_rank + qk_rope_head_dim`` values) in pages of the pool, and attend in absorbed (MQA)
  form: ``q_nope`` is mapped into the latent space by ``kv_b_proj``'s key half, the output is read out
  of the latent by its value half. A ``kv_b_proj`` that is not a plain ``nn.Linear`` (MXFP8 activation
  quantisation) is applied to the cached latents instead (keys and values expanded), as in training.

Pool layout: one tensor ``[num_pages, page_numel]`` of the pool dtype (the model's dtype by default:
bf16 latents for a bf16 model, as vLLM's ``kv_cache_dtype="auto"``; attention reads them back in
fp32). An MLA page is ``[n_mla, page_size, R]``; a KDA checkpoint (every KDA layer's state and tails,
flattened) spans ``checkpoint_pages`` pages and stays fp32 whatever the pool dtype: its fp32 words
are stored bit for bit (a bf16 pool holds each as two bf16 slots), so a restored state is exact. The
host tier is a second such tensor in host memory (pinned on CUDA).

Tensor / expert parallelism: the runner also drives a model transformed by
``parallel.parallelize`` (the trainer's plan) without sequence or pipeline parallelism. Each rank
caches its own heads' KDA state and the (replicated) MLA latents; a token mixer wrapped in a
``TPRegion`` has its partial output all-reduced, the vocabulary-parallel head's logits are gathered,
and the expert dispatch runs inside the MoE as in training. Every rank runs the same engine loop.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..model.kda import _l2norm
from ..ops.kda import kda, kda_gate, recurrent_kda


def _inner(module: nn.Module) -> nn.Module:
    """The token mixer inside a tensor-parallel ``TPRegion`` (or the module itself)."""
    return getattr(module, "inner", module)


def reduce_from_tp(x, group):
    from parallel.tensor_parallel.collectives import reduce_from_tp as f

    return f(x, group)


def gather_from_tp(x, group, dim):
    from parallel.tensor_parallel.collectives import gather_from_tp as f

    return f(x, group, dim)


@dataclass
class SeqState:
    """One sequence's KDA state: per KDA layer S [H, K, V] fp32 and tails [3, W-1, P] fp32."""
    S: List[torch.Tensor]
    tails: List[torch.Tensor]


class ModelRunner:
    def __init__(self, model: nn.Module, page_size: int, num_pages: int, host_pages: int = 0,
                 pool_dtype: Optional[torch.dtype] = None):
        self.model = model.eval()
        cfg = model.config
        self.cfg = cfg
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.page_size = page_size
        kinds = [l.kind for l in model.layers]
        self.kda_idx = [i for i, k in enumerate(kinds) if k == "kda"]
        self.mla_idx = [i for i, k in enumerate(kinds) if k == "mla"]
        self.slot = {i: j for j, i in enumerate(self.mla_idx)}
        if len(model.layers) != cfg.num_layers or getattr(model, "context_parallel", None) is not None:
            raise ValueError("generation runs the whole model on every rank: use parallel.pp=1 and parallel.cp=1")
        for layer in model.layers:
            if getattr(layer.self_attn, "sequence_parallel", False):
                raise ValueError("generation runs without sequence parallelism; set parallel.sequence_parallel=false")
        m = cfg.mla
        self.R = m.kv_lora_rank + m.qk_rope_head_dim
        self.W = cfg.kda.conv_kernel
        self.state_shapes = []   # per KDA layer: (S [H, K, V], tails [3, W-1, H*K]); H = this rank's heads
        for i in self.kda_idx:
            a = _inner(model.layers[i].self_attn)
            P = a.num_heads * a.head_dim
            self.state_shapes.append(((a.num_heads, a.head_dim, a.head_dim), (3, self.W - 1, P)))
        self.pool_dtype = pool_dtype or (self.dtype if self.dtype.is_floating_point else torch.float32)
        if torch.finfo(self.pool_dtype).bits not in (16, 32):
            raise ValueError(f"cache dtype {self.pool_dtype} must be float32, bfloat16 or float16")
        self.words = 32 // torch.finfo(self.pool_dtype).bits   # pool slots per fp32 checkpoint value
        self.page_numel = max(len(self.mla_idx), 1) * page_size * self.R
        self.page_numel += self.page_numel % self.words         # whole fp32 words per page
        self.checkpoint_numel = sum(math.prod(a) + math.prod(b) for a, b in self.state_shapes)
        self.checkpoint_pages = max(1, math.ceil(self.checkpoint_numel * self.words / self.page_numel))
        self.pool = torch.zeros(num_pages, self.page_numel, dtype=self.pool_dtype, device=self.device)
        self.host = torch.zeros(host_pages, self.page_numel, dtype=self.pool_dtype,
                                pin_memory=self.device.type == "cuda")

    # ------------------------------------------------------------------------------ sizes
    @property
    def page_bytes(self) -> int:
        return self.page_numel * self.pool.element_size()

    def mla_values_per_token(self) -> int:
        """Cached MLA values per token: R per MLA layer."""
        return self.R * len(self.mla_idx)

    # --------------------------------------------------------------------------- KDA state
    def new_state(self) -> SeqState:
        z = lambda shape: torch.zeros(shape, dtype=torch.float32, device=self.device)
        return SeqState([z(a) for a, _ in self.state_shapes], [z(b) for _, b in self.state_shapes])

    def save_state(self, st: SeqState, pages: Sequence[int]) -> None:
        flat = torch.cat([t.float().reshape(-1) for pair in zip(st.S, st.tails) for t in pair])
        buf = torch.zeros(len(pages) * self.page_numel // self.words, dtype=torch.float32, device=self.device)
        buf[:flat.numel()] = flat
        self.pool[torch.as_tensor(list(pages), device=self.device)] = buf.view(self.pool_dtype).view(len(pages), -1)

    def load_state(self, pages: Sequence[int]) -> SeqState:
        flat = self.pool[torch.as_tensor(list(pages), device=self.device)].reshape(-1).view(torch.float32)
        S, tails, off = [], [], 0
        for shapes in self.state_shapes:
            for shape, out in zip(shapes, (S, tails)):
                n = math.prod(shape)
                out.append(flat[off:off + n].view(shape).clone())
                off += n
        return SeqState(S, tails)

    def copy_state(self, st: SeqState) -> SeqState:
        return SeqState([t.clone() for t in st.S], [t.clone() for t in st.tails])

    def _latent_pool(self) -> torch.Tensor:
        """The MLA part of the pool as [num_pages, n_mla, page_size, R]."""
        return self.pool[:, :len(self.mla_idx) * self.page_size * self.R].view(
            self.pool.shape[0], len(self.mla_idx), self.page_size, self.R)

    def _slots(self, table: List[int], start: int, end: int):
        pos = torch.arange(start, end, device=self.device)
        return torch.as_tensor(table, device=self.device)[pos // self.page_size], pos % self.page_size

    def read_latents(self, table: List[int], start: int, end: int) -> torch.Tensor:
        """The cached MLA latents of positions start .. end-1 of a sequence's page table, [T, n_mla, R]."""
        page, off = self._slots(table, start, end)
        return self._latent_pool()[page, :, off]

    def write_latents(self, table: List[int], start: int, latents: torch.Tensor) -> None:
        """Store ``read_latents``' result at positions start .. start+T-1 of another page table."""
        page, off = self._slots(table, start, start + latents.shape[0])
        self._latent_pool()[page, :, off] = latents

    def execute(self, actions) -> None:
        """Run the cache manager's copies in order (host-tier write-backs and prefetches)."""
        for op, a, b in actions:
            if op == "save":
                self.host[b].copy_(self.pool[a])
            else:
                self.pool[b].copy_(self.host[a])

    # ----------------------------------------------------------------------------- forward
    @torch.no_grad()
    def embed(self, ids: List[int], images=None) -> torch.Tensor:
        """Token (and spliced image) embeddings of a whole prompt, [1, T, D]."""
        ids_BT = torch.as_tensor([ids], dtype=torch.long, device=self.device)
        return self.model.embed(ids_BT, images or None)

    @torch.no_grad()
    def forward(self, x0_BTD: torch.Tensor, states: List[SeqState], starts: List[int],
                tables: List[List[int]], all_logits: bool = False) -> torch.Tensor:
        """Run N sequences' next T tokens (embeddings ``x0_BTD``) from positions ``starts``; their
        pages must already cover ``start + T`` tokens. Updates ``states`` in place; returns fp32
        logits [N, T, V] (``all_logits``) or of the last token [N, V]."""
        model = self.model
        N, T, _ = x0_BTD.shape
        S = [torch.stack([st.S[j] for st in states]) for j in range(len(self.kda_idx))]
        tails = [torch.stack([st.tails[j] for st in states]) for j in range(len(self.kda_idx))]
        addr = self._addresses(starts, tables, T) if self.mla_idx else None
        partial, blocks = x0_BTD, ()
        kj = 0
        for layer in model.layers:
            x = layer._attn_input(partial, *blocks)
            if layer.layer_idx % layer.block_size == 0:
                blocks, partial = blocks + (partial,), None
            attn = _inner(layer.self_attn)
            if layer.kind == "kda":
                a, S[kj], tails[kj] = self._kda(attn, x, S[kj], tails[kj])
                kj += 1
            else:
                a = self._mla(attn, self.slot[layer.layer_idx], x, addr)
            if attn is not layer.self_attn:   # a TPRegion: this rank's heads give a partial sum
                a = reduce_from_tp(a, layer.self_attn.group)
            partial = a if partial is None else partial + a
            x = layer._mlp_input(partial, *blocks)
            f = layer._moe(x)[0] if layer.is_moe else layer.mlp(x)
            partial = partial + f
        for n, st in enumerate(states):
            st.S = [s[n] for s in S]
            st.tails = [t[n] for t in tails]
        if not all_logits:
            partial, blocks = partial[:, -1:], tuple(b[:, -1:] for b in blocks)
        logits = model.head(partial, blocks)
        group = getattr(model.lm_head, "group", None)
        if group is not None:   # vocabulary-parallel head: this rank's slice of the vocabulary
            logits = gather_from_tp(logits, group, dim=-1)
        return logits if all_logits else logits[:, 0]

    def _addresses(self, starts, tables, T):
        """Pool addresses of the new tokens and the padded key layout of every sequence."""
        ps, dev = self.page_size, self.device
        pos_BT = torch.as_tensor(starts, device=dev)[:, None] + torch.arange(T, device=dev)
        ends = [s + T for s in starts]
        nb = -(-max(ends) // ps)
        tab = torch.zeros(len(tables), nb, dtype=torch.long, device=dev)
        for n, t in enumerate(tables):
            need = -(-ends[n] // ps)
            tab[n, :need] = torch.as_tensor(t[:need], device=dev)
        page_BT = tab.gather(1, pos_BT // ps)
        key_pos = torch.arange(nb * ps, device=dev)
        mask_BTC = key_pos[None, None, :] <= pos_BT[:, :, None]   # causal; also hides padding
        return page_BT, pos_BT % ps, tab, mask_BTC, max(ends)

    def _kda(self, attn, x_BTD, S_BHKV, tails_B3WP):
        N, T, _ = x_BTD.shape
        H, K, W = attn.num_heads, attn.head_dim, self.W
        outs, new_tails = [], []
        pairs = ((attn.q_proj, attn.q_conv1d), (attn.k_proj, attn.k_conv1d), (attn.v_proj, attn.v_conv1d))
        for c, (proj, conv) in enumerate(pairs):
            xf = torch.cat([tails_B3WP[:, c], proj(x_BTD).float()], 1)   # ShortConv with its past
            w_PW = conv.weight[:, 0, :].float()
            out = None
            for j in range(W):  # tap j looks j tokens back (ShortConv's order)
                term = xf[:, W - 1 - j: W - 1 - j + T] * w_PW[:, W - 1 - j]
                out = term if out is None else out + term
            outs.append(F.silu(out))
            new_tails.append(xf[:, T:])
        q = _l2norm(outs[0].view(N, T, H, K))
        k = _l2norm(outs[1].view(N, T, H, K))
        v = outs[2].view(N, T, H, K)
        # [N, T, H, K] given: kda_gate would read a flat [N, 1, H*K] of one head (H = 1, one token) as [.., H, K]
        g = kda_gate(attn.f_b_proj(attn.f_a_proj(x_BTD)).view(N, T, H, K), attn.A_log, attn.dt_bias,
                     attn.lower_bound)
        beta = torch.sigmoid(attn.b_proj(x_BTD).float())
        if T == 1:
            o, S_BHKV = recurrent_kda(q, k, v, g, beta, initial_state=S_BHKV, output_final_state=True)
        else:
            o, S_BHKV = kda(q, k, v, g, beta, initial_state=S_BHKV, output_final_state=True,
                            chunk_size=attn.chunk_size, use_fla=attn.use_fla)
        return attn._output(o, x_BTD), S_BHKV, torch.stack(new_tails, 1)

    def _mla(self, attn, slot: int, x_BTD, addr):
        page_BT, off_BT, tab, mask_BTC, L = addr
        N, T, _ = x_BTD.shape
        H, nope, rope, r = attn.num_heads, attn.nope, attn.rope, attn.kv_rank
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x_BTD))).view(N, T, H, nope + rope).float()
        c_kv, k_pe = attn.kv_a_proj_with_mqa(x_BTD).split([r, rope], dim=-1)
        entry = torch.cat([attn.kv_a_layernorm(c_kv), k_pe], -1).float()
        pool = self._latent_pool()
        pool[page_BT, slot, off_BT] = entry.to(pool.dtype)
        lat_BCR = pool[tab, slot].reshape(N, -1, self.R)[:, :L].float()
        mask = mask_BTC[:, :, :L].unsqueeze(1)                       # [N, 1, T, L]
        c_BCr, pe_BCd = lat_BCR.split([r, rope], dim=-1)
        q_nope, q_pe = q.split([nope, rope], dim=-1)
        if type(attn.kv_b_proj) is nn.Linear:   # absorbed (MQA) form over the latent
            W_HXr = attn.kv_b_proj.weight.float().view(H, nope + attn.v_dim, r)
            q_lat = torch.einsum("nthd,hdr->nhtr", q_nope, W_HXr[:, :nope])
            s = (torch.einsum("nhtr,nlr->nhtl", q_lat, c_BCr)
                 + torch.einsum("nthd,nld->nhtl", q_pe, pe_BCd)) * attn.softmax_scale
            p = s.masked_fill(~mask, float("-inf")).softmax(-1)
            o_lat = torch.einsum("nhtl,nlr->nhtr", p, c_BCr)
            o = torch.einsum("nhtr,hvr->nhtv", o_lat, W_HXr[:, nope:])
        else:   # expanded keys and values (the projection quantises its input)
            kv = attn.kv_b_proj(c_BCr.to(x_BTD.dtype)).view(N, L, H, nope + attn.v_dim).float()
            k_nope, v = kv.split([nope, attn.v_dim], dim=-1)
            s = (torch.einsum("nthd,nlhd->nhtl", q_nope, k_nope)
                 + torch.einsum("nthd,nld->nhtl", q_pe, pe_BCd)) * attn.softmax_scale
            p = s.masked_fill(~mask, float("-inf")).softmax(-1)
            o = torch.einsum("nhtl,nlhv->nhtv", p, v)
        return attn._output(o, x_BTD)
