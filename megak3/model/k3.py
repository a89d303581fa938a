"""The Kimi-K3 decoder (K3_SPEC.md §3): hybrid KDA / Gated-MLA layers, Block AttnRes across depth,
a dense SiTU-GLU layer 0 and Stable LatentMoE elsewhere, untied lm_head, optional native vision.

No process-group code here: parallel layouts transform this module from the outside (parallel/).
The depth state that flows between layers (and across pipeline stages) is ``(partial, blocks)``:
the current AttnRes block's partial sum and the tuple of committed block sums.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .attn_res import AttnResMix
from .ffn import SiTUGLUMLP
from .kda import KimiDeltaAttention
from .mla import GatedMLA
from .moe import LatentMoE, MoEStats
from .norm import RMSNorm, set_norm_impl
from .recompute import MODES as RECOMPUTE_MODES, recompute_whole, segment, selective_scope
from .seqinfo import SeqInfo, make_seq_info

Blocks = Tuple[torch.Tensor, ...]


@dataclass
class K3Output:
    loss: Optional[torch.Tensor]
    """mean next-token cross entropy over labels != -100 (None without labels)"""
    loss_sum: Optional[torch.Tensor]
    """summed token losses (for exact averaging over micro-batches / ranks)"""
    num_tokens: Union[torch.Tensor, int]
    """number of labelled tokens: a 0-dim int64 tensor on the labels' device (no host read); 0 without labels"""
    logits: Optional[torch.Tensor]
    """[B, T, V] fp32 logits, when requested"""
    moe_stats: List[MoEStats] = field(default_factory=list)
    """router statistics, one entry per MoE layer in layer order"""


class K3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_idx = layer_idx
        self.block_size = cfg.attn_res_block_size
        self.kind = cfg.layer_kinds()[layer_idx]
        self.is_moe = cfg.is_moe_layer(layer_idx)
        self.attn_res = AttnResMix(d, eps)
        self.mlp_res = AttnResMix(d, eps)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.self_attn = KimiDeltaAttention(cfg) if self.kind == "kda" else GatedMLA(cfg)
        if self.is_moe:
            self.mlp = LatentMoE(cfg)
        else:
            self.mlp = SiTUGLUMLP(d, cfg.dense_intermediate_size, cfg.situ_beta1, cfg.situ_beta2)

    def forward(self, partial: torch.Tensor, blocks: Blocks, seq: SeqInfo):
        """One decoder layer on the AttnRes depth state; returns (partial, blocks, moe_stats|None).
        Under ``recompute='selective'`` each sub-block is a :func:`segment` (megak3/model/recompute.py)."""
        new_block = self.layer_idx % self.block_size == 0
        x = segment(self._attn_input, partial, *blocks)
        if new_block:  # block boundary: commit the finished block
            blocks = blocks + (partial,)
            partial = None
        a = self.self_attn(x, seq)
        partial = a if partial is None else partial + a
        x = segment(self._mlp_input, partial, *blocks)
        stats = None
        if self.is_moe:
            f, stats = segment(self._moe, x)
        else:
            f = segment(self.mlp, x)
        return partial + f, blocks, stats

    def _attn_input(self, partial, *blocks):
        return self.input_layernorm(partial if not blocks else self.attn_res(partial, blocks))

    def _mlp_input(self, partial, *blocks):
        return self.post_attention_layernorm(self.mlp_res(partial, blocks))

    def _moe(self, x):
        f, stats = self.mlp(x.reshape(-1, x.shape[-1]))
        return f.view_as(x), stats


