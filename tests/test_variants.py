"""The RLVR toolbox through the loop: aggregation invariance, mismatch corrections, KL in the
reward, overlong masking, dynamic sampling, the LLM critic, and tiny end-to-end runs."""
import dataclasses
import math
import itertools

import pytest
import torch
from safetensors.torch import load_file

import rollouts
import rundir
import train
import utils
from algos import group_baseline, masked_mean
from envs import CartPole
from model import MLPPolicy
from rollouts import rollout_control


pytestmark = pytest.mark.usefixtures("one_thread")


def cfg_from(*argv):
    return utils.load_config(train.Config, list(argv))


def cartpole(cfg, seed=0):
    torch.manual_seed(seed)
    policy = MLPPolicy(4, 2, critic=cfg.algo == "ppo")
    return policy, rollout_control(CartPole(), policy, cfg.batch, seed=seed, group_size=cfg.group_size)


def sgd_delta(cfg, edit=lambda policy, batch: None):
    """Parameter change of one SGD(lr=1) update: the gradient, clipping off."""
    policy, batch = cartpole(cfg)
    edit(policy, batch)
    batch = train.prepare(policy, batch, cfg)
    before = [p.detach().clone() for p in policy.parameters()]
    stats = train.update(policy, torch.optim.SGD(policy.parameters(), lr=1.0), batch, cfg)
    return [b - p.detach() for b, p in zip(before, policy.parameters())], stats, batch


# ---------------------------------------------------------------- aggregation
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "constant"])
@pytest.mark.parametrize("loss", ["ppo", "gspo"])
def test_every_aggregation_is_invariant_to_micro_batch_size(agg, loss):
    base = cfg_from("--algo", "grpo", "--group-size", "4", "--max-grad-norm", "1e9", "--loss-agg", agg, "--loss", loss)
    deltas = [sgd_delta(dataclasses.replace(base, micro_batch=m))[0] for m in (0, 3, 1)]
    for other in deltas[1:]:
        for a, b in zip(deltas[0], other):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)


def test_aggregation_modes_weigh_rows_as_documented():
    cfg = cfg_from("--algo", "grpo", "--group-size", "4", "--loss-agg", "seq_mean")
    _, _, batch = sgd_delta(cfg)
    per_row = batch.weights.sum(1)  # seq_mean: every episode weighs 1 / N, however long
    assert torch.allclose(per_row, torch.full_like(per_row, 1 / cfg.batch))
    _, _, batch = sgd_delta(dataclasses.replace(cfg, loss_agg="constant", loss_agg_constant=500))
    assert torch.allclose(batch.weights.sum(1), batch.mask.sum(1) / (cfg.batch * 500))


# ---------------------------------------------------------------- sampler/trainer mismatch
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_corrections_are_exactly_neutral_when_sampler_and_trainer_agree(level):
    cfg = cfg_from("--algo", "reinforce", "--max-grad-norm", "1e9")

    def same_as_trainer(policy, batch):  # the sampler's log-probs, bit for bit the trainer's
        with torch.no_grad():
            batch.logp = policy.score(batch, slice(None))[0] * batch.mask

    plain, _, _ = sgd_delta(cfg, same_as_trainer)
    corrected, stats, batch = sgd_delta(dataclasses.replace(cfg, tis=level, mis=level, tis_cap=1.0, mis_low=1.0, mis_high=1.0),
                                        same_as_trainer)
    assert torch.equal(batch.is_weight, torch.ones_like(batch.mask)) and torch.equal(batch.loss_mask, batch.mask)
    assert stats["is_ratio_mean"] == 1.0 and stats["is_capped_frac"] == 0 and stats["is_masked_frac"] == 0
    for a, b in zip(plain, corrected):
        assert torch.equal(a, b)


def test_sync_prepare_recomputes_old_logp_once_a_correction_is_on():
    cfg = cfg_from("--algo", "reinforce", "--tis", "token")
    policy, batch = cartpole(cfg)
    batch.logp = batch.logp - 0.1 * batch.mask  # a sampler 10% less sure of every action than the trainer
    batch = train.prepare(policy, batch, cfg)
    ratio = torch.tensor(0.1).exp()  # trainer / sampler = e^0.1 on every step
    assert torch.allclose(batch.is_weight[batch.mask > 0], ratio)
    assert batch.metrics["is_ratio_mean"] == pytest.approx(ratio.item(), rel=1e-5)


