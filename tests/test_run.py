"""Around a run: --help, resuming from the run alone (damaged checkpoints, a SIGKILL in each phase),
TensorBoard and W&B loggers, the end-of-run summary."""
import collections
import errno
import functools
import importlib
import itertools
import json
import multiprocessing
import os
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401 (torch.optim imports it on first use, seconds here: forked runs then start at once)
import yaml
from safetensors.torch import load_file

import report
import rundir
import train
import utils
from model import MLPPolicy

ROOT = Path(__file__).parent.parent


def cartpole(out, *argv):
    """A few fast CartPole steps (the run stops early only if solved, the same way every time)."""
    return [sys.executable, "train.py", "--task", "cartpole", "--out", str(out), "--no-progress", "--batch", "4",
            "--eval-episodes", "2", "--eval-every", "2", *argv]


def run(argv, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env, **kw)


def rows(out: Path) -> list[tuple[int, str]]:
    return [(s, k) for k, pts in rundir.read_metrics(out / "metrics.csv").items() for s, _, _ in pts]


def final_weights(out: Path) -> dict:
    return load_file(str(rundir.checkpoints(out)[-1] / "weights.safetensors"))


def test_help_shows_each_fields_comment_default_and_choices_grouped_as_in_config():
    text = run([sys.executable, "train.py", "--help"]).stdout
    flat = " ".join(text.split())  # argparse wraps lines
    assert "--lr FLOAT CartPole REINFORCE, 8 seeds: 5e-3 solved all" in flat and "(default: 0.005)" in flat
    assert "choices: reinforce, reinforce_baseline, reinforce_pp, ppo, grpo, rloo, opd; default: 'reinforce'" in flat
    assert "--lora, --no-lora LoRA: ~1% of the weights train" in flat  # a % in a comment survives argparse
    sections = ["run:", "cartpole (LLM tasks refuse these):", "LLM tasks (cartpole refuses these):", "torchrun (",
                "LLM tasks: disaggregated"]
    positions = [text.index("\n" + s) for s in sections]
    assert positions == sorted(positions) and text.index("\n  --model ") > positions[2] > text.index("\n  --hidden ")
    assert positions[1] > text.index("\n  --steps ")


def test_resume_skips_a_checkpoint_without_what_nanorl_writes(tmp_path, capsys):
    policy = MLPPolicy(4, 2)
    opt = torch.optim.Adam(policy.parameters())
    for step in (1, 2):
        rundir.save_checkpoint(tmp_path, step, policy, opt, {"wall_s": 0.0, "source": {"position": step}}, keep=3)
    (tmp_path / "ckpt-0000002" / "meta.json").write_text('{"step": 2}')  # valid JSON of another format
    assert rundir.resume_checkpoint(tmp_path, policy, opt)["source"] == {"position": 1}
    err = capsys.readouterr().err
    assert f"skipping {tmp_path / 'ckpt-0000002'}: KeyError: 'meta.json or state.pt lacks" in err


@pytest.mark.parametrize("part, craft", [
    ("state", lambda s: {**s, "torch_rng": torch.zeros(5, dtype=torch.uint8)}),  # loaded all but the RNG
    ("state", lambda s: {**s, "torch_rng": torch.zeros(1, 5056, dtype=torch.uint8)}),  # no mt19937 state
    ("state", lambda s: {**s, "optimizer": {"state": {}, "param_groups": []}}),  # ValueError's traceback
    ("state", lambda s: {**s, "optimizer": {**s["optimizer"], "state": {  # Adam's step failed on it, later
        0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}}}}),
    ("hyperparameters", lambda s: {**s, "optimizer": {**s["optimizer"], "param_groups": [  # this run's stand
        {**s["optimizer"]["param_groups"][0], "betas": "x"}]}}),
    ("meta", lambda m: {**m, "step": "2"}), ("meta", lambda m: {**m, "source": [1]}),  # tracebacks, later
    ("meta", lambda m: {**m, "wall_s": None}), ("meta", lambda m: {**m, "last_eval": {"eval_return": "1"}})])
def test_a_foreign_or_crafted_checkpoint_is_skipped_before_it_changes_the_policy_optimizer_or_rng(
        tmp_path, capsys, part, craft):
    """Each loaded, or half loaded, into a run that then crashed with a traceback (or, its RNG refused once
    weights and optimizer were in, started over from them); the betas one is harmless now: never loaded."""
    policy = MLPPolicy(4, 2)
    opt = torch.optim.Adam(policy.parameters())
    for p in policy.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # Adam's moments, to damage
    rundir.save_checkpoint(tmp_path, 2, policy, opt, {"wall_s": 0.0, "source": {}, "last_eval": {}}, keep=3)
    ckpt = tmp_path / "ckpt-0000002"
    if part != "meta":
        torch.save(craft(torch.load(ckpt / "state.pt", weights_only=True)), ckpt / "state.pt")
    else:
        (ckpt / "meta.json").write_text(json.dumps(craft(json.loads((ckpt / "meta.json").read_text()))))
    fresh = MLPPolicy(4, 2)
    before, fresh_opt, rng = dict(fresh.state_dict()), torch.optim.Adam(fresh.parameters()), torch.get_rng_state()
    meta = rundir.resume_checkpoint(tmp_path, fresh, fresh_opt)
    if part == "hyperparameters":  # it alone loads, without its betas
        assert fresh_opt.param_groups[0]["betas"] == (0.9, 0.999) and meta["step"] == 2
        return
    assert meta is None and "skipping" in capsys.readouterr().err
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
    assert not fresh_opt.state and torch.equal(torch.get_rng_state(), rng)


def test_a_newest_checkpoint_of_another_policy_is_skipped_for_the_runs_own_unless_none_is(tmp_path, capsys):
    """A checkpoint copied in from another run (--hidden 32) stopped `--resume RUN` with an error whose fix
    was `--resume RUN` alone, though the run's own checkpoints were there; with none, it still stops."""
    policy, other = MLPPolicy(4, 2), MLPPolicy(4, 2, hidden=32)
    opt = torch.optim.Adam(policy.parameters())
    rundir.save_checkpoint(tmp_path, 2, policy, opt, {"wall_s": 0.0, "source": {"position": 2}}, keep=3)
    meta = {"wall_s": 0.0, "source": {"position": 9}}
    rundir.save_checkpoint(tmp_path, 9, other, torch.optim.Adam(other.parameters()), meta, keep=3)
    assert rundir.resume_checkpoint(tmp_path, policy, opt)["source"] == {"position": 2}
    assert capsys.readouterr().err.splitlines() == [
        f"skipping {tmp_path / 'ckpt-0000009'}: its tensors are another policy's (copied from another run?)"]
    shutil.rmtree(tmp_path / "ckpt-0000002")
    with pytest.raises(utils.ConfigError, match="ckpt-0000009: its tensors do not match this policy"):
        rundir.resume_checkpoint(tmp_path, policy, opt)


def test_only_rank_0_writes_a_checkpoint(tmp_path, monkeypatch):
    policy = MLPPolicy(4, 2)
    opt, meta = torch.optim.Adam(policy.parameters()), {"wall_s": 0.0, "source": {}}
    monkeypatch.setattr(utils, "rank", lambda: 1)  # torchrun's rank 1: same weights, and rank 0 writes them
    assert rundir.save_checkpoint(tmp_path, 1, policy, opt, meta, keep=3) is None and not any(tmp_path.iterdir())
    monkeypatch.setattr(utils, "rank", lambda: 0)
    assert rundir.save_checkpoint(tmp_path, 1, policy, opt, meta, keep=3) == tmp_path / "ckpt-0000001"
    assert rundir.checkpoints(tmp_path) == [tmp_path / "ckpt-0000001"]


def test_only_rank_0_logs_the_other_ranks_write_no_file_and_keep_no_logger(tmp_path, monkeypatch):
    monkeypatch.setattr(utils, "rank", lambda: 1)  # torchrun's rank 1: rank 0 logs the all-reduced numbers
    metrics = rundir.Metrics(tmp_path / "run", train.Config(log="tensorboard"))
    metrics.log(1, {"loss": 1.0})
    metrics.samples(1, [{"kind": "train", "text": "x"}])
    metrics.close()
    assert metrics.loggers == [] and not (tmp_path / "run").exists()


def test_only_rank_0_makes_a_new_runs_directory_the_others_only_name_it(tmp_path, monkeypatch):
    """Under torchrun rank 0 makes runs/NAME-<time>; another rank's mkdir would find it made and make -2."""
    real = rundir.time.strftime
    monkeypatch.setattr(rundir.time, "strftime", lambda fmt, *t: "20261202-000000" if fmt == "%Y%m%d-%H%M%S"
                        else real(fmt, *t))
    monkeypatch.setattr(utils, "rank", lambda: 1)
    assert rundir.fresh_dir(str(tmp_path / "run")) == tmp_path / "run-20261202-000000"
    assert not any(tmp_path.iterdir())
    monkeypatch.setattr(utils, "rank", lambda: 0)
    assert rundir.fresh_dir(str(tmp_path / "run")) == tmp_path / "run-20261202-000000"
    assert [p.name for p in tmp_path.iterdir()] == ["run-20261202-000000"]


