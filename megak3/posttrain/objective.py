"""The RL objective as pure tensor functions: group-relative advantages, staleness weights, the clipped policy loss.

Shapes: ``N`` sequences (rollouts), ``T`` response positions (right-padded; ``mask_NT`` marks real
response tokens), groups of ``K`` rollouts of one prompt.

``group_advantages``   A_i = (r_i - mean_g r) / (std_g r + eps) over each prompt's K rollouts
                       (``scale="none"``: no division, the Dr.GRPO variant); std is the population std.
``staleness_weights``  per-token truncated importance weight ``min(exp(logp_old - logp_behaviour), cap)``:
                       logp_behaviour is what the engine recorded when it sampled the token (possibly under
                       an older policy version), logp_old the learner's policy at the start of this update.
                       Mixed-version samples are corrected token by token.
``policy_loss``        per token ``-w_t * min(rho_t A, clip(rho_t, 1-eps_low, 1+eps_high) A) + beta * KL_t``,
                       rho_t = exp(logp - logp_old), KL_t the k3 estimator ``exp(ref - logp) - (ref - logp) - 1``
                       to a reference policy (beta=0 or no reference: no KL term); aggregated per token
                       (sum over all tokens / ``denom`` tokens) or per sequence (each sequence's token mean,
                       summed / ``denom`` sequences). ``denom`` is the count over the whole step (every
                       micro-batch and data-parallel rank) so gradients are sums, as in the trainer's loss.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

AGGREGATIONS = ("token", "sequence")
SCALES = ("std", "none")


@dataclass
class LossConfig:
    """Knobs of the clipped policy-gradient objective (conf/rl/: ``rl.loss.*``)."""

    clip_low: float = 0.2
    """eps_low: the ratio is clipped below at 1 - clip_low"""
    clip_high: float = 0.2
    """eps_high: the ratio is clipped above at 1 + clip_high (> clip_low: the 'clip-higher' variant)"""
    kl_coef: float = 0.0
    """beta of the k3 KL estimator to the reference policy (0: no KL term, no reference forward)"""
    aggregation: str = "token"
    """'token' (every response token weighs the same) or 'sequence' (every rollout weighs the same)"""
    advantage_scale: str = "std"
    """'std' (divide by the group's std, GRPO) or 'none' (mean-centred only, Dr.GRPO)"""
    is_cap: float = 2.0
    """cap of the per-token truncated importance weight correcting staleness (behaviour -> learner policy)"""

    def validate(self) -> "LossConfig":
        def need(ok, f, rule):
            if not ok:
                raise ValueError(f"rl.loss.{f}={getattr(self, f)!r} {rule}")

        need(0 <= self.clip_low < 1, "clip_low", "must lie in [0, 1)")
        need(self.clip_high >= 0, "clip_high", "must be >= 0")
        need(self.kl_coef >= 0, "kl_coef", "must be >= 0")
        need(self.aggregation in AGGREGATIONS, "aggregation", f"must be one of {', '.join(AGGREGATIONS)}")
        need(self.advantage_scale in SCALES, "advantage_scale", f"must be one of {', '.join(SCALES)}")
        need(self.is_cap >= 1, "is_cap", "must be >= 1 (1 = never up-weight a token)")
        return self


def group_advantages(rewards_G_K: torch.Tensor, scale: str = "std", eps: float = 1e-6) -> torch.Tensor:
    """[G, K] rewards of G prompts x K rollouts -> [G, K] advantages (see the module docstring)."""
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r} must be one of {', '.join(SCALES)}")
    r = rewards_G_K.double()
    a = r - r.mean(dim=1, keepdim=True)
    if scale == "std":
        a = a / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    return a.to(rewards_G_K.dtype if rewards_G_K.is_floating_point() else torch.float32)


def staleness_weights(logp_old_NT: torch.Tensor, logp_behaviour_NT: torch.Tensor, mask_NT: torch.Tensor,
                      cap: float) -> tuple[torch.Tensor, Dict[str, float]]:
    """Per-token ``min(exp(logp_old - logp_behaviour), cap)`` (0 off the mask) and its report:
    ``is_mean`` (mean weight over real tokens), ``is_capped`` (fraction at the cap), ``is_max_raw``."""
    m = mask_NT.bool()
    raw = torch.exp((logp_old_NT - logp_behaviour_NT).double()).masked_fill(~m, 0.0)
    w = raw.clamp(max=cap)
    n = max(int(m.sum()), 1)
    report = {"is_mean": float(w.sum()) / n, "is_capped": float((raw > cap)[m].sum()) / n,
              "is_max_raw": float(raw[m].max()) if m.any() else 0.0}
    return w.to(logp_old_NT.dtype), report


def policy_loss(logp_NT: torch.Tensor, logp_old_NT: torch.Tensor, adv_N: torch.Tensor, mask_NT: torch.Tensor,
                cfg: LossConfig, denom: float, weights_NT: Optional[torch.Tensor] = None,
                logp_ref_NT: Optional[torch.Tensor] = None,
                row_tokens_N: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """(loss to backpropagate, detached stats: ``clip_frac``, ``kl`` sums and ``tokens``) of one micro-batch.
    ``adv_N``: one advantage per sequence [N], or per token [N, T] (MOPD's per-token rewards).

    ``denom``: tokens (aggregation='token') or sequences ('sequence') of the whole step.
    ``row_tokens_N``: each sequence's masked tokens over its whole row when ``mask_NT`` holds only a
    segment of it (context parallelism; None: ``mask_NT.sum(1)``)."""
    m = mask_NT.to(logp_NT.dtype)
    ratio = torch.exp(logp_NT - logp_old_NT)
    A = adv_N.to(logp_NT.dtype)
    A = A if A.dim() == 2 else A[:, None]  # per-sequence [N] or per-token [N, T] advantages
    clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    surr = torch.minimum(ratio * A, clipped * A)
    per_tok = -surr if weights_NT is None else -weights_NT.detach() * surr
    kl = torch.zeros_like(per_tok)
    if cfg.kl_coef > 0 and logp_ref_NT is not None:
        d = logp_ref_NT.detach() - logp_NT
        kl = torch.exp(d) - d - 1
        per_tok = per_tok + cfg.kl_coef * kl
    if cfg.aggregation == "token":
        loss = (per_tok * m).sum() / denom
    else:
        n_N = m.sum(1) if row_tokens_N is None else row_tokens_N.to(m.dtype)
        loss = ((per_tok * m).sum(1) / n_N.clamp_min(1)).sum() / denom
    with torch.no_grad():
        was_clipped = ((ratio * A) > (clipped * A)) & mask_NT.bool()  # min picked the clipped term
        stats = {"clip_frac_sum": was_clipped.sum().double(), "kl_sum": (kl * m).sum().double(),
                 "tokens": m.sum().double()}
    return loss, stats


def token_logprobs(logits_NTV: torch.Tensor, targets_NT: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[target]`` per position, in fp32 (what the engine reports per token)."""
    lp = torch.log_softmax(logits_NTV.float(), dim=-1)
    return lp.gather(-1, targets_NT.clamp_min(0).unsqueeze(-1)).squeeze(-1)
