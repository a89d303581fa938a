"""The RL policy update at any trainer layout: one optimizer step of the production RankStep.

:func:`policy_update` (``RLRunner.update``): each data-parallel rank takes its contiguous slice of the
update's samples, sorts them by length (stable: a long-tailed batch then pads to its longest sample in one
micro-batch, not in every one; the loss is a sum over samples, the same up to rounding) and cuts them into
micro-batches of ``rl.micro_batch_size`` rows, each padded to its longest row. Under pipeline, context
or expert parallelism every rank runs the same number of micro-batches of one fixed shape ``[M, T]``
(T: the update's longest sample, rounded up to the token shard ``tp (SP) x cp``), padded with masked rows:
the pipeline's point-to-point payloads have fixed shapes and MoonEP's dispatch needs equal routed rows on
every EP rank; an interleaved schedule gets its micro-batch count rounded up to a multiple of ``pp``.

The model runs as pretraining runs it: one forward per micro-batch, or the pipeline schedule
(:class:`parallel.pipeline.PipelineEngine`), whose last stage applies a ``head`` to the logits instead of
the cross entropy. Two passes: ``logp_old`` (no grad; also the reference policy's, under the KL term),
then the clipped policy loss (objective.py), backpropagated. Under context parallelism each rank holds
its segment ``[r T/cp, (r+1) T/cp)`` of every row (the model cuts its inputs the same way) and scores
that segment's tokens; the per-sequence aggregation divides by whole-row token counts. The loss and its
statistics are summed over the data x context ranks and the pipeline stages (only the last has them);
the tensor-parallel ranks hold the same values. ``RankStep.apply`` then reduces, clips and steps.
``lp_gap``: the largest |trainer logp_old - engine behaviour logprob| over tokens sampled by the current
policy version (0 when none): the engine-vs-trainer agreement right after a refit.
"""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist

from parallel.parallelize import sync_partial_grads

from ..data.packing import IGNORE_INDEX
from ..train.step import all_reduce_sum
from .buffer import Rollout
from .objective import policy_loss, staleness_weights
from .mopd import kl_report, new_tally, tally_kl, teacher_logprobs
from .rewards import mopd_rewards


