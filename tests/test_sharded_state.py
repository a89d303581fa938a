"""megak3/checkpoint/legacy.py (older per-rank part format): parts of any (tp, ep, pp) layout merge back to the full tensors."""
import pytest
import torch

from megak3.checkpoint import legacy as S
from parallel.data_parallel import CANONICAL_FORMAT


def _export(states):
    return {"format": CANONICAL_FORMAT, "state": states, "optimizer": {n: "adamw" for n in states},
            "hyperparameters": {n: {"lr": 1.0} for n in states}}


def test_merge_tp_ep_pp_parts_and_slice_back():
    torch.manual_seed(0)
    full = {"layers.0.w": torch.randn(4, 6), "layers.1.mlp.experts.w1": torch.randn(8, 3, 2),
            "norm.weight": torch.randn(6)}
    tp_dim = {"layers.0.w": 1, "layers.1.mlp.experts.w1": None, "norm.weight": None}
    ep_dim = {"layers.1.mlp.experts.w1": 0}
    parts = []
    # pp stage 0 holds layers.0 (tp=2); stage 1 holds layers.1 + norm (ep=2 over the same two ranks)
    for pp in range(2):
        for r in range(2):
            if pp == 0:
                model = {"layers.0.w": full["layers.0.w"].chunk(2, 1)[r]}
            else:
                model = {"layers.1.mlp.experts.w1": full["layers.1.mlp.experts.w1"].chunk(2, 0)[r]}
                if r == 0:
                    model["norm.weight"] = full["norm.weight"]
            tags = S.make_tags(model, tp_dim, 2, ep_dim, 2)
            opt = _export({n: {"exp_avg": 2 * t, "step": torch.tensor(3.0)} for n, t in model.items()})
            parts.append(S.build_part({"tp": (r, 2), "ep": (r, 2), "pp": (pp, 2)}, tags, model, opt))
    m, o = S.merge_parts(parts)
    for n, t in full.items():
        assert torch.equal(m[n], t)
        assert torch.equal(o["state"][n]["exp_avg"], 2 * t)
    # an ep=4 layout takes the right quarter of the experts
    loc = S.local_model_state(m, ["layers.1.mlp.experts.w1"], ep_dim, 3, 4)
    assert torch.equal(loc["layers.1.mlp.experts.w1"], full["layers.1.mlp.experts.w1"][6:8])
    lo = S.local_optimizer_state(o, ["layers.1.mlp.experts.w1"], ep_dim, 1, 4)
    assert torch.equal(lo["state"]["layers.1.mlp.experts.w1"]["exp_avg"], 2 * full["layers.1.mlp.experts.w1"][2:4])


def test_missing_shard_is_a_clear_error():
    w = torch.randn(4, 2)
    tags = S.make_tags(["w"], {"w": 0}, 2)
    part = S.build_part({"tp": (0, 2)}, tags, {"w": w[:2]}, _export({}))
    with pytest.raises(ValueError, match="incomplete"):
        S.merge_parts([part])