@pytest.mark.parametrize("argv, edit", [
    ((), {}), (("--inner-epochs", "2"), {}), (("--minibatches", "2"), {}), (("--tis", "token"), {}),
    (("--mis", "sequence"), {}), (("--algo", "ppo"), {}), ((), {"role": "trainer"}),
])
def test_stage_2_rescores_the_batch_exactly_when_the_update_is_off_policy(argv, edit):
    """Plain sync REINFORCE: the update's first forward is the old policy, so stage 2 runs none; every
    other mode rescores each row (a worker's rows under their version's weights), critic values too."""
    cfg = dataclasses.replace(cfg_from("--algo", "reinforce", *argv), **edit)
    policy, batch = cartpole(cfg)
    batch = train.prepare(policy, batch, cfg)
    if not argv and not edit:
        assert batch.old_logp is None and batch.values is None and "logp_gap" not in batch.metrics
        return
    logp, _, values = policy.score(batch, slice(None))
    torch.testing.assert_close(batch.old_logp, logp * batch.mask, rtol=0, atol=1e-6)
    assert batch.metrics["logp_gap"] == pytest.approx(0.0, abs=1e-6)  # the sampler was this policy
    if cfg.algo == "ppo":
        torch.testing.assert_close(batch.values, values * batch.mask, rtol=0, atol=1e-6)


@pytest.mark.parametrize("group_size, frac", [(1, None), (2, 0.5)])
def test_rollout_metrics_count_the_groups_whose_rewards_all_agree(group_size, frac):
    cfg = cfg_from("--algo", "reinforce", "--group-size", str(group_size))
    policy, batch = cartpole(cfg)
    score = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0, 3.0, 0.0]).repeat(2)  # groups of 2: =, !=, =, !=, ...
    rewards = torch.zeros_like(batch.mask)
    rewards[torch.arange(cfg.batch), batch.mask.sum(1).long() - 1] = score  # on each episode's last step
    batch.group = torch.arange(cfg.batch) // group_size
    batch = train.prepare(policy, batch, cfg)
    out = train.rollout_metrics(batch, rewards, cfg)
    assert out.get("frac_zero_std") == frac and out["reward"] == pytest.approx(10 / 8)
    assert out["reward_std"] == pytest.approx((7.5 / 8) ** 0.5)  # the population std of the scores
    adv = batch.adv[batch.mask > 0]  # the advantages of the policy's steps
    assert out["adv_mean"] == pytest.approx(adv.mean().item())
    assert out["adv_std"] == pytest.approx(adv.std(correction=0).item())
    assert out["steps_env"] == batch.mask.sum().item() and out["length_max"] == batch.mask.sum(1).max().item()


def test_rollout_metrics_average_the_reward_over_scored_rows_never_counting_a_dropped_one_as_0():
    """--judge-down drop masks out a group no judge scored (collate): its rows logged a reward of 0, so an
    outage looked like the policy collapsing. Scores as above (sum 20 over 16 rows); group 0 (1, 1) dropped."""
    cfg = cfg_from("--algo", "reinforce", "--group-size", "2")
    policy, batch = cartpole(cfg)
    score = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0, 3.0, 0.0]).repeat(2)
    rewards = torch.zeros_like(batch.mask)
    rewards[torch.arange(cfg.batch), batch.mask.sum(1).long() - 1] = score
    batch.group, batch.mask[:2] = torch.arange(cfg.batch) // 2, 0.0
    out = train.rollout_metrics(train.prepare(policy, batch, cfg), rewards, cfg)
    assert out["reward"] == out["reward_mean"] == pytest.approx(18 / 14)
    batch.mask[:] = 0.0  # every sample dropped: no reward at all
    assert math.isnan(train.rollout_metrics(batch, rewards, cfg)["reward"])


