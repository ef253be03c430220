"""Advantage estimators and the one loss.

Contract: every estimator is `fn(batch, cfg) -> adv [N, T]`, 0 where mask == 0, reading the fields of a
rollouts.Batch it needs; one that trains a critic also stores its targets in `batch.returns`. Adding
an algorithm is one function and one entry in ALGOS; the loss below never changes.
"""
import torch

import utils

EPS = 1e-6


def masked_mean(x: torch.Tensor, mask: torch.Tensor, of_none: float = 0.0) -> torch.Tensor:
    """Mean over the whole batch: under torchrun the sums span every rank (a collective); `of_none` where the
    mask has no entry. Summed in float64: returns of 1e34 (float32 holds each) summed past its range."""
    total = utils.all_sum(torch.stack([(x * mask).sum(dtype=torch.float64), mask.sum(dtype=torch.float64)]))
    return torch.where(total[1] > 0, total[0] / total[1].clamp(min=1), of_none).to(x.dtype)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """In float64, as group_baseline: a spread past ~1.8e19 squares past float32's range (std inf, adv 0)."""
    x, mask = x.double(), mask.double()
    mean = masked_mean(x, mask)
    std = masked_mean((x - mean) ** 2, mask).sqrt()
    return ((x - mean) / (std + EPS) * mask).float()


