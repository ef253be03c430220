"""Environments. CartPole comes from gymnasium, stepped as one vectorised numpy env so a whole
batch of episodes advances with one policy forward per time step; that batching, not the
algorithm, is what makes CartPole train in seconds.

A rollout returns a batch dict of [N, T] tensors (see train.py for the keys).
"""
from __future__ import annotations

import numpy as np
import torch
from gymnasium.envs.classic_control.cartpole import CartPoleVectorEnv

EVAL_SEED = 1_000_000_000  # eval seeds live above this; training seeds stay below it


class CartPole:
    """CartPole-v1: +1 per step, terminal when the pole falls, truncated (not terminal) at 500."""

    obs_dim, n_actions = 4, 2

    def __init__(self, max_steps: int = 500):
        self.max_steps = max_steps

    def rollout(self, policy, n: int, seed: int, group_size: int = 1, greedy: bool = False) -> dict:
        """Runs n episodes in lockstep from `seed`. Episodes in the same group of `group_size`
        start from the same state, so GRPO/RLOO compare like with like."""
        env = CartPoleVectorEnv(num_envs=n, max_episode_steps=self.max_steps)
        obs, _ = env.reset(seed=seed)
        leader = np.arange(n) // group_size * group_size
        env.state = env.state[:, leader]  # [4, n]: every member copies its group leader
        obs = env.state.T.astype(np.float32)
        T = self.max_steps
        obs_buf = np.zeros((T, n, self.obs_dim), np.float32)
        act_buf = np.zeros((T, n), np.int64)
        logp_buf = np.zeros((T, n), np.float32)
        alive_buf = np.zeros((T, n), np.float32)
        alive = np.ones(n, bool)
        terminated = np.zeros(n, bool)
        last_obs = np.zeros((n, self.obs_dim), np.float32)
        for t in range(T):
            actions, logp, _ = policy.act(torch.from_numpy(obs), greedy=greedy)
            obs_buf[t], act_buf[t], logp_buf[t], alive_buf[t] = obs, actions.numpy(), logp.numpy(), alive
            obs, _, term, trunc, _ = env.step(actions.numpy())
            ended = alive & (term | trunc)
            terminated |= alive & term
            last_obs[ended] = obs[ended]  # the state after the final step, for bootstrapping
            alive &= ~ended
            if not alive.any():
                break
        T = t + 1
        mask = torch.from_numpy(alive_buf[:T].T.copy())  # [N, T]
        batch = {
            "obs": torch.from_numpy(obs_buf[:T].transpose(1, 0, 2).copy()),  # [N, T, 4]
            "actions": torch.from_numpy(act_buf[:T].T.copy()),  # [N, T]
            "logp": torch.from_numpy(logp_buf[:T].T.copy()) * mask,  # [N, T]
            "mask": mask,
            "rewards": mask.clone(),  # +1 for every step the pole is up
            "terminated": torch.from_numpy(terminated),  # [N]
            "last_obs": torch.from_numpy(last_obs),  # [N, 4]
            "group": torch.from_numpy(leader),  # [N]
        }
        return batch
