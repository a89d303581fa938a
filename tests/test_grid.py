"""parallel/grid.py (rank arithmetic), parallel/config.py (ParallelConfig) and parallel/state.py (groups).

The exhaustive sweep covers every world size 1..64 and every factorization of the dense grid
(tp, cp, dp, pp) and of the expert grid (etp, ep, pp), checked against an independent coordinate
formula; hand-written cases are copied from Megatron-Core's parallel_state.py docstrings.
Rank bodies of the multi-process test live at module level (each rank imports this module).
"""
import dataclasses
import doctest
import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

import parallel.grid as grid
from parallel.config import ParallelConfig
from parallel.grid import DEFAULT_ORDER, Layout, rank_groups, validate_layout

ROOT = Path(__file__).resolve().parents[1]
DENSE_PLAIN = ("tp", "cp", "dp", "pp")
EXPERT_PLAIN = ("etp", "ep", "edp", "pp")
DENSE_COMPOSITE = {"dp-cp": ("dp", "cp"), "tp-cp": ("tp", "cp"), "tp-dp-cp": ("tp", "dp", "cp")}
EXPERT_COMPOSITE = {"ep-etp": ("ep", "etp")}


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def factorizations(n, k):
    """All ordered k-tuples of positive ints with product n."""
    if k == 1:
        return [(n,)]
    return [(d, *rest) for d in divisors(n) for rest in factorizations(n // d, k - 1)]


def coordinate_table(world, names, sizes):
    """{rank: {axis: coordinate}}, first name fastest: rank = c0 + s0*(c1 + s1*(c2 + ...))."""
    table = {}
    for digits in itertools.product(*[range(s) for s in reversed(sizes)]):
        digits = digits[::-1]  # product() varies its last factor fastest
        rank, scale = 0, 1
        for d, s in zip(digits, sizes):
            rank += d * scale
            scale *= s
        table[rank] = dict(zip(names, digits))
    assert sorted(table) == list(range(world))
    return table


def check_grid(world, groups, coords, plain, composite, sizes):
    for axis, gs in groups.items():
        flat = sorted(r for g in gs for r in g)
        assert flat == list(range(world)), (axis, "groups must partition the world")
        assert all(len(g) == sizes[axis] for g in gs), (axis, "group size")
    for axis in plain:
        for g in groups[axis]:
            others = {tuple(v for a, v in coords[r].items() if a != axis) for r in g}
            assert len(others) == 1, (axis, g, "members must differ only in the axis coordinate")
            assert [coords[r][axis] for r in g] == list(range(sizes[axis])), (axis, g)
    # a composite group is closed under moves along each of its parts, and has their product's
    # size: it is exactly the union of its members' groups of those parts
    for axis, parts in composite.items():
        part_of = {part: {r: set(g) for g in groups[part] for r in g} for part in parts}
        for g in groups[axis]:
            members = set(g)
            assert all(part_of[p][r] <= members for p in parts for r in g), (axis, g)


def test_exhaustive_dense_grids_1_to_64():
    names = ("tp", "cp", "ep", "dp", "pp")
    for world in range(1, 65):
        for tp, cp, dp, pp in factorizations(world, 4):
            lay = Layout(world_size=world, tp=tp, cp=cp, dp=dp, pp=pp)
            groups = lay.dense_groups()
            table = coordinate_table(world, names, (tp, cp, 1, dp, pp))
            coords = {r: {a: c[a] for a in DENSE_PLAIN} for r, c in table.items()}
            sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp, "dp-cp": dp * cp, "tp-cp": tp * cp,
                     "tp-dp-cp": tp * dp * cp}
            check_grid(world, groups, coords, DENSE_PLAIN, DENSE_COMPOSITE, sizes)
            assert groups["tp"][0] == list(range(tp)), "tp is fastest-varying"
            assert groups["tp-dp-cp"][0] == list(range(world // pp)), "pp is slowest-varying"
            for r in range(world):
                c = lay.coords(r)
                assert all(c[a] == coords[r][a] for a in DENSE_PLAIN)
            if world in (12, 64):  # positions inside composite groups, on two worlds
                for r in range(world):
                    c = lay.coords(r)
                    for a in DENSE_COMPOSITE:
                        g = next(g for g in groups[a] if r in g)
                        assert g.index(r) == c[a]


def test_exhaustive_expert_grids_and_shared_pipeline_groups():
    names = ("tp", "cp", "ep", "dp", "pp")
    for world in range(1, 65):
        for pp in divisors(world):
            dense_pp = [Layout(world_size=world, tp=tp, cp=cp, dp=dp, pp=pp).dense_groups()["pp"]
                        for tp, cp, dp in factorizations(world // pp, 3)]
            for etp, ep, edp in factorizations(world // pp, 3):
                lay = Layout(world_size=world, dp=world // pp, pp=pp, ep=ep, etp=etp)
                assert lay.edp == edp
                groups = lay.expert_groups()
                table = coordinate_table(world, names, (etp, 1, ep, edp, pp))
                coords = {r: {"etp": c["tp"], "ep": c["ep"], "edp": c["dp"], "pp": c["pp"]}
                          for r, c in table.items()}
                sizes = {"etp": etp, "ep": ep, "edp": edp, "pp": pp, "ep-etp": ep * etp}
                check_grid(world, groups, coords, EXPERT_PLAIN, EXPERT_COMPOSITE, sizes)
                for r in range(world):
                    c = lay.coords(r)
                    assert all(c[a] == coords[r][a] for a in EXPERT_PLAIN)
                    if world in (12, 64):
                        assert next(g for g in groups["ep-etp"] if r in g).index(r) == c["ep-etp"]
                # every dense grid of this world and pp has the same pipeline groups
                assert all(d == groups["pp"] for d in dense_pp), (world, etp, ep, pp)


# ---- Megatron-Core's documented examples ----------------------------------------------------

def test_megatron_16_gpu_example():
    """initialize_model_parallel's docstring: 16 GPUs, tp=2, pp=4 (so dp=2)."""
    g = Layout(world_size=16, tp=2, dp=2, pp=4).dense_groups()
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert g["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]


def test_megatron_context_parallel_example():
    """context_parallel_size docstring: 8 GPUs, tp=4, cp=2 -> cp groups [0,4] [1,5] [2,6] [3,7]."""
    g = Layout(world_size=8, tp=4, cp=2).dense_groups()
    assert g["cp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["tp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_megatron_masked_orthogonal_examples_non_default_order():
    """generate_masked_orthogonal_rank_groups' docstring, with its tp-pp-dp and tp-dp-pp orders."""
    # 8 GPUs, order tp-pp-dp, sizes 2-2-2: dp groups [[0, 4], [1, 5], [2, 6], [3, 7]]
    sizes = {"tp": 2, "pp": 2, "dp": 2}
    assert rank_groups(8, sizes, "tp-pp-cp-ep-dp", "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert rank_groups(8, sizes, "tp-pp-cp-ep-dp", "pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # parallel_size [tp, dp, pp] = [2, 3, 4]: dp_group[0] = [0, 2, 4], [1] = [1, 3, 5], [7] = [19, 21, 23]
    dp = rank_groups(24, {"tp": 2, "dp": 3, "pp": 4}, "tp-dp-cp-ep-pp", "dp")
    assert len(dp) == 8 and dp[0] == [0, 2, 4] and dp[1] == [1, 3, 5] and dp[7] == [19, 21, 23]


def test_composite_token_order_does_not_matter_and_tp_pp_example():
    sizes = {"tp": 2, "dp": 2, "pp": 2}
    assert rank_groups(8, sizes, DEFAULT_ORDER, "tp-pp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert rank_groups(8, sizes, DEFAULT_ORDER, "pp-tp") == rank_groups(8, sizes, DEFAULT_ORDER, "tp-pp")


def test_every_order_keeps_the_grid_properties():
    names = ("tp", "cp", "ep", "dp", "pp")
    for perm in itertools.permutations(names):
        order = "-".join(perm)
        for tp, cp, dp, pp in [(2, 3, 1, 2), (2, 1, 2, 3), (1, 2, 2, 2), (3, 2, 2, 1)]:
            world = tp * cp * dp * pp
            sz = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
            groups = {a: rank_groups(world, sz, order, t) for a, t in grid.DENSE_AXES.items()}
            table = coordinate_table(world, perm, [sz[n] for n in perm])
            coords = {r: {a: c[a] for a in DENSE_PLAIN} for r, c in table.items()}
            sizes = {**{a: sz[a] for a in DENSE_PLAIN}, "dp-cp": dp * cp, "tp-cp": tp * cp,
                     "tp-dp-cp": tp * dp * cp}
            check_grid(world, groups, coords, DENSE_PLAIN, DENSE_COMPOSITE, sizes)
            first = perm[0] if perm[0] != "ep" else perm[1]
            assert groups[first][0] == list(range(sz[first])), "first axis is fastest"


def test_non_default_order_pp_first():
    g = Layout(world_size=8, tp=2, dp=2, pp=2, order="pp-tp-cp-ep-dp").dense_groups()
    assert g["pp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["tp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_docstring_examples_hold():
    assert doctest.testmod(grid, optionflags=doctest.ELLIPSIS).failed == 0


def test_grid_and_config_do_not_import_torch():
    code = "import sys, parallel.grid, parallel.config; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env={"PYTHONPATH": str(ROOT)})


# ---- validation -----------------------------------------------------------------------------

@pytest.mark.parametrize("layout, needle", [
    (Layout(world_size=8, tp=0, dp=8), "parallel.tp=0"),
    (Layout(world_size=8, tp=2, dp=2), "world_size=8"),
    (Layout(world_size=8, dp=8, ep=3), "parallel.etp*ep*pp"),
    (Layout(world_size=8, dp=8, order="tp-dp-pp"), "parallel.order"),
    (Layout(world_size=8, dp=8, order="tp-tp-cp-ep-dp-pp"), "parallel.order"),
    (Layout(world_size=8, tp=2, dp=2, pp=2, ep=4, order="tp-pp-cp-ep-dp"), "parallel.order"),
    (Layout(world_size=8, dp=8, etp=True), "parallel.etp"),
])
def test_validate_layout_names_the_field(layout, needle):
    with pytest.raises(ValueError) as e:
        validate_layout(layout)
    assert needle in str(e.value)


def test_validate_layout_against_model():
    from megak3.config import load_model_config

    mini = load_model_config("k3_mini")  # 8 KDA/MLA heads, 128 experts, 13 layers
    validate_layout(Layout(world_size=64, tp=8, dp=4, pp=2, ep=8), mini)
    cases = [(Layout(world_size=3, tp=3), "parallel.tp=3 does not divide model.kda.num_heads=8"),
             (Layout(world_size=3, dp=3, ep=3), "parallel.ep=3 does not divide model.moe.num_experts=128"),
             (Layout(world_size=16, dp=1, pp=16), "parallel.pp=16 exceeds model.num_layers=13"),
             (Layout(world_size=3, dp=3, etp=3), "parallel.etp=3 does not divide model.moe.expert_intermediate_size")]
    for lay, msg in cases:
        with pytest.raises(ValueError) as e:
            validate_layout(lay, mini)
        assert msg in str(e.value)
    tp4 = Layout(world_size=4, tp=4)
    validate_layout(tp4, mini)
    for change, msg in [({"kda": dataclasses.replace(mini.kda, num_heads=6)}, "model.kda.num_heads=6"),
                        ({"mla": dataclasses.replace(mini.mla, num_heads=6)}, "model.mla.num_heads=6"),
                        ({"dense_intermediate_size": 4098}, "model.dense_intermediate_size=4098"),
                        ({"moe": dataclasses.replace(mini.moe, expert_intermediate_size=513)},
                         "model.moe.num_shared_experts*moe.expert_intermediate_size=1026"),
                        ({"vocab_size": 163842}, "model.vocab_size=163842")]:
        with pytest.raises(ValueError) as e:
            validate_layout(tp4, dataclasses.replace(mini, **change))
        assert f"parallel.tp=4 does not divide {msg}" in str(e.value)


# ---- ParallelConfig -------------------------------------------------------------------------

def test_config_derives_dp_and_validates():
    cfg = ParallelConfig(tp=4, pp=2, ep=8)
    assert cfg.validate(64) is cfg
    assert cfg.to_layout(64) == Layout(world_size=64, tp=4, dp=8, pp=2, ep=8)
    assert ParallelConfig().validate().to_layout(1) == Layout(world_size=1)  # the trainer's call
    for bad, needle in [(ParallelConfig(tp=3), "parallel.tp*cp*pp"), (ParallelConfig(dp=-1), "parallel.dp"),
                        (ParallelConfig(dp=2), "parallel.dp=0"), (ParallelConfig(backend="mpi"), "parallel.backend"),
                        (ParallelConfig(timeout_s=0), "parallel.timeout_s"), (ParallelConfig(cp=0), "parallel.cp=0"),
                        (ParallelConfig(pp=2, vp=2), "needs parallel.pp_schedule=interleaved_1f1b"),
                        (ParallelConfig(pp=2, pp_schedule="gpipe"), "parallel.pp_schedule='gpipe'")]:
        with pytest.raises(ValueError) as e:
            bad.validate(8)
        assert needle in str(e.value), (bad, str(e.value))


def test_config_loads_from_the_single_preset():
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(OmegaConf.structured(ParallelConfig), OmegaConf.load(ROOT / "conf/parallel/single.yaml"))
    assert OmegaConf.to_object(merged).validate(1).to_layout(1) == Layout(world_size=1)


# ---- ParallelState --------------------------------------------------------------------------

def _group_ranks(state, axis):
    g = getattr(state, f"{axis}_group")
    return None if g is None else dist.get_process_group_ranks(g)


@pytest.mark.parametrize("cfg", [ParallelConfig(tp=2, cp=2, pp=2, ep=4, etp=2),
                                 ParallelConfig(tp=4, pp=2, ep=8),
                                 ParallelConfig(tp=2, dp=8, pp=4, ep=2, order="tp-ep-cp-dp-pp")])
def test_state_groups_match_grid_under_fake_pg_world_64(cfg):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from parallel.state import AXES, destroy_parallel, init_parallel

    lay = cfg.to_layout(64)
    grids = {**lay.dense_groups(), **lay.expert_groups()}
    for rank in (0, 5, 37, 63):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=64)
        try:
            st = init_parallel(cfg)
            assert (st.rank, st.world_size, st.layout) == (rank, 64, lay)
            coords = lay.coords(rank)
            for axis in AXES:
                mine = next(g for g in grids[axis.replace("_", "-")] if rank in g)
                assert getattr(st, f"{axis}_size") == len(mine)
                assert getattr(st, f"{axis}_rank") == mine.index(rank) == coords[axis.replace("_", "-")]
                assert _group_ranks(st, axis) == (mine if len(mine) > 1 else None), axis
        finally:
            destroy_parallel()


def test_state_single():
    from parallel.state import AXES, ParallelState, init_parallel

    single = ParallelState.single()
    assert all(getattr(single, f"{a}_group") is None and getattr(single, f"{a}_size") == 1 for a in AXES)
    assert not dist.is_initialized()  # conftest's no_leaked_process_group fails the test that leaks one
    assert init_parallel(ParallelConfig()) == single  # plain python: no process group is created
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="parallel.tp"):
        init_parallel(ParallelConfig(tp=2))  # validated before any process group exists


def _gloo_rank(rank, world_size, rdv_path):
    """Re-join through init_parallel's own rendezvous, then all-reduce over every group."""
    import torch

    from parallel.state import AXES, destroy_parallel, init_parallel

    dist.destroy_process_group()  # the harness's group; init_parallel must make its own
    st = init_parallel(ParallelConfig(tp=2, cp=2, ep=2), backend="gloo", timeout_s=30,
                       init_method="file://" + rdv_path)
    out = {}
    for axis in AXES:
        g = getattr(st, f"{axis}_group")
        if g is not None:
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=g)
            out[axis] = (dist.get_process_group_ranks(g), t.item(), getattr(st, f"{axis}_rank"))
    destroy_parallel()
    return out


@pytest.mark.slow
def test_state_under_gloo_4_ranks(tmp_path):
    from parallel.testing import run_distributed

    results = run_distributed(_gloo_rank, 4, str(tmp_path / "rendezvous"), timeout_s=60)
    lay = ParallelConfig(tp=2, cp=2, ep=2).to_layout(4)
    grids = {**lay.dense_groups(), **lay.expert_groups()}
    for rank, out in enumerate(results):
        expected = {a.replace("-", "_"): next(g for g in gs if rank in g) for a, gs in grids.items()}
        expected = {a: g for a, g in expected.items() if len(g) > 1}
        assert sorted(out) == sorted(expected)
        for axis, (ranks, total, idx) in out.items():
            assert ranks == expected[axis] and total == sum(ranks) and idx == ranks.index(rank)
