"""Data parallelism with a ZeRO-1 sharded Muon/AdamW that is exactly single-process megak3.optim.

Why whole parameters
    Muon orthogonalises whole matrices (or per-head / per-expert blocks of one matrix), so a
    parameter cannot be split across ranks the way ZeRO splits flat AdamW state. Each DP rank
    therefore OWNS a set of whole parameters, holds the fp32 main copy and the optimizer state
    (Muon momentum, Adam exp_avg/exp_avg_sq) only for those, and computes only their update with
    the unchanged :class:`megak3.optim.Muon` / ``torch.optim.AdamW``. Per-Head Muon blocks and
    stacked experts [E, A, B] need nothing special: their owner sees the whole tensor.

Loss-normalisation contract: gradients are SUMMED over DP, never averaged
    The caller backpropagates its local share of the GLOBAL token mean,
    ``loss_sum_local / global_tokens`` with ``global_tokens`` summed over the DP group (as the
    trainer already does over micro-batches: ``loss_sum / step_tokens``). The sum over ranks of
    those gradients is then exactly the gradient of the global-batch mean, whatever the per-rank
    token counts, which a local mean followed by averaging is not.

Call order per optimizer step::

    loss.backward()                # every micro-batch; grads accumulate in model .grad
    opt.reduce_gradients()         # reduce-scatter; model .grad are released
    opt.clip_grad_norm_(max_norm)  # global norm from the owners' shards (one all-reduce)
    set_lr(opt, lr); opt.step()    # local Muon/AdamW on owned params, then all-gather (or only
    opt.zero_grad()                # issue it: overlap_param_gather, waited in the next forward)

Modules, by role
    layout.py     ownership (:func:`assign_owners`), the flat bucket layout (:func:`plan_buckets`),
                  the forward blocks of the all-gather overlap (:func:`forward_blocks`)
    comm.py       process-group helpers and the flat collectives
    optimizer.py  :class:`ShardedOptimizer` (construction, ownership, TP and norm partitions) and
                  :func:`build_sharded_optimizer` (wired from a :class:`parallel.plan.ParallelPlan`)
    grads.py      reduce-scatter into the owners' main gradients (blocking or overlapped with the
                  backward, ``overlap_grad_reduce``) and the global gradient-norm clip
    gather.py     the step and the all-gather of the updated params (blocking or behind the next
                  forward, ``overlap_param_gather``)
    state.py      the per-rank checkpoint shard, the layout-free export
                  (:meth:`~ShardedOptimizer.export_state`) and :meth:`~ShardedOptimizer.memory_report`
"""
from .layout import DEFAULT_BUCKET_BYTES, EXPERT_NAME_PART, assign_owners, forward_blocks, plan_buckets
from .optimizer import ShardedOptimizer, build_sharded_optimizer
from .state import CANONICAL_FORMAT, STATE_FORMAT

__all__ = ["CANONICAL_FORMAT", "DEFAULT_BUCKET_BYTES", "EXPERT_NAME_PART", "STATE_FORMAT", "ShardedOptimizer",
           "assign_owners", "build_sharded_optimizer", "forward_blocks", "plan_buckets"]
