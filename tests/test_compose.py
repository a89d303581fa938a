"""Start-up composes the configuration once (issue 30 item 6): ``python -m megak3.train`` composes
the run config one time, validates that very config before anything is written and runs it as
Hydra's job. A spy on Hydra's composition counts the calls of the README's main command
(``torchrun --nproc-per-node 4 -m megak3.train parallel=tp2_sp``: rank 0 of 4, trainer stubbed),
of a job that starts its own ranks, and of a bad input."""
import logging
import sys

import pytest
from hydra._internal.hydra import Hydra

import megak3.train.__main__ as M

RANK0_OF_4 = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}


@pytest.fixture
def start(tmp_path, monkeypatch):
    """main() with ARGV in a fresh directory; returns (compositions, exit code)."""
    calls = []
    real = Hydra.compose_config

    def spy(self, *args, **kwargs):
        calls.append(kwargs.get("overrides"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Hydra, "compose_config", spy)
    monkeypatch.setattr(M, "catch_early", lambda: None)  # no signal handlers in the test process
    monkeypatch.chdir(tmp_path)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MEGAK3_SLURM_SRUN"):
        monkeypatch.delenv(k, raising=False)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level

    def go(argv, env=None):
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        monkeypatch.setattr(sys, "argv", ["megak3.train"] + argv)
        calls.clear()
        try:
            M.main()
            code = 0
        except SystemExit as e:
            code = e.code
        finally:  # Hydra's job logging configured the root logger: give pytest its own back
            for h in root.handlers[:]:
                if h not in handlers:
                    root.removeHandler(h)
                    h.close()
            root.setLevel(level)
        return list(calls), code

    return go


def test_the_readme_main_command_composes_once(start, tmp_path, monkeypatch):
    seen = {}

    def fake_run(cfg, prepared=None):  # the trainer's place: what it would be given
        seen["cfg"], seen["prepared"] = cfg, prepared
        return {"peak_memory_mb_per_rank": [1.0], "steps": 0}

    monkeypatch.setattr(M, "run", fake_run)
    calls, code = start(["parallel=tp2_sp"], RANK0_OF_4)
    assert code == 0 and len(calls) == 1, calls
    job, notices = seen["prepared"]  # the config it composed is the one validated and run
    assert (job.parallel.tp, job.parallel.sequence_parallel, job.parallel.resolved_dp(4)) == (2, True, 2)
    assert seen["cfg"].parallel.tp == 2 and "hydra" not in seen["cfg"]
    assert any(n.startswith("train.threads=") for n in notices)
    run_dir, = (tmp_path / "runs").iterdir()  # Hydra's run directory, as before
    assert (run_dir / ".hydra" / "config.yaml").exists() and (run_dir / "status.json").exists()


def test_a_job_that_starts_its_ranks_composes_once(start, tmp_path, monkeypatch):
    spawned = []
    monkeypatch.setattr(M, "spawn", lambda overrides, nproc, job_dir, launcher: spawned.append((overrides, nproc)) or (0, None))
    calls, code = start(["parallel=tp2_dp2", f"train.run_dir={tmp_path / 'run'}"])
    assert code == 0 and len(calls) == 1, calls
    assert spawned == [(["parallel=tp2_dp2", f"train.run_dir={tmp_path / 'run'}"], 4)]


def test_a_bad_input_composes_once_and_writes_nothing(start, tmp_path, capsys):
    calls, code = start(["parallel.tp=3"], RANK0_OF_4)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(calls) == 1, calls
    assert err.count("\n") == 0 and "parallel.tp*cp*pp = 3*1*1 = 3 does not divide world_size=4" in err
    assert not list(tmp_path.iterdir())
