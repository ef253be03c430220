"""Hand-computed values for every advantage estimator, the masked reductions and the loss."""
import math
from types import SimpleNamespace

import pytest
import torch

import algos

CFG = SimpleNamespace(gamma=0.5, lam=0.5, dr_grpo=False)


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def test_masked_mean_ignores_masked_entries():
    assert algos.masked_mean(t([1.0, 100.0, 3.0]), t([1, 0, 1])).item() == 2.0



def test_masked_mean_of_one_entry_is_that_entry_and_of_none_is_zero():
    assert algos.masked_mean(t([5.0, 7.0]), t([0, 1])).item() == 7.0
    assert algos.masked_mean(t([5.0, 7.0]), t([0, 0])).item() == 0.0  # an empty batch: 0, not nan

def test_masked_mean_of_none_is_what_the_caller_names():  # a metric of rows none of which counts: NaN
    assert math.isnan(algos.masked_mean(t([5.0, 7.0]), t([0, 0]), of_none=math.nan).item())
    assert algos.masked_mean(t([5.0, 7.0]), t([1, 0]), of_none=math.nan).item() == 5.0


def test_masked_whiten_has_zero_mean_unit_std_and_zeros_outside_mask():
    x, m = t([[1.0, 2.0, 3.0, 50.0]]), t([[1, 1, 1, 0]])
    w = algos.masked_whiten(x, m)
    std = (2 / 3) ** 0.5
    assert torch.allclose(w, t([[-1 / std, 0, 1 / std, 0]]), atol=1e-5)


def test_statistics_of_rewards_within_float32_but_squaring_past_it_stay_finite():
    """Rewards 0 and 1e25 (float32 holds both): the deviations' squares overflowed, std was inf, and every
    advantage 0, silently. A group of the two, and the whole batch whitened: -1 and 1."""
    b = SimpleNamespace(rewards=t([[0.0], [1e25]]), mask=t([[1], [1]]), group=torch.tensor([0, 0]))
    assert algos.grpo(b, CFG).tolist() == [[-1.0], [1.0]]
    assert algos.group_baseline(t([0.0, 1e25]), b.group)[1].tolist() == [pytest.approx(5e24)] * 2
    assert algos.masked_whiten(t([[0.0, 1e25]]), t([[1, 1]])).tolist() == [[-1.0, 1.0]]


def test_discounted_returns_stop_at_the_end_of_each_row():
    r, m = t([[1, 1, 1, 0], [2, 0, 0, 0]]), t([[1, 1, 1, 0], [1, 0, 0, 0]])
    g = algos.discounted_returns(r, m, gamma=0.5)
    assert torch.equal(g, t([[1.75, 1.5, 1.0, 0.0], [2.0, 0, 0, 0]]))


def test_next_policy_step_skips_the_environments_tokens_and_is_0_after_the_last():
    x, m = t([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]), t([[1, 0, 0, 1, 0], [1, 1, 1, 1, 1]])
    assert torch.equal(algos.next_policy_step(x, m), t([[4, 4, 4, 0, 0], [7, 8, 9, 10, 0]]))
    assert torch.equal(algos.next_policy_step(m, m), t([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]))  # a step to come


def test_an_early_turn_of_a_multi_turn_row_earns_the_return_of_the_turns_after_it():
    # turn 1 (2 tokens), the environment's reply (2 tokens, mask 0), turn 2 (2 tokens) that solves it
    r, m = t([[0, 0, 0, 0, 0, 1, 0]]), t([[1, 1, 0, 0, 1, 1, 0]])
    g = algos.discounted_returns(r, m, gamma=0.5)  # discounted per policy step, not per reply token
    assert torch.equal(g, t([[0.125, 0.25, 0, 0, 0.5, 1.0, 0]]))
    assert torch.equal(algos.reinforce(SimpleNamespace(rewards=r, mask=m), CFG), g)  # CFG.gamma is 0.5