def test_an_empty_or_foreign_state_file_is_skipped_and_a_stray_copy_is_no_checkpoint(tmp_path, capsys):
    policy = MLPPolicy(4, 2)
    opt = torch.optim.Adam(policy.parameters())
    for step in (1, 2, 3):
        rundir.save_checkpoint(tmp_path, step, policy, opt, {"wall_s": 0.0, "source": {"position": step}}, keep=3)
    (tmp_path / "ckpt-0000003" / "state.pt").write_bytes(b"")  # what a full disk leaves
    (tmp_path / "ckpt-0000002" / "state.pt").write_bytes(bytes(range(256)) * 4)  # not a torch.save
    shutil.copytree(tmp_path / "ckpt-0000001", tmp_path / "ckpt-0000001.bak")  # a user's copy: int() crashed on it
    assert [p.name for p in rundir.checkpoints(tmp_path)] == ["ckpt-0000001", "ckpt-0000002", "ckpt-0000003"]
    assert rundir.resume_checkpoint(tmp_path, policy, opt)["step"] == 1  # both escaped the skip before
    skipped = [line for line in capsys.readouterr().err.splitlines() if line.startswith("skipping")]
    assert [line.split(": ")[1] for line in skipped] == ["EOFError", "UnpicklingError"]
    rundir.save_checkpoint(tmp_path, 4, policy, opt, {"wall_s": 0.0, "source": {}}, keep=1)  # pruning skips it too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-0000001.bak", "ckpt-0000004"]


def test_a_meta_json_of_bytes_that_are_no_utf8_is_skipped_as_a_damaged_checkpoint(tmp_path, capsys):
    """read_text() raised UnicodeDecodeError, which the skip did not catch: a disk error's byte in the
    newest checkpoint's meta.json made the resume a traceback, though an older checkpoint loads."""
    policy = MLPPolicy(4, 2)
    opt = torch.optim.Adam(policy.parameters())
    for step in (1, 2):
        rundir.save_checkpoint(tmp_path, step, policy, opt, {"wall_s": 0.0, "source": {"position": step}}, keep=3)
    meta = tmp_path / "ckpt-0000002" / "meta.json"
    meta.write_bytes(b"\xff" + meta.read_bytes()[1:])
    assert rundir.resume_checkpoint(tmp_path, policy, opt)["step"] == 1
    assert capsys.readouterr().err.startswith(f"skipping {meta.parent}: UnicodeDecodeError: 'utf-8' codec")


def test_a_checkpoint_write_cut_short_by_a_kill_is_swept_by_the_next_save(tmp_path):
    """A SIGKILL (a preemption, the OOM killer) mid-write left its .tmp-ckpt-* directory beside the run's
    checkpoints for good: with full fine-tuning, the weights and Adam's state each time."""
    policy = MLPPolicy(4, 2)
    opt, meta = torch.optim.Adam(policy.parameters()), {"wall_s": 0.0, "source": {}}

    def killed_mid_write():
        torch.save = lambda *args, **kw: time.sleep(600)  # in the forked child only: the weights are written
        rundir.save_checkpoint(tmp_path, 1, policy, opt, meta, keep=3)

    child = multiprocessing.get_context("fork").Process(target=killed_mid_write)
    child.start()
    deadline = time.time() + 60
    while not list(tmp_path.glob(".tmp-ckpt-0000001-*/weights.safetensors")) and time.time() < deadline:
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert len(list(tmp_path.glob(".tmp-ckpt-*"))) == 1 and rundir.checkpoints(tmp_path) == []
    rundir.save_checkpoint(tmp_path, 1, policy, opt, meta, keep=3)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-0000001"]


def test_a_named_checkpoint_or_an_eval_only_must_load_instead_of_the_untrained_model_standing_in(tmp_path, capsys):
    out = tmp_path / "run"
    assert train.main(cartpole(out, "--steps", "2", "--ckpt-every", "1", "--target", "0")[2:]) == 0
    for ckpt in rundir.checkpoints(out):
        (ckpt / "meta.json").write_text("{")
    capsys.readouterr()
    for argv in (["--resume", str(out / "ckpt-0000002")], ["--resume", str(out), "--eval-only"]):
        assert train.main([*argv, "--no-progress"]) == 2  # it evaluated (and exported) step 0's weights, exit 0
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(f"error: --resume {argv[1]}: no checkpoint of it loads (above); resume another")
        assert len(err) >= 2 and all(line.startswith("skipping") for line in err[:-1])
    assert not (out / "eval-0000000").exists()


