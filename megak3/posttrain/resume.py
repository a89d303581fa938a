"""Resumable RL runs: kill -9 at any point loses no finished sample.

Three files in the run directory, each written atomically (temporary file, fsync, rename):

``rl_rank{r}.pt``   after every update (and its refit): this rank's policy weights, its ZeRO-1 optimizer
                    shard, the KL reference, the policy version, how many prompts were drawn, the history,
                    and the rollout buffer as it stands after the update (untrained samples, paused ones
                    with their tokens and versions).
``rl_buffer.json``  after new prompts join (before generation starts): the buffer and the version (rank 0).
``finished.jsonl``  a journal line, flushed and fsync'ed, the moment a sample finishes (rank 0).

:meth:`RLState.restore` loads the newest policy file, takes the buffer from ``rl_buffer.json`` when it is
from the same version and the same or a later journal position, then replays every journal line written
after that position into the buffer. A sample that finished before the kill is therefore either in the
restored buffer (finished, with its tokens, behaviour logprobs and versions) or was trained on by the
restored policy. If the kill falls between an update and its policy file, the groups of that update are
trained again (never lost). Paused samples lose their engine caches; they resume by prefilling their
prompt and the tokens they already have, under the restored weights, with what is left of their budget.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from .buffer import Rollout

BUFFER = "rl_buffer.json"
JOURNAL = "finished.jsonl"


def _atomic(path: Path, write: Callable[[str], None]) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


class RLState:
    def __init__(self, runner, run_dir):
        self.runner = runner
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank = runner.ps.rank
        self.policy_path = self.dir / f"rl_rank{self.rank}.pt"
        self.journal_path = self.dir / JOURNAL
        self.journal_lines = self._count_lines()

    def _count_lines(self) -> int:
        if not self.journal_path.exists():
            return 0
        return sum(1 for _ in open(self.journal_path, "rb"))

    # ------------------------------------------------------------------------------------- writes
    def journal(self, r: Rollout) -> None:
        self.journal_lines += 1
        if self.rank != 0:
            return
        with open(self.journal_path, "a") as f:
            f.write(json.dumps(asdict(r)) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def save_buffer(self) -> None:
        if self.rank != 0:
            return
        state = {"version": self.runner.version, "journal_lines": self.journal_lines,
                 "prompts_used": self.runner.prompts_used, "buffer": self.runner.buffer.state_dict()}
        _atomic(self.dir / BUFFER, lambda p: Path(p).write_text(json.dumps(state)))

    def save_policy(self) -> None:
        rn = self.runner
        state = {"version": rn.version, "journal_lines": self.journal_lines, "prompts_used": rn.prompts_used,
                 "model": rn.model.state_dict(), "optimizer": rn.rs.optimizer.state_dict(),
                 "ref": None if rn.ref_model is None else rn.ref_model.state_dict(),
                 "buffer": rn.buffer.state_dict(), "history": rn.history}
        _atomic(self.policy_path, lambda p: torch.save(state, p))

    # -------------------------------------------------------------------------------------- restore
    def restore(self) -> bool:
        """Load the newest state (module docstring); False when the run directory holds none."""
        rn = self.runner
        pol = torch.load(self.policy_path, weights_only=False) if self.policy_path.exists() else None
        if pol is not None:
            rn.model.load_state_dict(pol["model"])
            rn.rs.optimizer.load_state_dict(pol["optimizer"])
            if rn.ref_model is not None and pol["ref"] is not None:
                rn.ref_model.load_state_dict(pol["ref"])
            rn.version, rn.history = int(pol["version"]), list(pol["history"])
            buf, offset, used = pol["buffer"], int(pol["journal_lines"]), int(pol["prompts_used"])
        else:
            buf, offset, used = None, 0, 0
        bpath = self.dir / BUFFER
        if bpath.exists():
            b = json.loads(bpath.read_text())
            if int(b["version"]) == rn.version and int(b["journal_lines"]) >= offset:
                buf, offset, used = b["buffer"], int(b["journal_lines"]), int(b["prompts_used"])
        if buf is None and not self.journal_path.exists():
            return False
        if buf is not None:
            rn.buffer.load_state_dict(buf)
        if self.journal_path.exists():
            with open(self.journal_path) as f:
                for n, line in enumerate(f):
                    if n < offset:
                        continue
                    try:
                        d = json.loads(line)
                    except json.JSONDecodeError:  # the line a kill cut short: its sample is not finished
                        break
                    if int(d["uid"]) in rn.buffer.rollouts:
                        rn.buffer.rollouts[int(d["uid"])] = Rollout(**d)
        self.journal_lines = self._count_lines()
        rn.skip_prompts(used)
        rn.refit()
        return True
