"""Packed-sequence metadata computed once per forward and shared by every layer.

``cu_seqlens`` indexes the flattened ``B*T`` token stream (fla convention). Row ends are always
document ends (a document never continues into the next row), so the row boundaries are merged
in here: callers may pass document boundaries only.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence, Tuple

import torch

from ..ops.h2d import host_to_device


@dataclass(frozen=True)
class SeqInfo:
    batch: int
    seqlen: int
    cu_seqlens: Optional[torch.Tensor]
    """int32 [N+1] offsets into the flattened B*T stream, or None (one document per row)"""
    doc_ids_BT: Optional[torch.Tensor]
    """int64 [B, T] document index per token, or None"""
    pos_in_doc_BT: Optional[torch.Tensor]
    """int64 [B, T] position of each token inside its document, or None"""
    cu_seqlens_host: Optional[torch.Tensor] = None
    """int64 [N+1] the same offsets on the host (fla's ``cu_seqlens_cpu``; the CPU KDA twin reads
    its document layout from it), so no kernel needs a device-to-host copy to size its work"""
    cp: Optional[object] = None
    """under context parallelism: this rank's segment (parallel.context_parallel.CPShard; the layers
    call its causal_conv / kda / gather_keys), None otherwise. The fields above then describe the
    local segment (T = global length / cp)."""

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def moved(self, device, extra: Sequence[Optional[torch.Tensor]] = ()) -> Tuple["SeqInfo", list]:
        """(this SeqInfo with ``cu_seqlens`` / ``doc_ids_BT`` / ``pos_in_doc_BT`` on ``device``, the
        ``extra`` host tensors on ``device``): all in ONE non-blocking copy
        (:func:`megak3.ops.h2d.host_to_device`); ``cu_seqlens_host`` stays on the host."""
        cu, doc, pos, *rest = host_to_device([self.cu_seqlens, self.doc_ids_BT, self.pos_in_doc_BT, *extra], device)
        return replace(self, cu_seqlens=cu, doc_ids_BT=doc, pos_in_doc_BT=pos), rest


def make_seq_info(batch: int, seqlen: int, cu_seqlens: Optional[torch.Tensor],
                  device: Optional[torch.device] = None) -> SeqInfo:
    """Validate ``cu_seqlens`` and derive per-token document ids / positions (index math on the
    host); ``device``: where the three index tensors go, in one non-blocking copy
    (:meth:`SeqInfo.moved`), None: they stay on the host."""
    if cu_seqlens is None:
        return SeqInfo(batch, seqlen, None, None, None)
    total = batch * seqlen
    cu = torch.as_tensor(cu_seqlens, dtype=torch.int64).flatten().cpu()
    if cu.numel() < 2 or cu[0].item() != 0 or cu[-1].item() != total:
        raise ValueError(f"cu_seqlens must start at 0 and end at B*T={total}; got {cu.tolist()[:8]}...")
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError("cu_seqlens must be non-decreasing")
    rows = torch.arange(0, total + 1, seqlen, dtype=torch.int64, device="cpu")  # host index math
    cu = torch.unique(torch.cat([cu, rows]))  # sorted; merges row ends, drops empty documents
    lengths = cu[1:] - cu[:-1]
    doc_ids = torch.repeat_interleave(torch.arange(lengths.numel(), device="cpu"), lengths)
    starts = torch.repeat_interleave(cu[:-1], lengths)
    pos = torch.arange(total, device="cpu") - starts
    seq = SeqInfo(batch, seqlen, cu.to(torch.int32), doc_ids.view(batch, seqlen), pos.view(batch, seqlen),
                  cu_seqlens_host=cu)
    return seq if device is None else seq.moved(device)[0]
