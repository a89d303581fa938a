"""RL core pieces against hand computations: advantages, staleness weights, the clipped loss and its
gradient, MOPD and effort rewards, the rollout buffer (versions per token, budgets, trainable groups)."""
import math

import pytest
import torch

from megak3.posttrain.buffer import RolloutBuffer
from megak3.posttrain.objective import LossConfig, group_advantages, policy_loss, staleness_weights
from megak3.posttrain.rewards import effort_budget, effort_override, exact_answer, mopd_rewards, thinking_tokens


def test_group_advantages_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    a = group_advantages(r, "std", eps=0.0 + 1e-12)
    # group 0: mean 0.5, population std 0.5 -> +-1; group 1: all equal -> 0
    assert torch.allclose(a[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-6)
    assert torch.equal(a[1], torch.zeros(4))
    assert torch.allclose(group_advantages(torch.tensor([[3.0, 1.0]]), "none"), torch.tensor([[1.0, -1.0]]))


def test_staleness_weights_truncate_and_report():
    old = torch.tensor([[math.log(0.5), math.log(0.9), 0.0]])
    beh = torch.tensor([[math.log(0.25), math.log(0.1), 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    w, rep = staleness_weights(old, beh, mask, cap=3.0)
    assert torch.allclose(w, torch.tensor([[2.0, 3.0, 0.0]]), atol=1e-6)  # 0.5/0.25=2, 0.9/0.1=9 -> cap 3
    assert rep["is_capped"] == 0.5 and abs(rep["is_mean"] - 2.5) < 1e-6 and abs(rep["is_max_raw"] - 9) < 1e-5


def test_policy_loss_value_and_gradient_by_hand():
    # two tokens of one sequence, A = +1; ratio 1.5 (clipped at 1.2: no gradient) and 1.0
    lp_old = torch.tensor([[math.log(0.2), math.log(0.5)]])
    lp = torch.tensor([[math.log(0.3), math.log(0.5)]], requires_grad=True)
    cfg = LossConfig(clip_low=0.2, clip_high=0.2)
    loss, st = policy_loss(lp, lp_old, torch.tensor([1.0]), torch.ones(1, 2), cfg, denom=2)
    assert abs(float(loss.detach()) - (-(1.2 + 1.0) / 2)) < 1e-6
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[0.0, -0.5]]), atol=1e-6)  # d/dlp of -rho/2 = -rho/2
    assert float(st["clip_frac_sum"]) == 1
    # negative advantage: min picks the unclipped (larger-loss) side at ratio 1.5
    lp2 = lp.detach().clone().requires_grad_(True)
    loss2, _ = policy_loss(lp2, lp_old, torch.tensor([-1.0]), torch.ones(1, 2), cfg, denom=2)
    assert abs(float(loss2.detach()) - (1.5 + 1.0) / 2) < 1e-6
    # staleness weights multiply per token; sequence aggregation averages within each sequence first
    w = torch.tensor([[2.0, 0.5]])
    loss3, _ = policy_loss(lp2.detach(), lp_old, torch.tensor([1.0]), torch.ones(1, 2), cfg, denom=1, weights_NT=w)
    assert abs(float(loss3) - (-(2 * 1.2 + 0.5 * 1.0))) < 1e-6
    cfg_s = LossConfig(aggregation="sequence")
    m = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    lp4 = torch.zeros(2, 2)
    loss4, _ = policy_loss(lp4, lp4, torch.tensor([1.0, 2.0]), m, cfg_s, denom=2)
    assert abs(float(loss4) - (-(1.0 + 2.0) / 2)) < 1e-6  # token mean per sequence, then / 2 sequences


def test_kl_term_k3_by_hand():
    lp = torch.tensor([[math.log(0.5)]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25)]])
    cfg = LossConfig(kl_coef=0.1)
    loss, st = policy_loss(lp, lp.detach(), torch.tensor([0.0]), torch.ones(1, 1), cfg, denom=1, logp_ref_NT=ref)
    d = math.log(0.25) - math.log(0.5)
    assert abs(float(loss.detach()) - 0.1 * (math.exp(d) - d - 1)) < 1e-6
    assert abs(float(st["kl_sum"]) - (math.exp(d) - d - 1)) < 1e-6


def test_mopd_reward_hand_example():
    student = torch.tensor([[-1.0, -2.0, -0.5]])
    teachers = torch.tensor([[[-0.5, -5.0, -0.5]], [[-3.0, -1.0, -0.1]]])  # M=2 teachers, N=1
    r0 = mopd_rewards(student, teachers, torch.tensor([0]), r_max=1.0)
    assert torch.allclose(r0, torch.tensor([[0.5, -1.0, 0.0]]))  # -3 clipped to -1
    r1 = mopd_rewards(student.requires_grad_(True), teachers, torch.tensor([1]), r_max=1.5)
    assert torch.allclose(r1, torch.tensor([[-1.5, 1.0, 0.4]])) and not r1.requires_grad


def test_effort_override_and_verifiable_reward():
    assert exact_answer(" 19\n", "19") == 1.0 and exact_answer("190", "19") == 0.0
    assert thinking_tokens([5, 6, 7, 9, 8], end_id=9) == 3 and thinking_tokens([5, 6], end_id=9) == 2
    b0 = effort_budget([10, 20])  # 15
    r = effort_override(torch.tensor([1.0, 1.0, 0.0]), torch.tensor([30, 31, 40]), torch.full((3,), b0), tau=2.0)
    assert r.tolist() == [1.0, -1.0, -1.0]  # 30 = tau*b0 is allowed, 31 is over
    with pytest.raises(ValueError):
        effort_override(r, r, r, tau=0)


def test_buffer_versions_budget_and_resume():
    buf = RolloutBuffer(group_size=2)
    a, b = buf.add_prompt([1, 5], budget=4, answer="x")
    a.extend([7, 8], [-0.1, -0.2], version=0)        # paused after 2 tokens under version 0
    b.extend([9, 2], [-0.3, -0.4], version=0)
    b.finish("stop")
    assert buf.take_trainable() == [] and [r.uid for r in buf.unfinished()] == [a.uid]
    a.extend([6, 6], [-0.5, -0.6], version=1)        # resumed under version 1: only 2 tokens left
    assert a.versions == [0, 0, 1, 1] and a.remaining == 0
    with pytest.raises(ValueError, match="remaining budget"):
        a.extend([1], [0.0], version=1)
    a.finish("length")
    state = buf.state_dict()
    again = RolloutBuffer(2)
    again.load_state_dict(state)
    groups = again.take_trainable()
    assert len(groups) == 1 and groups[0][0].versions == [0, 0, 1, 1] and groups[0][1].logprobs == [-0.3, -0.4]
    assert again.rollouts == {}


def test_rl_cli_bad_input_is_one_line_exit_2(tmp_path, capsys):
    from megak3.posttrain.__main__ import main

    assert main(["--init-from", str(tmp_path / "missing")]) == 2
    assert main(["--init-from", str(tmp_path), "rl.nope=1"]) == 2
    assert main(["--init-from", str(tmp_path), "lr=1"]) == 2
    assert main(["--init-from", str(tmp_path), "rl.rollout.replicas=-1"]) == 2
    errs = [l for l in capsys.readouterr().err.splitlines() if l]
    assert len(errs) == 4 and all(l.startswith("error: ") for l in errs)
    assert "rl.nope: no such field" in errs[1] and "rl.FIELD=VALUE" in errs[2]
    assert "rl.rollout.replicas=-1 must be >= 0" in errs[3]
