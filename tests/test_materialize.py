"""Sharded construction: every rank's materialised shard is bitwise the same box of the
single-process initialisation, for every rank of layouts up to 8 ranks (tp, ep with MoonEP,
pp with vp, dp, combined), and the tiled init generates any box alone."""
import pytest
import torch
import torch.distributed as dist

from megak3.config import load_model_config
from megak3.model.init import TILE_COLS, init_slice
from megak3.model.k3 import build_model
from parallel.materialize import materialize
from parallel.parallelize import parallelize
from parallel.testing import PARITY_MODEL
from parallel.plan import canonical_name

LAYOUTS = {
    "tp2_sp": (2, dict(tp=2, sequence_parallel=True)),
    "ep4_moonep": (4, dict(ep=4)),
    "pp2_vp2": (2, dict(pp=2, vp=2, pp_schedule="interleaved_1f1b", pp_split_blocks=True)),
    "dp4": (4, dict()),
    "tp2_ep2_pp2": (8, dict(tp=2, ep=2, pp=2, sequence_parallel=True)),
    "tp2_pp2_dp2": (8, dict(tp=2, pp=2, sequence_parallel=True)),
}


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    cfg = load_model_config("k3_tiny", **PARITY_MODEL)
    ref = build_model(cfg, seed=11)
    return cfg, {canonical_name(k): v for k, v in ref.state_dict().items()}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_rank_shard_is_the_box_of_the_single_process_init(name, reference):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from parallel.config import ParallelConfig
    from parallel.state import init_parallel

    cfg, full = reference
    world, par = LAYOUTS[name]
    pc = ParallelConfig(**par)
    covered = {n: torch.zeros(t.shape, dtype=torch.int32) for n, t in full.items()}
    for rank in range(world):
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            ps = init_parallel(pc, model_cfg=cfg)
            model = build_model(cfg, device="meta")
            plan = parallelize(model, ps, pc)
            assert all(t.device.type == "meta" for t in model.parameters())
            materialize(model, plan, seed=11, std=cfg.init_std)
            plan.check_model(model)
            for n, t in list(model.named_parameters()) + list(model.named_buffers()):
                s = plan.tensors[canonical_name(n)]
                box = tuple(slice(o, o + l) for o, l in zip(s.offsets, s.local_shape))
                assert torch.equal(full[canonical_name(n)][box], t), (name, rank, n)
                covered[canonical_name(n)][box] += 1
        finally:
            dist.destroy_process_group()
    # together the ranks hold every element of the model (replicas more than once)
    missing = [n for n, c in covered.items() if int(c.min()) == 0]
    assert not missing, missing


def test_init_slice_any_box_equals_the_full_tensor_box():
    from torch import nn

    full_shape = (5, 3 * TILE_COLS // 2 + 7)  # several column tiles, ragged edges
    mod = nn.Module()
    full = init_slice(mod, "w", "x.w", full_shape, (0, 0), full_shape, torch.float32, 1, 0.02)
    for off, shp in (((1, 0), (3, full_shape[1])), ((0, 100), (5, 5000)), ((4, 6000), (1, 150))):
        part = init_slice(mod, "w", "x.w", full_shape, off, shp, torch.float32, 1, 0.02)
        assert torch.equal(part, full[off[0]:off[0] + shp[0], off[1]:off[1] + shp[1]])
    cube = init_slice(mod, "w", "y.w", (4, 6, 10), (0, 0, 0), (4, 6, 10), torch.bfloat16, 2, 1.0)
    box = init_slice(mod, "w", "y.w", (4, 6, 10), (1, 2, 3), (2, 3, 4), torch.bfloat16, 2, 1.0)  # general box
    assert torch.equal(box, cube[1:3, 2:5, 3:7])
    assert float(full.std()) == pytest.approx(0.02, rel=0.05)