def test_a_checkpoint_the_run_lacks_is_refused_naming_those_it_has(tmp_path, capsys):
    """`--resume RUN/ckpt-10` said "no such run directory or checkpoint", though the run was there."""
    out = tmp_path / "run"
    assert train.main(cartpole(out, "--steps", "2", "--ckpt-every", "1", "--target", "0")[2:]) == 0
    capsys.readouterr()
    assert train.main(["--resume", str(out / "ckpt-10")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --resume {out / 'ckpt-10'}: no such checkpoint; {out} has ckpt-0000001, ckpt-0000002"]
    for ckpt in rundir.checkpoints(out):
        shutil.rmtree(ckpt)
    assert train.main(["--resume", str(out / "ckpt-0000002")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --resume {out / 'ckpt-0000002'}: no such checkpoint; {out} has no checkpoint"]


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory):
    """A CartPole run of 6 steps, checkpointed every 2."""
    out = tmp_path_factory.mktemp("six_steps") / "run"
    assert run(cartpole(out, "--steps", "6", "--ckpt-every", "2", "--target", "0")).returncode == 0
    return out


@pytest.mark.parametrize("damage", ["weights.safetensors", "meta.json"])
def test_resume_skips_a_truncated_newest_checkpoint_and_never_logs_a_step_twice(tmp_path, damage, six_steps):
    full, cut = six_steps, tmp_path / "cut"
    shutil.copytree(full, cut)  # the same run (the run is deterministic: the check below relies on it)
    newest = cut / "ckpt-0000006" / damage
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # a copy or a full disk cut it short
    resumed = run([sys.executable, "train.py", "--resume", str(cut), "--no-progress"])
    assert resumed.returncode == 0, resumed.stderr
    skipped = [line for line in resumed.stderr.splitlines() if line.startswith("skipping")]
    error = "SafetensorError" if damage.endswith("safetensors") else "JSONDecodeError"
    assert len(skipped) == 1 and "ckpt-0000006" in skipped[0] and error in skipped[0]
    a, b = final_weights(full), final_weights(cut)
    assert all(torch.equal(a[k], b[k]) for k in a)  # steps 5 and 6 replayed from ckpt-0000004, bitwise
    assert sorted(rows(cut)) == sorted(rows(full))  # each (step, key) once: the replayed rows were dropped first


def test_resume_alone_restores_the_runs_config_and_warns_about_a_changed_algorithm(tmp_path):
    out = tmp_path / "run"
    assert run(cartpole(out, "--steps", "2", "--lr", "0.003", "--hidden", "32", "--target", "0")).returncode == 0
    more = run([sys.executable, "train.py", "--resume", str(out), "--steps", "4", "--no-progress"])
    assert more.returncode == 0 and "warning" not in more.stderr
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert (saved["lr"], saved["hidden"], saved["steps"]) == (0.003, 32, 4)
    assert [s for s, k in rows(out) if k == "loss"] == [1, 2, 3, 4]
    other = run([sys.executable, "train.py", "--resume", str(out), "--algo", "ppo", "--steps", "5"])
    lines = other.stderr.strip().splitlines()
    assert other.returncode == 2 and "algo 'ppo' replaces the run's 'reinforce'" in lines[0]
    assert lines[1].startswith("error: ") and "do not match this policy" in lines[1] and len(lines) == 2


def test_a_resume_with_another_lr_trains_at_it_not_at_the_checkpoints(tmp_path):
    """The optimizer's saved state put the old rate back: a resume with --lr 1e-9 ended bitwise as one
    without it, while its config.yaml said 1e-9."""
    out = tmp_path / "run"
    assert run(cartpole(out, "--steps", "2", "--target", "0")).returncode == 0
    assert run([sys.executable, "train.py", "--resume", str(out), "--steps", "3", "--lr", "1e-9",
                "--no-progress"]).returncode == 0
    state = torch.load(out / "ckpt-0000003" / "state.pt", weights_only=True)
    assert state["optimizer"]["param_groups"][0]["lr"] == 1e-9 and state["optimizer"]["state"]  # Adam's moments


def test_cartpole_stops_when_solved_and_ends_with_a_summary(tmp_path):
    done = run(cartpole(tmp_path / "run", "--batch", "16", "--eval-episodes", "10", "--eval-every", "5"))
    evals = rundir.read_metrics(tmp_path / "run" / "metrics.csv")["eval_return"]
    assert done.returncode == 0 and evals[-1][2] >= 475 and evals[-1][0] < 200  # solved, long before --steps
    assert f"eval_return: best {evals[-1][2]:.4g} (step {evals[-1][0]})" in done.stdout
    assert "report: " in done.stdout and "ckpt-" in done.stdout


def kill_on(target: str, call: int, after: bool) -> None:
    """In this process: the call-th call of `target` (module.name or module.Class.name, looked up where the
    run calls it) SIGKILLs it, on entry or once the call returned (what it wrote is then on disk)."""
    module, *attrs, name = target.split(".")
    owner = functools.reduce(getattr, attrs, importlib.import_module(module))
    real, calls = getattr(owner, name), itertools.count(1)

    @functools.wraps(real)
    def killing(*args, **kw):
        hit = next(calls) == call
        result = os.kill(os.getpid(), signal.SIGKILL) if hit and not after else real(*args, **kw)
        if hit:
            os.kill(os.getpid(), signal.SIGKILL)
        return result
    setattr(owner, name, killing)


def main_then_exit(argv: list[str], kill: tuple[str, int, bool] | None = None):
    if kill:
        kill_on(*kill)
    os._exit(train.main(argv))  # its exit code, and no cleanup, as a process of its own would


def in_child(argv: list[str], kill: tuple[str, int, bool] | None = None):
    """train.py's main in a process forked from a forkserver that has it imported (an import takes seconds
    here), yet a real process that a SIGKILL ends without any cleanup. Not forked from pytest: once this
    process has run a parallel torch op, a forked child's first one can hang in libgomp's thread pool."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["train", __name__])
    child = context.Process(target=main_then_exit, args=(argv, kill))
    child.start()
    return child


# Where a SIGKILL lands, one per phase of a run, each in the next resume of the run before (steps 12, a
# checkpoint and an eval every 2). A random moment (20 of them: 82 s) mostly fell in a rollout or update.
KILLS = [
    ("rundir.atomic_write", 1, False),  # building a new run: its directory holds a lock, no config.yaml yet
    ("rollouts.ControlRollouts.next", 3, False),  # step 3's rollout, ckpt-0000002 saved
    ("train.update", 2, False),  # step 4's update, step 3 logged after ckpt-0000002
    ("rundir.Metrics.samples", 2, False),  # step 4's metrics.csv rows written, its samples not
    ("rundir.save_file", 1, True),  # ckpt-0000004's write: weights in its .tmp-ckpt-*, no state or meta
    ("rollouts.ControlRollouts.evaluate", 2, False),  # the eval at step 6, ckpt-0000004 saved
    ("report.refresh", 1, False),  # the eval at step 6 logged, its checkpoint not written
    ("rundir.truncate_log", 1, True),  # a resume rewriting its logs: metrics.csv cut to step 4, samples not
    ("rundir.save_checkpoint", 2, True),  # ckpt-0000008 whole, ckpt-0000006 before it
]


def test_sigkill_in_each_phase_then_resume_alone_ends_with_the_uninterrupted_weights(tmp_path):
    flags = cartpole(tmp_path / "full", "--steps", "12", "--ckpt-every", "2", "--target", "0", "--batch", "8")
    full, out = in_child(flags[2:]), tmp_path / "killed"  # beside the killed ones (on a second core, if idle)
    for kill in KILLS:
        resume = (out / "config.yaml").exists()
        argv = ["--resume", str(out), "--no-progress"] if resume else [*flags[2:], "--out", str(out)]
        (child := in_child(argv, kill)).join()
        assert child.exitcode == -signal.SIGKILL, kill  # killed there, not finished or failed before it
    (last := in_child(["--resume", str(out), "--no-progress"])).join()
    full.join()
    assert (full.exitcode, last.exitcode) == (0, 0)
    a, b = final_weights(tmp_path / "full"), final_weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    counts = collections.Counter(rows(out))
    assert max(counts.values()) == 1 and set(counts) == set(rows(tmp_path / "full"))


def test_tensorboard_and_wandb_get_the_numbers_of_metrics_csv(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("WANDB_MODE", raising=False)  # unset: the logger picks offline itself
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = utils.load_config(train.Config, cartpole(tmp_path / "run", "--steps", "3", "--log", "tensorboard,wandb",
                                                   "--target", "0")[2:])
    out = train.train(cfg)
    csv = rundir.read_metrics(out / "metrics.csv")
    events = EventAccumulator(str(out / "tensorboard")).Reload()
    assert set(events.Tags()["scalars"]) == set(csv)
    for key, points in csv.items():
        logged = [(e.step, e.value) for e in events.Scalars(key)]
        assert logged == [(s, pytest.approx(v, rel=1e-5)) for s, _, v in points]
    [log] = (out / "wandb").glob("offline-run-*/run-*.wandb")
    history = [r for kind, r in wandb_records(log) if kind == "history"]
    logged = {(r["step"], k): v for r in history for k, v in r.items() if not k.startswith("_") and k != "step"}
    # CartPole has no eval samples: its training rows make one table, at the end (a stop lost them)
    assert logged.pop((3, "samples/nrows")) == 3 * cfg.samples and {s for s, k in logged if "samples" in k} == {3}
    logged = {(s, k): v for (s, k), v in logged.items() if not k.startswith("samples")}
    assert logged == {(s, k): pytest.approx(v, rel=1e-5) for k, pts in csv.items() for s, _, v in pts}
    config = next(r for kind, r in wandb_records(log) if kind == "run")
    assert config["lr"] == cfg.lr and config["task"] == "cartpole"


def test_a_resume_logs_after_its_checkpoints_step_and_time_dropping_the_later_rows_and_events(
        tmp_path, monkeypatch):
    """A killed run logged steps 3-4 past its checkpoint at step 2: the resume drops them from metrics.csv
    and hides them from TensorBoard, then logs its own step 3 once, its wall clock going on from the
    checkpoint's 50 s."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    now = [1000.0]
    monkeypatch.setattr(rundir.time, "perf_counter", lambda: now[0])
    cfg = train.Config(log="tensorboard")
    killed = rundir.Metrics(tmp_path, cfg)
    for step in (1, 2, 3, 4):
        now[0] = 1000 + step * 0.1234
        killed.log(step, {"loss": step / 3})
    killed.close()
    now[0] = 2000.0
    resumed = rundir.Metrics(tmp_path, cfg, wall_offset=50.0, resumed_at=2)
    now[0] = 2000.25
    resumed.log(3, {"loss": 30})
    resumed.close()
    assert (tmp_path / "metrics.csv").read_text().splitlines() == [  # one header, each step once
        "step,wall_s,key,value", "1,0.123,loss,0.333333", "2,0.247,loss,0.666667", "3,50.25,loss,30"]
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload().Scalars("loss")
    assert [(e.step, e.value) for e in events] == [(1, pytest.approx(1 / 3)), (2, pytest.approx(2 / 3)),
                                                    (3, 30)]


def test_evals_of_several_checkpoints_into_one_out_keep_every_step_in_tensorboard(tmp_path):
    """An --eval-only purged TensorBoard's events from its step on: evaluating ckpt-10, then ckpt-5, into one
    --out hid step 10's numbers (metrics.csv kept both)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = train.train(utils.load_config(train.Config, cartpole(tmp_path / "run", "--steps", "10", "--ckpt-every",
                                                                "5", "--target", "0")[2:]))
    for step in (10, 5):
        train.train(utils.load_config(train.Config, ["--resume", str(run / f"ckpt-{step:07d}"), "--eval-only",
                                                     "--out", str(tmp_path / "evals"), "--log", "tensorboard",
                                                     "--no-progress"]))
    csv = rundir.read_metrics(tmp_path / "evals" / "metrics.csv")["eval_return"]
    events = EventAccumulator(str(tmp_path / "evals" / "tensorboard")).Reload().Scalars("eval_return")
    assert [s for s, _, _ in csv] == [5, 10]  # both kept (read in step order)
    assert sorted((e.step, e.value) for e in events) == [(s, pytest.approx(v, rel=1e-5)) for s, _, v in csv]


@pytest.mark.parametrize("log, module, fix", [
    ("tensorboard", "torch.utils.tensorboard",
     "--log tensorboard needs tensorboard: pip install tensorboard"),
    ("wandb", "wandb", "--log wandb needs the wandb package: pip install wandb")])
def test_a_logger_whose_package_is_not_installed_is_one_line_naming_the_install(tmp_path, monkeypatch, log,
                                                                                 module, fix):
    monkeypatch.setitem(sys.modules, module, None)  # `import` then fails as where it is not installed
    with pytest.raises(utils.ConfigError) as e:
        rundir.Metrics(tmp_path, train.Config(log=log))
    assert str(e.value) == fix


def test_wandb_keeps_the_rows_since_the_last_eval_at_a_stop_and_its_own_id_per_directory(tmp_path, monkeypatch):
    """A stop lost the training rows held for the next eval's table; the id was the directory's last part
    alone: the evals runs/a/eval-0000030 and runs/b/eval-0000030 were one W&B run."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    ids = []
    for run in ("a", "b"):
        log = rundir.Metrics(tmp_path / run / "eval-0000030", train.Config(log="wandb,wandb"))
        log.samples(1, [{"kind": "train", "text": "x"}, {"kind": "train", "text": "y"}])
        log.samples(2, [{"kind": "eval", "text": "z"}])  # a table at its step, with the rows since the last
        if run == "a":
            log.samples(3, [{"kind": "train", "text": "w"}])  # held for the next eval's table, or the stop's
        ids.append(log.loggers[0].run.id)
        assert len(log.loggers) == 1  # named twice, it wrote every point twice
        log.close()  # b's: nothing held, no table
    assert ids[0] != ids[1] and ids[0].startswith("eval-0000030-")
    tables = {}
    for run in ("a", "b"):
        [file] = (tmp_path / run / "eval-0000030" / "wandb").glob("offline-run-*/run-*.wandb")
        tables[run] = [(r["step"], r["samples/nrows"]) for kind, r in wandb_records(file)
                       if kind == "history" and "samples/nrows" in r]
    assert tables == {"a": [(2, 3), (3, 1)], "b": [(2, 3)]}


def test_wandb_takes_a_long_directory_name_its_samples_table_and_all(tmp_path, monkeypatch):
    """The id was the whole name: past ~115 characters W&B refused the samples table's artifact name
    ("run-<id>-samples", at most 128) and the run ended in a traceback, its report and summary unwritten."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / ("n" * 200)
    log = rundir.Metrics(out, train.Config(log="wandb"))
    log.samples(2, [{"kind": "eval", "text": "z"}])
    ident = log.loggers[0].run.id
    log.close()
    assert ident.startswith("n" * 64 + "-") and len(ident) == 64 + 9
    [file] = (out / "wandb").glob("offline-run-*/run-*.wandb")
    assert [(r["step"], r["samples/nrows"]) for kind, r in wandb_records(file)
            if kind == "history" and "samples/nrows" in r] == [(2, 1)]


def wandb_records(path: Path) -> list[tuple[str, dict]]:
    """The records of a finished W&B run. Its log can still be written after run.finish() returns (wandb's
    service writes it; seen for a process's second run), so this waits for the run's exit record."""
    from google.protobuf.message import DecodeError

    deadline = time.time() + 60
    while True:
        try:
            records = list(log_records(path))
        except DecodeError:  # a record still being written
            records = []
        if any(kind == "exit" for kind, _ in records) or time.time() > deadline:
            return records
        time.sleep(0.1)


def log_records(path: Path):
    """(kind, {key: value}) of the records in a W&B transaction log (.wandb): LevelDB's log format (a 7-byte
    file header, 32 KiB blocks of checksum/length/type-framed chunks) around wandb's own protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data, pos, chunks = path.read_bytes(), 7, b""
    while pos + 7 <= len(data):
        if (left := 32768 - pos % 32768) < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunks, pos = chunks + data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record.FromString(chunks)
            chunks, which = b"", record.WhichOneof("record_type")
            body = getattr(record, which)
            items = body.config.update if which == "run" else getattr(body, "item", [])  # a run record holds the config
            yield which, {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}


def test_samples_rotate_past_their_byte_limit_and_a_resume_trims_both_files(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir.Metrics, "SAMPLES_MAX_BYTES", 100)
    line = len(json.dumps({"step": 1, "text": "x" * 40}) + "\n")  # 64 bytes: every second step rotates
    metrics, on_disk = rundir.Metrics(tmp_path, train.Config()), []
    for step in range(1, 8):
        metrics.samples(step, [{"text": "x" * 40}])
        on_disk.append(sum(p.stat().st_size for p in tmp_path.glob("samples*.jsonl")) // line)
    metrics.close()
    assert on_disk == [1, 2, 3, 2, 3, 2, 3]  # lines kept: the rotated file's 2, then 1 new, never more
    steps = lambda name: [json.loads(x)["step"] for x in (tmp_path / name).read_text().splitlines()]
    assert (steps("samples.1.jsonl"), steps("samples.jsonl")) == ([5, 6], [7])  # 1-4 rotated away
    assert [r["step"] for r in report.read_samples(tmp_path)] == [5, 6, 7]
    metrics = rundir.Metrics(tmp_path, train.Config(), resumed_at=5)  # a resume from step 5's checkpoint
    metrics.samples(6, [{"text": "again"}])
    metrics.close()
    assert [(r["step"], r["text"][:5]) for r in report.read_samples(tmp_path)] == [(5, "xxxxx"), (6, "again")]


def test_a_resume_keeps_the_log_lines_of_the_steps_it_keeps_less_a_last_line_cut_short(tmp_path):
    metrics, samples = tmp_path / "metrics.csv", tmp_path / "samples.jsonl"
    metrics.write_text("step,wall_s,key,value\n1,0.1,loss,2\n2,0.2,loss,3\n3,0.3,loss,4\n3,0.3,ev")
    samples.write_text('{"step": 1, "text": "a"}\n{"step": 2, "text": "b"}\n{"step": 3, "te')
    for path in (metrics, samples):  # an --eval-only's keep: every step but the one it evaluates again
        rundir.truncate_log(path, lambda s: s != 1)
    assert metrics.read_text() == "step,wall_s,key,value\n2,0.2,loss,3\n3,0.3,loss,4\n"  # the header stays
    assert samples.read_text() == '{"step": 2, "text": "b"}\n'
    rundir.truncate_log(tmp_path / "samples.1.jsonl", lambda s: True)  # a run that never rotated its samples
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.csv", "samples.jsonl"]


def test_a_header_cut_short_is_written_again_and_the_resumes_first_row_is_kept(tmp_path):
    """A disk that filled at the run's first write left "step,wal": the resume kept it as the header and
    appended its first row to it ("step,wal1,0.1,loss,2"), which every reader then skipped as the header."""
    (tmp_path / "metrics.csv").write_text("step,wal")
    metrics = rundir.Metrics(tmp_path, train.Config(), resumed_at=0)
    metrics.log(1, {"loss": 2.0})
    metrics.close()
    assert (tmp_path / "metrics.csv").read_text().startswith("step,wall_s,key,value\n1,")
    assert rundir.read_metrics(tmp_path / "metrics.csv")["loss"][0][::2] == (1, 2.0)


def test_bytes_that_are_no_utf8_in_a_log_are_kept_as_they_are_or_named_in_one_line(tmp_path):
    """truncate_log read the logs as strict UTF-8: a byte a disk error or a foreign tool left (0xff) made a
    resume a UnicodeDecodeError traceback; read_metrics and the report read past it."""
    metrics = tmp_path / "metrics.csv"
    metrics.write_bytes(b"step,wall_s,key,value\n1,0.1,lo\xffss,2\n2,0.2,loss,3\n")
    rundir.truncate_log(metrics, lambda s: s <= 1)
    assert metrics.read_bytes() == b"step,wall_s,key,value\n1,0.1,lo\xffss,2\n"  # byte for byte
    metrics.write_bytes(b"step,wall_s,key,value\n1\xff,0.1,loss,2\n")
    with pytest.raises(utils.ConfigError) as e:
        rundir.truncate_log(metrics, lambda s: True)
    assert str(e.value) == f"{metrics}:2: cannot read the line '1\\udcff,0.1,loss,2\\n'; fix or delete it"


def test_a_damaged_log_line_stops_a_resume_naming_its_line_number_and_first_40_characters(tmp_path):
    damaged = "x" * 50
    for name, text, n in (("metrics.csv", f"step,wall_s,key,value\n1,0.1,loss,2\n{damaged}\n", 3),
                          ("samples.jsonl", f'{{"step": 1}}\n{damaged}\n', 2)):
        (tmp_path / name).write_text(text)
        with pytest.raises(utils.ConfigError) as e:
            rundir.truncate_log(tmp_path / name, lambda s: True)
        assert str(e.value) == f"{tmp_path / name}:{n}: cannot read the line '{'x' * 40}'; fix or delete it"
        assert (tmp_path / name).read_text() == text  # the run must not drop what it cannot read


def test_a_resume_sets_aside_the_checkpoints_after_its_step_with_a_copy_of_the_logs_there(tmp_path, capsys):
    for step in (-2, 0, 2, 4):  # a warm-start's checkpoint, then the RL steps'
        (tmp_path / f"ckpt-{step:07d}").mkdir()
    (tmp_path / "config.yaml").write_text("task: cartpole\n")
    (tmp_path / "metrics.csv").write_text("step,wall_s,key,value\n4,0.4,loss,2\n")  # no samples*.jsonl
    rundir.set_aside(tmp_path, 0)  # a resume of ckpt-0000000
    aside, = tmp_path.glob("replaced-*")
    assert [p.name for p in rundir.checkpoints(tmp_path)] == ["ckpt--000002", "ckpt-0000000"]
    assert sorted(p.name for p in aside.iterdir()) == [
        "ckpt-0000002", "ckpt-0000004", "config.yaml", "metrics.csv"]
    assert (aside / "metrics.csv").read_text() == (tmp_path / "metrics.csv").read_text()
    said = capsys.readouterr().err
    assert said == f"moved the checkpoints after step 0 to {aside}, with a copy of the logs\n"
    rundir.set_aside(tmp_path, 0)  # nothing after step 0 now: no second directory, nothing said
    assert len(list(tmp_path.glob("replaced-*"))) == 1 and capsys.readouterr().err == ""


def test_a_set_aside_the_disk_refuses_moves_no_checkpoint_and_its_retry_copies_the_logs(tmp_path, monkeypatch):
    """The checkpoints moved first, then the logs were copied: a disk full at that copy (a samples.jsonl of
    32 MiB) left them moved without the logs, so the retry found nothing to set aside and dropped the lines."""
    for step in (2, 4):
        (tmp_path / f"ckpt-{step:07d}").mkdir()
    (tmp_path / "metrics.csv").write_text("step,wall_s,key,value\n4,0.4,loss,2\n")
    (tmp_path / "samples.jsonl").write_text('{"step": 4}\n')
    copy = shutil.copy2

    def disk_full(src, dst):
        if Path(src).name == "samples.jsonl":
            raise OSError(errno.ENOSPC, "No space left on device")
        return copy(src, dst)

    monkeypatch.setattr(rundir.shutil, "copy2", disk_full)
    with pytest.raises(OSError):
        rundir.set_aside(tmp_path, 2)
    assert [p.name for p in rundir.checkpoints(tmp_path)] == ["ckpt-0000002", "ckpt-0000004"]
    monkeypatch.setattr(rundir.shutil, "copy2", copy)  # room made
    rundir.set_aside(tmp_path, 2)
    held = {p.name: sorted(q.name for q in p.iterdir()) for p in tmp_path.glob("replaced-*")}
    assert ["ckpt-0000004", "metrics.csv", "samples.jsonl"] in held.values()


def test_ctrl_c_in_the_warm_start_finishes_its_step_and_resume_alone_continues_it_bitwise(tmp_path, monkeypatch):
    from modeldir import build_tiny_model
    from rollouts import TaskRollouts

    tiny = build_tiny_model(str(tmp_path / "tiny"), layers=2, hidden=128, heads=2, intermediate=256)
    flags = ["--task", "arith", "--algo", "grpo", "--model", tiny, "--sft-steps", "4", "--steps", "1", "--batch", "4",
             "--group-size", "2", "--eval-size", "2", "--max-new-tokens", "2", "--no-progress"]
    full = train.train(utils.load_config(train.Config, [*flags, "--out", str(tmp_path / "full")]))
    real, calls = TaskRollouts.demonstrations, []

    def demonstrations_then_ctrl_c(self, n):
        calls.append(n)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)  # during the warm-start's second step
        return real(self, n)

    monkeypatch.setattr(TaskRollouts, "demonstrations", demonstrations_then_ctrl_c)
    out = tmp_path / "cut"
    assert train.train(utils.load_config(train.Config, [*flags, "--out", str(out)])) is None  # stopped (exit 130)
    assert [c.name for c in rundir.checkpoints(out)] == ["ckpt--000002"]  # after warm-start steps -4..-3 of -4..-1
    assert [s for s, _, _ in rundir.read_metrics(out / "metrics.csv")["sft_loss"]] == [-3, -2]
    monkeypatch.setattr(TaskRollouts, "demonstrations", real)
    assert train.main(["--resume", str(out)]) == 0
    a, b = final_weights(full), final_weights(out)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(rows(out)) == sorted(rows(full))


@pytest.mark.parametrize("during", ["last_sft_step", "step_0_eval"])
def test_a_stop_right_after_the_warm_start_saves_it_at_step_0_with_rls_optimizer(tmp_path, monkeypatch, during):
    """The warm-start can take most of an hour (sql on tiny). A stop in its last step, or in the step-0 eval
    after it, checkpoints step 0 (after the reset to RL's Adam and lr), and --resume goes on bitwise."""
    from modeldir import build_tiny_model
    from rollouts import TaskRollouts

    tiny = build_tiny_model(str(tmp_path / "tiny"), layers=2, hidden=128, heads=2, intermediate=256)
    flags = ["--task", "arith", "--algo", "grpo", "--model", tiny, "--sft-steps", "3", "--steps", "1", "--batch", "4",
             "--group-size", "2", "--eval-size", "2", "--max-new-tokens", "2", "--no-progress", "--lr", "0.002"]
    full = train.train(utils.load_config(train.Config, [*flags, "--out", str(tmp_path / "full")]))
    name = "demonstrations" if during == "last_sft_step" else "evaluate"
    real, calls = getattr(TaskRollouts, name), []

    def then_ctrl_c(self, *args):
        calls.append(1)
        if len(calls) == (3 if during == "last_sft_step" else 2):  # eval 1 is the one before the warm-start
            os.kill(os.getpid(), signal.SIGINT)  # evaluate: the handler raises here, abandoning it
        return real(self, *args)

    monkeypatch.setattr(TaskRollouts, name, then_ctrl_c)
    out = tmp_path / "cut"
    assert train.train(utils.load_config(train.Config, [*flags, "--out", str(out)])) is None
    assert [c.name for c in rundir.checkpoints(out)] == ["ckpt-0000000"]
    state = torch.load(out / "ckpt-0000000" / "state.pt", weights_only=True)["optimizer"]
    assert state["state"] == {} and state["param_groups"][0]["lr"] == 0.002  # not the warm-start's moments
    assert "eval_accuracy" not in {k for s, k in rows(out) if s == 0}  # skipped, or abandoned: not logged
    monkeypatch.setattr(TaskRollouts, name, real)
    assert train.main(["--resume", str(out)]) == 0
    a, b = final_weights(full), final_weights(out)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(rows(out)) == sorted(rows(full))


def test_a_warm_start_alone_is_checkpointed_and_rl_resumes_from_it_as_one_run_would(tmp_path):
    """--steps 0 --sft-steps N is a supervised run: it leaves ckpt-0 (its step-0 eval logged), and --resume
    --steps 1 goes on bitwise as one run would, without logging the step-0 eval a second time."""
    from modeldir import build_tiny_model

    tiny = build_tiny_model(str(tmp_path / "tiny"), layers=2, hidden=128, heads=2, intermediate=256)
    flags = ["--task", "arith", "--algo", "grpo", "--model", tiny, "--sft-steps", "3", "--batch", "4",
             "--group-size", "2", "--eval-size", "2", "--max-new-tokens", "2", "--no-progress", "--lr", "0.002"]
    full = train.train(utils.load_config(train.Config, [*flags, "--steps", "1", "--out", str(tmp_path / "full")]))
    out = train.train(utils.load_config(train.Config, [*flags, "--steps", "0", "--out", str(tmp_path / "sft")]))
    assert [c.name for c in rundir.checkpoints(out)] == ["ckpt-0000000"]
    assert (0, "eval_accuracy") in rows(out)
    assert train.main(["--resume", str(out), "--steps", "1"]) == 0
    a, b = final_weights(full), final_weights(out)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(rows(out)) == sorted(rows(full))  # one eval_accuracy at step 0, as in the full run


def test_a_failed_checkpoint_write_keeps_the_previous_one_and_leaves_no_partial_one(tmp_path, monkeypatch):
    policy = MLPPolicy(4, 2)
    opt, meta = torch.optim.Adam(policy.parameters()), {"wall_s": 0.0, "source": {"position": 1}}
    rundir.save_checkpoint(tmp_path, 1, policy, opt, meta, keep=1)
    saved = {p.name: p.read_bytes() for p in (tmp_path / "ckpt-0000001").iterdir()}

    def full_disk(tensors, path):
        Path(path).write_bytes(b"\0" * 10)  # the start of the file, then the disk is full
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rundir, "save_file", full_disk)
    for step in (2, 1):  # a new step (keep=1 would prune step 1 after it), and step 1 written again
        with pytest.raises(OSError, match="No space left on device"):
            rundir.save_checkpoint(tmp_path, step, policy, opt, {**meta, "source": {"position": step}}, keep=1)
        assert [p.name for p in tmp_path.iterdir()] == ["ckpt-0000001"]  # no ckpt-0000002, no .tmp-ckpt-*
        assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt-0000001").iterdir()} == saved
    assert rundir.resume_checkpoint(tmp_path, policy, opt)["source"] == {"position": 1}


def test_a_write_that_safetensors_or_torch_refuses_is_an_io_error_naming_the_free_space_and_leaves_nothing(
        tmp_path, monkeypatch):
    """Their own errors carry no errno and no path: the cause (a full disk, say) is only in the message."""
    policy = MLPPolicy(4, 2)
    opt, meta = torch.optim.Adam(policy.parameters()), {"wall_s": 0.0, "source": {}}

    def refused(tensors, path):
        raise RuntimeError("unexpected pos 64 vs 0")

    monkeypatch.setattr(rundir, "save_file", refused)
    monkeypatch.setattr(rundir.shutil, "disk_usage", lambda path: collections.namedtuple("usage", "free")(
        (3 << 20) + 5))  # 3 MiB and 5 bytes
    with pytest.raises(OSError) as e:
        rundir.save_checkpoint(tmp_path, 1, policy, opt, meta, keep=1)
    assert (e.value.errno, e.value.strerror, e.value.filename) == (
        errno.EIO, "unexpected pos 64 vs 0; 3 MiB free there", str(tmp_path / "ckpt-0000001"))
    assert list(tmp_path.iterdir()) == []


def test_an_atomic_directory_replaces_the_old_one_whole_as_mkdir_makes_it_and_fills_an_empty_one_in_place(
        tmp_path):
    """An empty one (an --export DIR, a mount point) cannot be replaced: it is filled, the same inode."""
    new, old, empty = tmp_path / "a" / "b" / "new", tmp_path / "old", tmp_path / "empty"
    (old / "stale").mkdir(parents=True)  # a file of the old one that the new one lacks
    empty.mkdir()
    inode = empty.stat().st_ino
    for final in (new, old, empty):
        with rundir.atomic_dir(final) as tmp:
            (tmp / "sub").mkdir()
            (tmp / "sub" / "w").write_bytes(b"1")
            (tmp / "sub" / "w").chmod(0o600)  # as safetensors writes its files
        modes = {str(p.relative_to(final)): p.stat().st_mode & 0o7777 for p in (final, *final.rglob("*"))}
        mkdir, create = 0o777 & ~utils.UMASK, 0o666 & ~utils.UMASK  # the modes mkdir and open() give
        assert modes == {".": mkdir, "sub": mkdir, "sub/w": create}
    assert empty.stat().st_ino == inode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "empty", "old"]  # no .tmp-* left


def test_resume_names_each_checkpoint_that_fails_and_only_a_plain_resume_starts_over(tmp_path, capsys):
    policy = MLPPolicy(4, 2)
    opt = torch.optim.Adam(policy.parameters())
    with pytest.raises(utils.ConfigError) as e:  # an --eval-only of a directory without checkpoints
        rundir.resume_checkpoint(tmp_path, policy, opt, required=True)
    assert str(e.value) == f"--resume {tmp_path}: it holds no checkpoint; resume another run or ckpt-*"
    for step in (1, 2):
        rundir.save_checkpoint(tmp_path, step, policy, opt, {"wall_s": 0.0, "source": {}}, keep=3)
        (tmp_path / f"ckpt-{step:07d}" / "meta.json").write_text("{")
    capsys.readouterr()
    assert rundir.resume_checkpoint(tmp_path, policy, opt) is None  # --resume RUN: the run starts over
    assert [line.split(": ")[:2] for line in capsys.readouterr().err.splitlines()] == [
        [f"skipping {tmp_path / 'ckpt-0000002'}", "JSONDecodeError"],
        [f"skipping {tmp_path / 'ckpt-0000001'}", "JSONDecodeError"],
        [f"--resume {tmp_path}", "no checkpoint loads; the run starts over"]]
    for named, required in ((tmp_path / "ckpt-0000002", False), (tmp_path, True)):  # a ckpt-*, an --eval-only
        with pytest.raises(utils.ConfigError) as e:
            rundir.resume_checkpoint(named, policy, opt, required)
        why = "no checkpoint of it loads (above)"
        assert str(e.value) == f"--resume {named}: {why}; resume another run or ckpt-*"


def test_a_second_ctrl_c_stops_mid_step_with_exit_130_and_keeps_what_was_saved(tmp_path, capsys, monkeypatch):
    """The first Ctrl-C finishes the step; a second (in a step that never ends, e.g. a trainer waiting for
    workers) stops at once: exit code 130, no traceback, the checkpoints and metrics as the last step left
    them, and --resume alone goes on from there."""
    from rollouts import ControlRollouts

    out, real, handler = tmp_path / "run", ControlRollouts.next, signal.getsignal(signal.SIGINT)
    flags = cartpole(out, "--steps", "4", "--ckpt-every", "1", "--target", "0")[2:]

    def ctrl_c_twice_in_step_3(self, step):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)  # its handler raises KeyboardInterrupt here
        return real(self, step)

    monkeypatch.setattr(ControlRollouts, "next", ctrl_c_twice_in_step_3)
    assert train.main(flags) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.splitlines()[-2:] == [
        "Ctrl-C: finishing this step and checkpointing; Ctrl-C again stops now",
        f"stopped during step 3 (not saved); checkpoints so far: --resume {out}"]
    assert [p.name for p in rundir.checkpoints(out)] == ["ckpt-0000001", "ckpt-0000002"]
    assert [s for s, k in rows(out) if k == "loss"] == [1, 2] and signal.getsignal(signal.SIGINT) is handler
    monkeypatch.setattr(ControlRollouts, "next", real)
    assert train.main(["--resume", str(out), "--no-progress"]) == 0
    assert [s for s, k in rows(out) if k == "loss"] == [1, 2, 3, 4]