class K3Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.config = cfg
        d = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(K3DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.output_attn_res = AttnResMix(d, cfg.rms_norm_eps)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        self.vision = None
        if cfg.vision.enabled:
            from .vision import VisionTower

            self.vision = VisionTower(cfg.vision, d, cfg.rms_norm_eps)
        set_norm_impl(self, cfg.norm_impl)   # model.norm_impl on every RMSNorm (megak3/model/norm.py)
        self.recompute = "none"
        self.has_mla = "mla" in cfg.layer_kinds()
        # what a parallel layout plugs in (ParallelHooks, set_parallel_hooks): the model math stays
        # free of process groups
        self._parallel_hooks = ParallelHooks()

    @property
    def parallel_hooks(self) -> "ParallelHooks":
        """The hooks a parallel layout installed (the single-process defaults until one does)."""
        return self._parallel_hooks

    def set_parallel_hooks(self, hooks: "ParallelHooks") -> None:
        """Install a parallel layout's hooks (parallel/parallelize.py ``parallelize_tp``)."""
        if not isinstance(hooks, ParallelHooks):
            raise TypeError(f"set_parallel_hooks takes a ParallelHooks, got {type(hooks).__name__}")
        self._parallel_hooks = hooks

    @property
    def loss_fn(self) -> Callable:
        """(logits, labels) -> (loss_sum, count): ``parallel_hooks.loss_fn``."""
        return self._parallel_hooks.loss_fn

    @property
    def context_parallel(self):
        """This rank's context-parallel row cutter, or None: ``parallel_hooks.context_parallel``."""
        return self._parallel_hooks.context_parallel

    @property
    def sequence_shard(self) -> Optional[Callable]:
        """[B, T, D] -> this rank's token shard after the embedding, or None: ``parallel_hooks.sequence_shard``."""
        return self._parallel_hooks.sequence_shard

    @property
    def recompute(self) -> str:
        """activation recomputation while training: 'none', 'full' or 'selective'
        (megak3/model/recompute.py), for the decoder layers and the vision tower's blocks alike"""
        return self._recompute

    @recompute.setter
    def recompute(self, mode: str) -> None:
        self._recompute = mode
        if self.vision is not None:
            from .vision import VisionTower

            for m in self.vision.modules():   # the tower itself, or inside parallel/'s image-split wrapper
                if isinstance(m, VisionTower):
                    m.recompute = mode

    def batch_dependent_parameters(self) -> list:
        """Parameters whose gradient exists only in steps whose batch uses them: the vision tower's
        (only micro-batches with images run it). Every other parameter gets a gradient in every
        training step (the ZeRO-1 optimizer relies on it: parallel/data_parallel/grads.py)."""
        return [] if self.vision is None else list(self.vision.parameters())

    @property
    def gradient_checkpointing(self) -> bool:
        """Whole-layer recomputation (``recompute == 'full'``); setting False means 'none'."""
        return self.recompute == "full"

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, on: bool) -> None:
        self.recompute = "full" if on else "none"

    def moe_layers(self) -> List[LatentMoE]:
        return [l.mlp for l in self.layers if l.is_moe]

    # ---- pieces (also used by pipeline stages) ----------------------------------------------
    def shard_inputs(self, input_ids_BT: torch.Tensor, labels_BT: Optional[torch.Tensor],
                     cu_seqlens: Optional[torch.Tensor]):
        """(input ids, labels, SeqInfo) this rank runs: the whole rows, or under context parallelism
        its segment of every row (``cu_seqlens`` always describes the whole rows)."""
        if self.context_parallel is not None:
            return self.context_parallel.shard(input_ids_BT, labels_BT, cu_seqlens)
        B, T = input_ids_BT.shape
        return input_ids_BT, labels_BT, make_seq_info(B, T, cu_seqlens, input_ids_BT.device)

    def embed(self, input_ids_BT: torch.Tensor, images: Optional[Sequence[torch.Tensor]] = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids_BT)
        if images and self.context_parallel is not None:
            raise ValueError("images under context parallelism (parallel.cp > 1) are not supported: their "
                             "tokens are spliced into the whole sequence, which no CP rank holds; train "
                             "image-text data with parallel.cp=1")
        if images:
            if self.vision is None:
                raise ValueError("images were given but model.vision.enabled=false; enable the vision tower")
            from .vision import splice_image_tokens

            x = splice_image_tokens(x, input_ids_BT, self.vision(list(images)),
                                    self.config.media_placeholder_token_id)
        return x

    def run_layers(self, layers, partial, blocks: Blocks, seq: SeqInfo):
        mode = self.recompute
        if mode not in RECOMPUTE_MODES:
            raise ValueError(f"K3Model.recompute={mode!r} must be one of {', '.join(RECOMPUTE_MODES)}")
        if not (self.training and torch.is_grad_enabled()):
            mode = "none"
        stats: List[MoEStats] = []
        with (selective_scope() if mode == "selective" else contextlib.nullcontext()):
            for layer in layers:
                if mode == "full":
                    partial, blocks, st = recompute_whole(_call_layer, layer, partial, seq, *blocks)
                else:
                    partial, blocks, st = layer(partial, blocks, seq)
                if st is not None:
                    stats.append(st)
        return partial, blocks, stats

    def head(self, partial, blocks: Blocks) -> torch.Tensor:
        return self.lm_head(self.norm(self.output_attn_res(partial, blocks))).float()

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None, images: Optional[Sequence[torch.Tensor]] = None,
                return_logits: Optional[bool] = None) -> K3Output:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T]; got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds model.max_seq_len={self.config.max_seq_len}")
        input_ids, labels, seq = self.shard_inputs(input_ids, labels, cu_seqlens)
        x = self.embed(input_ids, images)
        if self.sequence_shard is not None:
            x = self.sequence_shard(x)
        partial, blocks, stats = self.run_layers(self.layers, x, (), seq)
        logits = self.head(partial, blocks)
        loss = loss_sum = None
        n = 0
        if labels is not None:
            loss_sum, n = self.loss_fn(logits, labels)
            # n: a device tensor from token_loss_sum (no host read); a custom loss_fn may count on the host
            loss = loss_sum / (n.clamp_min(1) if torch.is_tensor(n) else max(n, 1))
        keep = return_logits if return_logits is not None else labels is None
        return K3Output(loss, loss_sum, n, logits if keep else None, stats)


