"""Rank arithmetic of the two parallel grids: pure functions, no torch (DESIGN.md "Parallel dimensions").

Every rank of the world sits in two grids at once ("MoE parallel folding", as in Megatron-Core):

- the dense grid  ``tp x cp x dp x pp``  (attention, embeddings, dense FFN, shared experts);
- the expert grid ``etp x ep x edp x pp`` (routed experts), ``edp = world / (etp * ep * pp)``.

Both are laid out by one order string (default ``tp-cp-ep-dp-pp``, first = fastest-varying). The
dense grid reads it with ep=1, the expert grid with cp=1, tp:=etp and dp:=edp, exactly like
Megatron-Core's two ``RankGenerator`` objects; with pp last both grids have the same pipeline groups.

Worked example: world 8, tp=2, pp=2, hence dp=2 (cp=ep=etp=1, default order)::

    rank = tp_rank + 2 * dp_rank + 4 * pp_rank
    tp groups  [0, 1] [2, 3] [4, 5] [6, 7]
    dp groups  [0, 2] [1, 3] [4, 6] [5, 7]
    pp groups  [0, 4] [1, 5] [2, 6] [3, 7]

and with ep=2, etp=1 the expert grid of the same world (edp = 8 / (1*2*2) = 2) is::

    rank = ep_rank + 2 * edp_rank + 4 * pp_rank
    ep groups  [0, 1] [2, 3] [4, 5] [6, 7]
    edp groups [0, 2] [1, 3] [4, 6] [5, 7]
    pp groups  [0, 4] [1, 5] [2, 6] [3, 7]     (identical to the dense pp groups)
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

__all__ = ["AXES", "DEFAULT_ORDER", "DENSE_AXES", "EXPERT_AXES", "Layout", "rank_groups",
           "validate_layout"]

AXES = ("tp", "cp", "ep", "dp", "pp")
"""the names an order string must contain, each exactly once"""
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
"""Megatron-Core's default: tp fastest (inside a node), pp slowest (across nodes)"""

DENSE_AXES = {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp",
              "dp-cp": "cp-dp", "tp-cp": "tp-cp", "tp-dp-cp": "tp-cp-dp"}
"""dense-grid axis name -> token of the dense generator"""
EXPERT_AXES = {"etp": "tp", "ep": "ep", "edp": "dp", "pp": "pp", "ep-etp": "tp-ep"}
"""expert-grid axis name -> token of the expert generator (its tp is etp, its dp is edp)"""


def _parse_order(order: str) -> list[str]:
    names = order.split("-") if isinstance(order, str) else []
    if sorted(names) != sorted(AXES):
        raise ValueError(f"parallel.order={order!r} must name each of {'-'.join(AXES)} exactly once, "
                         f"joined by '-' (first = fastest-varying); default {DEFAULT_ORDER!r}")
    return names


def _digits(index: int, shape: list[int]) -> list[int]:
    """Mixed-radix digits of index, first digit fastest: _digits(5, [2, 3]) == [1, 2]."""
    out = []
    for s in shape:
        out.append(index % s)
        index //= s
    return out


def rank_groups(world_size: int, sizes: dict, order: str, token: str) -> list[list[int]]:
    """The groups of ranks that differ only in the axes named by `token` (Megatron-Core semantics).

    world_size: number of ranks; must equal the product of `sizes`.
    sizes: degree of each of tp, cp, ep, dp, pp (a missing name counts as 1).
    order: the names joined by '-', first = fastest-varying, e.g. "tp-cp-ep-dp-pp".
    token: one axis ("tp") or several joined by '-' ("tp-pp", "dp-cp"); their order inside the
        token does not matter, the group lists its ranks with the order string's fastest axis first.

    With ``shape = [sizes[n] for n in order]`` a rank is ``sum(digit_i * prod(shape[:i]))``. The
    groups are enumerated by the digits of the axes *not* in the token (fastest first), the
    ranks inside a group by the digits of the axes in the token; this reproduces
    ``generate_masked_orthogonal_rank_groups`` of Megatron-Core's parallel_state.py.

    >>> rank_groups(8, {"tp": 2, "dp": 2, "pp": 2}, "tp-cp-ep-dp-pp", "dp")
    [[0, 2], [1, 3], [4, 6], [5, 7]]
    >>> rank_groups(8, {"tp": 2, "dp": 2, "pp": 2}, "tp-cp-ep-dp-pp", "tp-pp")
    [[0, 1, 4, 5], [2, 3, 6, 7]]
    """
    names = _parse_order(order)
    shape = [int(sizes.get(n, 1)) for n in names]
    if prod(shape) != world_size:
        raise ValueError(f"degrees {dict(zip(names, shape))} multiply to {prod(shape)}, "
                         f"not world_size={world_size}")
    picked = token.split("-")
    unknown = [t for t in picked if t not in names]
    if unknown or len(set(picked)) != len(picked):
        raise ValueError(f"token {token!r} must name distinct axes among {names}")
    inner = _offsets(shape, [n in picked for n in names])      # rank offsets inside a group
    bases = _offsets(shape, [n not in picked for n in names])  # first rank of each group
    return [[b + o for o in inner] for b in bases]


