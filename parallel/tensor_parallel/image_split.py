"""The vision tower under tensor parallelism: weights replicated, images split over the TP ranks.

Every TP rank of a group sees the same micro-batch, so the plain replicated tower would encode every
image tp times. Here rank r encodes images r, r + tp, r + 2tp, ... (round robin, in batch order), and
the merged tokens are all-gathered (padded to the largest rank's count, then put back in image
order), so each rank splices the same full set of image tokens as one process would.

Backward: the spliced tokens feed the TP regions, whose input gradient is already the full sum on
every rank (and under SP the scatter's backward all-gathers it), so the gather's backward just keeps
this rank's slice (``gather_from_tp``). Each rank's tower gradient then covers only its images: the
vision parameters are partial over TP and summed by ``sync_partial_grads`` (the ``images`` rule of
parallel/sharding.py). A rank with no image this micro-batch still produces (zero) gradients for every tower
parameter, because the TP gradient sum needs the same parameter set on every rank.

Why this and not the alternatives, for K3's tower (27 layers of width 1024, 401M parameters + a 46M
projector; a 1024x1024 image is 5329 patches -> 1332 LM tokens). Training FLOPs per patch: 3 x
(2 x 447M + attention 4 x 5329 x 1536 x 27) ~ 5.3 GFLOP, i.e. ~21 GFLOP per vision LM token,
~3% of the decoder's 6 x 104B = 625 GFLOP per token (not counted).
- Replicated (every TP rank encodes every image): per rank 21 GFLOP per vision token against
  625/tp for the decoder: +27% of a vision token's per-rank compute at tp=8 (+7% at tp=2).
- Sharded like the decoder (heads, MLP columns): compute 1/tp, but each of 27 layers all-reduces
  [patches, 1024] twice forward and twice backward: ~216 KB per patch in bf16 (~380 KB of ring
  traffic per rank at tp=8), about as long on NVLink (~1.5 us at 250 GB/s) as the 0.66 GFLOP of
  per-rank compute it parallelises (~1.3 us at 500 TFLOP/s), in 108 latency-bound collectives.
- Split images (this): compute 1/tp, one all-gather of the merged tokens (7168 x 2 B per LM token,
  ~3.6 KB per patch), and one TP all-reduce of the tower's gradient per step (1.8 GB fp32, ~10 ms at
  NVLink speed, overlappable); weights stay whole on every rank (0.9 GB bf16; ZeRO-1 shards the
  optimizer state). Load balance is by image count, not size: a mix of very different sizes
  leaves some ranks idle (a size-aware assignment is a possible refinement).
These are estimates from the configuration, not measurements (this project's CPU machine cannot
time NVLink).
"""
from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F
from torch import nn

from .collectives import gather_from_tp, group_rank, group_size


class ImageSplitTower(nn.Module):
    """Wraps a :class:`megak3.model.vision.VisionTower`; same call: list of [C, H, W] -> list of [n_i, E]."""

    def __init__(self, tower: nn.Module, group):
        super().__init__()
        self.inner = tower
        self.group = group
        self.size, self.rank = group_size(group), group_rank(group)

    def num_tokens(self, H: int, W: int) -> int:
        return self.inner.num_tokens(H, W)

    def forward(self, images: List[torch.Tensor]) -> List[torch.Tensor]:
        for i, img in enumerate(images):
            self.inner._check(i, img)  # every rank checks every image: the same error everywhere
        counts = [self.inner.num_tokens(img.shape[1], img.shape[2]) for img in images]
        owned = [list(range(r, len(images), self.size)) for r in range(self.size)]
        pad = max(sum(counts[j] for j in js) for js in owned)
        mine = owned[self.rank]
        params = list(self.inner.parameters())
        width = self.inner.merger.fc2.out_features
        if mine:
            local = torch.cat(self.inner([images[j] for j in mine]))
        else:
            # zero-weighted touch of every parameter: gradients exist on every rank (see the docstring)
            anchor = sum(p.reshape(-1)[:1].sum() for p in params) * 0.0
            local = params[0].new_zeros(0, width) + anchor
        local = F.pad(local, (0, 0, 0, pad - local.shape[0]))
        full = gather_from_tp(local, self.group, dim=0)  # [size * pad, E]
        out: List[torch.Tensor] = [None] * len(images)  # type: ignore[list-item]
        for r, js in enumerate(owned):
            off = r * pad
            for j in js:
                out[j] = full[off:off + counts[j]]
                off += counts[j]
        return out
