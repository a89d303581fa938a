"""The TP sharding table (parallel/sharding.py) against what parallelize() does to the real model.

k3_tiny with the vision tower, on the meta device, as rank 1 of a tp=2 x dp=2 fake process group (no
data moves): every parameter matches exactly one kind of rule, its local shape is the global shape
split along the rule's dim, and the plan's partial-gradient list is the table's; a parameter inside a
TP region without a rule is refused, naming it.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from megak3.config import load_model_config
from megak3.model.k3 import K3Model
from parallel.sharding import COLUMN, EXPERT, IMAGES, REGION, REPLICATED, ROW, VOCAB, tp_rule


@pytest.fixture
def fake_tp2():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from parallel.config import ParallelConfig
    from parallel.state import destroy_parallel, init_parallel

    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())
    try:
        cfg = load_model_config("k3_tiny", **{"vision.enabled": True})
        par = ParallelConfig(tp=2, sequence_parallel=True)
        yield cfg, par, init_parallel(par, model_cfg=cfg)
    finally:
        destroy_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_table_matches_parallelize(fake_tp2):
    from parallel.parallelize import parallelize

    cfg, par, ps = fake_tp2
    with torch.device("meta"):
        model = K3Model(cfg)
    full = {n: tuple(p.shape) for n, p in model.named_parameters()}
    plan = parallelize(model, ps, par)
    kinds = {}
    for name, shape in full.items():
        rule = tp_rule(name)
        kinds.setdefault(rule.kind, []).append(name)
        want = list(shape)
        if rule.tp_dim is not None:
            want[rule.tp_dim] //= 2
        s = plan.tensors[name]
        assert s.local_shape == tuple(want), name
        assert (s.axis, s.dim) == (("tp", rule.tp_dim) if rule.tp_dim is not None else (None, None)), name
        assert s.offsets == tuple(0 if d != rule.tp_dim else want[d] for d in range(len(want))), name  # rank 1
    # every kind the K3 family uses occurs, and each where the architecture puts it
    assert set(kinds) == {COLUMN, ROW, VOCAB, REGION, IMAGES, EXPERT, REPLICATED}
    assert sorted(kinds[VOCAB]) == ["embed_tokens.weight", "lm_head.weight"]
    assert all(".self_attn." in n or ".mlp." in n for n in kinds[COLUMN] + kinds[ROW])
    assert all(n.endswith(("o_proj.weight", "down_proj.weight")) for n in kinds[ROW])
    assert all(".self_attn." in n for n in kinds[REGION])
    assert all(n.startswith("vision.") for n in kinds[IMAGES])
    assert all(".mlp.experts." in n for n in kinds[EXPERT])
    assert not any(".self_attn." in n or n.startswith("vision.") for n in kinds[REPLICATED])
    # under SP every parameter TP does not split has partial gradients (tp = 2, ep = 1)
    assert plan.partial_grad == [n for n in full if tp_rule(n).tp_dim is None]


def test_parameter_without_rule_inside_region_is_refused(fake_tp2):
    from parallel.parallelize import parallelize

    cfg, par, ps = fake_tp2
    with torch.device("meta"):
        model = K3Model(cfg)
        model.layers[0].self_attn.extra_scale = nn.Parameter(torch.ones(4))
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.extra_scale sits inside a tensor-parallel region"):
        parallelize(model, ps, par)
