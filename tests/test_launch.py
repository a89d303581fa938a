"""tools/launch.py: the sbatch script of a 4 x 8 GPU job, SLURM -> torch rank variables, a fake
SLURM run of the generated script (requeue on the preemption exit code), and a real 4-rank local
run on CPU checked against one process."""
import importlib.util
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from megak3.launch import commands as C
from megak3.job.launcher import LauncherConfig, inside_launcher
from megak3.launch.preemption import REQUEUE_EXIT_CODE

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("launch_tool", ROOT / "tools" / "launch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sbatch_opts(script):
    return {l.split()[1].split("=")[0]: (l.split("=", 1)[1] if "=" in l else True)
            for l in script.splitlines() if l.startswith("#SBATCH")}


def test_sbatch_4_nodes_x_8_gpus(capsys):
    rc = _tool().main(["--slurm", "--nodes", "4", "--gpus-per-node", "8", "--time", "12:00:00",
                       "--partition", "h200", "--account", "proj42", "--setup", "module load cuda/12.4",
                       "--dry-run", "--workdir", "/scratch/megak3", "parallel=tp4_sp", "train.device=cuda",
                       "train.max_steps=1000", "train.micro_batch_size=1", "train.global_batch_size=64"])
    script = capsys.readouterr().out
    assert rc == 0, script
    opts = _sbatch_opts(script)
    assert opts["--nodes"] == "4" and opts["--ntasks-per-node"] == "8" and opts["--gpus-per-node"] == "8"
    assert opts["--time"] == "12:00:00" and opts["--partition"] == "h200" and opts["--account"] == "proj42"
    assert opts["--signal"] == "USR1@180" and opts["--requeue"] is True
    body = script.splitlines()
    assert body[0] == "#!/bin/bash"
    assert "cd /scratch/megak3" in body and "module load cuda/12.4" in body
    assert body.index("cd /scratch/megak3") < body.index("module load cuda/12.4") < \
        next(i for i, l in enumerate(body) if l.startswith("srun"))
    srun = script[script.index("srun"):script.index("rc=$?")]
    assert "--ntasks-per-node=8" in srun and "-m megak3.train parallel=tp4_sp train.device=cuda" in srun
    assert "train.resume=auto" in srun and '"train.run_dir=runs/megak3-${SLURM_JOB_ID}"' in srun
    assert "export MEGAK3_SLURM_SRUN=1" in script and f"if [ $rc -eq {REQUEUE_EXIT_CODE} ]" in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)  # valid bash

    tr = C.sbatch_script(LauncherConfig(nnodes=4, gpus_per_node=8, mode="torchrun"), ["parallel=tp2_sp"])
    o = _sbatch_opts(tr)
    assert o["--ntasks-per-node"] == "1" and o["--cpus-per-task"] == "64"
    assert "--nnodes=4 --nproc-per-node=8" in tr and "--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT" in tr
    assert "python -m megak3.launch.torchrun --nnodes=4" in tr  # passes SIGUSR1/SIGTERM to the ranks, exits 75