def test_rollout_metrics_leave_a_dropped_group_out_of_frac_zero_std_and_length_mean():
    """A dropped group's rows have mask 0: its 'rewards' 0, 0 agreed (frac_zero_std 5/8, not 4/7) and its
    'lengths' 0 pulled length_mean down, so an outage looked like collapse. Scores as above, group 1 (0, 1)
    dropped: 4 of the 7 scored groups agree."""
    cfg = cfg_from("--algo", "reinforce", "--group-size", "2")
    policy, batch = cartpole(cfg)
    score = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0, 3.0, 0.0]).repeat(2)
    rewards = torch.zeros_like(batch.mask)
    rewards[torch.arange(cfg.batch), batch.mask.sum(1).long() - 1] = score
    lengths = batch.mask.sum(1)
    batch.group, batch.mask[2:4] = torch.arange(cfg.batch) // 2, 0.0
    out = train.rollout_metrics(train.prepare(policy, batch, cfg), rewards, cfg)
    assert out["frac_zero_std"] == pytest.approx(4 / 7)
    assert out["length_mean"] == pytest.approx((lengths.sum() - lengths[2:4].sum()).item() / 14)
    assert out["length_max"] == lengths[[0, 1, *range(4, 16)]].max().item()


def test_rollout_metrics_adv_std_of_advantages_squaring_past_float32_is_finite():
    """REINFORCE's advantages are raw returns: +-1e20 (float32 holds them) squared past its range, so adv_std
    was inf. Two steps a row, 1e20 then -1e20: mean 0, std 1e20."""
    cfg = cfg_from("--algo", "reinforce")
    policy, batch = cartpole(cfg)
    batch = train.prepare(policy, batch, cfg)
    batch.mask[:, 2:] = 0.0
    batch.adv = torch.zeros_like(batch.mask)
    batch.adv[:, :2] = torch.tensor([1e20, -1e20])
    out = train.rollout_metrics(batch, batch.rewards, cfg)
    assert out["adv_mean"] == 0.0 and out["adv_std"] == pytest.approx(1e20)


# ---------------------------------------------------------------- the loss's terms, the update's arithmetic
def kl_reference(policy, batch):  # k1 = logp - ref: ref is the sampler's log-prob + 0.5, no gradient
    policy.ref_logp = lambda b, rows: b.logp[rows] + 0.5


