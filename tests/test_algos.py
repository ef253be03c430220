"""Hand-computed values for every advantage estimator, the masked reductions and the loss."""
from types import SimpleNamespace

import pytest
import torch

import algos

CFG = SimpleNamespace(gamma=0.5, lam=0.5, dr_grpo=False)


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def test_masked_mean_ignores_masked_entries():
    assert algos.masked_mean(t([1.0, 100.0, 3.0]), t([1, 0, 1])).item() == 2.0


def test_masked_whiten_has_zero_mean_unit_std_and_zeros_outside_mask():
    x, m = t([[1.0, 2.0, 3.0, 50.0]]), t([[1, 1, 1, 0]])
    w = algos.masked_whiten(x, m)
    std = (2 / 3) ** 0.5
    assert torch.allclose(w, t([[-1 / std, 0, 1 / std, 0]]), atol=1e-5)


def test_discounted_returns_stop_at_the_end_of_each_row():
    r, m = t([[1, 1, 1, 0], [2, 0, 0, 0]]), t([[1, 1, 1, 0], [1, 0, 0, 0]])
    g = algos.discounted_returns(r, m, gamma=0.5)
    assert torch.equal(g, t([[1.75, 1.5, 1.0, 0.0], [2.0, 0, 0, 0]]))


def gae_batch(terminated):
    return dict(rewards=t([[1, 1, 0]]), values=t([[0.5, 0.25, 0]]), mask=t([[1, 1, 0]]),
                last_value=t([2.0]), terminated=torch.tensor([terminated]))


def test_gae_bootstraps_a_truncated_episode_with_the_last_value():
    b = gae_batch(terminated=False)
    adv = algos.gae(b["rewards"], b["values"], b["mask"], b["last_value"], b["terminated"], 0.5, 0.5)
    # deltas: 1 + .5*.25 - .5 = .625 and 1 + .5*2 - .25 = 1.75; adv0 = .625 + .25*1.75
    assert torch.allclose(adv, t([[1.0625, 1.75, 0]]))


def test_gae_does_not_bootstrap_a_terminated_episode():
    b = gae_batch(terminated=True)
    adv = algos.gae(b["rewards"], b["values"], b["mask"], b["last_value"], b["terminated"], 0.5, 0.5)
    assert torch.allclose(adv, t([[0.8125, 0.75, 0]]))


def test_gae_with_lambda_one_and_zero_values_is_the_discounted_return():
    r, m = t([[1, 2, 3]]), t([[1, 1, 1]])
    adv = algos.gae(r, torch.zeros_like(r), m, t([0.0]), torch.tensor([True]), 0.5, 1.0)
    assert torch.allclose(adv, algos.discounted_returns(r, m, 0.5))


def test_reinforce_is_the_discounted_return_to_go():
    b = dict(rewards=t([[1, 1, 1]]), mask=t([[1, 1, 1]]))
    assert torch.equal(algos.reinforce(b, CFG), t([[1.75, 1.5, 1.0]]))


def test_reinforce_baseline_subtracts_one_constant_for_the_batch():
    b = dict(rewards=t([[1, 1, 0], [1, 0, 0]]), mask=t([[1, 1, 0], [1, 0, 0]]))
    # returns 1.5, 1 | 1 ; batch mean 3.5/3
    mean = 3.5 / 3
    assert torch.allclose(algos.reinforce_baseline(b, CFG), t([[1.5 - mean, 1 - mean, 0], [1 - mean, 0, 0]]))


def test_reinforce_pp_whitens_over_all_tokens_of_the_batch():
    b = dict(rewards=t([[0, 2], [0, 0]]), mask=t([[1, 1], [1, 1]]))
    # returns (gamma .5): [1, 2], [0, 0]; mean .75, std sqrt(((.25)^2+(1.25)^2+2*(.75)^2)/4)
    std = ((0.0625 + 1.5625 + 2 * 0.5625) / 4) ** 0.5
    expected = (t([[1, 2], [0, 0]]) - 0.75) / std
    assert torch.allclose(algos.reinforce_pp(b, CFG), expected, atol=1e-5)