def test_slurm_env_and_hostlist():
    env = {"SLURM_PROCID": "13", "SLURM_NTASKS": "32", "SLURM_LOCALID": "5", "SLURM_NTASKS_PER_NODE": "8(x4)",
           "SLURM_JOB_NODELIST": "gpu[012-015]", "MASTER_PORT": "29555"}
    assert C.torch_env_from_slurm(env) == {"RANK": "13", "WORLD_SIZE": "32", "LOCAL_RANK": "5",
                                           "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "gpu012", "MASTER_PORT": "29555"}
    assert C.first_host("a17,b[3-4]") == "a17" and C.first_host("n[007,009-010]") == "n007"
    with pytest.raises(ValueError, match="SLURM_LOCALID"):
        C.torch_env_from_slurm({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert inside_launcher({"LOCAL_RANK": "0"}) and not inside_launcher({})


def test_bad_input_is_rejected_before_work(capsys):
    tool = _tool()
    assert tool.main(["--slurm", "--time", "4h", "--dry-run"]) == 2
    assert "launcher.time='4h'" in capsys.readouterr().err
    assert tool.main(["--slurm", "--nodes", "1", "--gpus-per-node", "3", "--dry-run", "parallel=tp2_sp"]) == 2
    assert "parallel.tp" in capsys.readouterr().err  # tp=2 does not divide 3 ranks
    assert tool.main(["--nproc", "4", "--dry-run", "train.max_steps"]) == 2
    assert "key=value" in capsys.readouterr().err
    with pytest.raises(ValueError, match="launcher.mode"):
        LauncherConfig(mode="mpirun").validate()


def test_generated_script_under_fake_slurm_requeues(tmp_path):
    """Run the batch script with fake srun/scontrol: every task maps SLURM_* to torch's variables
    and exits with the preemption code; the script must then requeue the job."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        '#!/bin/bash\nif [ "$1" = show ]; then printf "node7\\nnode8\\n"; else echo "$@" >> "$LOG"; fi\n')
    # fake srun: 2 nodes x 2 tasks, sequentially, with the variables SLURM gives each task
    (bin_dir / "srun").write_text(
        '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nrc=0\nfor i in 0 1 2 3; do\n'
        '  SLURM_PROCID=$i SLURM_NTASKS=4 SLURM_LOCALID=$((i % 2)) SLURM_NTASKS_PER_NODE="2(x2)" "$@" || rc=$?\n'
        'done\nexit $rc\n')
    fake_py = tmp_path / "fakepython"
    fake_py.write_text(
        f'#!/bin/bash\nexec {sys.executable} -c "import json, os, sys; from megak3.launch.commands import '
        f'torch_env_from_slurm as t; open(os.environ[\'LOG\'], \'a\').write(json.dumps(t(os.environ)) + \'\\n\'); '
        f'sys.exit({REQUEUE_EXIT_CODE})"\n')
    for f in (bin_dir / "scontrol", bin_dir / "srun", fake_py):
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    script = C.sbatch_script(LauncherConfig(nnodes=2, gpus_per_node=2, log_dir=str(tmp_path / "logs")),
                             ["train.max_steps=5"], python=str(fake_py))
    log = tmp_path / "log.txt"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", LOG=str(log), SLURM_JOB_ID="4242",
               SLURM_JOB_NODELIST="node[7-8]", SLURM_JOB_NUM_NODES="2", PYTHONPATH=str(ROOT))
    r = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.stdout, r.stderr)
    lines = log.read_text().splitlines()
    ranks = [json.loads(l) for l in lines[:4]]
    assert [e["RANK"] for e in ranks] == ["0", "1", "2", "3"] and {e["WORLD_SIZE"] for e in ranks} == {"4"}
    assert [e["LOCAL_RANK"] for e in ranks] == ["0", "1", "0", "1"]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in ranks} == {("node7", "29500")}
    assert lines[4] == "requeue 4242" and "requeueing 4242" in r.stdout


def _metrics(d):
    return [json.loads(l) for l in (Path(d) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_local_four_cpu_ranks_end_to_end(corpus_dataset, tmp_path):
    from test_sweep import common_overrides

    prefix, tok = corpus_dataset
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    runs = {}
    for name, nproc, extra in (("one", 1, []), ("tp2dp2", 4, ["parallel=tp2_sp"])):
        d = tmp_path / name
        cmd = [sys.executable, str(ROOT / "tools" / "launch.py"), "--nproc", str(nproc), "train.max_steps=2",
               f"train.run_dir={d}", f"hydra.run.dir={d}"] + common_overrides(prefix, tok) + extra
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
        runs[name] = d
    head = subprocess.run([sys.executable, str(ROOT / "tools" / "launch.py"), "--nproc", "4", "--dry-run",
                           "parallel=tp2_sp"], cwd=ROOT, env=env, capture_output=True, text=True).stdout
    assert "megak3.launch.torchrun --standalone --nproc-per-node=4 -m megak3.train parallel=tp2_sp" in head
    st = json.loads((runs["tp2dp2"] / "status.json").read_text())
    assert st["status"] == "ok" and st["nproc"] == 4 and len(st["peak_memory_mb_per_rank"]) == 4
    ref = {m["step"]: m["loss"] for m in _metrics(runs["one"]) if m["kind"] == "train"}
    got = {m["step"]: m["loss"] for m in _metrics(runs["tp2dp2"]) if m["kind"] == "train"}
    assert sorted(got) == [1, 2] and all(abs(got[s] - ref[s]) <= 1e-4 for s in (1, 2)), (got, ref)
