"""The benchmarks in bench/ with small and wrong arguments, as a user tries them first: a setting they cannot
measure stops in one line that names the fix, before any child process or run starts."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import rundir

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def bench(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def test_memory_refuses_rows_that_are_not_whole_groups_in_one_line(script):
    """countdown's GRPO groups are 8 completions: 4 rows held no group (a crash), 12 rows held one (8 rows
    measured as 12). Neither starts a child or writes a results file."""
    for rows, fix in ((4, 8), (12, 8)):
        proc = script("bench/memory.py", "--model", "tiny", "--rows", str(rows), "--tokens", "8")
        assert (proc.returncode, proc.stdout) == (2, "")
        assert proc.stderr == (f"error: --rows {rows}: whole groups of 8 completions (a GRPO group); "
                               f"try --rows {fix}\n")
        assert not (ROOT / "results" / f"memory_tiny_{rows}x8.json").exists()
    proc = script("bench/memory.py", "--model", "tiny", "--rows", "8", "--micro", "0,x")
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


def test_stop_mid_rollout_case_saves_the_finished_step_then_the_one_in_progress_at_8_tokens(tmp_path):
    """At 8 new tokens a sync step's rollout is over well before the case's SIGTERM 1 s after step 1, so
    the stop came in the update, saved only that step, and the case took the trainer's exit for a crash.
    Now the SIGTERM comes a tenth of a step into a rollout: the step before is saved at once, then this."""
    spec = importlib.util.spec_from_file_location("bench_stop", ROOT / "bench" / "stop.py")
    stop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stop)
    early, late = stop.sigterm_mid_rollout(tmp_path / "run", 8)
    assert 0 <= early <= late
    first, second = rundir.checkpoints(tmp_path / "run")
    steps = [json.loads((c / "meta.json").read_text())["step"] for c in (first, second)]
    assert steps[0] >= 3 and steps[1] == steps[0] + 1  # steps 1-3 logged before the SIGTERM
    losses = rundir.read_metrics(tmp_path / "run" / "metrics.csv")["loss"]
    assert [s for s, _, _ in losses] == list(range(1, steps[1] + 1))  # the step in progress finished, no more


def test_stop_refuses_no_repeats_or_no_tokens_in_one_line(script):
    """--repeats 0 ran the async cases' trainers, then crashed on the median of no runs."""
    for flag in ("--repeats", "--max-new-tokens"):
        proc = script("bench/stop.py", flag, "0")
        assert (proc.returncode, proc.stderr) == (2, f"error: {flag} 0: need at least 1\n")


def test_cartpole_refuses_an_unknown_algo_in_one_line_before_any_run(script):
    """A typo'd --only name ran the other seeds first, then raised CalledProcessError (no preset)."""
    proc = script("bench/cartpole.py", "--only", "reinforce", "reinfroce", "--no-sb3", "--seeds", "1")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == ("error: --only reinfroce: no configs/cartpole_<algo>.yaml; choices: reinforce "
                           "reinforce_baseline reinforce_pp ppo grpo rloo\n")


def test_envs_refuses_too_few_calls_problems_or_groups_in_one_line(script):
    """--calls 1 played every environment, then crashed in statistics.quantiles (it needs 2 points)."""
    for flag, value, least in (("--calls", 1, 2), ("--problems", 0, 1), ("--group-size", 0, 1)):
        proc = script("bench/envs.py", flag, str(value))
        assert (proc.returncode, proc.stderr) == (2, f"error: {flag} {value}: need at least {least}\n")


def test_opd_export_of_a_directory_without_checkpoints_says_so_in_one_line(tmp_path, script):
    """It raised IndexError on the empty list of the directory's checkpoints."""
    proc = script("bench/opd.py", str(tmp_path / "nothing"), str(tmp_path / "out"))
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr == (f"error: {tmp_path / 'nothing'}: no checkpoint here; give a run directory or one "
                           "of its ckpt-*\n")
    assert not (tmp_path / "out").exists()


def test_variants_refuses_a_set_without_value_or_bad_seeds_in_one_line(script):
    """`--set foo` and `--seeds ''` raised ValueError tracebacks from dict() and int()."""
    proc = script("bench/variants.py", "--set", "foo")
    assert (proc.returncode, proc.stderr) == (2, "error: --set foo: give key=value, e.g. --set batch=16\n")
    proc = script("bench/variants.py", "--seeds", "0,,1")
    assert (proc.returncode, proc.stderr) == (2, "error: --seeds '0,,1': comma-separated integers, e.g. "
                                                 "--seeds 0,1,2\n")


def test_generate_refuses_zero_repeats_in_one_line(tmp_path, script):
    """--repeats 0 loaded the model and sampled the warm-up, then crashed on the median of no rates."""
    proc = script("bench/generate.py", "--repeats", "0", "--prompts", "1", "--samples", "1", "--tokens", "1",
                  "--out", str(tmp_path / "g.json"))
    assert (proc.returncode, proc.stderr) == (2, "error: --repeats 0: need at least 1\n")
    assert not (tmp_path / "g.json").exists()
