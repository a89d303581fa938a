"""Per-MoE-layer load statistics, recorded on device with no host sync (issue 6 part 6).

The dispatcher calls ``LoadRecorder.record(layer, counts_RE, plan, row_bytes, expert_weight_bytes)``
once per MoE call; everything accumulates in device tensors (no ``.item()``). ``summary()`` (called
only at logging steps: that is the one host sync) returns flat scalar metrics, ``write_jsonl`` appends
the per-layer arrays to ``RUN_DIR/expert_load.jsonl`` (read by ``tools/expert_load.py``), ``reset()``
starts the next logging window. Without EP pass ``counts_RE`` as ``[1, E]`` and ``plan=None``: tokens
per expert are still recorded (rows per rank "after" then equal "before").

Per layer: tokens per expert [E]; rows per rank before planning (home load) [R] and after (rows the
plan makes each rank compute) [R]; max-violation max/mean - 1 before and after (mean over calls);
replicas; bytes moved: token rows leaving their source rank (``row_bytes`` each, dispatch direction)
and replica weights (``expert_weight_bytes`` per replica).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist


def _maxvio(load_R: torch.Tensor) -> torch.Tensor:
    load = load_R.double()
    return load.max() / load.mean().clamp(min=1e-12) - 1.0


class _Layer:
    def __init__(self, R: int, E: int, device):
        z = lambda *s, dt=torch.int64: torch.zeros(*s, dtype=dt, device=device)  # noqa: E731
        self.tokens_E, self.before_R, self.after_R = z(E), z(R), z(R)
        self.vio_before, self.vio_after = z((), dt=torch.float64), z((), dt=torch.float64)
        self.replicas, self.token_bytes, self.weight_bytes = z(()), z(()), z(())
        self.calls = 0


class LoadRecorder:
    """Accumulates per-layer MoE load statistics between logging steps (see module docstring)."""

    def __init__(self):
        self.layers: dict[int, _Layer] = {}

    def __call__(self, dispatcher, counts, plan) -> None:
        """The dispatcher hook (``parallelize_ep(..., recorder=rec)``): record one MoE call.

        ``counts`` is ``[R, E]`` (MoonEP already gathered it) or this rank's ``[E]`` (baseline
        dispatcher: gathered here over the EP group, one small fixed-shape collective per layer and
        call; every EP rank runs the same layers, so the collective lines up)."""
        if counts.dim() == 1:
            group = getattr(dispatcher, "group", None)
            R = 1 if group is None else dist.get_world_size(group)
            if R > 1:
                out = torch.empty(R * counts.numel(), dtype=counts.dtype, device=counts.device)
                dist.all_gather_into_tensor(out, counts.contiguous(), group=group)
                counts = out.view(R, -1)
            else:
                counts = counts.view(1, -1)
        self.record(getattr(dispatcher, "layer_idx", 0), counts, plan,
                    row_bytes=getattr(dispatcher, "row_bytes", 0),
                    expert_weight_bytes=getattr(dispatcher, "expert_weight_bytes", 0))

    def record(self, layer: int, counts_RE: torch.Tensor, plan=None, row_bytes: int = 0,
               expert_weight_bytes: int = 0) -> None:
        if counts_RE.dim() != 2:
            raise ValueError(f"LoadRecorder.record: counts_RE must be [R, E], got {tuple(counts_RE.shape)}")
        R, E = counts_RE.shape
        if E % R:
            raise ValueError(f"LoadRecorder.record: num_experts {E} not divisible by parallel.ep {R}")
        counts_RE = counts_RE.detach().to(torch.int64)
        st = self.layers.get(layer)
        if st is None:
            st = self.layers[layer] = _Layer(R, E, counts_RE.device)
        c_E = counts_RE.sum(0)
        before_R = c_E.view(R, -1).sum(1)
        eye_RR = torch.eye(R, dtype=torch.bool, device=counts_RE.device)
        if plan is None:
            after_R = before_R
            home_RE = eye_RR.repeat_interleave(E // R, dim=1)  # [s, e]: e homed on s
            off_rank = (counts_RE * ~home_RE).sum()
            nrep = torch.zeros((), dtype=torch.int64, device=counts_RE.device)
        else:
            rows_SRJ = plan.rows_SRJ.to(counts_RE.device)
            after_R = rows_SRJ.sum((0, 2))
            off_rank = (rows_SRJ.sum(2) * ~eye_RR).sum()
            nrep = plan.num_replicas.to(counts_RE.device)
        st.tokens_E += c_E
        st.before_R += before_R
        st.after_R += after_R
        st.vio_before += _maxvio(before_R)
        st.vio_after += _maxvio(after_R)
        st.replicas += nrep
        st.token_bytes += off_rank * int(row_bytes)
        st.weight_bytes += nrep * int(expert_weight_bytes)
        st.calls += 1

    def _layer_host(self, st: _Layer) -> dict:
        n = max(st.calls, 1)
        return {"calls": st.calls, "tokens_per_expert": st.tokens_E.tolist(), "rows_before": st.before_R.tolist(),
                "rows_after": st.after_R.tolist(), "maxvio_before": float(st.vio_before) / n,
                "maxvio_after": float(st.vio_after) / n, "replicas": int(st.replicas) / n,
                "token_bytes": int(st.token_bytes), "weight_bytes": int(st.weight_bytes)}

    def summary(self) -> dict[str, float]:
        """Flat scalar metrics (host sync): means over layers plus ``moe/L{i}/...`` per layer."""
        out: dict[str, float] = {}
        if not self.layers:
            return out
        per = {i: self._layer_host(st) for i, st in sorted(self.layers.items())}
        # rank_imbalance_*: max / mean rows per EP rank - 1 (the per-layer records call it maxvio_*);
        # not the train log's "maxvio" (expert_load_max_violation: max / mean tokens per expert - 1)
        for i, d in per.items():
            out[f"moe/L{i}/rank_imbalance_before"] = d["maxvio_before"]
            out[f"moe/L{i}/rank_imbalance_after"] = d["maxvio_after"]
            out[f"moe/L{i}/replicas"] = d["replicas"]
        nl = len(per)
        out["moe/rank_imbalance_before"] = sum(d["maxvio_before"] for d in per.values()) / nl
        out["moe/rank_imbalance_after"] = sum(d["maxvio_after"] for d in per.values()) / nl
        out["moe/replicas"] = sum(d["replicas"] for d in per.values())
        out["moe/dispatch_mb"] = sum(d["token_bytes"] for d in per.values()) / 2**20
        out["moe/replica_weight_mb"] = sum(d["weight_bytes"] for d in per.values()) / 2**20
        return out

    def write_jsonl(self, path, step: int) -> None:
        """Append one JSON line {step, layers: {i: per-layer arrays}} to ``path`` (host sync)."""
        rec = {"step": int(step), "layers": {str(i): self._layer_host(st) for i, st in sorted(self.layers.items())}}
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        with p.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    def reset(self) -> None:
        self.layers.clear()