def next_policy_step(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x at the row's next policy step after t, past an environment's tokens between turns; 0 if none."""
    T = x.shape[1]
    at = torch.where(mask > 0, torch.arange(T), T)  # [N, T]: a policy step's own index, else T
    first = at.flip(1).cummin(1).values.flip(1)  # [N, T]: the row's first policy step at or after t
    after = torch.cat([first[:, 1:], torch.full_like(first[:, :1], T)], 1)  # [N, T]: ... after t
    return torch.cat([x, torch.zeros_like(x[:, :1])], 1).gather(1, after)  # index T: none follows, 0


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G at the row's next policy step; [N, T] -> [N, T]. A multi-turn episode is
    one row: the environment's tokens pass G on undiscounted, so an early turn earns a later solve."""
    out, factor = rewards * mask, torch.where(mask > 0, gamma, 1.0)  # [N, T] each
    for t in reversed(range(rewards.shape[1] - 1)):
        out[:, t] += factor[:, t] * out[:, t + 1]
    return out * mask


def gae(rewards, values, mask, last_value, terminated, gamma: float, lam: float) -> torch.Tensor:
    """GAE over each row's policy steps; after the row's last one the next value is `last_value` if a
    time limit cut the episode (truncation is not death), 0 if it terminated; [N, T] -> [N, T]."""
    is_last = mask * (1 - next_policy_step(mask, mask))  # [N, T]: 1 on each row's final policy step
    bootstrap = (last_value * (~terminated).float()).unsqueeze(1)  # [N, 1]
    next_values = next_policy_step(values, mask) + is_last * bootstrap  # [N, T]
    deltas = (rewards + gamma * next_values - values) * mask  # [N, T]
    return discounted_returns(deltas, mask, gamma * lam)  # GAE: the TD errors' (gamma * lam)-discounted sum


def group_baseline(scores: torch.Tensor, group: torch.Tensor):
    """Per-row mean, std (population) and size of the row's group; all [N]. In float64: rewards 0 and 1e25
    (float32's range holds both) square past it, and a std of inf made every advantage 0."""
    _, idx = torch.unique(group, return_inverse=True)
    sums = lambda x: torch.zeros(int(idx.max()) + 1, dtype=torch.float64).index_add_(0, idx, x.double())
    k = sums(torch.ones_like(scores))  # [groups], as mean and std
    mean = sums(scores) / k
    # about the mean, not E[x^2] - mean^2, which cancels to 0 in float32 for rewards like 1000 +- 0.01
    std = (sums((scores - mean[idx]) ** 2) / k).sqrt()
    return mean[idx].float(), std[idx].float(), k[idx].float()


def reinforce(batch, cfg):
    return discounted_returns(batch.rewards, batch.mask, cfg.gamma)


def reinforce_baseline(batch, cfg):
    g = discounted_returns(batch.rewards, batch.mask, cfg.gamma)
    return (g - masked_mean(g, batch.mask)) * batch.mask


def reinforce_pp(batch, cfg):
    """REINFORCE++: returns whitened with one mean and std over every token of the batch."""
    return masked_whiten(discounted_returns(batch.rewards, batch.mask, cfg.gamma), batch.mask)


def ppo(batch, cfg):
    """GAE with the critic's values from before the update; targets fixed once, here."""
    adv = gae(batch.rewards, batch.values, batch.mask, batch.last_value, ~batch.truncated, cfg.gamma, cfg.lam)
    batch.returns = (adv + batch.values) * batch.mask
    return masked_whiten(adv, batch.mask)


def grpo(batch, cfg):
    """Group-relative: (R - mean_group) / std_group; --dr-grpo drops the division (and its up-weighting)."""
    r = (batch.rewards * batch.mask).sum(1)  # [N]: each row's return
    mean, std, _ = group_baseline(r, batch.group)
    adv = r - mean if cfg.dr_grpo else (r - mean) / (std + EPS)  # [N]
    return adv.unsqueeze(1) * batch.mask


def rloo(batch, cfg):
    """Leave-one-out: each row's baseline is the mean of the other rows of its group."""
    r = (batch.rewards * batch.mask).sum(1)  # [N]
    mean, _, k = group_baseline(r, batch.group)
    adv = (r - mean) * k / (k - 1)  # == r - mean(others)
    return adv.unsqueeze(1) * batch.mask


def opd(batch, cfg):
    """On-policy distillation: the per-token advantage teacher_logp - old_logp (minus the teacher's
    per-token reverse KL on the student's own samples), plus opd_reward_coef x the task's return."""
    adv = (batch.teacher_logp - batch.old_logp) * batch.mask  # [N, T]
    return adv + cfg.opd_reward_coef * discounted_returns(batch.rewards, batch.mask, cfg.gamma)


ALGOS = {fn.__name__: fn for fn in (reinforce, reinforce_baseline, reinforce_pp, ppo, grpo, rloo, opd)}
GROUPED = {"grpo", "rloo"}  # estimators that need group_size >= 2
AGGREGATIONS = ("token_mean", "seq_mean", "constant")
LOSSES = ("ppo", "gspo", "cispo")
IS_LEVELS = ("off", "token", "sequence")  # sampler/trainer mismatch corrections
# KL(policy || ref) per token from samples of the policy (Schulman's k1, k2, k3). As a loss their gradients
# differ: k2's is that of KL(policy || ref), k3's that of KL(ref || policy) (GRPO's), k1's is zero in
# expectation; as a reward (--kl-in-reward) k1 gives the true KL's gradient.
KL = {"k1": lambda logp, ref_logp: logp - ref_logp,
      "k2": lambda logp, ref_logp: 0.5 * (logp - ref_logp) ** 2,
      "k3": lambda logp, ref_logp: torch.exp(ref_logp - logp) - (ref_logp - logp) - 1}


def loss_weights(mask, mode="token_mean", total_tokens=None, total_rows=None, constant=None) -> torch.Tensor:
    """Per-token loss weights [N, T]: token_mean mask / tokens (DAPO), seq_mean mask / (len_i * rows) (the
    GRPO paper), constant mask / (rows * constant) (Dr. GRPO). Tokens and rows (not fully masked) are the
    whole batch's, all ranks' unless given, so the micro-batch gradients sum to one big backward's."""
    counts = torch.stack([mask.sum(), (mask.sum(1) > 0).float().sum()])  # tokens, rows not fully masked
    tokens, rows = utils.all_sum(counts).tolist()  # the whole batch's: one collective for both
    tokens = max(float(tokens if total_tokens is None else total_tokens), 1.0)
    rows = max(float(rows if total_rows is None else total_rows), 1.0)
    if mode == "seq_mean":  # a row's length is its own: no collective needed
        return mask / (mask.sum(1, keepdim=True).clamp(min=1) * rows)
    return mask / (rows * constant if mode == "constant" else tokens)


def policy_loss(logp, old_logp, adv, weights, mask, loss="ppo", eps_low=0.2, eps_high=0.2, dual_clip=0.0):
    """The one policy loss, summed with `weights`, and per-token stats [n, T] for the caller to average.
    Inputs [n, T], only logp carries grad; with old_logp == logp.detach() each is the plain policy gradient.
      ppo:   max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), r = exp(logp - old_logp); dual_clip c > 1
             caps a negative-advantage token's loss at -c A, so one huge ratio cannot dominate the batch.
      gspo:  the same clip on the row's s = exp(mean_t(logp - old_logp)): value s on every token, gradient
             token by token (GSPO-token: GSPO's own under seq_mean). GSPO wants eps ~ 3e-4 / 4e-4.
      cispo: -sg(clip(r)) A logp: clipping bounds the weight, yet every token keeps its gradient."""
    gap = logp - old_logp  # [n, T]
    ratio = torch.exp(gap)
    if loss == "gspo":
        seq = (gap * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)  # [n, 1]
        ratio = torch.exp(seq).detach() * torch.exp(logp - logp.detach())  # [n, T]: value s_i, grad d logp_t
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    if loss == "cispo":
        surr = -clipped.detach() * adv * logp
    else:
        surr = torch.max(-adv * ratio, -adv * clipped)
        if dual_clip:
            surr = torch.where(adv < 0, torch.min(surr, -dual_clip * adv), surr)
    r = ratio.detach()
    stats = {"ratio": r, "clip_frac_low": (r < 1 - eps_low).float(),
             "clip_frac_high": (r > 1 + eps_high).float(),
             "approx_kl": KL["k3"](old_logp, logp.detach())}  # KL(old || new) per token, on old's samples
    return (surr * weights).sum(), stats


def value_loss(values, returns, weights, old_values=None, clip=0.0):
    """Half squared error; clip > 0: PPO value clipping, the max with that of a value within clip of old."""
    err = (values - returns) ** 2
    if clip:
        err = torch.max(err, (old_values + (values - old_values).clamp(-clip, clip) - returns) ** 2)
    return 0.5 * (err * weights).sum()


def importance_correction(old_logp, sampler_logp, mask, tis, tis_cap, mis, mis_low, mis_high):
    """Sampler/trainer mismatch (e.g. vLLM vs the trainer's kernels), r = p_trainer / p_sampler per token or
    its product over the row: truncated IS weights the policy loss by min(r, tis_cap); masked IS drops tokens
    (rows) whose r leaves [mis_low, mis_high], ends kept. Returns (weight [N, T], keep [N, T], stats of r)."""
    log_r = (old_logp - sampler_logp) * mask  # [N, T]
    # "off" is a log-ratio of 0, which validate() keeps under tis_cap and inside the mis bounds
    level = {"off": torch.zeros_like(log_r), "token": log_r,
             "sequence": log_r.sum(1, keepdim=True).expand_as(log_r)}
    r_tis, r_mis, raw = level[tis].exp(), level[mis].exp(), log_r.exp() * mask  # [N, T]
    keep = mask * ((r_mis >= mis_low) & (r_mis <= mis_high)).float()
    stats = {"is_ratio_mean": masked_mean(raw, mask), "is_ratio_max": raw.max(),
             "is_capped_frac": masked_mean((r_tis > tis_cap).float(), mask),
             "is_masked_frac": masked_mean(mask - keep, mask)}
    return r_tis.clamp(max=tis_cap), keep, {k: float(v) for k, v in stats.items()}