def term_grad(cfg, term) -> list[torch.Tensor]:
    """The gradient of term(logp [N, T], entropy [N, T], values [N, T] | None, batch) at the start weights,
    computed here from the networks' outputs, not by policy.score."""
    policy, batch = cartpole(cfg)
    kl_reference(policy, batch)
    batch = train.prepare(policy, batch, cfg)
    logits = torch.log_softmax(policy.pi(batch.obs), -1)  # [N, T, A]
    logp = logits.gather(-1, batch.tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(logits.exp() * logits).sum(-1)
    values = policy.v(batch.obs).squeeze(-1) if policy.v is not None else None
    params = list(policy.parameters())
    return torch.autograd.grad(term(logp, entropy, values, batch), params, allow_unused=True)


@pytest.mark.parametrize("extra, term", [
    (("--ent-coef", "0.3"), lambda lp, h, v, b: -0.3 * (h * b.weights).sum()),  # a bonus: the loss falls
    (("--kl-coef", "0.2", "--kl-estimator", "k1"), lambda lp, h, v, b: 0.2 * (lp * b.weights).sum()),
    (("--algo", "ppo", "--vf-coef", "0.7", "--critic-max-grad-norm", "1e9"),
     lambda lp, h, v, b: 0.7 * 0.5 * ((v - b.returns) ** 2 * b.weights).sum()),
])
def test_each_extra_loss_term_adds_its_coefficient_times_its_own_gradient(extra, term):
    """SGD(lr=1) moves the weights by the gradient; a term switched on adds exactly its gradient."""
    on = cfg_from("--algo", "reinforce", "--max-grad-norm", "1e9", *extra)
    off = dataclasses.replace(on, ent_coef=0.0, kl_coef=0.0, vf_coef=0.0)
    (with_term, stats, _), (without, _, _) = sgd_delta(on, kl_reference), sgd_delta(off, kl_reference)
    for a, b, g in zip(with_term, without, term_grad(on, term)):
        torch.testing.assert_close(a - b, torch.zeros_like(a) if g is None else g, rtol=1e-4, atol=1e-6)
    if on.kl_coef:
        assert stats["kl"] == pytest.approx(-0.5)  # the logged token mean of k1


class Recording(torch.optim.SGD):
    """lr 0: the weights stay put; keeps each step's gradient."""
    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.grads = []

    def step(self, closure=None):
        self.grads.append([p.grad.clone() for g in self.param_groups for p in g["params"]])


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_minibatch_gradients_are_weighted_by_their_share_of_the_batch(agg):
    """Each random minibatch is scaled up as if it were the batch (by its share of the tokens, or of the
    rows that have any): weighted by those shares, the minibatches' gradients add up to the batch's."""
    cfg = cfg_from("--algo", "reinforce", "--max-grad-norm", "1e9", "--loss-agg", agg)
    stats, grads = [], []
    for mb, epochs in ((1, 1), (2, 1), (1, 2)):
        policy, batch = cartpole(cfg)
        batch.mask[0], batch.mask[1, 1:] = 0, 0  # a row without tokens (no share of the rows), one with 1
        run = dataclasses.replace(cfg, minibatches=mb, inner_epochs=epochs)
        batch, opt = train.prepare(policy, batch, run), Recording(policy.parameters())
        torch.manual_seed(7)
        order = torch.randperm(len(batch)).chunk(2)  # the minibatches update() draws under the same seed
        torch.manual_seed(7)
        stats.append(train.update(policy, opt, batch, run))
        grads.append(opt.grads)
    unit = batch.mask if agg == "token_mean" else (batch.mask.sum(1) > 0).float()[:, None]
    shares = [unit[rows].sum() / unit.sum() for rows in order]
    assert 0 < shares[0] < 1 and len(grads[1]) == 2
    for g1, g2, whole in zip(*grads[1], grads[0][0]):
        torch.testing.assert_close(shares[0] * g1 + shares[1] * g2, whole, rtol=1e-4, atol=1e-7)
    # on-policy, ratio 1: the loss is -sum(weights * adv); two epochs of unmoved weights log its mean
    assert stats[0]["loss"] == pytest.approx(-(batch.weights * batch.adv).sum().item(), rel=1e-5)
    for k in ("loss", "grad_norm", "entropy"):
        assert stats[2][k] == pytest.approx(stats[0][k], rel=1e-5) and stats[0]["entropy"] > 0
    assert "critic_grad_norm" not in stats[0]


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "constant"])
def test_a_minibatch_without_tokens_trains_nothing_and_leaves_the_logged_means_to_the_one_that_trained(agg):
    """Minibatch 1 holds only masked-out rows (a dropped group, --mask-truncated): its share was 0, its weights
    0 / 0, and the step logged loss and grad_norm NaN, ratio 0.5 and half the entropy. Minibatch 2 holds all
    the tokens (share 1): its one SGD step is the whole batch's gradient, its stats the whole batch's."""
    cfg = cfg_from("--algo", "reinforce", "--max-grad-norm", "1e9", "--loss-agg", agg, "--minibatches", "2")

    def empty_first_minibatch(policy, batch):
        torch.manual_seed(7)
        batch.mask[torch.randperm(len(batch)).chunk(2)[0]] = 0  # the rows update() draws first, below
        torch.manual_seed(7)

    split, stats, batch = sgd_delta(cfg, empty_first_minibatch)
    whole, one, _ = sgd_delta(dataclasses.replace(cfg, minibatches=1), empty_first_minibatch)
    assert stats["skipped"] == 1 and stats["ratio"] == pytest.approx(1.0, abs=1e-6)
    assert stats["loss"] == pytest.approx(-(batch.weights * batch.adv).sum().item(), rel=1e-5)  # ratio 1
    for k in ("loss", "grad_norm", "entropy", "approx_kl"):
        assert stats[k] == pytest.approx(one[k], rel=1e-5, abs=1e-7), k
    for a, b in zip(split, whole):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("kept", [0, 1])
