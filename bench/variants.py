"""Held-out accuracy of the RLVR loss variants after a fixed budget, on the CPU learning task.

    python bench/variants.py                                   # 6 variants x 3 seeds, the preset's steps
    python bench/variants.py --steps 4 --seeds 0 --set eval_size=8 --set batch=16   # a smoke test

Every run is `train.py --config configs/arith_tiny_cpu.yaml` plus the variant's overrides plus
COMMON (two passes over each batch, so that the ratio leaves 1 and the clipping rules differ at
all: with one on-policy pass PPO, clip-higher and GRPO are the same update). The score is the
last greedy eval_accuracy of each run; the table gives the mean, the sample std and min-max over
seeds. Runs are separate processes (`--jobs` at a time), one torch thread each.
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMON = {"inner_epochs": 2}
VARIANTS = {  # name -> Config overrides (train.py documents each field)
    "GRPO": {"algo": "grpo"},
    "Dr. GRPO": {"algo": "grpo", "dr_grpo": True, "loss_agg": "constant"},
    "RLOO": {"algo": "rloo"},
    "clip-higher": {"algo": "grpo", "eps_high": 0.28},
    "GSPO": {"algo": "grpo", "loss": "gspo", "eps_low": 3e-4, "eps_high": 4e-4, "loss_agg": "seq_mean"},
    "CISPO": {"algo": "grpo", "loss": "cispo", "eps_low": 1.0, "eps_high": 2.0},
}


def flags(overrides: dict) -> list[str]:
    out = []
    for key, value in overrides.items():
        flag = "--" + key.replace("_", "-")
        out += ([flag] if value else ["--no-" + flag[2:]]) if isinstance(value, bool) else [flag, str(value)]
    return out


def run(name: str, seed: int, args) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / args.config), "--seed", str(seed),
               "--out", tmp, "--no-progress", *flags({**COMMON, **VARIANTS[name], **args.set})]
        if args.steps:
            cmd += ["--steps", str(args.steps), "--eval-every", str(args.steps)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # tiny matmuls: one thread per run, runs side by side
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode:
            raise SystemExit(f"{name} seed {seed} failed:\n{done.stderr[-2000:]}")
        with open(Path(tmp) / "metrics.csv") as f:
            accuracy = [float(r["value"]) for r in csv.DictReader(f) if r["key"] == "eval_accuracy"][-1]
        print(f"{name} seed {seed}: {accuracy:.3f}", file=sys.stderr, flush=True)  # partial results survive a cut-off
        return accuracy


def table(scores: dict[str, list[float]], title: str) -> str:
    lines = [title, "", "| variant | accuracy mean | std | min-max | seeds |", "|---|---|---|---|---|"]
    for name, xs in scores.items():
        std = statistics.stdev(xs) if len(xs) > 1 else float("nan")
        lines.append(f"| {name} | {statistics.mean(xs):.3f} | {std:.3f} | {min(xs):.2f}-{max(xs):.2f} | {len(xs)} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/arith_tiny_cpu.yaml")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=0, help="0 = the preset's steps")
    p.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    p.add_argument("--set", action="append", default=[], help="key=value Config override for every run")
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    p.add_argument("--out", default="", help="also write the table to this markdown file")
    args = p.parse_args()
    if bad := [kv for kv in args.set if "=" not in kv]:  # dict() of it: a traceback
        p.exit(2, f"error: --set {bad[0]}: give key=value, e.g. --set batch=16\n")
    if not all(s.strip().isdigit() for s in args.seeds.split(",")):
        p.exit(2, f"error: --seeds {args.seeds!r}: comma-separated integers, e.g. --seeds 0,1,2\n")
    args.set = dict(kv.split("=", 1) for kv in args.set)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(VARIANTS)
    unknown = set(names) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variant(s) {sorted(unknown)}; choices: {', '.join(VARIANTS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    jobs = [(n, s) for n in names for s in seeds]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda job: run(*job, args), jobs))
    scores = {n: [r for (m, _), r in zip(jobs, results) if m == n] for n in names}
    budget = f"{args.steps} steps" if args.steps else "the preset's steps"
    extra = ", ".join(f"{k}={v}" for k, v in {**COMMON, **args.set}.items())
    out = table(scores, f"Held-out greedy accuracy, `{args.config}` + {extra}, {budget}, seeds {args.seeds}")
    print(out)
    if args.out:
        Path(args.out).write_text(out + "\n")


if __name__ == "__main__":
    main()
