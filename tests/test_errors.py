"""Every user-facing error (config, data, model, checkpoint) is one line naming the fix, exit code
2, never a traceback."""
import subprocess
import sys
from pathlib import Path

import pytest

import train

ROOT = Path(__file__).resolve().parent.parent
MIXED = str(ROOT / "tests" / "data" / "gsm8k_mixed.jsonl")  # 9 good rows
LLM = ["--task", "arith", "--model", "tiny", "--no-progress"]


def one_line_error(capsys, argv) -> str:
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()  # above it, at most a model-loading progress bar
    assert err[-1].startswith("error: ") and sum("rror" in line for line in err) == 1, err
    assert not any("Traceback" in line for line in err), err
    return err[-1]


@pytest.mark.parametrize("argv, fix", [
    (["--task", "cartpole", "--sft-steps", "5"], "--sft-steps is for LLM tasks"),
    (LLM + ["--gen-batch", "0"], "need --gen-batch >= 1 (got 0)"),
    (LLM + ["--gen-batch", "-1"], "need --gen-batch >= 1 (got -1)"),
    (LLM + ["--eval-size", "0"], "need --eval-size >= 1 (got 0)"),
    (["--eval-every", "0"], "need --eval-every >= 1 (got 0)"),
    (LLM + ["--max-new-tokens", "0"], "need --max-new-tokens >= 1 (got 0)"),
    (["--steps", "-3"], "need --steps >= 0 (got -3)"),
    (["--workers", "2"], "are for --role trainer"),
    (LLM + ["--role", "trainer", "--algo", "ppo"], "use --role sync, or a critic-free --algo"),
    (LLM + ["--overlong-buffer", "999", "--max-new-tokens", "8"], "in 1..--max-new-tokens"),
])
def test_bad_flags_stop_in_one_line_naming_the_fix(capsys, argv, fix):
    assert fix in one_line_error(capsys, argv)


@pytest.mark.parametrize("argv, fix", [
    (["--task", "gsm8k", "--data", MIXED, "--eval-size", "9"], "leaves no training problems"),
    (["--task", "gsm8k", "--data", "no/such/file.jsonl"], "--task gsm8k: "),
    (["--task", "arith", "--data", MIXED], "drop --data"),
])
def test_task_data_errors_stop_in_one_line(capsys, tmp_path, argv, fix):
    err = one_line_error(capsys, ["--model", "tiny", "--no-progress", "--out", str(tmp_path / "r"), *argv])
    assert fix in err


def test_resume_of_another_policy_names_the_runs_own_config(capsys, tmp_path):
    out = tmp_path / "run"
    assert train.main(["--out", str(out), "--steps", "1", "--batch", "4", "--eval-episodes", "1", "--hidden", "16",
                       "--no-progress"]) == 0
    capsys.readouterr()
    err = one_line_error(capsys, ["--resume", str(out), "--steps", "2", "--batch", "4", "--no-progress"])
    assert f"--config {out / 'config.yaml'} --resume {out}" in err


def test_the_command_line_prints_no_traceback():
    run = subprocess.run([sys.executable, "train.py", "--task", "cartpole", "--sft-steps", "5"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
