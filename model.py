"""Policies. Every policy is an nn.Module with the same scoring protocol:

    score(batch, rows) -> (logp [n, T], entropy [n, T], values [n, T] or None)

recomputes, with grad, the log-probability of the actions stored in `batch[...][rows]`, so the
training loop never needs to know whether it is pushing a cart or writing an answer.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


class MLPPolicy(nn.Module):
    """Categorical policy for control tasks; PPO gets a critic with its own trunk, because a
    shared trunk lets the value loss (returns of ~100) drown the policy gradient."""

    def __init__(self, obs_dim: int, n_actions: int, hidden: int = 64, critic: bool = False):
        super().__init__()
        self.pi = mlp([obs_dim, hidden, hidden, n_actions])
        self.v = mlp([obs_dim, hidden, hidden, 1]) if critic else None
        self.has_critic = critic

    @torch.no_grad()
    def act(self, obs: torch.Tensor, greedy: bool = False):
        """obs [B, D] -> actions [B], logp [B], values [B] or None."""
        logits = self.pi(obs)  # [B, A]
        dist = torch.distributions.Categorical(logits=logits)
        actions = logits.argmax(-1) if greedy else dist.sample()
        return actions, dist.log_prob(actions), self.value(obs)

    def value(self, obs: torch.Tensor) -> torch.Tensor | None:
        return None if self.v is None else self.v(obs).squeeze(-1)

    def score(self, batch: dict, rows: slice):
        obs = batch["obs"][rows]  # [n, T, D]
        logp_all = F.log_softmax(self.pi(obs), dim=-1)  # [n, T, A]
        logp = logp_all.gather(-1, batch["actions"][rows].unsqueeze(-1)).squeeze(-1)  # [n, T]
        entropy = -(logp_all.exp() * logp_all).sum(-1)  # [n, T]
        return logp, entropy, self.value(obs)