@pytest.mark.parametrize("during", ["step", "eval"])
def test_a_stop_checkpoints_without_waiting_for_the_eval_it_skips_or_abandons(tmp_path, capsys, monkeypatch, during):
    """A scheduler's SIGTERM is followed by SIGKILL after a grace period, and an eval can take longer (100
    problems with a real model: minutes). So a stop in a step skips the eval that step would run, and a stop
    in an eval abandons it: the step is checkpointed at once, the eval is not logged, and --resume goes on."""
    from rollouts import ControlRollouts

    out, real_next, real_eval = tmp_path / "run", ControlRollouts.next, ControlRollouts.evaluate
    handler, evals = signal.getsignal(signal.SIGTERM), []

    def sigterm_in_step_2(self, step):
        batch = real_next(self, step)
        if step == 1 and during == "step":  # late in the rollout: its seed drawn, its actions sampled
            os.kill(os.getpid(), signal.SIGTERM)
        return batch

    def sigterm_in_eval_2(self):  # the evals of steps 0 and 2
        evals.append(len(evals))
        if len(evals) == 2 and during == "eval":
            os.kill(os.getpid(), signal.SIGTERM)  # the handler raises in this frame: the eval's own
        return real_eval(self)

    monkeypatch.setattr(ControlRollouts, "next", sigterm_in_step_2)
    monkeypatch.setattr(ControlRollouts, "evaluate", sigterm_in_eval_2)
    assert train.main(cartpole(out, "--steps", "4", "--ckpt-every", "3", "--target", "0")[2:]) == 130  # stopped
    abandoned = ["the eval at step 2 is abandoned (not logged)"] if during == "eval" else []
    assert capsys.readouterr().err.splitlines() == [
        "SIGTERM: finishing this step and checkpointing; SIGTERM again stops now", *abandoned,
        f"interrupted: checkpoint saved; continue with --resume {out}"]
    assert evals == ([0, 1] if during == "eval" else [0]) and signal.getsignal(signal.SIGTERM) is handler
    # a stop in step 2's rollout first saves step 1, the last finished (a SIGKILL would lose only step 2)
    saved = ["ckpt-0000001", "ckpt-0000002"] if during == "step" else ["ckpt-0000002"]
    assert [p.name for p in rundir.checkpoints(out)] == saved
    assert [s for s, k in rows(out) if k in ("loss", "eval_return")] == [0, 1, 2]  # no eval at step 2
    monkeypatch.setattr(ControlRollouts, "next", real_next)
    monkeypatch.setattr(ControlRollouts, "evaluate", real_eval)
    killed = tmp_path / "killed"  # as a SIGKILL before step 2's end would have left it: the early save
    if during == "step":
        shutil.copytree(out, killed)
        shutil.rmtree(killed / "ckpt-0000002")
        assert train.main(["--resume", str(killed), "--no-progress"]) == 0
    assert train.main(["--resume", str(out), "--no-progress"]) == 0
    assert [s for s, k in rows(out) if k == "eval_return"] == [0, 2, 4]  # the resume runs step 2's
    assert [s for s, k in rows(out) if k == "loss"] == [1, 2, 3, 4]
    if during == "step":  # it holds the data position and RNG of step 1's end: step 2 runs again alike
        assert [s for s, k in rows(killed) if k == "loss"] == [1, 2, 3, 4]
        a, b = final_weights(out), final_weights(killed)
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("abandoned", [2, 4])
def test_a_resume_runs_the_eval_a_stop_abandoned_and_logs_what_one_run_logs(tmp_path, monkeypatch, abandoned):
    """A stop abandons the eval in progress; the resume went on without it: that step's eval_return was
    never logged, and when it was the last step's, the run (at its --steps) ended without its final eval."""
    from rollouts import ControlRollouts

    flags = cartpole(tmp_path / "full", "--steps", "4", "--target", "0")[2:]
    assert train.main(flags) == 0
    real_eval, evals = ControlRollouts.evaluate, []

    def sigterm_in_eval(self):  # the evals of steps 0, 2 and 4
        evals.append(2 * len(evals))
        if evals[-1] == abandoned:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler raises in this frame: the eval is abandoned
        return real_eval(self)

    out = tmp_path / "stopped"
    monkeypatch.setattr(ControlRollouts, "evaluate", sigterm_in_eval)
    assert train.main([*flags, "--out", str(out)]) == 130
    assert (abandoned, "eval_return") not in rows(out)
    monkeypatch.setattr(ControlRollouts, "evaluate", real_eval)
    assert train.main(["--resume", str(out), "--no-progress"]) == 0
    logged, full = ({k: [(s, v) for s, _, v in pts] for k, pts in rundir.read_metrics(run / "metrics.csv").items()}
                    for run in (out, tmp_path / "full"))
    assert logged == full  # every step's numbers once, in order, the eval at `abandoned` included
    assert (out / "samples.jsonl").read_text() == (tmp_path / "full" / "samples.jsonl").read_text()
    meta = json.loads((rundir.checkpoints(out)[-1] / "meta.json").read_text())
    assert meta["step"] == 4 and meta["last_eval"] == {"eval_return": full["eval_return"][-1][1]}