def test_gae_runs_past_the_environments_tokens_to_the_next_turns_value():
    r, v, m = t([[0, 5, 1]]), t([[0.5, 9.0, 0.25]]), t([[1, 0, 1]])  # the reply's 5 and 9.0 are not the policy's
    adv = algos.gae(r, v, m, t([2.0]), torch.tensor([True]), 0.5, 0.5)
    # deltas: 0 + .5*.25 - .5 = -.375 (the next turn's value), 1 - .25 = .75 (terminated); adv0 = -.375 + .25*.75
    assert torch.allclose(adv, t([[-0.1875, 0, 0.75]]))


def gae_batch(terminated):
    return SimpleNamespace(rewards=t([[1, 1, 0]]), values=t([[0.5, 0.25, 0]]), mask=t([[1, 1, 0]]),
                           last_value=t([2.0]), truncated=torch.tensor([not terminated]))


def test_gae_bootstraps_a_truncated_episode_with_the_last_value():
    b = gae_batch(terminated=False)
    adv = algos.gae(b.rewards, b.values, b.mask, b.last_value, ~b.truncated, 0.5, 0.5)
    # deltas: 1 + .5*.25 - .5 = .625 and 1 + .5*2 - .25 = 1.75; adv0 = .625 + .25*1.75
    assert torch.allclose(adv, t([[1.0625, 1.75, 0]]))


def test_gae_does_not_bootstrap_a_terminated_episode():
    b = gae_batch(terminated=True)
    adv = algos.gae(b.rewards, b.values, b.mask, b.last_value, ~b.truncated, 0.5, 0.5)
    assert torch.allclose(adv, t([[0.8125, 0.75, 0]]))



def test_gae_bootstraps_each_row_of_a_batch_by_its_own_ending():
    # row 0 as above, truncated (last value 2); row 1 terminated, so its last value 10 is never used
    r, v, m = t([[1, 1, 0], [0, 1, 1]]), t([[0.5, 0.25, 0], [0, 0, 0.5]]), t([[1, 1, 0], [1, 1, 1]])
    adv = algos.gae(r, v, m, t([2.0, 10.0]), torch.tensor([False, True]), 0.5, 0.5)
    # row 1 deltas: 0, 1 + .5*.5 = 1.25, 1 - .5 = .5; adv1 = 1.25 + .25*.5 = 1.375, adv0 = .25*1.375
    assert torch.allclose(adv, t([[1.0625, 1.75, 0], [0.34375, 1.375, 0.5]]))

def test_gae_with_lambda_one_and_zero_values_is_the_discounted_return():
    r, m = t([[1, 2, 3]]), t([[1, 1, 1]])
    adv = algos.gae(r, torch.zeros_like(r), m, t([0.0]), torch.tensor([True]), 0.5, 1.0)
    assert torch.allclose(adv, algos.discounted_returns(r, m, 0.5))


def test_reinforce_is_the_discounted_return_to_go():
    b = SimpleNamespace(rewards=t([[1, 1, 1]]), mask=t([[1, 1, 1]]))
    assert torch.equal(algos.reinforce(b, CFG), t([[1.75, 1.5, 1.0]]))


def test_reinforce_baseline_subtracts_one_constant_for_the_batch():
    b = SimpleNamespace(rewards=t([[1, 1, 0], [1, 0, 0]]), mask=t([[1, 1, 0], [1, 0, 0]]))
    # returns 1.5, 1 | 1 ; batch mean 3.5/3
    mean = 3.5 / 3
    assert torch.allclose(algos.reinforce_baseline(b, CFG), t([[1.5 - mean, 1 - mean, 0], [1 - mean, 0, 0]]))


