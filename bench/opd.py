"""On-policy distillation vs RL on arith_chain with the tiny model (a CPU-sized stand-in for the
real-model comparison). The teacher is a checkpoint of an RL run (full fine-tuning), exported as a
model directory that --teacher loads:

    python bench/opd.py RUN_OR_CKPT OUT_DIR    # a checkpoint (a run: its newest) -> a model directory
"""
import shutil
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import utils  # noqa: E402
from model import build_tiny_model  # noqa: E402


def export(run: str, out: str) -> str:
    """The tiny model's directory with its weights replaced by a checkpoint's (a run's newest)."""
    ckpt = Path(run) if (Path(run) / "weights.safetensors").exists() else utils.latest_checkpoint(Path(run))
    weights = load_file(str(ckpt / "weights.safetensors"))
    if not all(k.startswith("model.") for k in weights) or any("lora_" in k for k in weights):
        raise SystemExit(f"{run}: not a full fine-tuning run of the tiny model (--no-lora)")
    shutil.copytree(build_tiny_model(), out, dirs_exist_ok=True)
    save_file({k[len("model."):]: v.contiguous() for k, v in weights.items()}, f"{out}/model.safetensors",
              metadata={"format": "pt"})
    return out


if __name__ == "__main__":
    print(export(*sys.argv[1:3]))
