"""MoonEP configuration (``conf/moonep/``): which expert-parallel dispatcher runs and its replica budget.

    cfg = MoonEPConfig(enabled=True, max_replicas_per_rank=0, planner_backend="auto", tolerance=0.0)
    cfg.validate(num_experts=896, ep=64)      # raises ValueError naming moonep.<field> (or parallel.ep)
    cfg.replicas_per_rank(896, 64)            # 14 (0 means E/ep)

``enabled=false`` keeps expert parallelism but uses the baseline dispatcher (dynamic shapes, no
replicas): the reference MoonEP is compared with. Only consulted when ``parallel.ep > 1``.

``validate(num_experts, ep)`` also bounds the weight groups of one rank's expert GEMMs (E/ep home
experts plus, under MoonEP, the replica slots) by the 1023 groups one CUDA grouped GEMM takes
(megak3/ops/cuda_rules.py), so such a layout stops before work starts, on any device.
"""
from __future__ import annotations

from dataclasses import dataclass

PLANNERS = ("auto", "torch", "cpp")


@dataclass
class MoonEPConfig:
    """Expert-parallel dispatch settings."""

    enabled: bool = True
    """true: MoonEP (per-batch replicas, every EP rank computes exactly S*K rows, fixed buffers);
    false: the baseline dispatcher (each expert only on its home rank, dynamic split sizes)"""
    max_replicas_per_rank: int = 0
    """replica slots per EP rank (extra expert copies a rank may host for one step); 0 = E/ep"""
    planner_backend: str = "auto"
    """planner backend: 'auto' (the C++ extension when built, else torch), 'torch' or 'cpp'"""
    tolerance: float = 0.0
    """plan no replicas for a layer when its max/mean EP-rank load is <= 1 + tolerance (ranks then
    compute up to S*K*(1 + tolerance) rows); 0 keeps exact balance (every rank exactly S*K rows).
    0.02 skips the ~1 replica per rank that near-uniform routing (max/mean ~1.01) would cost"""

    def validate(self, num_experts: int | None = None, ep: int | None = None) -> "MoonEPConfig":
        """Raise ValueError naming ``moonep.<field>`` and the fix; return self."""
        if not isinstance(self.enabled, bool):
            raise ValueError(f"moonep.enabled={self.enabled!r} must be true or false")
        m = self.max_replicas_per_rank
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"moonep.max_replicas_per_rank={m!r} must be an integer >= 0 "
                             "(0 = num_experts / ep)")
        t = self.tolerance
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0:
            raise ValueError(f"moonep.tolerance={t!r} must be a number >= 0 (0 = exact balance)")
        if self.planner_backend not in PLANNERS:
            raise ValueError(f"moonep.planner_backend={self.planner_backend!r}: choose one of {', '.join(PLANNERS)}")
        if num_experts is not None and ep is not None:
            if ep < 1 or num_experts % ep:
                raise ValueError(f"parallel.ep={ep} must divide model.moe.num_experts={num_experts}")
            if m > num_experts - num_experts // ep:
                raise ValueError(f"moonep.max_replicas_per_rank={m} exceeds the {num_experts - num_experts // ep} "
                                 f"experts a rank does not home (num_experts={num_experts}, ep={ep}); "
                                 "use at most that, or 0 for num_experts / ep")
            self._check_groups(num_experts, ep)
        return self

    def groups_per_rank(self, num_experts: int, ep: int) -> int:
        """Weight groups of one rank's expert GEMMs: its E/ep home experts plus, under MoonEP
        (enabled, ep > 1), its replica slots."""
        replicas = self.replicas_per_rank(num_experts, ep) if self.enabled and ep > 1 else 0
        return num_experts // ep + replicas

    def _check_groups(self, num_experts: int, ep: int) -> None:
        from megak3.ops.cuda_rules import GROUPED_MM_MAX_GROUPS as cap

        g = self.groups_per_rank(num_experts, ep)
        if g <= cap:
            return
        home = num_experts // ep
        if home > cap:
            raise ValueError(f"parallel.ep={ep}: {home} experts per rank (model.moe.num_experts={num_experts}) "
                             f"exceed the {cap} groups of one CUDA grouped GEMM; raise parallel.ep or lower "
                             "model.moe.num_experts")
        raise ValueError(f"moonep.max_replicas_per_rank={self.max_replicas_per_rank}: {home} home experts + "
                         f"{g - home} replica slots = {g} groups per rank exceed the {cap} of one CUDA grouped "
                         f"GEMM; set moonep.max_replicas_per_rank <= {cap - home} or raise parallel.ep")

    def replicas_per_rank(self, num_experts: int, ep: int) -> int:
        """The replica slots M per rank (the default E/ep when the field is 0)."""
        return self.max_replicas_per_rank or num_experts // ep
