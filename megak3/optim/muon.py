"""Muon with the Moonlight update and K3 Per-Head Muon (K3_SPEC.md §9.1–9.3).

Update, per parameter W with gradient G (μ momentum, η lr, λ weight decay)::

    M  = μ·M + G
    G' = G + μ·M   (Nesterov)   or   M
    O  = NS5(blocks(G'))                      # orthogonalise each block independently
    W <- W·(1 - η·λ) - η · 0.2·sqrt(max(A, B)) · O      # [A, B] = block shape

Block rule, one per parameter, stored in ``group["heads"]`` (a list parallel to
``group["params"]``; ``None`` = no per-head split):

* 2-D ``[A, B]``, heads None: whole matrix, one block ``[A, B]``.
* 2-D ``[H·r, in]``, heads H: Per-Head Muon, viewed as ``[H, r, in]`` (rows are head-major),
  H blocks ``[r, in]``; scale 0.2·sqrt(max(r, in)).
* 3-D ``[E, A, B]``: stacked experts, E blocks ``[A, B]`` (each expert is its own matrix).
* 4-D ``[out, in, kh, kw]`` (vision patch-embedding conv): flattened to ``[out, in·kh·kw]``,
  the matrix the conv actually multiplies by.

The momentum buffer (``state[p]["momentum_buffer"]``) has the gradient's dtype, as in Moonlight.

Collectives: the one exception to "optimizer and model math hold none" (docs/PARALLEL.md). A
whole-matrix parameter declared a TP shard with :meth:`Muon.set_tp_shard` (parallel/data_parallel/
does) has its update all-gathered over the given group, orthogonalised whole and sliced back:
Newton-Schulz needs the full matrix, and only this optimizer knows when in its step that is.
"""
from __future__ import annotations

import math

import torch

NS_COEFFS = (3.4445, -4.7750, 2.0315)
"""quintic Newton–Schulz coefficients (a, b, c) of KellerJordan/Muon and Moonlight"""


