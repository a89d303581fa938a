"""MoonEP replica weight buffers shared across a model's MoE layers (parallelize_ep hands one
moonep.moonep.ReplicaBuffers to every dispatcher). With full recomputation one buffer per rank serves
all 8 MoE layers: each layer's recompute refetches its replicas in backward, and the loss and every
gradient equal those of the run without recomputation bitwise (where every layer keeps its own
buffer). The buffer bytes equal the planner's figure in both cases."""
import pytest
import torch

from megak3.config import load_model_config
from megak3.launch import planner as P
from parallel.testing import PARITY_MODEL


def _model_case(rank, world, recompute):
    import torch.distributed as dist

    from megak3.model.k3 import build_model
    from moonep.config import MoonEPConfig
    from parallel.expert_parallel import full_expert_tensor, parallelize_ep

    torch.set_num_threads(1)
    cfg = load_model_config("k3_tiny", **PARITY_MODEL)
    model = build_model(cfg, seed=5).train()
    for moe in model.moe_layers():       # a skew that makes replicas in every layer
        moe.gate.e_score_correction_bias.copy_(torch.tensor([0.3, 0.2, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0]))
    plan = parallelize_ep(model, dist.group.WORLD, MoonEPConfig())
    model.recompute = recompute
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
    out = model(ids, torch.roll(ids, -1, 1))
    replicas = [d.last["num_replicas"] for d in plan.dispatchers]
    out.loss.backward()
    grads = {}
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        gr = p.grad.detach().clone()
        grads[n] = full_expert_tensor(gr, plan) if ".experts." in n else gr
    rb = plan.replica_buffers
    return (out.loss.detach(), grads, rb.allocations, rb.nbytes(), replicas,
            all(d.replica_buffers is rb for d in plan.dispatchers))


def test_one_replica_buffer_serves_every_layer_under_recompute():
    from parallel.testing import run_distributed

    cfg = load_model_config("k3_tiny", **PARITY_MODEL)
    n_moe = len([i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)])
    keep = run_distributed(_model_case, 2, "none", timeout_s=300)
    rerun = run_distributed(_model_case, 2, "full", timeout_s=300)
    for ckpt, results in ((False, keep), (True, rerun)):
        pc = P.PlanConfig(ep=2, world_size=2, seq_len=16, global_batch_size=4, precision="fp32",
                          activation_checkpointing=ckpt).resolved()
        fig = P.moonep_replica_figures(cfg, pc, n_moe, 1)
        for loss, grads, allocs, nbytes, replicas, shared in results:
            assert shared and all(r > 0 for r in replicas), replicas
            assert allocs == fig["buffers"] == (1 if ckpt else n_moe)
            assert nbytes == fig["memory"]
    for (l0, g0, *_), (l1, g1, *_) in zip(keep, rerun):
        assert torch.equal(l0, l1)
        assert g0.keys() == g1.keys() and any(".experts." in n for n in g0)
        for n in g0:
            assert torch.equal(g0[n], g1[n]), n