def _offsets(shape: list[int], mask: list[bool]) -> list[int]:
    """sum(digit_i * stride_i) over the masked axes, for every combination of their digits,
    first masked axis fastest: _offsets([2, 3, 2], [True, False, True]) == [0, 1, 6, 7]."""
    out, stride = [0], 1
    for s, m in zip(shape, mask):
        if m:
            out = [o + d * stride for d in range(s) for o in out]
        stride *= s
    return out


def _positions(rank: int, sizes: dict, order: str, tokens: dict) -> dict:
    """{axis: index of `rank` inside its group of rank_groups(..., token)} for axis, token in
    tokens, without building the groups: the token's digits of the rank, read as one number."""
    names = order.split("-")
    shape = [int(sizes.get(n, 1)) for n in names]
    digit = dict(zip(names, _digits(rank, shape)))
    out = {}
    for axis, token in tokens.items():
        pos, scale, picked = 0, 1, token.split("-")
        for n, s in zip(names, shape):
            if n in picked:
                pos += digit[n] * scale
                scale *= s
        out[axis] = pos
    return out


@dataclass(frozen=True)
class Layout:
    """One parallel layout of `world_size` ranks; all degrees explicit (no 'derive' values here).

    Dense grid tp x cp x dp x pp == world_size; expert grid etp x ep x edp x pp with
    ``edp = world_size // (etp * ep * pp)``. Call :func:`validate_layout` before trusting it.

    >>> lay = Layout(world_size=8, tp=2, pp=2, dp=2, ep=2)
    >>> lay.dense_groups()["tp"], lay.dense_groups()["pp"]
    ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])
    >>> lay.expert_groups()["edp"]
    [[0, 2], [1, 3], [4, 6], [5, 7]]
    >>> lay.coords(5)["tp"], lay.coords(5)["dp"], lay.coords(5)["pp"], lay.coords(5)["ep"]
    (1, 0, 1, 1)
    """

    world_size: int
    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    order: str = DEFAULT_ORDER

    @property
    def edp(self) -> int:
        """expert data-parallel degree: world_size / (etp * ep * pp)"""
        return self.world_size // (self.etp * self.ep * self.pp)

    def dense_sizes(self) -> dict:
        """Sizes of the dense generator (Megatron-Core: ep=1)."""
        return {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}

    def expert_sizes(self) -> dict:
        """Sizes of the expert generator (Megatron-Core: tp=etp, dp=edp, cp=1)."""
        return {"tp": self.etp, "cp": 1, "ep": self.ep, "dp": self.edp, "pp": self.pp}

    def dense_groups(self) -> dict:
        """{axis: groups} for tp, cp, dp, pp, dp-cp, tp-cp, tp-dp-cp of the dense grid."""
        validate_layout(self)
        s = self.dense_sizes()
        return {a: rank_groups(self.world_size, s, self.order, t) for a, t in DENSE_AXES.items()}

    def expert_groups(self) -> dict:
        """{axis: groups} for etp, ep, edp, pp, ep-etp of the expert grid."""
        validate_layout(self)
        s = self.expert_sizes()
        return {a: rank_groups(self.world_size, s, self.order, t) for a, t in EXPERT_AXES.items()}

    def sizes(self) -> dict:
        """{axis: group size} for every dense and expert axis."""
        d, e = self.dense_sizes(), self.expert_sizes()
        out = {a: prod(d[t] for t in tok.split("-")) for a, tok in DENSE_AXES.items()}
        out.update({a: prod(e[t] for t in tok.split("-")) for a, tok in EXPERT_AXES.items()})
        return out

    def coords(self, rank: int) -> dict:
        """{axis: index of `rank` inside its group of that axis}, for every dense and expert axis.

        For a plain axis this is the rank's coordinate (tp_rank, ...); for a composite one
        (dp-cp, ...) it is the position in the composite group, fastest axis first.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} must lie in [0, world_size={self.world_size})")
        return {**_positions(rank, self.dense_sizes(), self.order, DENSE_AXES),
                **_positions(rank, self.expert_sizes(), self.order, EXPERT_AXES)}


def _positive_int(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"parallel.{name}={v!r} must be an integer >= 1")


def _divides(field: str, degree: int, model_field: str, value: int) -> None:
    if value % degree:
        raise ValueError(f"parallel.{field}={degree} does not divide model.{model_field}={value}; "
                         f"choose a parallel.{field} that divides {value}")


def validate_layout(layout: Layout, model_cfg=None) -> Layout:
    """Raise ValueError naming the `parallel.<field>` at fault and the fix; return the layout.

    Checks: positive integer degrees; a valid order string; tp*cp*dp*pp == world_size;
    etp*ep*pp divides world_size; the dense and expert grids share their pipeline groups. With a
    `model_cfg` (megak3.config.ModelConfig or anything with its fields): tp divides the KDA and MLA
    head counts, the dense FFN width, the shared-expert width and the vocabulary; etp divides the
    routed-expert width; ep divides the number of routed experts; pp <= num_layers.

    >>> validate_layout(Layout(world_size=8, tp=3, dp=1))
    Traceback (most recent call last):
    ValueError: parallel.tp*cp*dp*pp = 3*1*1*1 = 3 must equal world_size=8; ...
    """
    L = layout
    _positive_int("world_size", L.world_size)
    for f in ("tp", "cp", "dp", "pp", "ep", "etp"):
        _positive_int(f, getattr(L, f))
    _parse_order(L.order)
    dense = L.tp * L.cp * L.dp * L.pp
    if dense != L.world_size:
        raise ValueError(f"parallel.tp*cp*dp*pp = {L.tp}*{L.cp}*{L.dp}*{L.pp} = {dense} must equal "
                         f"world_size={L.world_size}; set parallel.dp=0 to derive dp, or change the degrees")
    expert = L.etp * L.ep * L.pp
    if L.world_size % expert:
        raise ValueError(f"parallel.etp*ep*pp = {L.etp}*{L.ep}*{L.pp} = {expert} does not divide "
                         f"world_size={L.world_size}; change parallel.ep or parallel.etp")
    if L.pp > 1:
        dense_pp = rank_groups(L.world_size, L.dense_sizes(), L.order, "pp")
        if dense_pp != rank_groups(L.world_size, L.expert_sizes(), L.order, "pp"):
            names = L.order.split("-")
            before = names[:names.index("pp")]
            d = prod(L.dense_sizes()[n] for n in before)
            e = prod(L.expert_sizes()[n] for n in before)
            raise ValueError(f"parallel.order={L.order!r} gives the dense and expert grids different "
                             f"pipeline groups (the axes before pp span {d} dense but {e} expert "
                             f"ranks); put pp last, as in the default {DEFAULT_ORDER!r}")
    if model_cfg is not None:
        m = model_cfg
        _divides("tp", L.tp, "kda.num_heads", m.kda.num_heads)
        _divides("tp", L.tp, "mla.num_heads", m.mla.num_heads)
        _divides("tp", L.tp, "dense_intermediate_size", m.dense_intermediate_size)
        shared = m.moe.num_shared_experts * m.moe.expert_intermediate_size
        if shared:
            _divides("tp", L.tp, "moe.num_shared_experts*moe.expert_intermediate_size", shared)
        _divides("tp", L.tp, "vocab_size", m.vocab_size)
        _divides("etp", L.etp, "moe.expert_intermediate_size", m.moe.expert_intermediate_size)
        _divides("ep", L.ep, "moe.num_experts", m.moe.num_experts)
        if L.pp > m.num_layers:
            raise ValueError(f"parallel.pp={L.pp} exceeds model.num_layers={m.num_layers}; "
                             "use at most one pipeline stage per layer")
    return L
