"""The benchmarks in bench/ with small and wrong arguments, as a user tries them first: a setting they cannot
measure stops in one line that names the fix, before any child process or run starts."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def bench(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def test_memory_refuses_rows_that_are_not_whole_groups_in_one_line():
    """countdown's GRPO groups are 8 completions: 4 rows held no group (a crash), 12 rows held one (8 rows
    measured as 12). Neither starts a child or writes a results file."""
    for rows, fix in ((4, 8), (12, 8)):
        proc = bench("bench/memory.py", "--model", "tiny", "--rows", str(rows), "--tokens", "8")
        assert (proc.returncode, proc.stdout) == (2, "")
        assert proc.stderr == (f"error: --rows {rows}: whole groups of 8 completions (a GRPO group); "
                               f"try --rows {fix}\n")
        assert not (ROOT / "results" / f"memory_tiny_{rows}x8.json").exists()
    proc = bench("bench/memory.py", "--model", "tiny", "--rows", "8", "--micro", "0,x")
    assert proc.returncode == 2 and proc.stderr.startswith("error: --micro 0,x: rows per micro-batch")
    assert proc.stderr.count("\n") == 1


def test_memory_when_every_setting_fails_names_the_first_error_in_one_line():
    """2,000 new tokens leave no room for a prompt in the tiny model's 1,024 positions: the child says
    so, and the parent ends on that line (it crashed on the median of no measurements)."""
    proc = bench("bench/memory.py", "--model", "tiny", "--rows", "8", "--tokens", "2000", "--micro", "0")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr == ("error: every setting failed, the first with: utils.ConfigError: "
                           "--task countdown: --max-new-tokens 2000 leaves no room for a prompt in the "
                           "model's 1,024-token context; lower it\n")
    assert not (ROOT / "results" / "memory_tiny_8x2000.json").exists()
