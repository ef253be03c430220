"""Advantage estimators and the one loss.

Contract: every estimator is `fn(batch, cfg) -> adv [N, T]`, reading per-step `rewards`, `mask`
(1 on the policy's own steps) and, where it needs them, `group` [N], `values` [N, T],
`last_value` [N] and `terminated` [N]. Positions with mask == 0 get advantage 0. An estimator
that trains a critic also stores its regression targets in `batch["returns"]`. Adding an
algorithm is one function and one entry in ALGOS; the loss below never changes.
"""
from __future__ import annotations

import torch

import utils

EPS = 1e-6


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the whole batch: under torchrun the sums span every rank (a collective)."""
    total = utils.all_sum(torch.stack([(x * mask).sum(), mask.sum()]))
    return total[0] / total[1].clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mean = masked_mean(x, mask)
    std = masked_mean((x - mean) ** 2, mask).sqrt()
    return (x - mean) / (std + EPS) * mask


def next_mask(mask: torch.Tensor) -> torch.Tensor:
    """mask shifted left by one step: 1 where the following step also belongs to the policy."""
    return torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], 1)  # [N, T]


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} inside each row's run of policy steps; [N, T] -> [N, T]."""
    nxt = next_mask(mask)
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running * nxt[:, t]
        out[:, t] = running
    return out * mask


def gae(rewards, values, mask, last_value, terminated, gamma: float, lam: float) -> torch.Tensor:
    """Generalised advantage estimation. After a row's last policy step the next value is
    `last_value` when the episode was cut by a time limit (truncation is not death) and 0 when
    it terminated; [N, T] -> [N, T]."""
    nxt = next_mask(mask)
    is_last = mask * (1 - nxt)  # [N, T]: 1 on each row's final policy step
    bootstrap = (last_value * (~terminated).float()).unsqueeze(1)  # [N, 1]
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], 1) * nxt + is_last * bootstrap
    deltas = (rewards + gamma * next_values - values) * mask  # [N, T]
    adv = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = deltas[:, t] + gamma * lam * running * nxt[:, t]
        adv[:, t] = running
    return adv * mask


def group_baseline(scores: torch.Tensor, group: torch.Tensor):
    """Per-row mean, std (population) and size of the row's group; all [N]."""
    _, idx = torch.unique(group, return_inverse=True)
    k = torch.zeros(int(idx.max()) + 1).index_add_(0, idx, torch.ones_like(scores))
    total = torch.zeros_like(k).index_add_(0, idx, scores)
    sq = torch.zeros_like(k).index_add_(0, idx, scores**2)
    mean = total / k
    std = (sq / k - mean**2).clamp(min=0).sqrt()
    return mean[idx], std[idx], k[idx]


def sequence_score(batch) -> torch.Tensor:
    return (batch["rewards"] * batch["mask"]).sum(1)  # [N]


def reinforce(batch, cfg):
    return discounted_returns(batch["rewards"], batch["mask"], cfg.gamma)


def reinforce_baseline(batch, cfg):
    g = discounted_returns(batch["rewards"], batch["mask"], cfg.gamma)
    return (g - masked_mean(g, batch["mask"])) * batch["mask"]


def reinforce_pp(batch, cfg):
    """REINFORCE++: returns whitened with one mean and std over every token of the batch."""
    g = discounted_returns(batch["rewards"], batch["mask"], cfg.gamma)
    return masked_whiten(g, batch["mask"])


def ppo(batch, cfg):
    """GAE with the critic's values from before the update; targets fixed once, here."""
    m = batch["mask"]
    adv = gae(batch["rewards"], batch["values"], m, batch["last_value"], batch["terminated"], cfg.gamma, cfg.lam)
    batch["returns"] = (adv + batch["values"]) * m
    return masked_whiten(adv, m)


def grpo(batch, cfg):
    """Group-relative: (R - mean_group) / std_group; Dr. GRPO drops the std division, which
    otherwise up-weights groups that are nearly all right or all wrong."""
    r = sequence_score(batch)
    mean, std, _ = group_baseline(r, batch["group"])
    adv = r - mean if cfg.dr_grpo else (r - mean) / (std + EPS)  # [N]
    return adv.unsqueeze(1) * batch["mask"]


def rloo(batch, cfg):
    """Leave-one-out: each row's baseline is the mean of the other rows of its group."""
    r = sequence_score(batch)
    mean, _, k = group_baseline(r, batch["group"])
    adv = (r - mean) * k / (k - 1)  # == r - mean(others)
    return adv.unsqueeze(1) * batch["mask"]


ALGOS = {
    "reinforce": reinforce,
    "reinforce_baseline": reinforce_baseline,
    "reinforce_pp": reinforce_pp,
    "ppo": ppo,
    "grpo": grpo,
    "rloo": rloo,
}
GROUPED = {"grpo", "rloo"}  # estimators that need group_size >= 2


def loss_weights(mask: torch.Tensor, total_tokens: float | None = None, total_rows: float | None = None) -> torch.Tensor:
    """Token-mean weights over the whole batch. Computing them once, before any micro-batching,
    is what makes the sum of micro-batch gradients equal one big backward. Under torchrun the
    totals are the whole batch's over all ranks (utils.batch_totals); total_rows is for
    row-normalised modes."""
    tokens = mask.sum() if total_tokens is None else torch.tensor(float(total_tokens))
    return mask / tokens.clamp(min=1)  # [N, T], sums to 1 over the whole batch


def policy_loss(logp, old_logp, adv, weights, clip_eps: float):
    """Clipped importance-ratio surrogate (PPO). With old_logp == logp.detach() the ratio is
    exactly 1 and this is the plain policy gradient."""
    ratio = torch.exp(logp - old_logp)  # [n, T]
    surr = torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip_eps, 1 + clip_eps))
    clipped = ((ratio - 1).abs() > clip_eps).float()
    return (surr * weights).sum(), {"ratio": (ratio * weights).sum().detach(), "clip_frac": (clipped * weights).sum()}


def value_loss(values, returns, weights):
    return 0.5 * (((values - returns) ** 2) * weights).sum()


def kl_k3(logp, ref_logp):
    """Schulman's k3 estimator of KL(policy || ref) per token: unbiased, always >= 0, low variance."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1
