"""Tensor-parallel sharding of each model family: the one table of what TP does to every parameter.

Read by :func:`parallel.parallelize.parallelize_tp` (which splits the tensors, wraps the TP regions and
records the split in the :class:`parallel.plan.ParallelPlan`) and by the planner
(megak3/launch/planner/inventory.py, which counts shard sizes and partial gradients from names alone,
without building or sharding a model: a search plans thousands of layouts).

A rule maps a canonical (single-process) parameter name, matched whole by a regular expression, to
its kind; the first rule that matches wins:

  column      split along ``dim`` 0 into tp contiguous chunks, rank r holds chunk r (output rows:
              heads, channels, FFN width); inside a TP region
  row         split along ``dim`` 1 (input columns: the region's output projection, whose output is
              partial and reduced by the region's exit collective)
  vocab       split along ``dim`` 0 over the vocabulary (embedding; lm_head with vocab-parallel cross
              entropy)
  region      whole on every TP rank inside a TP region, feeding sharded heads: its gradient is a
              partial sum over TP whenever tp > 1 (MLA's q_a/kv_a projections and norms, KDA's f_a
              projection and per-head output norm)
  images      whole on every TP rank, which encodes only its share of the images
              (parallel/tensor_parallel/image_split.py): partial gradients whenever tp > 1
  expert      routed experts: split along ``dim`` 0 over the EP group (parallel/expert_parallel.py),
              whole on every TP rank (etp = 1); like ``replicated`` for TP
  replicated  whole on every TP rank; under sequence parallelism applied to this rank's token shard,
              so its gradient is partial (norms, AttnRes mixes, router, latent projections, final
              norm); without SP computed redundantly on identical inputs (complete gradients)

Partial gradients are summed over the TP group after backward
(:func:`parallel.parallelize.sync_partial_grads`); the plan drops expert parameters from that list
when EP shards them (their gradients are complete within the EP group).

The TP regions themselves (which modules get the enter/exit collectives) are parallelize_tp's: every
decoder layer's ``self_attn``, a dense layer's ``mlp`` and a MoE layer's ``mlp.shared_experts``; a
parameter inside a region whose rule is not column / row / region is refused there.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, Optional, Tuple

COLUMN, ROW, VOCAB, REGION, IMAGES, EXPERT, REPLICATED = (
    "column", "row", "vocab", "region", "images", "expert", "replicated")
TP_SPLIT = (COLUMN, ROW, VOCAB)
"""kinds whose tensors TP splits"""


@dataclass(frozen=True)
class TPRule:
    """What tensor (and expert) parallelism does with one parameter."""

    kind: str
    dim: Optional[int] = None
    """the split dim: over TP for column / row / vocab, over EP for expert; None otherwise"""

    @property
    def tp_dim(self) -> Optional[int]:
        """The dim TP splits (None: every TP rank holds the whole tensor)."""
        return self.dim if self.kind in TP_SPLIT else None

    def partial_grad(self, sequence_parallel: bool) -> bool:
        """Whether, at tp > 1, this parameter's gradient is a partial sum over the TP group."""
        if self.kind in TP_SPLIT:
            return False
        if self.kind in (REGION, IMAGES):
            return True
        return sequence_parallel  # replicated / expert: applied to this rank's tokens under SP


_L = r"layers\.\d+\."
TABLES: Dict[str, Tuple[Tuple[str, TPRule], ...]] = {
    # Kimi-K3: KDA and MLA attention layers, dense SiTU-GLU FFN or LatentMoE (shared + routed experts),
    # AttnRes mixes, vocab-parallel embedding and head, the vision tower
    "k3": (
        (r"embed_tokens\.weight", TPRule(VOCAB, 0)),
        (r"lm_head\.weight", TPRule(VOCAB, 0)),
        # KDA: q/k/v/g/f_b/b projections, short convolutions, per-head decay and dt bias; MLA: q_b/kv_b/g
        (_L + r"self_attn\.(q|k|v|g|f_b|b|q_b|kv_b)_proj\.weight", TPRule(COLUMN, 0)),
        (_L + r"self_attn\.(q|k|v)_conv1d\.weight", TPRule(COLUMN, 0)),
        (_L + r"self_attn\.(A_log|dt_bias)", TPRule(COLUMN, 0)),
        (_L + r"self_attn\.o_proj\.weight", TPRule(ROW, 1)),
        (_L + r"self_attn\.(f_a_proj|o_norm|q_a_proj|q_a_layernorm|kv_a_proj_with_mqa|kv_a_layernorm)\.weight",
         TPRule(REGION)),
        # dense FFN and the MoE's shared experts: gate/up column, down row
        (_L + r"mlp\.(shared_experts\.)?(gate|up)_proj\.weight", TPRule(COLUMN, 0)),
        (_L + r"mlp\.(shared_experts\.)?down_proj\.weight", TPRule(ROW, 1)),
        (_L + r"mlp\.experts\.(w1|w2|w3)", TPRule(EXPERT, 0)),
        (r"vision\..*", TPRule(IMAGES)),
        (r".*", TPRule(REPLICATED)),
    ),
}
"""model family -> ((canonical name pattern, rule), ...), first match wins"""

_COMPILED = {fam: tuple((re.compile(p), r) for p, r in rules) for fam, rules in TABLES.items()}


@lru_cache(maxsize=None)
def tp_rule(name: str, family: str = "k3") -> TPRule:
    """The rule of canonical parameter ``name`` (wrappers' ``.inner.`` stripped) in ``family``'s table."""
    for pattern, rule in _COMPILED[family]:
        if pattern.fullmatch(name):
            return rule
    raise KeyError(f"no tensor-parallel rule matches {name!r} in the {family!r} table (parallel/sharding.py)")