def test_reinforce_baseline_of_returns_whose_sum_passes_float32_stays_finite():
    """Returns 3e36 and 1e36 (float32 holds both) on 100 tokens each: their float32 sum, 4e38, was inf, the
    baseline inf and every advantage -inf (a NaN loss: each step skipped). The mean is 2e36: +-1e36."""
    rewards, mask = torch.zeros(2, 100), torch.ones(2, 100)
    rewards[:, -1] = t([3e36, 1e36])
    adv = algos.reinforce_baseline(SimpleNamespace(rewards=rewards, mask=mask), SimpleNamespace(gamma=1.0))
    assert torch.allclose(adv, t([[1e36], [-1e36]]).expand(2, 100), rtol=1e-6)
    assert algos.masked_mean(t([3e38, 3e38]), t([1, 1])).item() == t(3e38).item()  # float32 in, float32 out


def test_reinforce_pp_whitens_over_all_tokens_of_the_batch():
    b = SimpleNamespace(rewards=t([[0, 2], [0, 0]]), mask=t([[1, 1], [1, 1]]))
    # returns (gamma .5): [1, 2], [0, 0]; mean .75, std sqrt(((.25)^2+(1.25)^2+2*(.75)^2)/4)
    std = ((0.0625 + 1.5625 + 2 * 0.5625) / 4) ** 0.5
    expected = (t([[1, 2], [0, 0]]) - 0.75) / std
    assert torch.allclose(algos.reinforce_pp(b, CFG), expected, atol=1e-5)


def grouped(scores, group):
    rewards = torch.zeros(len(scores), 3)
    rewards[:, 2] = t(scores)  # reward on the last step only, as for an LLM completion
    return SimpleNamespace(rewards=rewards, mask=torch.ones(len(scores), 3), group=torch.tensor(group))


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



def test_grpo_divides_by_the_groups_population_std():
    # scores 1, 0, 3: mean 4/3, variance (1 + 0 + 9) / 3 - 16 / 9 = 14 / 9
    adv = algos.grpo(grouped([1, 0, 3], [5, 5, 5]), CFG)
    std = math.sqrt(14) / 3
    assert torch.allclose(adv[:, 0], t([-1 / 3, -4 / 3, 5 / 3]) / std, atol=1e-5)


def test_grpo_std_of_large_nearly_equal_rewards_does_not_cancel_in_float32():
    """E[x^2] - mean^2 in float32 gave std 0 for rewards 1000 +- 0.01, and advantages of about +-6000."""
    adv = algos.grpo(grouped([1000.0, 1000.01, 999.99, 1000.0], [0, 0, 0, 0]), CFG)
    assert torch.allclose(adv[:, 0], t([0, 2**0.5, -(2**0.5), 0]), atol=1e-3)  # +-0.01 over std 0.01 / sqrt 2


@pytest.mark.parametrize("algo, expected", [("grpo", [-1.5**0.5, 0, 1.5**0.5]), ("rloo", [-1.5, 0, 1.5])])
def test_grouped_estimators_sum_each_rows_own_tokens_and_leave_padding_zero(algo, expected):
    # rows of lengths 3, 2, 1, each rewarded on its last real token: returns 1, 2, 3, one group
    rewards, mask = t([[0, 0, 1], [0, 2, 0], [3, 0, 0]]), t([[1, 1, 1], [1, 1, 0], [1, 0, 0]])
    batch = SimpleNamespace(rewards=rewards, mask=mask, group=torch.tensor([0, 0, 0]))
    adv = algos.ALGOS[algo](batch, CFG)
    # grpo: (R - 2) / sqrt(2 / 3); rloo: R minus the mean of the other two
    assert torch.allclose(adv, t(expected).unsqueeze(1) * mask, atol=1e-5)

def test_rloo_baseline_is_the_mean_of_the_other_rows():
    adv = algos.rloo(grouped([3, 0, 0, 5, 1], [0, 0, 0, 1, 1]), CFG)
    assert torch.allclose(adv[:, 0], t([3, -1.5, -1.5, 4, -4]))



