"""Optimizer state of the ZeRO-1 optimizer: this rank's checkpoint shard, the layout-free export,
and the memory accounting.

Layout-free optimizer state
    :meth:`OptimizerState.export_state` gives this rank's owned params' state under canonical
    (single-process) names, as held here (TP shards); the trainer's checkpoint
    (megak3/checkpoint/train_state.py) saves it as boxes of the global tensors and loads each rank's
    box of them on any layout.
"""
from __future__ import annotations

import torch

from ..plan import canonical_name
from .comm import _rank, _size

STATE_FORMAT = "megak3.zero1.v1"
CANONICAL_FORMAT = "megak3.optim.canonical.v1"
"""format tag of :meth:`OptimizerState.export_state`"""


class OptimizerState:
    """Checkpoint and accounting half of :class:`parallel.data_parallel.ShardedOptimizer` (a mixin:
    it reads the specs, groups, ownership and local optimizers that ``ShardedOptimizer.__init__`` sets)."""

    def ownership(self) -> dict:
        """``{name: [owner rank, group size, shape]}`` for every trainable param (same on all ranks of a group)."""
        return {s.name: [self.owner[i], _size(self.groups[self.group_of[i]]), list(s.param.shape)]
                for i, s in enumerate(self.specs)}

    def state_dict(self) -> dict:
        """This rank's shard: local Muon/AdamW state, fp32 main copies that are not the model's own
        tensors (bf16 models), and the ownership map a loader checks."""
        self.finish_param_gather()
        return {
            "format": STATE_FORMAT,
            "rank": [_rank(g) for g in self.groups],
            "ownership": self.ownership(),
            "muon": None if self.muon is None else self.muon.state_dict(),
            "adamw": None if self.adamw is None else self.adamw.state_dict(),
            "main_params": {self.specs[i].name: m.clone() for i, m in self.main.items()
                            if m.data_ptr() != self.specs[i].param.data_ptr()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Load a shard saved by the same rank of the same layout; ``ValueError`` names the mismatch."""
        self.finish_param_gather()  # a gather landing later would overwrite what is loaded
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"optimizer state format {state.get('format')!r} is not {STATE_FORMAT!r}")
        mine, theirs = self.ownership(), state["ownership"]
        if mine != theirs:
            diff = sorted(set(mine) ^ set(theirs)) or [n for n in mine if mine[n] != theirs[n]]
            raise ValueError(f"optimizer shard does not match this layout (first difference: {diff[0]!r}: "
                             f"saved {theirs.get(diff[0])}, now {mine.get(diff[0])} as [owner, dp, shape]); "
                             f"resume with the same model and data-parallel size")
        ranks = [_rank(g) for g in self.groups]
        if state["rank"] != ranks:
            raise ValueError(f"optimizer shard was saved by rank(s) {state['rank']}, loading on {ranks}")
        for key, opt in (("muon", self.muon), ("adamw", self.adamw)):
            if (opt is None) != (state[key] is None):
                raise ValueError(f"optimizer shard and this rank disagree on whether a {key} part exists")
            if opt is not None:
                opt.load_state_dict(state[key])
        name_to = {self.specs[i].name: i for i in self.main}
        with torch.no_grad():
            for name, t in state["main_params"].items():
                self.main[name_to[name]].copy_(t)

    def export_state(self, canonical: bool = True) -> dict:
        """Layout-free optimizer state of the params THIS rank owns (TP shards as held here)::

            {"format": CANONICAL_FORMAT,
             "state": {name: {key: tensor}},      # Muon momentum_buffer; AdamW exp_avg, exp_avg_sq, step
             "optimizer": {name: "muon" | "adamw"},
             "hyperparameters": {name: {key: value}}}  # the param's group values (lr, weight_decay, ...)

        ``name`` is the canonical (single-process) name, or the model's own name if not
        ``canonical``. A param that was never stepped has ``{}`` state (before the first step:
        every param). Tensors are copies.
        """
        self.finish_param_gather()
        out = {"format": CANONICAL_FORMAT, "state": {}, "optimizer": {}, "hyperparameters": {}}
        groups = {id(p): (o, g) for o in self.optimizers for g in o.param_groups for p in g["params"]}
        for i in sorted(self.main):
            s, m = self.specs[i], self.main[i]
            opt, group = groups[id(m)]
            name = canonical_name(s.name) if canonical else s.name
            out["state"][name] = {k: v.detach().clone() if torch.is_tensor(v) else v
                                  for k, v in opt.state.get(m, {}).items()}
            out["optimizer"][name] = s.optimizer
            out["hyperparameters"][name] = {k: v for k, v in group.items() if k not in ("params", "heads")}
        return out

    # ---------------------------------------------------------------- accounting
    def memory_report(self) -> dict:
        """Bytes this rank holds for the optimizer, measured and analytic.

        ``main_param_bytes`` = 4·owned numel (fp32 main weights; for an fp32 model they are the
        model's own tensors). ``optimizer_state_bytes`` is measured from the local optimizers'
        state (0 before the first step); ``optimizer_state_host_bytes`` is the part of it held in
        host memory while the params are on an accelerator (``optim.offload=cpu``). Analytic per element: Muon 4 B (momentum), AdamW 8 B
        (exp_avg, exp_avg_sq); ``expected_*`` is the whole model's total / dp, and
        ``owned_expected_state_bytes`` the analytic value for this rank's own params.
        ``numel_per_rank`` / ``imbalance`` (max / mean) cover the params on ``dp_group``;
        ``comm_padding`` is the fraction of reduce-scatter / all-gather elements that are padding.
        """
        def state_per_elem(i: int) -> int:
            return 4 if self.specs[i].optimizer == "muon" else 8

        world = _size(self.dp_group)
        numel_per_rank: dict[int, int] = {}
        for i, s in enumerate(self.specs):
            if self.groups[self.group_of[i]] is self.dp_group:
                numel_per_rank[self.owner[i]] = numel_per_rank.get(self.owner[i], 0) + s.param.numel()
        per_rank = [numel_per_rank.get(r, 0) for r in range(world)]
        owned = list(self.main)
        state = [t for o in self.optimizers for st in o.state.values() for t in st.values() if torch.is_tensor(t)]
        measured = sum(t.numel() * t.element_size() for t in state)
        # optim.offload=cpu keeps the AdamW state in host memory while the params are on a GPU
        on_host = sum(t.numel() * t.element_size() for t in state
                      if t.device.type == "cpu" and self.device.type != "cpu")
        total_numel = sum(s.param.numel() for s in self.specs)
        total_state = sum(state_per_elem(i) * s.param.numel() for i, s in enumerate(self.specs))
        payload = sum(sl.numel for b in self.buckets for sl in b.slots)
        padded = sum(_size(self.groups[b.group_id]) * b.seg_len for b in self.buckets)
        return {
            "dp_size": world,
            "owned_params": len(owned),
            "owned_numel": sum(self.specs[i].param.numel() for i in owned),
            "total_numel": total_numel,
            "numel_per_rank": per_rank,
            "imbalance": max(per_rank) / max(1.0, sum(per_rank) / world),
            "main_param_bytes": 4 * sum(self.specs[i].param.numel() for i in owned),
            "optimizer_state_bytes": measured,
            "optimizer_state_host_bytes": on_host,
            "owned_expected_state_bytes": sum(state_per_elem(i) * self.specs[i].param.numel() for i in owned),
            "expected_main_param_bytes": 4 * total_numel / world,
            "expected_state_bytes": total_state / world,
            "buckets": len(self.buckets),
            "comm_padding": 1.0 - payload / max(1, padded),
        }