def zeropower_via_newtonschulz5(G: torch.Tensor, steps: int = 5,
                                dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Approximate the orthogonal polar factor U·Vᵀ of each matrix in ``G`` [..., A, B].

    Leading dims are a batch: every [A, B] slice is Frobenius-normalised and iterated on its own.
    The iteration runs in ``dtype`` (bf16 as in the spec; float32 for exact tests) and the result is
    returned in ``dtype``. Singular values land in roughly [0.68, 1.13] rather than exactly 1: the
    coefficients trade exact convergence for a steep slope at 0 (a = 3.4445), so small singular values
    grow fast in only 5 steps.
    """
    if G.ndim < 2:
        raise ValueError(f"zeropower_via_newtonschulz5 needs a [..., A, B] tensor, got shape {tuple(G.shape)}")
    a, b, c = NS_COEFFS
    X = G.to(dtype)
    transposed = G.size(-2) > G.size(-1)
    if transposed:
        X = X.mT  # iterate on the wide side so X·Xᵀ is the smaller Gram matrix
    # ||X||_F >= ||X||_2, so after this every singular value is <= 1, inside NS's convergence region.
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return X.mT if transposed else X


def muon_blocks(update: torch.Tensor, heads: int | None) -> torch.Tensor:
    """View ``update`` (a parameter-shaped tensor) as the [N, A, B] or [A, B] blocks Muon orthogonalises."""
    if heads is not None:
        if update.ndim != 2 or update.shape[0] % heads:
            raise ValueError(f"per-head Muon needs a 2-D [H*r, in] weight with rows divisible by "
                             f"heads={heads}, got shape {tuple(update.shape)}")
        return update.view(heads, update.shape[0] // heads, update.shape[1])
    if update.ndim == 4:
        return update.reshape(update.shape[0], -1)
    if update.ndim not in (2, 3):
        raise ValueError(f"Muon handles 2-D, 3-D (stacked experts) or 4-D (conv) weights, "
                         f"got shape {tuple(update.shape)}")
    return update


def muon_scale(blocks: torch.Tensor) -> float:
    """Moonlight's RMS-matching factor 0.2·sqrt(max(A, B)) for blocks [..., A, B].

    An orthogonal A×B block has element RMS 1/sqrt(max(A, B)); the factor lifts it to 0.2, the
    typical AdamW update RMS, so Muon and AdamW share one learning rate.
    """
    return 0.2 * math.sqrt(max(blocks.shape[-2], blocks.shape[-1]))


class Muon(torch.optim.Optimizer):
    """Muon (Moonlight update) with per-parameter block rules, see the module docstring.

    Param groups are dicts with ``params`` and optionally ``heads`` (list parallel to ``params``,
    int or None), ``lr``, ``weight_decay``, ``momentum``, ``nesterov``, ``ns_steps``, ``ns_dtype``
    ('bfloat16' | 'float32', a string so state dicts stay plain data).
    """

    def __init__(self, params, lr: float = 3e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, ns_dtype: str = "bfloat16"):
        if lr <= 0:
            raise ValueError(f"Muon lr={lr} must be > 0")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon momentum={momentum} must be in [0, 1)")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, ns_dtype=ns_dtype)
        super().__init__(params, defaults)
        # id(param) -> (dim, process group) for whole-matrix params that are tensor-parallel shards:
        # Newton-Schulz must see the full matrix, so the update is gathered, orthogonalised and
        # re-sliced (per-head blocks never need this: a TP shard holds whole heads). Kept out of
        # the param groups so state dicts stay plain data.
        self.tp_shards: dict = {}

    def set_tp_shard(self, param: torch.Tensor, dim: int, group) -> None:
        """Declare ``param`` a TP shard along ``dim`` of a full matrix split over ``group``."""
        self.tp_shards[id(param)] = (dim, group)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group; fills ``heads`` with None and checks it against the params' shapes."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        param_group["params"] = params
        heads = list(param_group.get("heads", [None] * len(params)))
        if len(heads) != len(params):
            raise ValueError(f"Muon group heads has {len(heads)} entries for {len(params)} params")
        for p, h in zip(params, heads):
            muon_blocks(p.detach(), h)  # raises ValueError for shapes Muon cannot orthogonalise
        param_group["heads"] = heads
        if param_group.get("ns_dtype", self.defaults["ns_dtype"]) not in ("bfloat16", "float32"):
            raise ValueError(f"Muon ns_dtype={param_group['ns_dtype']!r} must be 'bfloat16' or 'float32'")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        """One Muon update of every parameter that has a gradient.

        Device-side skip (torch's GradScaler protocol, as ``torch.optim.AdamW(fused=True)`` reads
        it): when the attribute ``found_inf`` is a 0-dim tensor, a value != 0 makes this step change
        nothing (no parameter, no momentum) without reading the flag on the host: the gradient is
        replaced by zeros, the momentum decay and the update are multiplied by the flag. The same
        collectives run either way (TP-shard gathers), so ranks stay in step.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        ok = None  # on the params' device (one device per optimizer), so no op mixes devices
        if found_inf is not None:
            ok = (found_inf == 0).to(next(p.device for g in self.param_groups for p in g["params"]))
        for group in self.param_groups:
            lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
            ns_dtype = getattr(torch, group["ns_dtype"])
            if ok is not None:  # the group's flagged factors: identity when the step is skipped
                mu_ok, keep_ok = torch.where(ok, mu, 1.0), torch.where(ok, 1.0 - lr * wd, 1.0)
            for p, heads in zip(group["params"], group["heads"]):
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g)
                buf = state["momentum_buffer"]
                if ok is not None:
                    g = torch.where(ok, g, 0.0)   # NaN/inf never reaches the state
                    buf.mul_(mu_ok.to(buf.dtype)).add_(g)
                else:
                    buf.mul_(mu).add_(g)
                update = g.add(buf, alpha=mu) if group["nesterov"] else buf
                shard = self.tp_shards.get(id(p)) if heads is None else None
                if shard is not None:
                    update, rank = _gather_shards(update, *shard)
                blocks = muon_blocks(update, heads)
                ortho = zeropower_via_newtonschulz5(blocks, group["ns_steps"], ns_dtype).reshape(update.shape)
                scale = muon_scale(blocks)
                if shard is not None:
                    ortho = ortho.chunk(len(_group_ranks(shard[1])), dim=shard[0])[rank]
                # Decoupled weight decay uses the unscaled η (Moonlight); the update uses the block scale.
                if ok is not None:
                    p.mul_(keep_ok.to(p.dtype))
                    # addcmul with a 0-dim factor rounds like add_(alpha=): bitwise the unflagged path
                    p.addcmul_(ortho.to(p.dtype), torch.where(ok, -lr * scale, 0.0).to(p.dtype))
                else:
                    p.mul_(1.0 - lr * wd)
                    p.add_(ortho.to(p.dtype), alpha=-lr * scale)
        return loss


def _group_ranks(group):
    import torch.distributed as dist

    return range(dist.get_world_size(group))


def _gather_shards(t: torch.Tensor, dim: int, group):
    """All-gather the shards of one matrix along ``dim``; returns (full tensor, this rank's index)."""
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim), dist.get_rank(group)