def test_opd_is_teacher_minus_old_logp_plus_the_weighted_return_to_go():
    batch = SimpleNamespace(teacher_logp=t([[-1, -2, 0]]), old_logp=t([[-1.5, -1, -3]]), mask=t([[1, 1, 0]]),
                            rewards=t([[0, 1, 0]]))
    cfg = SimpleNamespace(gamma=0.5, opd_reward_coef=0.5)
    # teacher - old on policy tokens: 0.5, -1; return-to-go: 0.5, 1; the pad stays 0
    assert torch.allclose(algos.opd(batch, cfg), t([[0.5 + 0.25, -1 + 0.5, 0]]))

def test_ppo_whitens_gae_and_stores_critic_targets_from_old_values():
    b = gae_batch(terminated=False)
    adv = algos.ppo(b, CFG)
    assert torch.allclose(b.returns, t([[1.0625 + 0.5, 1.75 + 0.25, 0]]))
    assert abs(algos.masked_mean(adv, b.mask).item()) < 1e-6
    assert adv[0, 2] == 0



@pytest.mark.parametrize("mode", algos.AGGREGATIONS)
def test_loss_weights_of_a_batch_with_no_policy_token_are_zero_not_nan(mode):
    w = algos.loss_weights(torch.zeros(2, 3), mode, constant=4)
    assert torch.equal(w, torch.zeros(2, 3))



@pytest.mark.parametrize("mode, expected", [("token_mean", 1.0), ("seq_mean", 1.0), ("constant", 0.5)])
def test_loss_weights_of_a_one_token_batch_put_all_weight_on_it(mode, expected):
    assert torch.equal(algos.loss_weights(t([[0, 1, 0]]), mode, constant=2), t([[0, expected, 0]]))

def test_gspo_gives_a_fully_masked_row_no_loss_and_no_nan():
    logp, mask = t([[0.1, -0.3], [0.7, 0.2]]).requires_grad_(), t([[1, 1], [0, 0]])
    adv = t([[1.0], [1.0]]) * mask
    loss, s = algos.policy_loss(logp, torch.zeros_like(logp), adv, t([[0.5, 0.5], [0, 0]]), mask, loss="gspo")
    assert loss.item() == pytest.approx(-math.exp(-0.1), abs=1e-6)  # row 1 alone: -A s, s = e^mean(0.1, -0.3)
    assert torch.equal(s["ratio"][1], t([1.0, 1.0]))  # the empty row's mean log-ratio is 0, so s = 1

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


# ---------------------------------------------------------------- loss variants (old_logp = 0, so ratio = exp(logp))
def ratios(*r):
    return torch.log(t([list(r)])).requires_grad_()


def test_clip_higher_lets_a_positive_advantage_token_grow_past_the_symmetric_clip():
    logp, adv, w = ratios(1.25, 1.3, 0.75), t([[1.0, 1.0, -1.0]]), t([[1.0, 1.0, 1.0]])
    loss, s = algos.policy_loss(logp, torch.zeros_like(logp), adv, w, torch.ones_like(w), eps_low=0.2, eps_high=0.28)
    # 1.25 < 1.28 is inside: -1.25 (grad -A r = -1.25); 1.3 > 1.28 clipped: -1.28; 0.75 < 0.8 with A < 0: +0.8
    assert loss.item() == pytest.approx(-1.25 - 1.28 + 0.8)
    loss.backward()
    assert torch.allclose(logp.grad, t([[-1.25, 0.0, 0.0]]))
    assert torch.equal(s["clip_frac_high"], t([[0, 1, 0]])) and torch.equal(s["clip_frac_low"], t([[0, 0, 1]]))
    sym, _ = algos.policy_loss(logp, torch.zeros_like(logp), adv, w, torch.ones_like(w), eps_low=0.2, eps_high=0.2)
    assert sym.item() == pytest.approx(-1.2 - 1.2 + 0.8)  # the symmetric clip stops the first token at 1.2