def grouped(scores, group):
    rewards = torch.zeros(len(scores), 3)
    rewards[:, 2] = t(scores)  # reward on the last step only, as for an LLM completion
    return dict(rewards=rewards, mask=torch.ones(len(scores), 3), group=torch.tensor(group))


def test_grpo_normalises_within_each_group_and_zeroes_uniform_groups():
    adv = algos.grpo(grouped([1, 0, 2, 2], [0, 0, 7, 7]), CFG)
    assert torch.allclose(adv[:, 0], t([1, -1, 0, 0]), atol=1e-5)
    assert torch.equal(adv[:, 0], adv[:, 2])  # every step of a row shares its advantage


def test_dr_grpo_skips_the_std_division():
    cfg = SimpleNamespace(**{**vars(CFG), "dr_grpo": True})
    adv = algos.grpo(grouped([3, 1, 2, 2], [0, 0, 1, 1]), cfg)
    assert torch.allclose(adv[:, 0], t([1, -1, 0, 0]))
    adv = algos.grpo(grouped([4, 0, 2, 2], [0, 0, 1, 1]), cfg)
    assert torch.allclose(adv[:, 0], t([2, -2, 0, 0]))


def test_rloo_baseline_is_the_mean_of_the_other_rows():
    adv = algos.rloo(grouped([3, 0, 0, 5, 1], [0, 0, 0, 1, 1]), CFG)
    assert torch.allclose(adv[:, 0], t([3, -1.5, -1.5, 4, -4]))


def test_ppo_whitens_gae_and_stores_critic_targets_from_old_values():
    b = gae_batch(terminated=False)
    adv = algos.ppo(b, CFG)
    assert torch.allclose(b["returns"], t([[1.0625 + 0.5, 1.75 + 0.25, 0]]))
    assert abs(algos.masked_mean(adv, b["mask"]).item()) < 1e-6
    assert adv[0, 2] == 0


def test_loss_weights_sum_to_one_over_the_whole_batch():
    w = algos.loss_weights(t([[1, 1, 0], [1, 0, 0]]))
    assert torch.allclose(w, t([[1 / 3, 1 / 3, 0], [1 / 3, 0, 0]]))


def test_policy_loss_at_ratio_one_is_minus_weighted_advantage():
    logp = torch.tensor([[-0.5, -1.0]], requires_grad=True)
    adv, w = t([[2.0, -1.0]]), t([[0.5, 0.5]])
    loss, stats = algos.policy_loss(logp, logp.detach(), adv, w, torch.ones_like(adv))
    assert loss.item() == pytest.approx(-0.5)  # -(0.5*2 + 0.5*-1)
    loss.backward()
    assert torch.allclose(logp.grad, t([[-1.0, 0.5]]))  # d/dlogp of -w*adv*ratio at ratio 1
    assert torch.equal(stats["ratio"], t([[1.0, 1.0]])) and not stats["clip_frac_low"].any() and not stats["clip_frac_high"].any()


def test_policy_loss_clips_the_ratio_on_the_side_that_would_overshoot():
    old = t([[0.0, 0.0]])
    logp = torch.log(t([[1.5, 0.5]])).requires_grad_()
    adv, w = t([[1.0, -1.0]]), t([[1.0, 1.0]])
    loss, stats = algos.policy_loss(logp, old, adv, w, torch.ones_like(adv))
    # row 0: min(1.5, 1.2)*1 -> -1.2 (clipped, no grad); row 1: max(-0.5*-1,...) -> ratio .5 vs .8: -(-0.8) clipped
    assert loss.item() == pytest.approx(-1.2 + 0.8)
    loss.backward()
    assert torch.equal(logp.grad, t([[0.0, 0.0]]))
    assert torch.equal(stats["clip_frac_high"], t([[1, 0]])) and torch.equal(stats["clip_frac_low"], t([[0, 1]]))


def test_value_loss_is_half_weighted_squared_error():
    assert algos.value_loss(t([[1.0, 3.0]]), t([[0.0, 1.0]]), t([[0.5, 0.5]])).item() == pytest.approx(1.25)