def test_a_step_with_0_or_1_tokens_left_logs_their_token_means_and_skips_only_the_empty_one(kept):
    cfg = cfg_from("--algo", "reinforce", "--mask-truncated")
    policy, batch = cartpole(cfg)
    batch.truncated[:] = True  # --mask-truncated drops every row ...
    batch.truncated[0], batch.mask[0, kept:] = False, 0  # ... but row 0, cut to `kept` tokens
    before = [p.detach().clone() for p in policy.parameters()]
    entropy = policy.score(batch, slice(0, 1))[1][0, 0].item()
    batch = train.prepare(policy, batch, cfg)
    stats = train.update(policy, torch.optim.SGD(policy.parameters(), lr=1.0), batch, cfg)
    moved = any(not torch.equal(b, p) for b, p in zip(before, policy.parameters()))
    assert (stats["skipped"], moved) == (1 - kept, kept == 1)
    assert stats["entropy"] == pytest.approx(entropy * kept, rel=1e-5)  # 0 tokens: 0, never NaN


def test_truncated_is_scales_the_policy_gradient_by_the_trainer_over_sampler_ratio():
    cfg = cfg_from("--algo", "reinforce", "--max-grad-norm", "1e9")

    def less_sure(policy, batch):  # the sampler: 10% less sure of every action than the trainer
        batch.logp = batch.logp - 0.1 * batch.mask

    plain, _, _ = sgd_delta(cfg, less_sure)
    corrected, _, _ = sgd_delta(dataclasses.replace(cfg, tis="token"), less_sure)
    for a, b in zip(plain, corrected):
        torch.testing.assert_close(b, a * torch.tensor(0.1).exp(), rtol=1e-4, atol=1e-7)


def test_ppo_clips_actor_and_critic_gradients_each_on_its_own():
    cfg = cfg_from("--algo", "ppo", "--max-grad-norm", "1e9", "--critic-max-grad-norm", "1e9")
    policy, batch = cartpole(cfg)
    opt = Recording(policy.parameters())
    stats = train.update(policy, opt, train.prepare(policy, batch, cfg), cfg)
    norms = [g.norm() ** 2 for g in opt.grads[0]]
    critic = list(policy.v.parameters())
    actor = sum(n for n, p in zip(norms, policy.parameters()) if all(p is not c for c in critic))
    assert stats["grad_norm"] == pytest.approx(actor.sqrt().item(), rel=1e-5)
    assert stats["critic_grad_norm"] == pytest.approx((sum(norms) - actor).sqrt().item(), rel=1e-5)


# ---------------------------------------------------------------- KL in the reward, overlong masking
def test_kl_in_reward_subtracts_the_penalty_from_each_token_before_the_advantage(monkeypatch):
    cfg = cfg_from("--algo", "reinforce", "--gamma", "1", "--kl-coef", "0.1", "--kl-in-reward", "--kl-estimator", "k1")
    policy, batch = cartpole(cfg)
    monkeypatch.setattr(policy, "ref_logp", lambda b, rows: b.logp[rows] + 0.5, raising=False)
    before = batch.rewards.clone()
    batch = train.prepare(policy, batch, cfg)
    # k1 = logp - ref = -0.5 on every policy step: the reward rises by 0.1 * 0.5
    assert torch.allclose(batch.rewards, before + 0.05 * batch.mask)
    assert batch.metrics["kl"] == pytest.approx(-0.5)
    assert batch.metrics["reward_mean"] == pytest.approx((before * batch.mask).sum(1).mean().item())  # task reward


def test_masked_truncated_rows_leave_the_loss_and_its_denominator():
    cfg = cfg_from("--algo", "reinforce", "--mask-truncated")
    policy, batch = cartpole(cfg)
    batch.truncated = torch.arange(cfg.batch) % 2 == 0  # [N]
    batch = train.prepare(policy, batch, cfg)
    assert not batch.weights[batch.truncated].any()
    assert batch.weights.sum().item() == pytest.approx(1.0)  # token mean over the kept rows only
    assert batch.metrics["truncated_frac"] == 0.5


# ---------------------------------------------------------------- tiny language model
LLM = ["--task", "arith", "--model", "tiny", "--lora", "--batch", "8", "--group-size", "4", "--max-new-tokens", "4",
       "--eval-size", "8", "--no-progress"]


@pytest.fixture(scope="module")
def llm_policy():
    torch.set_num_threads(1)
    return train.build(cfg_from(*LLM, "--algo", "grpo"))[0]


