"""The RLVR toolbox through the loop: aggregation invariance, mismatch corrections, KL in the
reward, overlong masking, dynamic sampling, the LLM critic, and tiny end-to-end runs."""
import dataclasses
import itertools

import pytest
import torch
from safetensors.torch import load_file

import rollouts
import train
import utils
from algos import group_baseline
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
    return {k: [v for _, _, v in rows] for k, rows in utils.read_metrics(out / "metrics.csv").items()}


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
    weights = load_file(str(utils.checkpoints(tmp_path / "run")[-1] / "weights.safetensors"))
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


@pytest.mark.parametrize("argv, message", [
    (["--loss", "gpso"], "unknown --loss 'gpso'; did you mean 'gspo'"),
    (["--loss-agg", "seq"], "unknown --loss-agg 'seq'"),
    (["--tis", "tokens"], "unknown --tis 'tokens'; did you mean 'token'"),
    (["--dual-clip", "0.5"], "dual_clip 0 \\(off\\) or > 1"),
    (["--tis-cap", "0.5"], "tis_cap >= 1"),
    (["--kl-in-reward"], "--kl-in-reward needs --kl-coef > 0"),
    (["--dynamic-sampling"], "--dynamic-sampling needs a grouped --algo"),
    (["--mask-truncated"], "--mask-truncated is for LLM tasks"),
])
def test_validate_names_the_fix_for_toolbox_options(argv, message):
    with pytest.raises(utils.ConfigError, match=message):
        train.validate(cfg_from(*argv))
