"""How long a run takes to end, and to save its steps, once stopped, against what it used to wait for.

An async trainer (`--role trainer --workers 1`, tiny model without its warm-start, so completions run to
--max-new-tokens) runs in a session of its own, as a shell starts it. Two ends are timed, --repeats times:
- "second Ctrl-C": two SIGINTs 0.5 s apart while the worker is generating; seconds from the first
  to the trainer's exit (the worker then generates a batch nobody takes);
- "end of run": --steps 2; seconds from the final checkpoint to the trainer's exit.
The peer, measured in the same runs: the seconds of a step (wall_s between step 1's and step 2's loss;
with --max-staleness 0 mostly one worker batch), about what a trainer that waits for its workers' batches
instead of stopping them waits at either end (it gave up at 60 s).
A third case is a sync run (no workers, --ckpt-every 1000):
- "SIGTERM mid-rollout": SIGTERM 1 s (a tenth of a step, if less) into step 4's rollout; seconds from it
  to step 3's checkpoint on disk (saved at once), and, its peer in the same run, to step 4's, the first
  checkpoint a stop gave before (a scheduler's SIGKILL in between lost every step since the last checkpoint).

    python bench/stop.py [--repeats 3] [--max-new-tokens 1000]

Writes results/stop.json.
"""
import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import rundir  # noqa: E402  (the repo root, as train.py sees it)


def launch(out: Path, steps: int, max_new: int, sync: bool = False) -> subprocess.Popen:
    flags = ["--task", "arith", "--steps", str(steps), "--eval-every", "100", "--eval-size", "4",
             "--max-new-tokens", str(max_new), "--batch", "16", "--group-size", "2", "--no-progress",
             "--out", str(out), "--sft-steps", "0"]  # random init: completions run to the budget
    trainer = ["--role", "trainer", "--workers", "1", "--max-staleness", "0", "--ckpt-every", "1"]
    flags += ["--ckpt-every", "1000"] if sync else trainer
    return subprocess.Popen([sys.executable, "train.py", *flags], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def wait_until(cond, proc: subprocess.Popen) -> None:
    while not cond():
        if proc.poll() is not None:
            sys.exit(f"the trainer exited early ({proc.returncode})")
        time.sleep(0.05)


def step_s(out: Path) -> list[float]:
    walls = [w for _, w, _ in rundir.read_metrics(out / "metrics.csv").get("loss", [])]
    return [b - a for a, b in zip(walls, walls[1:])]


def second_ctrl_c(out: Path, max_new: int) -> tuple[float, list[float]]:
    proc = launch(out, 1000, max_new)
    wait_until(lambda: (out / "ckpt-0000001").exists(), proc)  # step 1 is in (--ckpt-every 1)
    time.sleep(1.0)  # the worker is generating step 2's batch
    t = time.perf_counter()
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=300) == 130
    return time.perf_counter() - t, []


def end_of_run(out: Path, max_new: int) -> tuple[float, list[float]]:
    proc = launch(out, 2, max_new)
    wait_until(lambda: (out / "ckpt-0000002").exists(), proc)
    t = time.perf_counter()
    assert proc.wait(timeout=300) == 0
    return time.perf_counter() - t, step_s(out)


def sigterm_mid_rollout(out: Path, max_new: int) -> tuple[float, float]:
    proc = launch(out, 1000, max_new, sync=True)
    wait_until(lambda: (out / "metrics.csv").exists() and len(step_s(out)) >= 2, proc)  # steps 1-3 are done
    step = min(step_s(out))
    into = min(1.0, step / 10)  # into step 4's rollout: a step's first ~25% (4 tokens) to 50%
    time.sleep(into)
    t = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    saved: dict[str, float] = {}  # checkpoint -> seconds after the SIGTERM (--ckpt-every 1000: the stop's)
    while proc.poll() is None or len(saved) < len(rundir.checkpoints(out)):
        for ckpt in rundir.checkpoints(out):
            saved.setdefault(ckpt.name, time.perf_counter() - t)
        time.sleep(0.05)
    if proc.returncode != 130:  # stopped: not finished
        sys.exit(f"the trainer exited {proc.returncode} after the SIGTERM; expected 130 (stopped)")
    if len(saved) != 2:  # the last finished step at once, then the step in progress at its end
        sys.exit(f"--max-new-tokens {max_new}: the SIGTERM {into:.2f} s into a step of {step:.2f} s "
                 "came after its rollout, so nothing was saved early; a longer budget makes a longer rollout")
    early, late = sorted(saved.values())
    return early, late


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    # the tiny model's context is 1,024 tokens: a budget that leaves no room for the prompt is refused
    ap.add_argument("--max-new-tokens", type=int, default=1000)
    args = ap.parse_args()
    for flag, value in (("--repeats", args.repeats), ("--max-new-tokens", args.max_new_tokens)):
        if value < 1:  # no run to take a median of, or no token to generate: before minutes of the others
            ap.exit(2, f"error: {flag} {value}: need at least 1\n")
    results, batches = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in (("second Ctrl-C", second_ctrl_c), ("end of run", end_of_run)):
            exits = []
            for i in range(args.repeats):
                out = Path(tmp) / f"{fn.__name__}-{i}"
                s, r = fn(out, args.max_new_tokens)
                exits.append(s)
                batches += r
                shutil.rmtree(out)
            results[name] = {"exit_s_median": statistics.median(exits), "exit_s": exits}
            print(f"{name}: exit {statistics.median(exits):.1f} s after it (median of "
                  f"{[round(e, 1) for e in exits]})")
        results["step_s_median"] = statistics.median(batches)  # the end-of-run runs' step 2
        print(f"peer: a step (mostly one worker batch) takes {results['step_s_median']:.1f} s")
        runs = [sigterm_mid_rollout(Path(tmp) / f"sync-{i}", args.max_new_tokens)
                for i in range(args.repeats)]
        early, late = (statistics.median(r[i] for r in runs) for i in (0, 1))
        results["SIGTERM mid-rollout"] = {"finished_steps_saved_s_median": early,
                                          "step_end_saved_s_median": late, "runs": runs}
        print(f"SIGTERM mid-rollout (sync): the finished steps on disk {early:.2f} s after it; the step in "
              f"progress, the first checkpoint before, {late:.1f} s after it (medians)")
    (ROOT / "results").mkdir(exist_ok=True)
    (ROOT / "results" / "stop.json").write_text(json.dumps({"max_new_tokens": args.max_new_tokens,
                                                            **results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