def response_batch(samples: List[Rollout], pad_id: int, multiple: int = 1, rows: int = 0,
                   length: int = 0) -> Dict[str, torch.Tensor]:
    """Rows ``prompt + response`` shifted for next-token scoring: ``input_ids``/``targets`` [B, T],
    ``mask`` (1 at positions whose target is a response token), ``behaviour`` logprobs there, and
    ``cu_seqlens`` (one segment per row, padding its own segment), ``real`` (True at the input positions
    that are tokens of a sample, not padding). B is at least ``rows`` (extra rows:
    padding, mask 0) and T at least ``length``, rounded up to a multiple of ``multiple`` (the
    sequence-parallel shard count)."""
    T = max([length] + [len(s.prompt_ids) + len(s.token_ids) - 1 for s in samples])
    T = -(-T // multiple) * multiple
    B = max(len(samples), rows)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    tgt = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros(B, T)
    beh = torch.zeros(B, T)
    real = torch.zeros(B, T, dtype=torch.bool)
    cu = [0]
    for b, s in enumerate(samples):
        full = list(s.prompt_ids) + list(s.token_ids)
        L, P = len(full) - 1, len(s.prompt_ids)
        ids[b, :L] = torch.tensor(full[:-1])
        tgt[b, :L] = torch.tensor(full[1:])
        mask[b, P - 1:L] = torch.tensor(s.mask, dtype=torch.float32) if s.mask else 1  # model tokens only
        real[b, :L] = True
        beh[b, P - 1:L] = torch.tensor(s.logprobs, dtype=torch.float32)
        cu += [b * T + L] if L < T else []
        cu.append((b + 1) * T)
    cu += [(b + 1) * T for b in range(len(samples), B)]
    return {"input_ids": ids, "targets": tgt, "mask": mask, "behaviour": beh, "real": real,
            "cu_seqlens": torch.tensor(cu, dtype=torch.int32)}


def by_length(samples: List[Rollout], adv_N: torch.Tensor):
    """``samples`` and their advantages in order of length (prompt + response; stable)."""
    order = sorted(range(len(samples)), key=lambda j: len(samples[j].prompt_ids) + len(samples[j].token_ids))
    return [samples[j] for j in order], adv_N[order]


def _segment(runner, t_BT: torch.Tensor) -> torch.Tensor:
    """This context-parallel rank's contiguous segment of every row (the rows unchanged without CP)."""
    ps = runner.ps
    if ps.cp_size == 1:
        return t_BT
    Tl = t_BT.shape[1] // ps.cp_size
    return t_BT[:, ps.cp_rank * Tl:(ps.cp_rank + 1) * Tl]


def _routed(runner, real_BT: torch.Tensor) -> torch.Tensor:
    """Which of this rank's routed tokens (the MoE's flattened rows) are sample tokens, not padding."""
    real_BT = _segment(runner, real_BT)
    if runner.rs.plan.sequence_parallel:  # this rank routes its chunk of its segment
        T = real_BT.shape[1] // runner.ps.tp_size
        real_BT = real_BT[:, runner.ps.tp_rank * T:(runner.ps.tp_rank + 1) * T]
    return real_BT.reshape(-1)


def shapes(runner, samples: List[Rollout], cuts: List[int]) -> list:
    """[(rows, length)] of this rank's micro-batches ((0, 0): as its samples need)."""
    ps, M = runner.ps, runner.rl.micro_batch_size
    mine = cuts[ps.dp_rank + 1] - cuts[ps.dp_rank]
    if ps.pp_size == 1 and ps.cp_size == 1 and ps.ep_size == 1:
        return [(0, 0)] * (-(-mine // M))
    n = max(1, max(-(-(b - a) // M) for a, b in zip(cuts, cuts[1:])))
    if ps.pp_size > 1 and runner.job.parallel.pp_schedule == "interleaved_1f1b":
        n = -(-n // ps.pp_size) * ps.pp_size
    T = max(len(s.prompt_ids) + len(s.token_ids) - 1 for s in samples)
    return [(M, T)] * n


def _run(runner, model, pipe, mbs, head, train: bool) -> list:
    """Every micro-batch through ``model`` (or the pipeline ``pipe``), ``head(i, logits)`` -> 0-dim loss on
    the logits (under pp: the last stage's); ``train``: backpropagate it. Returns the MoE stats per micro-batch."""
    rs = runner.rs
    if pipe is not None:
        with rs.autocast():
            if train:
                return pipe.train_step(mbs, 1.0, head=head)[1]
            pipe.forward_only(mbs, head=head)
            return []
    stats = []
    for i, mb in enumerate(mbs):
        with rs.autocast(), torch.set_grad_enabled(train):
            out = model(mb["input_ids"], cu_seqlens=mb["cu_seqlens"], return_logits=True)
            loss = head(i, out.logits)
        if train:
            loss.backward()
        stats.append(out.moe_stats)
    return stats


def policy_update(runner, samples: List[Rollout], adv_N: torch.Tensor) -> dict:
    """One optimizer step on ``samples`` (module docstring); every rank passes the same list."""
    rl, ps, rs, model = runner.rl, runner.ps, runner.rs, runner.model
    M = rl.micro_batch_size
    cuts = [len(samples) * r // ps.dp_size for r in range(ps.dp_size + 1)]
    lo, hi = cuts[ps.dp_rank], cuts[ps.dp_rank + 1]
    mine, adv_mine = by_length(samples[lo:hi], adv_N[lo:hi])   # length-sorted micro-batches pad little
    dev = rs.device
    shard = (ps.tp_size if rs.plan.sequence_parallel else 1) * ps.cp_size
    if ps.cp_size > 1 and runner.job.parallel.cp_balance:
        shard *= runner.job.parallel.cp_balance_split
    mbs = []
    last_stage = ps.pp_size == 1 or ps.pp_rank == ps.pp_size - 1   # only the last stage computes the loss
    mopd = new_tally(len(runner.teachers))
    for i, (rows, length) in enumerate(shapes(runner, samples, cuts)):
        part = mine[i * M:(i + 1) * M]
        mb = response_batch(part, runner.tokenizer.pad_id, shard, rows, length)
        mb = {k: (v if k == "cu_seqlens" else v.to(dev)) for k, v in mb.items()}
        adv = torch.zeros(mb["mask"].shape[0])
        adv[:len(part)] = adv_mine[i * M:(i + 1) * M]
        mb["adv"] = adv.to(dev)
        mb["labels"] = mb["targets"]  # what the pipeline stages cut (shard_inputs)
        mb["row_tokens"] = mb["mask"].sum(1)
        for k in ("targets", "mask", "behaviour"):
            mb[k + "_l"] = _segment(runner, mb[k])
        if runner.teachers and last_stage:  # MOPD: each row scored by its own teacher only (whole rows)
            which = [runner.teacher_of(r) for r in part] + [-1] * (mb["mask"].shape[0] - len(part))
            with torch.no_grad(), rs.autocast():
                t_BT, fwd = teacher_logprobs(lambda m, b: runner._logp(m, b)[0], runner.teachers, which,
                                             lambda idx: _rows_batch(runner, part, idx, mb, shard, dev),
                                             mb["mask"].shape, dev)
            mopd["rows"] += fwd
            mb["teacher_lp"], mb["which"] = _segment(runner, t_BT), torch.tensor(which, device=dev)
        mbs.append(mb)
    agg = rl.loss.aggregation
    count = torch.tensor([float(sum(float(mb["mask"].sum()) for mb in mbs) if agg == "token" else len(mine))],
                         dtype=torch.float64, device=dev)
    denom = float(all_reduce_sum(count, [ps.dp_group]).clamp_min(1.0))
    model.train()
    zero = torch.zeros((), device=dev)
    cur = torch.zeros((), dtype=torch.float64, device=dev)  # lp_gap on this rank's tokens

    def old_head(i, logits):
        nonlocal cur
        mb = mbs[i]
        mb["logp_old"] = lp = runner._logits_logp(logits, mb["targets_l"])
        fresh = _segment(runner, torch.as_tensor(_fresh_mask(mine[i * M:(i + 1) * M], mb, runner.version),
                                                 device=dev))
        if fresh.any():
            cur = torch.maximum(cur, (lp - mb["behaviour_l"]).abs()[fresh].max().double())
        if "teacher_lp" in mb:
            own = torch.zeros(lp.shape[0], dtype=torch.long, device=dev)   # teacher_lp holds each row's own
            mb["adv"] = mopd_rewards(lp, mb["teacher_lp"].unsqueeze(0), own, rl.mopd_r_max) * mb["mask_l"]
            tally_kl(mopd, lp, mb["teacher_lp"], mb["mask_l"], mb["which"])
        return zero

    def ref_head(i, logits):
        mbs[i]["logp_ref"] = runner._logits_logp(logits, mbs[i]["targets_l"])
        return zero

    _run(runner, model, rs.engine, mbs, old_head, train=False)
    if runner.ref_model is not None:
        _run(runner, runner.ref_model, runner.ref_pipe, mbs, ref_head, train=False)
    # loss, clipped tokens, kl, tokens, staleness-weight sum, capped tokens
    sums = torch.zeros(6, dtype=torch.float64, device=dev)

    def loss_head(i, logits):
        nonlocal sums
        mb = mbs[i]
        logp = runner._logits_logp(logits, mb["targets_l"])
        w, rep = staleness_weights(mb["logp_old"], mb["behaviour_l"], mb["mask_l"], rl.loss.is_cap)
        n = max(float(mb["mask_l"].sum()), 1.0)
        loss, st = policy_loss(logp, mb["logp_old"], mb["adv"], mb["mask_l"], rl.loss, denom, w, mb.get("logp_ref"),
                               row_tokens_N=mb["row_tokens"] if ps.cp_size > 1 else None)
        sums = sums + torch.stack([loss.detach().double(), st["clip_frac_sum"], st["kl_sum"], st["tokens"],
                                   torch.tensor(rep["is_mean"] * n, dtype=torch.float64, device=dev),
                                   torch.tensor(rep["is_capped"] * n, dtype=torch.float64, device=dev)])
        return loss

    stats = _run(runner, model, rs.engine, mbs, loss_head, train=True)
    biases = [m.gate.e_score_correction_bias for m in model.moe_layers()]
    for mb, moe_stats in zip(mbs, stats):
        keep = _routed(runner, mb["real"])
        for acc, s, bias in zip(rs.balancers, moe_stats, biases):
            acc.add(s.scores_TE[keep], bias)
    sync_partial_grads(model, rs.plan, ps.tp_group)
    sums = all_reduce_sum(sums, [ps.dp_cp_group, ps.pp_group])
    for g in (ps.dp_cp_group, ps.pp_group):
        if g is not None:
            dist.all_reduce(cur, op=dist.ReduceOp.MAX, group=g)
    report = {}
    if runner.teachers:  # teacher row-forwards of this rank; KL to each teacher over the data x context ranks
        nt = len(runner.teachers)
        st = all_reduce_sum(torch.cat([mopd["kl"], mopd["tokens"]]).to(dev), [ps.dp_cp_group, ps.pp_group]).cpu()
        report["teacher_rows"] = mopd["rows"]
        report.update(kl_report(runner.teacher_tags, st[:nt], st[nt:]))
    out = rs.apply(runner.version, rl.iterations)
    tok = max(float(sums[3]), 1.0)
    return {"loss": float(sums[0]), "grad_norm": float(out["grad_norm"]), "clip_frac": float(sums[1]) / tok,
            "kl": float(sums[2]) / tok, "response_tokens": int(sums[3]), "is_mean": float(sums[4]) / tok,
            "is_capped": float(sums[5]) / tok, "lp_gap": float(cur), **report}


def _rows_batch(runner, part: List[Rollout], idx: List[int], mb: dict, shard: int, dev) -> dict:
    """The rows ``idx`` of micro-batch ``mb`` (built from rollouts ``part``) as a batch of their own, same length."""
    b = response_batch([part[j] for j in idx], runner.tokenizer.pad_id, shard, 0, mb["mask"].shape[1])
    return {k: (v if k == "cu_seqlens" else v.to(dev)) for k, v in b.items()}


def _fresh_mask(part: List[Rollout], mb: dict, version: int) -> torch.Tensor:
    """[B, T] True at the response positions of tokens the current policy version sampled."""
    m = torch.zeros(mb["mask"].shape, dtype=torch.bool)
    for b, r in enumerate(part):
        P = len(r.prompt_ids)
        v = torch.tensor(r.versions, dtype=torch.long) == version
        m[b, P - 1:P - 1 + len(r.versions)] = v & (mb["mask"][b, P - 1:P - 1 + len(r.versions)].cpu() > 0)
    return m