def test_stop_signals_abandon_only_the_code_named_and_only_in_one_process(monkeypatch):
    """torchrun's ranks must all reach the eval's all-reduce: there a stop saves the step instead.
    All are decorated alike, as a source's evaluate and train.prepare may be (one wrapper's code)."""
    @torch.no_grad()
    def evaluate():
        os.kill(os.getpid(), signal.SIGTERM)
        return "finished"

    @torch.no_grad()
    def rollout():
        os.kill(os.getpid(), signal.SIGTERM)
        return "finished"

    @torch.no_grad()
    def elsewhere():  # the same code, under another name: e.g. the update, never abandoned half-applied
        os.kill(os.getpid(), signal.SIGTERM)
        return "finished"

    before = signal.getsignal(signal.SIGTERM)
    # the state is saved at once in a rollout (where the weights are the last step's) and in an eval that
    # cannot be abandoned; never elsewhere (e.g. in the update, or under a snapshot's weights in stage 2)
    for world, code, result, saves in ((1, evaluate, utils.Abandoned, 0), (1, rollout, "finished", 1),
                                       (1, elsewhere, "finished", 0), (2, evaluate, "finished", 1),
                                       (2, rollout, "finished", 1), (2, elsewhere, "finished", 0)):
        monkeypatch.setattr(utils, "world", lambda: world)
        signals, saved = utils.StopSignals(evaluate, rollout), []
        signals.save = lambda: saved.append(code.__name__)
        try:
            if result is utils.Abandoned:
                with pytest.raises(utils.Abandoned):
                    code()
            else:
                assert code() == result
            assert signals.seen and saved == [code.__name__] * saves
            with pytest.raises(KeyboardInterrupt):  # the second stop, wherever it comes (torchrun: SIGTERM
                os.kill(os.getpid(), signal.SIGTERM if world == 1 else signal.SIGINT)  # again is the same one)
        finally:
            signals.restore()
        assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("world, first, again, stops_now, hint", [
    (2, signal.SIGTERM, signal.SIGTERM, False, "Ctrl-C"),  # Slurm's, to torchrun and to each rank: one stop
    (2, signal.SIGINT, signal.SIGTERM, True, "Ctrl-C again"),  # Ctrl-C twice at torchrun
    (2, signal.SIGINT, signal.SIGINT, True, "Ctrl-C again"),
    (1, signal.SIGTERM, signal.SIGTERM, True, "SIGTERM again"),  # no torchrun: a second kill is a second stop
])
def test_under_torchrun_a_sigterm_that_reaches_a_rank_twice_is_one_stop_and_a_second_ctrl_c_is_not(
        monkeypatch, capsys, world, first, again, stops_now, hint):
    """A scheduler's SIGTERM to every process reaches a rank twice, itself and forwarded by torchrun: one
    stop, whose step finishes. A second Ctrl-C at torchrun comes as SIGTERM after SIGINT: a second stop."""
    monkeypatch.setattr(utils, "world", lambda: world)
    signals = utils.StopSignals(train.evaluate, train.update)
    try:
        signals.handle(first, sys._getframe())
        try:
            signals.handle(again, sys._getframe())
            stopped_now = False
        except KeyboardInterrupt:
            stopped_now = True
    finally:
        signals.restore()
    assert (signals.seen, stopped_now) == (first, stops_now)
    said = f"{signals.NAMES[first]}: finishing this step and checkpointing; {hint} stops now"
    assert capsys.readouterr().err.splitlines() == [said]  # one line, naming what stops the run at once


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A CartPole run of 2 steps, checkpointed at each; --hidden 256: a 270 KB weights file, 550 KB of Adam state."""
    out = tmp_path_factory.mktemp("two_steps") / "run"
    assert run(cartpole(out, "--steps", "2", "--ckpt-every", "1", "--target", "0", "--hidden", "256")).returncode == 0
    return out


@pytest.mark.parametrize("kib, flags, cause", [
    (128, (), r"\[Errno 5\] Error while serializing: I/O error: File too large \(os error 27\); \d+ MiB free "
              r"there: '{out}/ckpt-0000003'"),  # the weights: safetensors' error carries no errno
    (400, (), r"\[Errno 5\] \[enforce fail at inline_container.cc:\d+\] \. unexpected pos \d+ vs \d+; \d+ MiB "
              r"free there: '{out}/ckpt-0000003'"),  # the optimizer's state: nor does torch.save's
    (12, ("--ckpt-every", "100"), r"\[Errno 27\] File too large")])  # report.html, at step 4's eval
def test_a_write_the_disk_refuses_is_one_line_and_resume_goes_on(tmp_path, two_steps, kib, flags, cause):
    """A full disk, here a real refusal by the kernel: RLIMIT_FSIZE (Python ignores SIGXFSZ, so a write past
    the limit fails with EFBIG). safetensors and torch.save raise errors of their own, never an OSError: a
    checkpoint, an --export or the model cache that met a full disk was a traceback. Now it is one line."""
    out = shutil.copytree(two_steps, tmp_path / "run")

    def file_size_limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (kib << 10, resource.RLIM_INFINITY))

    refused = run([sys.executable, "train.py", "--resume", str(out), "--steps", "4", "--no-progress", *flags],
                  preexec_fn=file_size_limit)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    stopped, error = refused.stderr.splitlines()[-2:]
    assert stopped == f"stopped during step {4 if flags else 3} (not saved); checkpoints so far: --resume {out}"
    cause = cause.format(out=re.escape(str(out)))
    assert re.fullmatch(rf"error: a write failed \({cause}\); make room, then --resume the run or run again", error)
    assert sorted(p.name for p in out.glob("*ckpt*")) == ["ckpt-0000001", "ckpt-0000002"]  # no .tmp-ckpt-*
    assert list(out.glob("*.tmp")) == []  # nor a report.html.tmp holding what room the disk had
    assert run([sys.executable, "train.py", "--resume", str(out), "--no-progress"]).returncode == 0
    assert [s for s, k in rows(out) if k == "loss"] == [1, 2, 3, 4]  # step 3 logged again, once


def test_a_write_refused_at_a_resumes_config_yaml_leaves_the_runs_own_whole(tmp_path):
    """config.yaml was rewritten in place: a write the disk refused (here past RLIMIT_FSIZE, 1100 bytes of
    its 1.2 kB) left it cut short, and the next --resume read a damaged config, or silently the defaults
    of the keys it lost."""
    out = tmp_path / "run"
    assert run(cartpole(out, "--steps", "1", "--target", "0", "--lr", "0.004")).returncode == 0
    config = (out / "config.yaml").read_bytes()
    assert len(config) > 1100 > max((out / name).stat().st_size for name in ("metrics.csv", "samples.jsonl"))

    def file_size_limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (1100, resource.RLIM_INFINITY))

    refused = run([sys.executable, "train.py", "--resume", str(out), "--steps", "2", "--no-progress"],
                  preexec_fn=file_size_limit)
    assert refused.returncode == 1 and refused.stderr.splitlines()[-1].startswith("error: a write failed")
    # the resume had not begun step 2; the message named step 1, which the run had trained and saved
    assert refused.stderr.splitlines()[-2] == f"stopped during step 2 (not saved); checkpoints so far: --resume {out}"
    assert (out / "config.yaml").read_bytes() == config and list(out.glob("*.tmp")) == []
    assert run([sys.executable, "train.py", "--resume", str(out), "--steps", "2", "--no-progress"]).returncode == 0
    assert yaml.safe_load((out / "config.yaml").read_text())["lr"] == 0.004


def test_a_run_directory_takes_one_run_at_a_time_and_a_killed_runs_hold_dies_with_it(tmp_path, capsys):
    """Two runs in one directory (a job requeued while the old one still runs) interleaved their steps in
    metrics.csv and overwrote each other's checkpoints. The live run holds RUN/.lock; a SIGKILL frees it."""
    out = tmp_path / "run"
    live = in_child(cartpole(out, "--steps", "100000", "--ckpt-every", "1", "--target", "0")[2:])
    try:
        deadline = time.time() + 120
        while len(rundir.checkpoints(out)) < 2 and time.time() < deadline:
            time.sleep(0.1)
        assert train.main(["--resume", str(out), "--no-progress"]) == 2
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"error: {out}: another run is still writing there; stop it first (a new run can take another --out)")
    finally:
        live.kill()  # SIGKILL
        live.join()
    last = int(rundir.checkpoints(out)[-1].name[5:])
    assert train.main(["--resume", str(out), "--no-progress", "--steps", str(last + 2)]) == 0
    logged = [s for s, k in rows(out) if k == "loss"]
    assert logged == list(range(1, last + 3))  # each step once, in order