def _call_layer(layer, partial, seq, *blocks):
    return layer(partial, tuple(blocks), seq)


def token_loss_sum(logits_BTV: torch.Tensor, labels_BT: torch.Tensor):
    """(sum of next-token CE over labels != -100, count). Labels are already shifted by the loader.
    The count is a 0-dim int64 tensor on the labels' device: reading it on the host would wait for
    the device on every micro-batch."""
    n = (labels_BT != -100).sum()
    loss = F.cross_entropy(logits_BTV.reshape(-1, logits_BTV.shape[-1]).float(), labels_BT.reshape(-1),
                           ignore_index=-100, reduction="sum")
    return loss, n


@dataclass(frozen=True)
class ParallelHooks:
    """What a parallel layout plugs into a :class:`K3Model` (``model.set_parallel_hooks(hooks)``;
    parallel/parallelize.py under tensor parallelism, parallel/context_parallel.py under CP). The defaults are the single-process ones.
    The pipeline engine (parallel/pipeline/engine.py) reads them through ``model.loss_fn`` and
    ``model.sequence_shard`` as K3Model.forward does."""

    loss_fn: Callable = token_loss_sum
    """(logits, labels) -> (loss_sum, count): e.g. vocab-parallel cross entropy over this rank's logits slice"""
    sequence_shard: Optional[Callable] = None
    """[B, T, D] -> this rank's token shard after the embedding (sequence parallelism when the
    embedding cannot reduce-scatter itself); None: keep every token"""
    context_parallel: Optional[Any] = None
    """context parallelism: an object whose ``shard(input_ids_BT, labels_BT, cu_seqlens)`` cuts whole
    rows into this rank's sequence segment (parallel/context_parallel.py ``ContextParallel``; used by
    ``K3Model.shard_inputs``); None: every rank keeps whole rows"""


def build_model(cfg: ModelConfig, seed: int = 0, device=None, init: bool = True) -> K3Model:
    """Construct a K3Model and initialise it deterministically from ``seed`` (skipped on meta)."""
    from .init import init_model

    if device is not None and torch.device(device).type == "meta":
        with torch.device("meta"):
            return K3Model(cfg)
    model = K3Model(cfg)
    if device is not None:
        model = model.to(device)
    if init:
        init_model(model, seed, cfg.init_std)
    return model
