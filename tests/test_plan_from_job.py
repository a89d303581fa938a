"""PlanConfig reads the job config through the keys its fields name (PlanConfig.from_job), and
tools/plan.py types its overrides by the job config: checked against PlanConfigs written out by hand."""
from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from megak3.job.config import JobConfig
from megak3.launch import planner as P
from megak3.launch.planner.config import job_default


def _tool():
    spec = importlib.util.spec_from_file_location("plan_tool_cfg", Path(__file__).resolve().parents[1] / "tools/plan.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_from_job_reads_every_mirrored_field():
    job = JobConfig()
    par, t = job.parallel, job.train
    par.tp, par.pp, par.ep, par.cp, par.vp, par.dp = 2, 2, 4, 2, 2, 1
    par.sequence_parallel, par.pp_schedule, par.pp_layout = True, "interleaved_1f1b", [1, 1, 1, 1]
    par.pp_split_blocks, par.cp_balance, par.cp_balance_split = True, True, 3
    t.micro_batch_size, t.global_batch_size, t.precision, t.recompute = 2, 12, "bf16", "full"
    job.data.seq_len = 1536
    job.moonep.enabled, job.moonep.max_replicas_per_rank = False, 3
    job.model.moe.qb_method, job.model.moe.qb_bins = "histogram", 512
    job.optim.offload = "cpu"
    want = P.PlanConfig(tp=2, pp=2, ep=4, cp=2, vp=2, dp=1, sequence_parallel=True, pp_schedule="interleaved_1f1b",
                        pp_layout=(1, 1, 1, 1), pp_split_blocks=True, cp_balance=True, cp_balance_split=3,
                        micro_batch_size=2, global_batch_size=12, precision="bf16", activation_checkpointing=True,
                        seq_len=1536, moonep=False, max_replicas_per_rank=3, qb_method="histogram", qb_bins=512,
                        offload="cpu", world_size=16, param_dtype="bf16", vision_fraction=0.25)
    got = P.PlanConfig.from_job(job, world_size=16, param_dtype="bf16", vision_fraction=0.25)
    assert got == want
    # only the keys named: the rest keep the planner's own defaults
    only = P.PlanConfig.from_job(job, world_size=16, keys=["parallel.tp", "data.seq_len"])
    assert only == P.PlanConfig(tp=2, seq_len=1536, world_size=16)
    # every field that mirrors the job config names a key the job config has; where the planner has
    # no default of its own, its default is the job config's
    own = {"sequence_parallel", "micro_batch_size", "seq_len", "global_batch_size", "precision",
           "activation_checkpointing", "pp_split_blocks", "qb_method", "qb_bins"}
    for key, name in P.PlanConfig.job_keys().items():
        d = job_default(key)
        assert (getattr(P.PlanConfig, name) == d) == (name not in own), (key, d)


def test_tool_overrides_typed_by_the_job_config(capsys):
    tool = _tool()
    args = ["model=k3_tiny", "gpu=cpu", "world_size=4", "parallel.tp=2", "parallel.pp=2", "parallel.pp_layout=[1,1]",
            "train.activation_checkpointing=no", "moonep.enabled=0", "data.seq_len=512", "param_dtype=bf16"]
    model, mo, pc, gpu, given = tool.parse_overrides(args)
    assert (model, mo, gpu) == ("k3_tiny", {}, "cpu")
    assert pc == P.PlanConfig(tp=2, pp=2, pp_layout=(1, 1), activation_checkpointing=False, moonep=False, seq_len=512,
                              param_dtype="bf16", world_size=4)
    assert given == {"tp", "pp", "pp_layout", "activation_checkpointing", "moonep", "seq_len", "param_dtype",
                     "world_size"}
    for bad, says in (("parallel.tp=x", "parallel.tp=x must be an integer"),
                      ("parallel.pp_layout=[a]", "parallel.pp_layout"),
                      ("train.max_steps=3", "unknown key 'train.max_steps'"),
                      ("world_size=x", "world_size='x' must be int")):
        assert tool.main(["model=k3_tiny", "gpu=cpu", bad]) == 2
        err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
        assert len(err) == 1 and says in err[0], err
    with pytest.raises(ValueError, match="parallel.sequence_parallel=maybe must be true or false"):
        tool.parse_overrides(["parallel.sequence_parallel=maybe"])
