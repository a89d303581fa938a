"""The KDA entry point :func:`kda`: fla's Triton ``chunk_kda`` where it runs and is importable, else
the pure-torch :func:`~megak3.ops.kda.chunked.chunk_kda`; and the offsets tensors handed to fla."""
from __future__ import annotations

import os
import weakref

import torch

from .chunked import chunk_kda
from .gate import fla_safe_gate

_FLA_CHUNK_KDA = None
_FLA_TRIED = False
_FLA_OFFSETS: dict = {}  # id(offsets given) -> (weakref to it, its int64 copy handed to fla)


def _fla_chunk_kda():
    """fla's Triton chunk_kda, imported lazily once; None when fla (or Triton) is unavailable."""
    global _FLA_CHUNK_KDA, _FLA_TRIED
    if not _FLA_TRIED:
        _FLA_TRIED = True
        try:
            from fla.ops.kda import chunk_kda as fla_chunk_kda
            _FLA_CHUNK_KDA = fla_chunk_kda
        except Exception:  # ImportError, or Triton failing to initialise on a CPU-only host
            _FLA_CHUNK_KDA = None
    return _FLA_CHUNK_KDA


def _fla_runs_on(x: torch.Tensor) -> bool:
    """fla's kernels take CUDA tensors, or CPU tensors under Triton's interpreter (TRITON_INTERPRET=1,
    the CI check of tools/ci_triton.sh)."""
    return x.is_cuda or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def _fla_offsets(cu: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """``cu`` as int64 on ``device``, the same tensor object for the same ``cu`` on every call (fla
    caches its chunk indices by the identity of the offsets it is given; a fresh ``.long()`` per
    call would rebuild them, and read them back from the device, in every layer)."""
    if cu is None or (cu.dtype == torch.int64 and cu.device == device):
        return cu
    hit = _FLA_OFFSETS.get(id(cu))
    if hit is not None and hit[0]() is cu and hit[1].device == device:
        return hit[1]
    key = id(cu)
    ref = weakref.ref(cu, lambda _, key=key: _FLA_OFFSETS.pop(key, None))
    _FLA_OFFSETS[key] = (ref, cu.to(device=device, dtype=torch.int64))
    return _FLA_OFFSETS[key][1]


def kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
        chunk_size=64, use_fla=True, lower_bound=-5.0, cu_seqlens_cpu=None):
    """KDA entry point: fla's Triton `chunk_kda` where it runs (`_fla_runs_on`) and is importable,
    else `chunk_kda` here.

    Arguments as `chunk_kda`. q/k must already be L2-normalised and g precomputed by `kda_gate`
    (so fla runs with use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False). `lower_bound` is the
    gate bound g was built with (the layer passes model.kda.gate_lower_bound): fla's safe_gate tiles
    (K3_SPEC §4.4) are used when it lies in [-5, 0) (`fla_safe_gate`), fla's general path otherwise
    or when it is None. fla always uses chunk size 64 (chunk_size only affects the torch path).
    `cu_seqlens_cpu`: the same offsets on the host (fla sizes its chunk index from it without
    reading the device; the torch path takes its document layout from it). Offsets are handed to
    fla as int64 tensors (cu_seqlens on q's device) that keep their identity from call to call for
    the same input tensor (`_fla_offsets`). fla (``fla-core>=0.4.2``: safe_gate, lower_bound and
    cu_seqlens_cpu) gets q, k, v and beta in the CUDA autocast dtype (bf16 in training), g and the
    state in fp32.
    """
    fla_fn = _fla_chunk_kda() if (use_fla and _fla_runs_on(q)) else None
    if fla_fn is None:
        return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state,
                         cu_seqlens=cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens,
                         chunk_size=chunk_size)
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs B == 1 (flatten the batch to [1, B*T, ...]); got B={q.shape[0]}")
    if torch.is_autocast_enabled("cuda"):   # fla's kernels take the low-precision operands as given
        dt = torch.get_autocast_dtype("cuda")
        q, k, v, beta = (x.to(dt) for x in (q, k, v, beta))
    with torch.autocast("cuda", enabled=False):
        return fla_fn(q, k, v, g.float(), beta, scale=scale,
                      initial_state=None if initial_state is None else initial_state.float(),
                      output_final_state=output_final_state, use_qk_l2norm_in_kernel=False,
                      use_gate_in_kernel=False, safe_gate=fla_safe_gate(lower_bound), lower_bound=lower_bound,
                      cu_seqlens=_fla_offsets(cu_seqlens, q.device),
                      cu_seqlens_cpu=_fla_offsets(cu_seqlens_cpu, torch.device("cpu")))