def test_dual_clip_caps_the_loss_of_a_negative_advantage_token_at_c_times_abs_advantage():
    logp, adv, w = ratios(4.0, 2.0, 4.0), t([[-1.0, -1.0, 1.0]]), t([[1.0, 1.0, 1.0]])
    loss, _ = algos.policy_loss(logp, torch.zeros_like(logp), adv, w, torch.ones_like(w), dual_clip=3.0)
    # A=-1, r=4: max(4, 1.2)=4 capped at 3 (no grad); A=-1, r=2: 2 < 3 (grad -A r = 2); A=+1, r=4: -1.2 (clipped)
    assert loss.item() == pytest.approx(3 + 2 - 1.2)
    loss.backward()
    assert torch.allclose(logp.grad, t([[0.0, 2.0, 0.0]]))
    plain, _ = algos.policy_loss(logp, torch.zeros_like(logp), adv, w, torch.ones_like(w))
    assert plain.item() == pytest.approx(4 + 2 - 1.2)



def test_dual_clip_caps_at_c_times_abs_advantage_and_leaves_positive_advantages_alone():
    # A=-2, r=4: plain max(8, 2.4) = 8, capped at c|A| = 6; A=+0.5, r=0.5: max(-0.25, -0.4) = -0.25, untouched
    logp, adv, w = ratios(4.0, 0.5), t([[-2.0, 0.5]]), t([[1.0, 1.0]])
    loss, _ = algos.policy_loss(logp, torch.zeros_like(logp), adv, w, torch.ones_like(w), dual_clip=3.0)
    assert loss.item() == pytest.approx(6 - 0.25)
    loss.backward()
    assert torch.allclose(logp.grad, t([[0.0, -0.25]]))  # the capped token has none; -A r on the other

def test_gspo_clips_the_length_normalised_sequence_ratio_and_its_gradient_is_gspos():
    # rows: log-ratios [0.1, -0.3] (mean -0.1), [0.5, pad], [0.5, pad]; A = +1, -1, +1; seq_mean weights 1/6, 1/3, 1/3
    logp = t([[0.1, -0.3], [0.5, 0.0], [0.5, 0.0]]).requires_grad_()
    mask = t([[1, 1], [1, 0], [1, 0]])
    adv = t([[1.0], [-1.0], [1.0]]) * mask
    w = algos.loss_weights(mask, "seq_mean")
    loss, s = algos.policy_loss(logp, torch.zeros_like(logp), adv, w, mask, loss="gspo")
    # s = e^-0.1 = 0.904837 (inside), e^0.5 = 1.648721 (A < 0: unclipped), e^0.5 with A > 0: clipped to 1.2
    # loss = -2 * 0.904837 / 6 + 1.648721 / 3 - 1.2 / 3 = -0.301612 + 0.549574 - 0.4
    assert loss.item() == pytest.approx(-0.152039, abs=1e-5)
    loss.backward()
    # per token -A s w: the gradient of GSPO's -A s_i / N, since d s_i / d logp_t = s_i / |y_i|
    assert torch.allclose(logp.grad, t([[-0.150806, -0.150806], [0.549574, 0.0], [0.0, 0.0]]), atol=1e-5)
    assert torch.allclose(s["ratio"][:, 0], t([0.904837, 1.648721, 1.648721]), atol=1e-5)


def test_cispo_clips_a_stop_gradient_weight_so_every_token_keeps_its_gradient():
    logp, adv, w = ratios(1.5, 0.5, 1.0), t([[1.0, 1.0, -2.0]]), t([[1.0, 1.0, 1.0]])
    loss, _ = algos.policy_loss(logp, torch.zeros_like(logp), adv, w, torch.ones_like(w), loss="cispo")
    # -sg(clip r) A logp: -1.2 * ln 1.5 = -0.486558, -0.8 * ln 0.5 * -1 = +0.554518, -1 * -2 * ln 1 = 0
    assert loss.item() == pytest.approx(0.067960, abs=1e-6)
    loss.backward()
    assert torch.allclose(logp.grad, t([[-1.2, -0.8, 2.0]]))  # PPO would give 0 for the first two


