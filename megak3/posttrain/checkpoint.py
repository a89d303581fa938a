"""RL checkpoints in the checkpoint package: a run directory that any megak3 tool reads, kill -9 safe.

Layout of ``train.run_dir`` (the trainer's names)::

    checkpoints/step_XXXXXXXX/   TrainCheckpoint (megak3/checkpoint/): the policy as ``model/NAME`` boxes, the
                                 ZeRO-1 optimizer as ``optim/NAME/STATE``, the KL reference as ``ref/NAME``
                                 (when rl.loss.kl_coef > 0), and in the common state the RL state below;
                                 step = the policy version. Atomic, per-shard, reshardable; read back as
                                 tensors, JSON and weights_only pickles (megak3/checkpoint/safe.py).
    tokenizer.json               the tokenizer (so ``--checkpoint RUN`` / ``--init-from RUN`` find it)
    rl_buffer.json               the rollout buffer (and the batch generated ahead) when new prompts joined (before
                                 generation), JSON
    finished.jsonl               a JSON line, flushed and fsync'ed, the moment a sample finishes

The RL state (``common["train_data"]``, plain data): policy version, prompts drawn, journal offset (lines of
``finished.jsonl`` already in the checkpoint's buffer), the rollout buffer after the update (paused partial
samples as token lists with their logprobs, versions and budgets), the history, the batch generated ahead
(``rl.rollout.lag=1``: its record and groups of finished samples), the routing (each GRPO group's replica, the
router's cache model and work counts: engines.ReplicaRollouts.state_dict), and what a subclass adds
(:meth:`RLRunner.extra_state`: the agentic driver and sandboxes). The writer also records the RNG state (of the
trainer ranks; a sample's sampling seed is a function of ``rl.seed`` and its uid, so generation keeps none).
With ``rl.rollout.placement=separate`` the trainer ranks write the checkpoint and its RL state also holds, under
``engines``, the first engine rank's part (prompts drawn, journal offset, buffer, batch ahead, routing, history),
sent to them at the save and back to every engine rank at restore (megak3/posttrain/placement.py gives the order);
the first engine rank writes ``rl_buffer.json`` and ``finished.jsonl``.

Restore (:meth:`RLCheckpoint.restore`): the newest complete checkpoint (``train.resume=auto``) or a named one;
then ``rl_buffer.json`` when it is of the restored version and the same or a later journal offset; then every
journal line after that offset is replayed into the buffer (a last line a kill cut short is skipped, any other
line that is not a journaled sample is refused in one line). A sample finished before a kill is therefore in
the restored buffer or the restored batch ahead, or was trained on by the restored policy. With synchronous
rollouts (``rl.partial_fraction=1``) and a kill after a save, the rerun is exact (same samples, losses and weights) at
either placement and lag: the buffer is empty at every save (tests/test_rl_checkpoint.py,
tests/test_rl_lag_resume.py). Paused samples (partial rollouts) continue from their token lists by prefill
under the restored weights with a fresh sampling stream, so their continuation is not bitwise the one an
uninterrupted run samples.

The files of the older format (``rl_rank{r}.pt``, torch.save pickles that only a full unpickler reads, so a
planted one runs code) are refused in one line; nothing in them is read.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Optional

import torch

from parallel.plan import canonical_name

from ..checkpoint.atomic import write_bytes_durably
from ..checkpoint.reader import CheckpointReader
from ..checkpoint.train_state import TrainCheckpoint
from ..checkpoint.writer import ShardEntry
from .buffer import Rollout, batch_state, load_batch
from .placement import broadcast, world_of

BUFFER = "rl_buffer.json"
JOURNAL = "finished.jsonl"
LEGACY = "rl_rank*.pt"


def refuse_legacy(run_dir: Path) -> None:
    """ValueError when ``run_dir`` holds an RL state of the older pickle format (never read)."""
    old = sorted(Path(run_dir).glob(LEGACY))
    if old:
        raise ValueError(f"train.run_dir={run_dir}: {old[0].name} is an RL state of the older format (a torch.save "
                         "pickle that only a full unpickler reads, so it could run code); it is refused unread: "
                         "start a new train.run_dir")


def _read_json(path: Path, what: str):
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"{path}: the {what} is not JSON (refused; nothing in it was run); remove it or start a "
                         "new train.run_dir") from None


class _WithRef(TrainCheckpoint):
    """TrainCheckpoint plus a second model of the same plan (the KL reference) as ``ref/NAME`` boxes."""

    def __init__(self, *a, ref=None, **kw):
        super().__init__(*a, **kw)
        self.ref = ref

    def _entries(self):
        entries, meta = super()._entries()
        if self.ref is not None:
            for n, v in ((canonical_name(k), v) for k, v in self.ref.state_dict().items()):
                if self.plan.is_saver(n):
                    sh = self.plan.tensors[n]
                    entries[f"ref/{n}"] = ShardEntry(v.detach(), sh.global_shape, sh.offsets)
        return entries, meta

    @torch.no_grad()
    def load(self, path):
        common = super().load(path)
        if self.ref is not None:
            reader = CheckpointReader(Path(path))
            keys = set(reader.keys())
            for k, dst in self.ref.state_dict().items():
                n = canonical_name(k)
                if f"ref/{n}" not in keys:
                    raise ValueError(f"checkpoint {path} holds no KL reference ({n!r}); it was saved with "
                                     "rl.loss.kl_coef=0: resume with the same rl.loss.kl_coef")
                sh = self.plan.tensors[n]
                reader.read(f"ref/{n}", sh.offsets, sh.local_shape, out=dst)
        return common


class _State:
    """The RL state as the checkpoint's ``train_data`` (its ``state_dict`` / ``load_state_dict``)."""

    def __init__(self, ck: "RLCheckpoint"):
        self.ck = ck

    def state_dict(self) -> dict:
        rn = self.ck.runner
        return {"version": rn.version, **self.ck.side_state(), "extra": rn.extra_state(),
                "engines": self.ck.engine_side}

    def load_state_dict(self, state: dict) -> None:
        self.ck.loaded = state


