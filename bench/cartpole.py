"""Time-to-solve CartPole: nanorl's algorithms vs Stable-Baselines3 PPO, in one run.

    python bench/cartpole.py --seeds 5            # all nanorl configs + SB3 PPO
    python bench/cartpole.py --only reinforce     # one config (plus SB3)

"Solved" = the greedy eval over 10 held-out episodes averages >= 475. For each run we report
training wall seconds until solved (the loop's own clock, from step 0), whole-process seconds
(imports included) and environment steps until solved. SB3 PPO uses rl-zoo's CartPole-v1
hyperparameters and the same batched greedy eval on the same held-out seeds, every 2,048 env
steps (about as often as nanorl evaluates). Needs `pip install stable-baselines3` for the peer.
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALGOS = ["reinforce", "reinforce_baseline", "reinforce_pp", "ppo", "grpo", "rloo"]
TARGET = 475.0


def run_nanorl(algo: str, seed: int, max_seconds: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / f"configs/cartpole_{algo}.yaml"),
               "--seed", str(seed), "--target", str(TARGET), "--out", tmp, "--no-progress", "--steps", "400"]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, timeout=max_seconds)
        process_s = time.perf_counter() - t0
        env_steps, solved = 0.0, None
        with open(Path(tmp) / "metrics.csv") as f:
            for row in csv.DictReader(f):
                if row["key"] == "steps_env":
                    env_steps += float(row["value"])
                if row["key"] == "eval_return" and int(row["step"]) > 0 and float(row["value"]) >= TARGET and solved is None:
                    solved = {"train_s": float(row["wall_s"]), "env_steps": env_steps}
    return {"process_s": process_s, **(solved or {"train_s": float("nan"), "env_steps": float("nan")})}


def sb3_worker(seed: int) -> None:
    """Runs in its own process so its imports count in process_s just as nanorl's do."""
    import numpy as np
    import torch
    from gymnasium.envs.classic_control.cartpole import CartPoleVectorEnv
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    sys.path.insert(0, str(ROOT))
    from envs import EVAL_SEED

    def greedy_eval(model) -> float:
        env = CartPoleVectorEnv(num_envs=10)
        obs, _ = env.reset(seed=EVAL_SEED)
        alive, total = np.ones(10, bool), np.zeros(10)
        for _ in range(500):
            action, _ = model.predict(obs, deterministic=True)
            obs, r, term, trunc, _ = env.step(action)
            total += r * alive
            alive &= ~(term | trunc)
            if not alive.any():
                break
        return float(total.mean())

    class StopWhenSolved(BaseCallback):
        def __init__(self):
            super().__init__()
            self.next_eval, self.solved = 2048, None

        def _on_step(self) -> bool:
            if self.num_timesteps >= self.next_eval:
                self.next_eval += 2048
                if greedy_eval(self.model) >= TARGET:
                    self.solved = {"train_s": time.perf_counter() - t0, "env_steps": self.num_timesteps}
                    return False
            return True

    def linear(start):
        return lambda progress: progress * start

    torch.manual_seed(seed)
    torch.set_num_threads(1)  # same setting nanorl uses; two threads on this MLP slow SB3 down too
    env = make_vec_env("CartPole-v1", n_envs=8, seed=seed)
    model = PPO("MlpPolicy", env, n_steps=32, batch_size=256, gae_lambda=0.8, gamma=0.98, n_epochs=20,
                ent_coef=0.0, learning_rate=linear(0.001), clip_range=linear(0.2), seed=seed, verbose=0)
    cb = StopWhenSolved()
    t0 = time.perf_counter()
    model.learn(total_timesteps=100_000, callback=cb)  # rl-zoo's budget
    print(json.dumps(cb.solved or {"train_s": float("nan"), "env_steps": float("nan")}))


def run_sb3(seed: int, max_seconds: float) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, "--sb3-worker", str(seed)], check=True, capture_output=True,
                         text=True, timeout=max_seconds)
    return {"process_s": time.perf_counter() - t0, **json.loads(out.stdout.strip().splitlines()[-1])}


def summary(name: str, runs: list[dict]) -> dict:
    solved = [r for r in runs if r["train_s"] == r["train_s"]]
    med = lambda k: statistics.median(r[k] for r in solved) if solved else float("nan")
    return {"name": name, "solved": f"{len(solved)}/{len(runs)}", "train_s": med("train_s"),
            "min": min((r["train_s"] for r in solved), default=float("nan")),
            "max": max((r["train_s"] for r in solved), default=float("nan")),
            "process_s": med("process_s"), "env_steps": med("env_steps")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--only", nargs="*", default=ALGOS)
    ap.add_argument("--no-sb3", action="store_true")
    ap.add_argument("--max-seconds", type=float, default=300)
    ap.add_argument("--sb3-worker", type=int, default=None)
    args = ap.parse_args()
    if args.sb3_worker is not None:
        return sb3_worker(args.sb3_worker)
    if unknown := [name for name in args.only if name not in ALGOS]:  # else a traceback after the others ran
        ap.exit(2, f"error: --only {' '.join(unknown)}: no configs/cartpole_<algo>.yaml; choices: "
                   f"{' '.join(ALGOS)}\n")
    if not args.no_sb3 and importlib.util.find_spec("stable_baselines3") is None:  # before the nanorl runs
        ap.error("the SB3 peer needs `pip install stable-baselines3`; or run without it: --no-sb3")
    rows = []
    peers = [] if args.no_sb3 else ["sb3_ppo"]
    # Interleave seeds across contenders so that machine noise hits all of them alike.
    results: dict[str, list] = {name: [] for name in list(args.only) + peers}
    for seed in range(args.seeds):
        for name in results:
            r = run_sb3(seed, args.max_seconds) if name == "sb3_ppo" else run_nanorl(name, seed, args.max_seconds)
            results[name].append(r)
            print(f"{name:20s} seed {seed}: train {r['train_s']:.2f} s, process {r['process_s']:.2f} s, "
                  f"env steps {r['env_steps']:.0f}", file=sys.stderr, flush=True)
    rows = [summary(name, runs) for name, runs in results.items()]
    print("| run | seeds solved | median train s (min-max) | median process s | median env steps |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['solved']} | {r['train_s']:.2f} ({r['min']:.2f}-{r['max']:.2f}) | "
              f"{r['process_s']:.2f} | {r['env_steps']:.0f} |")
    if "sb3_ppo" in results and "reinforce" in results:
        sb3, ours = rows[-1], next(r for r in rows if r["name"] == "reinforce")
        print(f"\nreinforce / sb3_ppo median train time: {ours['train_s'] / sb3['train_s']:.2f}x; "
              f"process time: {ours['process_s'] / sb3['process_s']:.2f}x")


if __name__ == "__main__":
    main()