def scripted(source, spread_groups, k=4):
    """task.score returns 1 for the first row of every group index in spread_groups, else 0."""
    calls = itertools.count()

    def score(prompt, completion, answer, drop=False):
        j = next(calls)
        return float(j // k in spread_groups and j % k == 0), {"scripted": 0.0}

    source.task.score = score


def counting(policy, monkeypatch):
    calls, real = [], policy.generate
    monkeypatch.setattr(policy, "generate", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def test_dynamic_sampling_returns_only_groups_with_reward_spread(llm_policy, monkeypatch):
    cfg = cfg_from(*LLM, "--algo", "grpo", "--dynamic-sampling", "--max-gen-batches", "5")
    source = rollouts.TaskRollouts(cfg, llm_policy)
    scripted(source, {2, 5, 6})  # 2 groups per round: rounds (0, 1), (2, 3), (4, 5) fill the batch
    calls = counting(llm_policy, monkeypatch)
    batch = source.next(0)
    score = (batch.rewards * batch.mask).sum(1)
    assert len(score) == 8 and (group_baseline(score, batch.group)[1] > 0).all()
    assert len(calls) == 3 and source.last["gen_rounds"] == 3 and source.last["gen_frac_zero_std"] == 4 / 6


def test_dynamic_sampling_stops_at_its_generation_bound(llm_policy, monkeypatch):
    cfg = cfg_from(*LLM, "--algo", "grpo", "--dynamic-sampling", "--max-gen-batches", "2")
    source = rollouts.TaskRollouts(cfg, llm_policy)
    scripted(source, {3})
    calls = counting(llm_policy, monkeypatch)
    batch = source.next(0)
    assert len(calls) == 2 and len(batch.mask) == 4  # the one informative group, a short batch
    scripted(source, set())
    batch = source.next(1)
    assert len(calls) == 4 and len(batch.mask) == 8  # nothing informative: the first round, untouched


def test_prompt_reweight_replays_recent_prompts_with_spread_and_survives_a_checkpoint(llm_policy):
    cfg = cfg_from(*LLM, "--algo", "grpo", "--prompt-reweight", "0.5")
    source = rollouts.TaskRollouts(cfg, llm_policy)
    scripted(source, {1})
    source.next(0)  # problems 0, 1: only problem 1's group had spread
    state = source.state()
    again = rollouts.TaskRollouts(cfg, llm_policy)
    again.load_state(state)
    picked = again.draw(2)  # fresh problems 2, 3: the first swapped for the replay
    assert picked == [source.task.train_problem(1), source.task.train_problem(3)]
    assert again.position == 4


def llm_run(tmp_path, *argv):
    out = train.train(cfg_from(*LLM, "--steps", "2", "--eval-every", "2", "--out", str(tmp_path / "run"), *argv))
    return {k: [v for _, _, v in rows] for k, rows in rundir.read_metrics(out / "metrics.csv").items()}


@pytest.mark.parametrize("argv", [
    ["--loss", "ppo", "--eps-high", "0.28", "--dual-clip", "3"],
    ["--loss", "gspo", "--eps-low", "3e-4", "--eps-high", "4e-4", "--loss-agg", "seq_mean"],
    ["--loss", "cispo", "--eps-high", "5"],
], ids=["ppo", "gspo", "cispo"])
def test_grpo_with_each_loss_trains_the_tiny_model(tmp_path, argv):
    m = llm_run(tmp_path, "--algo", "grpo", "--inner-epochs", "2", *argv)
    assert len(m["loss"]) == 2 and m["skipped"] == [0, 0]
    for key in ("entropy", "clip_frac_low", "clip_frac_high", "approx_kl", "grad_norm", "length_mean", "length_max",
                "truncated_frac", "reward_mean", "reward_std", "adv_mean", "adv_std", "frac_zero_std"):
        assert len(m[key]) == 2, key
    assert m["entropy"][0] > 0 and 1 <= m["length_mean"][0] <= m["length_max"][0] <= 4


def test_everything_switched_on_trains_the_tiny_model(tmp_path):
    m = llm_run(tmp_path, "--algo", "rloo", "--kl-coef", "0.01", "--kl-in-reward", "--kl-estimator", "k2",
                "--tis", "token", "--mis", "sequence", "--mis-low", "0.1", "--mis-high", "10", "--mask-truncated",
                "--loss-agg", "constant", "--dynamic-sampling", "--max-gen-batches", "2", "--prompt-reweight", "0.5")
    # --mask-truncated: a step whose every completion ran out of budget has no token to train, and skips
    assert m["skipped"] == [float(t == 1) for t in m["truncated_frac"]] and len(m["is_ratio_mean"]) == 2
    assert len(m["gen_rounds"]) == 2 and abs(m["is_ratio_mean"][0] - 1) < 1e-3  # sync: the sampler is the trainer, up to kernel noise


def test_ppo_trains_an_llm_critic_on_the_policy_trunk(tmp_path):
    m = llm_run(tmp_path, "--algo", "ppo", "--gamma", "1", "--lam", "1", "--inner-epochs", "2", "--vf-clip", "0.2",
                "--critic-max-grad-norm", "0.5", "--overlong-buffer", "3")  # the penalty: rewards a random model earns
    assert m["skipped"] == [0, 0] and len(m["critic_grad_norm"]) == 2
    weights = load_file(str(rundir.checkpoints(tmp_path / "run")[-1] / "weights.safetensors"))
    assert weights["v.weight"].abs().sum() > 0  # the zero-initialised head has learned something


def test_llm_values_sit_on_completion_tokens_only():
    cfg = cfg_from(*LLM, "--algo", "ppo")
    policy = train.build(cfg)[0]
    torch.nn.init.ones_(policy.v.bias)
    batch = rollouts.TaskRollouts(cfg, policy).next(0)
    logp, _, values = policy.score(batch, slice(None))
    assert torch.equal(values, batch.mask)  # a bias-only head: value 1 exactly where a token is scored
    batch = train.prepare(policy, batch, cfg)
    assert batch.last_value.shape == (8,) and not batch.last_value.any()  # nothing to bootstrap


def test_ent_coef_raises_the_llms_entropy_and_off_leaves_it_untouched():
    """GRPO on rewards that are all 0 has no policy gradient: what moves the weights is the bonus alone."""
    cfg = cfg_from(*LLM, "--algo", "grpo", "--ent-coef", "1.0", "--max-grad-norm", "1e9")
    entropies = []
    for coef in (0.0, 1.0):
        run = dataclasses.replace(cfg, ent_coef=coef)
        torch.manual_seed(0)
        policy = train.build(run)[0]
        batch = rollouts.TaskRollouts(run, policy).next(0)
        batch.rewards.zero_()
        batch = train.prepare(policy, batch, run)
        mean_entropy = lambda: masked_mean(policy.score(batch, slice(None))[1], batch.mask).item()
        before = mean_entropy()
        train.update(policy, torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.5),
                     batch, run)
        entropies.append((before, mean_entropy()))
    assert entropies[0][1] == entropies[0][0] and entropies[1][1] > entropies[1][0]


@pytest.mark.parametrize("argv, message", [
    (["--loss", "gpso"], "unknown --loss 'gpso'; did you mean 'gspo'"),
    (["--loss-agg", "seq"], "unknown --loss-agg 'seq'"),
    (["--tis", "tokens"], "unknown --tis 'tokens'; did you mean 'token'"),
    (["--dual-clip", "0.5"], "--dual-clip 0 \\(off\\) or > 1"),
    (["--tis-cap", "0.5"], "need --tis-cap >= 1 \\(got 0.5\\)"),
    (["--task", "arith", "--kl-in-reward"], "--kl-in-reward needs --kl-coef > 0"),
    (["--task", "arith", "--dynamic-sampling", "--algo", "reinforce"], "--dynamic-sampling needs a grouped --algo"),
    (["--task", "countdown_multiturn", "--dynamic-sampling"], "--dynamic-sampling needs a grouped --algo on a single-turn task"),
    (["--dynamic-sampling"], "--dynamic-sampling is for LLM tasks, not cartpole"),
    (["--mask-truncated"], "--mask-truncated is for LLM tasks"),
])
def test_validate_names_the_fix_for_toolbox_options(argv, message):
    with pytest.raises(utils.ConfigError, match=message):
        train.validate(cfg_from(*argv))