class RLCheckpoint:
    """Saves and restores one rank's RL run under ``run_dir`` (module docstring). ``save_interval``: a
    checkpoint every that many policy versions (and at the last one; 0: only at the last)."""

    def __init__(self, runner, run_dir, save_interval: int = 1, keep_last: int = 2, config: Optional[dict] = None):
        self.runner = rn = runner
        self.dir = Path(run_dir)
        refuse_legacy(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        rank, world = world_of(rn.ps, rn.rollout.placement)
        self.rank, self.trainers = rank, rn.rollout.trainer_ranks(world)
        self.separate = self.trainers < world
        """engines on ranks of their own: their side's state travels to the trainer ranks at a save, back at restore"""
        self.files = rank == rn.rollout.engine_offset(world)
        """this rank (the first that generates) writes the journal and the buffer file"""
        self.engine_side: Optional[dict] = None
        """the first engine rank's :meth:`side_state` at the last save (separate placement, trainer ranks)"""
        self.save_interval = int(save_interval)
        self.journal_path = self.dir / JOURNAL
        self.journal_lines = self._count_lines()
        self.loaded: Optional[dict] = None
        self.ckpt = None
        ps, job = rn.ps, rn.job
        if ps is None:  # an engine rank of the separate placement: the trainer ranks write the checkpoint
            return
        layout = {"tp": ps.tp_size, "cp": ps.cp_size, "dp": ps.dp_size, "ep": ps.ep_size, "pp": ps.pp_size,
                  "vp": job.parallel.vp, "sequence_parallel": rn.rs.plan.sequence_parallel}
        cfg = {"model": dataclasses.asdict(job.model), "quant": dataclasses.asdict(job.quant),
               "rl": dataclasses.asdict(rn.rl), **(config or {})}
        self.ckpt = _WithRef(self.dir / "checkpoints", rn.model, rn.rs.optimizer, rn.rs.plan, ps, _State(self),
                             rn.rs.device, layout, {"kind": "rl", "config": cfg}, keep_last=keep_last, ref=rn.ref_model)
        if ps.rank == 0:
            tmp = self.dir / f"tokenizer.json.tmp-{os.getpid()}"
            rn.tokenizer.hf.save(str(tmp))
            os.replace(tmp, self.dir / "tokenizer.json")

    def _count_lines(self) -> int:
        if not self.journal_path.exists():
            return 0
        return sum(1 for _ in open(self.journal_path, "rb"))

    def side_state(self) -> dict:
        """This rank's part of the RL state, plain data: prompts drawn, journal offset, buffer, history, the
        batch generated ahead (``rl.rollout.lag=1``) and the routing state (on a rank that generates)."""
        rn = self.runner
        gen = rn.sampler is not None
        return {"prompts_used": rn.prompts_used, "journal_lines": self.journal_lines,
                "buffer": rn.buffer.state_dict(), "history": rn.history,
                "pending": batch_state(rn._pending) if gen else None,
                "routing": rn.sampler.state_dict() if gen else None}

    # ------------------------------------------------------------------------------------- writes
    def journal(self, r: Rollout) -> None:
        self.journal_lines += 1
        if not self.files:
            return
        with open(self.journal_path, "a") as f:
            f.write(json.dumps(dataclasses.asdict(r)) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def save_buffer(self) -> None:
        if not self.files:
            return
        rn = self.runner
        state = {"version": rn.version, "journal_lines": self.journal_lines, "prompts_used": rn.prompts_used,
                 "buffer": rn.buffer.state_dict(), "pending": batch_state(rn._pending)}
        tmp = self.dir / f"{BUFFER}.tmp-{os.getpid()}"
        write_bytes_durably(tmp, json.dumps(state).encode())
        os.replace(tmp, self.dir / BUFFER)

    def after_update(self) -> bool:
        """Save when the version is a multiple of the interval or the last; returns True when it saved (every
        rank calls it). Separate placement: the first engine rank's :meth:`side_state` goes to the trainer
        ranks first (one broadcast over the trainer ranks and that engine rank), then the trainer ranks save."""
        rn = self.runner
        v = rn.version
        if v != rn.rl.iterations and not (self.save_interval and v % self.save_interval == 0):
            return False
        if self.separate and self.rank <= self.trainers:
            mine = self.side_state() if self.rank == self.trainers else None
            self.engine_side = broadcast(mine, self.trainers, rn._share_group)
        if self.ckpt is not None:
            self.ckpt.save(v)
        return True

    # -------------------------------------------------------------------------------------- restore
    def restore(self, spec: str = "auto") -> bool:
        """``train.resume`` (``auto``, ``none`` or a checkpoint path): load the state (module docstring);
        False when there is nothing to restore. A file needing the full unpickler: ValueError, one line. Every
        rank calls it. Separate placement, in this order: the trainer ranks read the checkpoint; trainer rank 0
        sends the RL state to the first engine rank (a broadcast over the trainer ranks and it), which sends it
        to every engine rank (over the engine ranks' group); the engine ranks add the buffer file and the
        journal; the first engine rank sends the batch generated ahead back to the trainer ranks (a broadcast
        over the same group as the first); then every rank refits (the engines get their weights from the
        restored policy: none are in the checkpoint twice). An error of the side that read a file travels with
        these broadcasts, so every rank raises its one line and none is left waiting for a rank that raised."""
        rn = self.runner
        if spec == "none":
            return False
        st, err = None, None
        if self.ckpt is not None:
            try:
                _, common = self.ckpt.resume(spec)
                st = self.loaded if common is not None else None
            except ValueError as e:  # on every trainer rank alike (TrainCheckpoint.resume agrees)
                if not self.separate:
                    raise
                err = str(e)
        T = self.trainers
        if self.separate:  # the engine ranks raise the trainer ranks' error instead of waiting for them
            if self.rank <= T:
                st, err = broadcast((st, err), 0, rn._share_group)
            if self.rank >= T:
                st, err = broadcast((st, err), T, rn.engine_ps.host_group)
            if err:
                raise ValueError(err)
        buf, offset, used, pending, routing, extra = None, 0, 0, None, None, {}
        if st is not None:  # the generating side's part: the engines' (saved separate) or the one state
            gen = st.get("engines") or st
            rn.version, rn.history = int(st["version"]), list((st if rn.ps is not None else gen)["history"])
            buf, offset, used = gen["buffer"], int(gen["journal_lines"]), int(gen["prompts_used"])
            pending, routing, extra = gen.get("pending"), gen.get("routing"), st.get("extra") or {}
        restored = st is not None
        if rn.sampler is not None:  # a rank that generates: the newer buffer file, the journal, the routing
            try:
                bpath = self.dir / BUFFER
                if bpath.exists():
                    b = _read_json(bpath, "rollout buffer")
                    if int(b["version"]) == rn.version and int(b["journal_lines"]) >= offset:
                        buf, offset, used = b["buffer"], int(b["journal_lines"]), int(b["prompts_used"])
                        pending = b.get("pending")
                restored = restored or buf is not None or self.journal_path.exists()
                if buf is not None:
                    rn.buffer.load_state_dict(buf)
                self._replay(offset)
                if routing is not None:
                    rn.sampler.load_state_dict(routing)
            except ValueError as e:
                if not self.separate:
                    raise
                err = str(e)
        if self.separate and self.rank <= T:  # the batch generated ahead, as the engines restored it
            mine = (restored, pending, err) if self.rank == T else None
            restored, pending, err = broadcast(mine, T, rn._share_group)
        if err:
            raise ValueError(err)
        if not restored:
            return False
        rn._pending = load_batch(pending)
        rn.load_extra_state(extra)
        rn.skip_prompts(used)
        rn.refit()
        return True

    def _replay(self, offset: int) -> None:
        """Every journal line is checked; a sample after ``offset`` still in the buffer takes its journaled state."""
        rn = self.runner
        if self.journal_path.exists():
            with open(self.journal_path, "rb") as f:
                lines = f.read().split(b"\n")
            for n, line in enumerate(lines):
                if not line:
                    continue
                try:
                    d = json.loads(line.decode("utf-8"))
                    r = Rollout(**d)
                except (UnicodeDecodeError, json.JSONDecodeError, TypeError):
                    if n == len(lines) - 1:  # the last line, cut short by a kill: its sample had not finished
                        break
                    raise ValueError(f"{self.journal_path}: line {n + 1} is not a journaled sample (refused; nothing "
                                     "in it was run); remove the file or start a new train.run_dir") from None
                if n >= offset and r.uid in rn.buffer.rollouts:
                    rn.buffer.rollouts[r.uid] = r
        self.journal_lines = self._count_lines()