def test_a_second_writer_of_a_run_directory_is_refused_until_the_first_closes(tmp_path):
    first = rundir.Metrics(tmp_path, train.Config())
    with pytest.raises(utils.ConfigError) as e:  # flock: another open file, even in this process, waits
        rundir.Metrics(tmp_path, train.Config())
    assert str(e.value) == (f"{tmp_path}: another run is still writing there; stop it first (a new run can "
                            "take another --out)")
    first.close()
    rundir.Metrics(tmp_path, train.Config()).close()


def test_resuming_an_earlier_checkpoint_sets_the_later_ones_aside_with_the_logs_and_retraces_them(tmp_path, capsys):
    """--resume RUN/ckpt-2 of a run at step 6 (to go on differently, say): rotation by step then deleted the
    checkpoint resumed from and kept the abandoned run's ckpt-6, which the summary named and a later --resume
    loaded, mixing two histories; the abandoned steps' log lines were dropped. Now they move aside, whole."""
    out = tmp_path / "run"
    assert run(cartpole(out, "--steps", "6", "--ckpt-every", "2", "--target", "0")).returncode == 0
    before = (out / "metrics.csv").read_text()
    assert train.main(["--resume", str(out / "ckpt-0000002"), "--steps", "5", "--no-progress"]) == 0
    aside, = out.glob("replaced-*")
    assert f"moved the checkpoints after step 2 to {aside}, with a copy of the logs" in capsys.readouterr().err
    assert [p.name for p in rundir.checkpoints(out)] == ["ckpt-0000002", "ckpt-0000004", "ckpt-0000005"]
    assert [p.name for p in rundir.checkpoints(aside)] == ["ckpt-0000004", "ckpt-0000006"]
    assert (aside / "metrics.csv").read_text() == before and (aside / "config.yaml").exists()
    assert [s for s, k in rows(out) if k == "loss"] == [1, 2, 3, 4, 5]
    a, b = (load_file(str(d / "ckpt-0000004" / "weights.safetensors")) for d in (out, aside))
    assert all(torch.equal(a[k], b[k]) for k in a)  # steps 3-4 again, as the first time: same data, same RNG
    assert train.main(["--resume", str(out), "--no-progress"]) == 0  # from ckpt-5, not the abandoned ckpt-6
    assert [s for s, k in rows(out) if k == "loss"] == [1, 2, 3, 4, 5] and len(list(out.glob("replaced-*"))) == 1