@pytest.mark.parametrize("loss", algos.LOSSES)
def test_every_loss_at_ratio_one_is_the_plain_policy_gradient(loss):
    logp, adv, w = torch.tensor([[-0.5, -1.0]], requires_grad=True), t([[2.0, -1.0]]), t([[0.5, 0.5]])
    algos.policy_loss(logp, logp.detach(), adv, w, torch.ones_like(w), loss=loss, eps_low=0.1, eps_high=0.3, dual_clip=3.0)[0].backward()
    assert torch.allclose(logp.grad, t([[-1.0, 0.5]]))


def test_approx_kl_to_the_old_policy_is_k3_on_old_samples():
    logp = ratios(2.0, 1.0)
    _, s = algos.policy_loss(logp, torch.zeros_like(logp), t([[1.0, 1.0]]), t([[1.0, 1.0]]), t([[1.0, 1.0]]))
    assert torch.allclose(s["approx_kl"], t([[2 - math.log(2) - 1, 0.0]]))  # r - ln r - 1


# ---------------------------------------------------------------- aggregation, value clip, KL, IS
MASK = t([[1, 1, 1, 0], [1, 0, 0, 0]])


@pytest.mark.parametrize("mode, totals, expected", [
    ("token_mean", {}, [[1 / 4, 1 / 4, 1 / 4, 0], [1 / 4, 0, 0, 0]]),  # 4 tokens
    ("seq_mean", {}, [[1 / 6, 1 / 6, 1 / 6, 0], [1 / 2, 0, 0, 0]]),  # 1 / (len * rows)
    ("constant", {"constant": 4}, [[1 / 8, 1 / 8, 1 / 8, 0], [1 / 8, 0, 0, 0]]),  # 1 / (rows * 4)
    ("token_mean", {"total_tokens": 8}, [[1 / 8, 1 / 8, 1 / 8, 0], [1 / 8, 0, 0, 0]]),  # a rank of two
    ("seq_mean", {"total_rows": 4}, [[1 / 12, 1 / 12, 1 / 12, 0], [1 / 4, 0, 0, 0]]),
    ("constant", {"total_rows": 4, "constant": 4}, [[1 / 16, 1 / 16, 1 / 16, 0], [1 / 16, 0, 0, 0]]),
])
def test_loss_weights_use_the_given_global_denominators(mode, totals, expected):
    assert torch.allclose(algos.loss_weights(MASK, mode, **totals), t(expected))


def test_value_clip_takes_the_pessimistic_error_of_a_value_kept_near_the_old_one():
    values = t([[1.0, 0.0, 0.6]]).requires_grad_()
    loss = algos.value_loss(values, t([[2.0, 0.0, 2.0]]), t([[1.0, 1.0, 1.0]]), t([[0.5, 0.5, 0.5]]), clip=0.2)
    # clipped values 0.7, 0.3, 0.6: max(1, 1.69), max(0, 0.09), max(1.96, 1.96) -> 0.5 * 3.74
    assert loss.item() == pytest.approx(1.87)
    loss.backward()
    assert torch.allclose(values.grad, t([[0.0, 0.0, -1.4]]))  # only the unclipped third moves


def test_kl_estimators_and_their_gradients():
    logp, ref = t([-1.0, -2.0]).requires_grad_(), t([-1.5, -1.0])  # d = ref - logp = -0.5, 1
    expected = {"k1": ([0.5, -1.0], [1.0, 1.0]), "k2": ([0.125, 0.5], [0.5, -1.0]),
                "k3": ([0.106531, 0.718282], [0.393469, -1.718282])}  # k3 = e^d - d - 1, grad 1 - e^d
    for name, (value, grad) in expected.items():
        logp.grad = None
        k = algos.KL[name](logp, ref)
        k.sum().backward()
        assert torch.allclose(k, t(value), atol=1e-6) and torch.allclose(logp.grad, t(grad), atol=1e-6), name


