"""Rewards: verifiable exact answers, the effort-control override, MOPD's per-token distillation reward.

``exact_answer``      1.0 when the completion text, stripped of surrounding whitespace, equals the answer,
                      else 0.0.
``effort_override``   K3's effort control (K3_SPEC §12): the reward becomes -1 when a rollout's thinking
                      tokens T(y) exceed tau * b0(x), b0(x) the budget of prompt x measured on the cold-start
                      model (``effort_budget``: the mean thinking length of its rollouts of x).
``thinking_tokens``   T(y) of a response whose thinking ends at the first ``end_id`` (all of it when absent).
``mopd_rewards``      per token ``clip(sg(log pi_teacher(y_t) - log pi_theta(y_t)), -R_max, R_max)`` on
                      student-sampled tokens; with several teachers each rollout uses the teacher of its
                      (domain, effort) by index.
"""
from __future__ import annotations

from typing import Sequence

import torch


def exact_answer(text: str, answer: str) -> float:
    return 1.0 if text.strip() == str(answer).strip() else 0.0


def thinking_tokens(token_ids: Sequence[int], end_id: int) -> int:
    ids = list(token_ids)
    return ids.index(end_id) if end_id in ids else len(ids)


def effort_budget(reference_lengths: Sequence[int]) -> float:
    """b0(x): mean thinking length of the cold-start model's rollouts of one prompt."""
    if not reference_lengths:
        raise ValueError("effort_budget needs at least one reference rollout length")
    return float(sum(reference_lengths)) / len(reference_lengths)


def effort_override(rewards_N: torch.Tensor, thinking_N: torch.Tensor, budget_N: torch.Tensor,
                    tau: float) -> torch.Tensor:
    """``rewards`` with -1 where ``thinking > tau * budget`` (elementwise over N rollouts)."""
    if tau <= 0:
        raise ValueError(f"effort tau={tau} must be > 0")
    over = thinking_N.double() > tau * budget_N.double()
    return torch.where(over, torch.full_like(rewards_N, -1.0), rewards_N)


def mopd_rewards(logp_student_NT: torch.Tensor, logp_teachers_MNT: torch.Tensor, teacher_N: torch.Tensor,
                 r_max: float) -> torch.Tensor:
    """[N, T] per-token rewards; ``logp_teachers_MNT`` stacks M teachers' logprobs of the same tokens and
    ``teacher_N`` picks rollout n's teacher. No gradient flows (the stop-gradient of the formula)."""
    if r_max <= 0:
        raise ValueError(f"mopd r_max={r_max} must be > 0")
    with torch.no_grad():
        idx = teacher_N.long().view(1, -1, 1).expand(1, *logp_teachers_MNT.shape[1:])
        teacher = logp_teachers_MNT.gather(0, idx)[0]
        return (teacher - logp_student_NT).clamp(-r_max, r_max)
