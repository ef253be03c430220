"""On-policy distillation vs RL on arith_chain with the tiny model (a CPU-sized stand-in for the
real-model comparison). The teacher is a checkpoint of an RL run (full fine-tuning), exported as a
model directory that --teacher loads:

    python bench/opd.py RUN_OR_CKPT OUT_DIR    # a checkpoint (a run: its newest) -> a model directory
    python bench/opd.py plot OUT label=RUN ...  # accuracy against steps and wall time, metrics copied
"""
import shutil
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import rundir  # noqa: E402
from modeldir import build_tiny_model  # noqa: E402


def export(run: str, out: str) -> str:
    """The tiny model's directory with its weights replaced by a checkpoint's (a run's newest)."""
    found = [Path(run)] if (Path(run) / "weights.safetensors").exists() else rundir.checkpoints(Path(run))
    if not found:
        raise SystemExit(f"error: {run}: no checkpoint here; give a run directory or one of its ckpt-*")
    ckpt = found[-1]
    weights = load_file(str(ckpt / "weights.safetensors"))
    if not all(k.startswith("model.") for k in weights) or any("lora_" in k for k in weights):
        raise SystemExit(f"{run}: not a full fine-tuning run of the tiny model (--no-lora)")
    shutil.copytree(build_tiny_model(), out, dirs_exist_ok=True)
    save_file({k[len("model."):]: v.contiguous() for k, v in weights.items()}, f"{out}/model.safetensors",
              metadata={"format": "pt"})
    return out




def plot(out: str, runs: dict[str, str]) -> None:
    """Held-out accuracy against RL/OPD steps and against wall seconds since step 0, one line per run
    (label -> run directory); each run's metrics.csv is copied to OUT/<label>.csv."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Path(out).mkdir(parents=True, exist_ok=True)
    fig, (by_step, by_wall) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for label, run in runs.items():
        shutil.copy(Path(run) / "metrics.csv", Path(out) / f"{label}.csv")
        acc = [(s, w, v) for s, w, v in rundir.read_metrics(Path(run) / "metrics.csv")["eval_accuracy"] if s >= 0]
        start = acc[0][1]
        by_step.plot([s for s, _, _ in acc], [v for *_, v in acc], marker=".", label=label)
        by_wall.plot([w - start for _, w, _ in acc], [v for *_, v in acc], marker=".", label=label)
    by_step.set(xlabel="step (after the shared start)", ylabel="held-out greedy accuracy")
    by_wall.set(xlabel="wall seconds since step 0")
    by_step.legend()
    fig.tight_layout()
    fig.savefig(Path(out) / "curve.png", dpi=100)


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] in ("-h", "--help"):  # usage; exit 2 when arguments are missing
        print(__doc__)
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    if sys.argv[1] == "plot":  # python bench/opd.py plot OUT label=RUN ...
        plot(sys.argv[2], dict(a.split("=", 1) for a in sys.argv[3:]))
    else:
        print(export(*sys.argv[1:3]))