def correction(old, sampler, mask, **kw):
    args = {"tis": "off", "tis_cap": 2.0, "mis": "off", "mis_low": 0.5, "mis_high": 2.0, **kw}
    return algos.importance_correction(old, sampler, mask, **args)


IS_MASK = t([[1, 1], [1, 0]])
IS_OLD = torch.log(t([[1.5, 2.5], [0.5, 1.0]]))  # sampler logp 0: token ratios 1.5, 2.5 | 0.5, (pad)


@pytest.mark.parametrize("kw, weight, keep", [
    ({"tis": "token"}, [[1.5, 2.0], [0.5, 1.0]], [[1, 1], [1, 0]]),
    ({"tis": "sequence"}, [[2.0, 2.0], [0.5, 0.5]], [[1, 1], [1, 0]]),  # 1.5 * 2.5 = 3.75 -> 2
    ({"mis": "token"}, [[1, 1], [1, 1]], [[1, 0], [1, 0]]),  # 0.5 sits on the lower bound: kept
    ({"mis": "sequence"}, [[1, 1], [1, 1]], [[0, 0], [1, 0]]),  # 3.75 leaves [0.5, 2]: the whole row goes
])
def test_importance_corrections_cap_or_mask(kw, weight, keep):
    w, k, stats = correction(IS_OLD, torch.zeros(2, 2), IS_MASK, **kw)
    assert torch.allclose(w, t(weight)) and torch.equal(k, t(keep))
    assert stats["is_ratio_mean"] == pytest.approx(1.5) and stats["is_ratio_max"] == pytest.approx(2.5)  # raw, before any cap


def test_importance_stats_count_capped_and_masked_tokens():
    _, _, s = correction(IS_OLD, torch.zeros(2, 2), IS_MASK, tis="token", mis="token")
    assert s["is_capped_frac"] == pytest.approx(1 / 3) and s["is_masked_frac"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_agreeing_sampler_and_trainer_get_weight_one_even_at_tight_bounds(level):
    old = t([[-0.3, -2.0], [-1.0, 0.0]])
    w, k, s = correction(old, old.clone(), IS_MASK, tis=level, tis_cap=1.0, mis=level, mis_low=1.0, mis_high=1.0)
    assert torch.equal(w, torch.ones(2, 2)) and torch.equal(k, IS_MASK)
    assert s["is_capped_frac"] == 0 and s["is_masked_frac"] == 0


def test_a_ratio_exactly_on_the_bound_is_kept_and_uncapped_and_one_just_past_it_is_not():
    at = t([[0.7]]).exp().item()  # the float32 ratio of a 0.7 log-gap, used as both bounds
    for gap, inside in ((0.7, True), (0.7 + 1e-6, False)):  # 1e-6 in the log is ~8 float32 steps of the ratio
        w, k, s = correction(t([[gap]]), t([[0.0]]), t([[1.0]]), mis="token", mis_high=at, tis="token", tis_cap=at)
        assert w.item() == at and k.item() == float(inside) and s["is_capped_frac"] == float(not inside)


@pytest.mark.parametrize("mode", algos.AGGREGATIONS)
def test_two_ranks_with_all_reduced_totals_weigh_like_one_process(mode):
    mask = t([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]])  # row 2 masked out entirely (not counted)
    whole = algos.loss_weights(mask, mode, constant=4)
    totals = {"total_tokens": mask.sum().item(), "total_rows": 3}  # what loss_weights sums over ranks
    halves = [algos.loss_weights(mask[r], mode, **totals, constant=4) for r in (slice(0, 2), slice(2, 4))]
    assert torch.allclose(torch.cat(halves), whole)
