"""The ``megak3`` front door (megak3/__main__.py) and the named configs (conf/model/k3_micro|k3_small,
conf/experiment/): every subcommand resolves to the module or tool it documents and its --help works;
a bad command or tool is one line and exit 2; the recipes compose to the override walls they replace."""
import subprocess
import sys
from pathlib import Path

import pytest

from megak3.__main__ import COMMANDS, TOOLS_DIR, resolve, usage

ROOT = Path(__file__).resolve().parents[1]


def test_help_lists_every_subcommand():
    text = usage()
    for name, (_, _, line) in COMMANDS.items():
        assert f"  {name}" in text and line in text
    for cmd in ([], ["--help"], ["-h"], ["help"]):
        argv, out, code = resolve(cmd)
        assert argv is None and code == 0 and out == text


def test_each_subcommand_execs_its_target():
    for name, (kind, target, _) in COMMANDS.items():
        if kind == "module":
            argv, _, code = resolve([name, "a=1", "--flag"])
            assert code == 0 and argv == [sys.executable, "-m", *target, "a=1", "--flag"]
        elif kind == "tool":
            argv, _, code = resolve([name, "x"])
            assert code == 0 and argv == [sys.executable, str(TOOLS_DIR / f"{target[0]}.py"), "x"]
    argv, _, _ = resolve(["bench", "sandbox", "--quick"])
    assert argv == [sys.executable, str(TOOLS_DIR / "bench_sandbox.py"), "--quick"]
    argv, _, _ = resolve(["tool", "layout", "parallel.tp=2"])
    assert argv == [sys.executable, str(TOOLS_DIR / "layout.py"), "parallel.tp=2"]
    for kind in ("bench", "tool"):          # listings name every tool with its first docstring line
        _, text, code = resolve([kind, "--help"])
        assert code == 0
        names = [p.stem for p in TOOLS_DIR.glob("*.py")]
        for n in names:
            if kind == "bench" and n.startswith("bench_"):
                assert f"  {n[len('bench_'):]}" in text
            elif kind == "tool" and not n.startswith(("bench_", "_")):
                assert f"  {n}" in text


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "megak3", *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


@pytest.mark.parametrize("args", [["trian"], ["bench", "nope"], ["tool", "bench_nope"], ["--bogus"]])
def test_bad_command_is_one_line_exit_2(args):
    r = _cli(*args)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megak3: error: "), r.stderr


def test_every_subcommand_help_runs():
    """``megak3 NAME --help`` for every subcommand, all started at once (each is a process start)."""
    cases = [[name, "--help"] for name in COMMANDS] + [["bench", "sandbox", "--help"], ["tool", "layout", "--help"]]
    procs = [(c, subprocess.Popen([sys.executable, "-m", "megak3", *c], cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True,
                                  env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})) for c in cases]
    for c, p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, (c, out[-2000:])
        assert out.strip(), c                                # every help says something


def test_named_configs_equal_the_override_walls():
    """k3_micro / k3_small and the experiment recipes compose to the exact fields of the command lines
    they replace (the README's former 20-override walls)."""
    from omegaconf import OmegaConf

    from megak3.job.compose import compose

    micro_wall = ("model.vocab_size=512 model.vision.enabled=false model.hidden_size=64 model.dense_intermediate_size=128 "
                  "model.kda.num_heads=2 model.kda.head_dim=16 model.kda.gate_rank=8 model.kda.chunk_size=16 "
                  "model.mla.num_heads=2 model.mla.q_lora_rank=32 model.mla.kv_lora_rank=16 model.mla.qk_nope_head_dim=8 "
                  "model.mla.qk_rope_head_dim=8 model.mla.v_head_dim=8 model.moe.num_experts=8 "
                  "model.moe.expert_intermediate_size=32 model.moe.latent_size=32").split()
    small_wall = ("model.vocab_size=512 model.vision.enabled=false model.hidden_size=128 model.dense_intermediate_size=256 "
                  "model.kda.num_heads=2 model.kda.head_dim=32 model.kda.gate_rank=16 model.kda.chunk_size=32 "
                  "model.mla.num_heads=2 model.mla.q_lora_rank=64 model.mla.kv_lora_rank=32 model.mla.qk_nope_head_dim=16 "
                  "model.mla.qk_rope_head_dim=16 model.mla.v_head_dim=16 model.moe.num_experts=8 "
                  "model.moe.expert_intermediate_size=64 model.moe.latent_size=64").split()

    def model(over):
        m = OmegaConf.to_container(compose(over).model)
        m.pop("name")
        return m

    assert model(["model=k3_micro"]) == model(micro_wall)
    assert model(["model=k3_small"]) == model(small_wall)
    a = compose(["experiment=sft_small"])
    b = compose(["data=demo_sft", "train.run_dir=runs/sft-small", "train.max_steps=150", "train.global_batch_size=8",
                 "train.micro_batch_size=8", "train.eval_interval=50", "optim.lr=0.01", *small_wall])
    for group in ("data", "train", "optim", "parallel"):
        assert a[group] == b[group], group
    assert model(["experiment=sft_small"]) == model(small_wall)
    over = compose(["experiment=sft_small", "train.max_steps=3"])      # later overrides win
    assert over.train.max_steps == 3