@pytest.mark.parametrize("damage", ["metrics.csv", "samples.jsonl", "lock"])
def test_a_damaged_log_line_or_a_run_directory_that_takes_no_writes_stops_a_resume_in_one_line(
        tmp_path, two_steps, capsys, damage):
    """A hand-edited line in metrics.csv or samples.jsonl was a ValueError traceback, after config.yaml had
    been rewritten; a run this user cannot write (another's, a read-only mount) a PermissionError one."""
    out = shutil.copytree(two_steps, tmp_path / "run")
    config = (out / "config.yaml").read_text()
    if damage == "lock":  # what open(".lock", "w") meets: as EACCES or EROFS would, even for root
        (out / ".lock").unlink(missing_ok=True)
        (out / ".lock").mkdir()
    else:
        with open(out / damage, "a") as f:
            f.write("\n" if damage == "metrics.csv" else "{not json\n")
    n = (out / damage).read_text().count("\n") if damage != "lock" else 0
    assert train.main(["--resume", str(out), "--steps", "3", "--no-progress"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    if damage == "lock":
        assert err == (f"error: {out}: cannot write the run there (Is a directory); pick another --out (to "
                       "resume: copy the run to a place you can write)")
    else:
        line = "'\\n'" if damage == "metrics.csv" else "'{not json\\n'"
        assert err == f"error: {out / damage}:{n}: cannot read the line {line}; fix or delete it"
    assert (out / "config.yaml").read_text() == config and len(rundir.checkpoints(out)) == 2


def test_an_empty_config_yaml_stops_a_resume_in_one_line_instead_of_resuming_on_the_defaults(
        tmp_path, two_steps, capsys):
    """A config.yaml a copy or a full disk left empty read as {}: the resume took every default. Here the
    default --hidden did not match the checkpoints, an error whose fix ("--resume RUN alone") was what ran;
    a run of the default --hidden went on at the default --batch, and saved those as the run's config."""
    out = shutil.copytree(two_steps, tmp_path / "run")
    (out / "config.yaml").write_text("")
    metrics = (out / "metrics.csv").read_text()
    assert train.main(["--resume", str(out), "--steps", "3", "--no-progress"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: {out / 'config.yaml'}: empty, cut short (a copy, a full disk); the run's values are in its "
        "report.html (Config): write them back as YAML")
    assert (out / "metrics.csv").read_text() == metrics and len(rundir.checkpoints(out)) == 2


def test_a_resume_past_a_damaged_metrics_line_trains_to_its_end_and_warns_of_it(tmp_path, two_steps):
    """A value that does not read (truncate_log reads only the step) killed the resumed run at its first eval
    (report.html): a ValueError traceback, exit 1, no curve, report or summary. The line stays to repair."""
    out = shutil.copytree(two_steps, tmp_path / "run")
    lines = (out / "metrics.csv").read_text().splitlines(keepends=True)
    lines[1] = lines[1].rsplit(",", 1)[0] + ",abc\n"  # line 2: a metric of step 0 or 1, kept by the resume
    (out / "metrics.csv").write_text("".join(lines))
    done = run(cartpole(out, "--resume", str(out), "--steps", "3"))
    assert done.returncode == 0 and "Traceback" not in done.stderr and "run saved to" in done.stdout
    warned = {line for line in done.stderr.splitlines() if "metrics.csv" in line}  # the eval's, the curve's
    assert warned == {f"warning: {out / 'metrics.csv'}:2: value 'abc' is not a number; repair or delete "
                      "that line (the run's checkpoints are untouched); the report and curve leave it out"}
    assert (out / "metrics.csv").read_text().splitlines(keepends=True)[1] == lines[1]
    assert (out / "curve.png").exists() and rundir.checkpoints(out)[-1].name == "ckpt-0000003"


def test_a_resume_whose_data_file_changed_warns_that_the_eval_problems_are_not_the_runs(tmp_path, capsys):
    """The split is reshuffled from the rows at each start: appending one row to --data and resuming swapped
    eval problems for former training ones, silently. The checkpoint now holds a digest of the eval keys."""
    from modeldir import build_tiny_model

    data, out = tmp_path / "add.jsonl", tmp_path / "run"
    lines = [json.dumps({"question": f"What is {i} plus {i + 1}?", "answer": f"#### {2 * i + 1}"}) for i in range(40)]
    data.write_text("\n".join(lines) + "\n")
    tiny = build_tiny_model(str(tmp_path / "tiny"), layers=2, hidden=128, heads=2, intermediate=256)
    flags = ["--task", "gsm8k", "--data", str(data), "--model", tiny, "--batch", "4", "--group-size", "2",
             "--eval-size", "8", "--max-new-tokens", "2", "--no-progress", "--out", str(out)]
    assert train.main([*flags, "--steps", "1"]) == 0
    assert train.main(["--resume", str(out), "--steps", "2"]) == 0  # the same rows: no warning
    assert "warning" not in capsys.readouterr().err
    with open(data, "a") as f:
        f.write(json.dumps({"question": "What is 2 times 3?", "answer": "#### 6"}) + "\n")
    assert train.main(["--resume", str(out), "--steps", "3"]) == 0
    assert capsys.readouterr().err.splitlines()[0] == (
        "warning: the eval problems are not the run's (its --data rows, --seed or --eval-size changed): evals "
        "from here on measure others, some perhaps trained on")
