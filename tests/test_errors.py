"""Every user-facing error (config, data, model, checkpoint) is one line naming the fix, exit code
2, never a traceback."""
import json
import math
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import envs
import rundir
import serve
import tasks
import train
import utils
from model import LLMPolicy
from modeldir import build_tiny_model
from rollouts import TaskRollouts, make_batch

pytestmark = pytest.mark.usefixtures("one_thread")  # the tiny models' runs: conftest says why

ROOT = Path(__file__).resolve().parent.parent
MIXED = str(ROOT / "tests" / "data" / "gsm8k_mixed.jsonl")  # 9 good rows
LLM = ["--task", "arith", "--model", "tiny", "--lora", "--sft-steps", "0", "--no-progress"]


def one_line_error(capsys, argv) -> str:
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()  # above it, at most a model-loading progress bar
    assert err[-1].startswith("error: ") and sum("rror" in line for line in err) == 1, err
    assert not any("Traceback" in line for line in err), err
    return err[-1]


@pytest.mark.parametrize("argv, fix", [
    (["--task", "cartpole", "--sft-steps", "5"], "--sft-steps is for LLM tasks"),
    (["--task", "cartpole", "--data", MIXED], "--data is for LLM tasks"),  # was ignored
    # the forgotten --task: a CartPole run with --model (or any LLM option) was trained, the option unused
    (["--model", "Qwen/Qwen3-0.6B", "--algo", "grpo"], "--model is for LLM tasks, not cartpole: drop it or pick another --task"),
    (["--temperature", "0.7"], "--temperature is for LLM tasks, not cartpole"),
    (LLM + ["--gen-batch", "0"], "need --gen-batch >= 1 (got 0)"),
    (LLM + ["--gen-batch", "-1"], "need --gen-batch >= 1 (got -1)"),
    (LLM + ["--eval-size", "0"], "need --eval-size >= 1 (got 0)"),
    (["--task", "countdown", "--model", "tiny", "--eval-size", "100000000"],  # it filled memory, for minutes
     "--task countdown: eval_size=100000000: 100000 at most; lower --eval-size"),
    (["--eval-every", "0"], "need --eval-every >= 1 (got 0)"),
    (LLM + ["--max-new-tokens", "0"], "need --max-new-tokens >= 1 (got 0)"),
    (["--steps", "-3"], "need --steps >= 0 (got -3)"),
    (LLM + ["--workers", "2"], "--workers needs --role trainer; add that or drop it"),
    # an option tuning another that is off went unused: each is refused, naming what turns it on
    (LLM + ["--role", "rollout", "--trainer-url", "http://h:1", "--workers", "2"], "--workers needs --role trainer"),
    (LLM + ["--trainer-url", "http://127.0.0.1:9"], "--trainer-url needs --role trainer or rollout"),
    # an async trainer's and its workers' knobs went unused in one process, silently
    (LLM + ["--max-staleness", "0"], "--max-staleness needs --role trainer or rollout; add that or drop it"),
    (LLM + ["--worker-patience", "5"], "--worker-patience needs --role trainer or rollout; add that or drop it"),
    (LLM + ["--tis-cap", "3"], "--tis-cap needs --tis token or sequence; add that or drop it"),
    (LLM + ["--mis-high", "3"], "--mis-high needs --mis token or sequence"),
    (LLM + ["--kl-estimator", "k2"], "--kl-estimator needs --kl-coef > 0 (e.g. 0.01)"),
    (LLM + ["--loss-agg-constant", "100"], "--loss-agg-constant needs --loss-agg constant"),
    (LLM + ["--max-gen-batches", "5"], "--max-gen-batches needs --dynamic-sampling"),
    (LLM + ["--opd-reward-coef", "0.5"], "--opd-reward-coef needs --algo opd"),
    (LLM + ["--sft-lr", "0.01"], "--sft-lr needs --sft-steps N (a warm-start)"),  # LLM has --sft-steps 0
    (LLM + ["--loss", "cispo", "--dual-clip", "3"], "--dual-clip needs --loss ppo or gspo"),  # was unused
    (LLM + ["--hidden", "256"], "--hidden is for cartpole tasks, not arith"),  # the tiny model's size is not it
    # a single-turn task has no episodes to end or code to run: these went unused, as --sandbox on CartPole
    (LLM + ["--max-turns", "2"], "--max-turns is for multi-turn tasks, not arith: drop it or pick another --task"),
    (LLM + ["--max-len", "512"], "--max-len is for multi-turn tasks, not arith"),
    (["--sandbox", "weak"], "--sandbox is for multi-turn tasks, not cartpole"),
    (LLM + ["--role", "trainer", "--algo", "ppo"], "--role needs a critic-free --algo (grpo, rloo, ...): workers"),
    (LLM + ["--overlong-buffer", "999", "--max-new-tokens", "8"], "in 1..--max-new-tokens"),
    (["--lr", "nan"], "'lr' must be a finite float, got 'nan'"),  # NaN passes every range check
    (LLM + ["--temperature", "nan"], "'temperature' must be a finite float"),
    (["--dist-timeout", "inf"], "'dist_timeout' must be a finite float"),
    (["--seed", str(2**64)], "--seed: 'seed' must be an int within +-2**63, got '18446744073709551616'"),  # torch's
    (["--hidden", "-1"], "need --hidden >= 1 (got -1)"),
    (LLM + ["--lora-rank", "0"], "need --lora-rank >= 1 (got 0)"),
    (LLM + ["--kl-coef", "-0.1"], "need --kl-coef >= 0 (got -0.1)"),
    (["--max-grad-norm", "-1"], "need --max-grad-norm >= 0 (got -1.0)"),  # 0 is off
    (["--dist-timeout", "0"], "need --dist-timeout >= 1 (got 0.0)"),
    (["--dual-clip", "-1"], "need --dual-clip 0 (off) or > 1 (got -1.0)"),
    (["--lr", "-1"], "need 0 < --lr <= 1 (got -1.0)"),  # the message listed five ranges, none named as broken
    # Adam moves each weight by about lr a step: past ~3e37 its step size overflowed float32 (a traceback in
    # step 1, after the run's directory and first eval), and any lr past 1 is a typo, not a schedule
    (["--lr", "1e38"], "need 0 < --lr <= 1 (got 1e+38)"),
    (LLM + ["--sft-steps", "2", "--sft-lr", "5"], "need 0 < --sft-lr <= 1 (got 5.0)"),
    (LLM + ["--mis-high", "0.5"], "need --mis-high >= 1 (got 0.5)"),
    (["--target", "-1"], "need --target >= 0 (got -1.0)"),
    (LLM + ["--dtype", "fp16"], "unknown --dtype 'fp16'; did you mean 'bf16'? (choices: fp32, bf16)"),  # at load
    (["--config", "configs/cartpole_ppo.yaml", "--config", "configs/cartpole_grpo.yaml"],  # the first was dropped
     "--config given twice: merge the presets into one file (flags override it)"),
    # YAML's `lora: false` works; on the command line the hint named --lora, which turns it on
    (LLM + ["--no-lora", "false"], "'false': --lora is a switch, without a value: --lora turns it on, --no-lora off"),  # every eval reached it: the run stopped at its first
])
def test_bad_flags_stop_in_one_line_naming_the_fix(capsys, argv, fix):
    assert fix in one_line_error(capsys, argv)


def test_reward_shaping_is_refused_under_pure_opd_alone():
    """Once the task's return is in OPD's advantage (--opd-reward-coef > 0), shaping it changes the update."""
    for shaping in (["--kl-coef", "0.1", "--kl-in-reward"], ["--overlong-buffer", "2"]):
        for algo in (["--algo", "opd", "--teacher", "tiny", "--opd-reward-coef", "0.5"], ["--algo", "grpo"]):
            train.validate(train.parse(LLM + algo + shaping))


def test_a_trainer_that_no_worker_could_join_is_refused_before_a_model_loads(capsys, monkeypatch):
    """Without NANORL_TOKEN only the trainer's own --workers get its fresh token; with none, it waited for
    batches for good, saying "waiting for batches (0 live workers)" once a minute."""
    monkeypatch.delenv("NANORL_TOKEN", raising=False)
    assert one_line_error(capsys, LLM + ["--role", "trainer"]) == (
        "error: --role trainer without NANORL_TOKEN takes only its own --workers, and there are none: set "
        "NANORL_TOKEN for workers to join, or pass --workers N")
    train.validate(train.parse(LLM + ["--role", "trainer", "--workers", "1"]))  # its own worker: fine
    monkeypatch.setenv("NANORL_TOKEN", "a-shared-secret-of-32-characters")
    train.validate(train.parse(LLM + ["--role", "trainer"]))  # workers started by hand may join


@pytest.mark.parametrize("argv, fix", [
    # the task's name once: "--task gsm8k: gsm8k: eval_size..." repeated it
    (["--task", "gsm8k", "--data", MIXED, "--eval-size", "9"],
     "error: --task gsm8k: 9 usable rows: --eval-size 9 leaves none to train on; lower it to 4 or less"),
])
def test_task_data_errors_stop_in_one_line(capsys, tmp_path, argv, fix):
    err = one_line_error(capsys, ["--model", "tiny", "--no-progress", "--out", str(tmp_path / "r"), *argv])
    assert fix in err


@pytest.mark.parametrize("argv, fix", [
    (["--task", "gsm8k", "--data", "no/such/file.jsonl"],
     "error: --task gsm8k: no file at no/such/file.jsonl; fix the --data path, or drop it to read gsm8k from the hub"),
    (["--task", "math", "--data", str(ROOT / "tests")], "error: --task math: no file at "),  # a directory
    (["--task", "arith", "--data", MIXED], "error: --task arith: this task generates its own problems; drop --data"),  # only the flag given
    (["--task", "sql", "--data", MIXED], "error: --task sql: this task generates its own problems; drop --data"),
    (["--task", "arith", "--bad-rows", "error"], "error: --task arith: this task generates its own problems; drop --bad-rows"),
    (["--task", "countdown_multiturn", "--bad-rows", "error"], "its own problems; drop --bad-rows"),  # were unused
    (["--task", "sql", "--data", MIXED, "--bad-rows", "error"], "its own problems; drop --data and --bad-rows"),
    (["--task", "gsm8k", "--data", "no/such/file.jsonl", "--role", "rollout", "--trainer-url", "http://127.0.0.1:9"],
     "error: --task gsm8k: no file at no/such/file.jsonl"),  # a worker, too, before it loads a model
    (["--task", "math"],  # it loaded the model, then said "No module named 'datasets'"
     "error: --task math: the hub's rows need the datasets package: pip install -e '.[hub]', or pass --data FILE"),
])
def test_data_that_cannot_be_read_stops_in_one_line_before_a_model_loads(capsys, tmp_path, monkeypatch, argv, fix):
    """A missing --data file was reported after the model loaded (minutes, for a large one), as
    `[Errno 2] No such file or directory`, naming no fix; --data on a task without rows, too."""
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed (as in CI): find_spec and import fail
    monkeypatch.setattr(train, "LLMPolicy", lambda *a, **kw: pytest.fail("a model loaded first"))
    monkeypatch.setattr(serve, "LLMPolicy", lambda *a, **kw: pytest.fail("a model loaded first"))
    err = one_line_error(capsys, ["--model", "tiny", "--no-progress", "--out", str(tmp_path / "r"), *argv])
    assert err.startswith(fix) if fix.startswith("error") else fix in err


def test_a_reward_that_turns_nan_mid_run_stops_in_one_line_keeping_the_checkpoints(capsys, tmp_path, monkeypatch):
    """A NaN reward was taken for a judge's missing score: every group masked, every step skipped, rc 0."""
    calls = []

    def mine(prompt, completion, answer):  # 4 calls for the eval at step 0, then 8 a step: NaN from step 3
        calls.append(1)
        return math.nan if len(calls) > 4 + 2 * 8 else 0.5

    class Mine(tasks.Arith):
        name, rewards = "arith_mine", [(tasks.int_correct, 1.0), (mine, 1.0)]

    monkeypatch.setitem(tasks.TASKS, "arith_mine", Mine)
    out = tmp_path / "run"
    err = one_line_error(capsys, [*LLM, "--task", "arith_mine", "--out", str(out), "--batch", "8",
                                  "--group-size", "4", "--eval-size", "4", "--max-new-tokens", "3", "--steps", "4",
                                  "--ckpt-every", "1"])
    assert err.startswith("error: reward mine returned nan for the completion ") and len(calls) == 4 + 2 * 8 + 1
    assert [c.name for c in rundir.checkpoints(out)] == ["ckpt-0000001", "ckpt-0000002"]


def test_resume_of_another_policy_names_the_runs_own_config(capsys, tmp_path):
    out = tmp_path / "run"
    assert train.main(["--out", str(out), "--steps", "1", "--batch", "4", "--eval-episodes", "1", "--hidden", "16",
                       "--no-progress"]) == 0
    capsys.readouterr()
    err = one_line_error(capsys, ["--resume", str(out), "--steps", "2", "--hidden", "32", "--no-progress"])
    assert f"--resume {out} alone restores the run's own" in err
    err = one_line_error(capsys, ["--resume", str(out), "--steps", "2", "--algo", "ppo", "--no-progress"])
    assert "(model, LoRA, --hidden or PPO critic unlike the run's)" in err  # PPO adds a critic's tensors


@pytest.mark.parametrize("saved, task", [("cartpole", "arith"), ("arith", "cartpole")])
def test_resuming_a_run_as_a_task_of_another_kind_of_policy_names_the_runs_task(capsys, tmp_path, monkeypatch,
                                                                               saved, task):
    """An arith run resumed with --task cartpole was told "--lora is for LLM tasks ...: drop it", of a flag
    its config.yaml held; cartpole resumed as arith loaded a model (then failed to load its checkpoint)."""
    monkeypatch.setattr(train, "LLMPolicy", lambda *a, **kw: pytest.fail("a model loaded first"))
    (tmp_path / "config.yaml").write_text(utils.dump_config(train.Config(task=saved)))
    err = one_line_error(capsys, ["--resume", str(tmp_path), "--task", task])
    assert err == f"error: --task {task}: the run trained {saved}, another policy; drop --task"


def test_an_async_run_resumed_in_one_process_or_evaluated_leaves_its_trainers_flags_behind(tmp_path):
    """Resumed with --role sync it was refused, "--workers needs --role trainer; ... drop it", of a flag that
    its config.yaml held (then --max-staleness, --worker-patience, --trainer-url, one by one)."""
    (tmp_path / "config.yaml").write_text("task: arith\nrole: trainer\nworkers: 2\nmax_staleness: 0\n"
                                          "worker_patience: 5.0\ntrainer_url: http://0.0.0.0:8000\n")
    for argv in (["--role", "sync"], ["--eval-only"]):
        cfg = train.parse(["--resume", str(tmp_path), *argv])
        train.validate(cfg)
        assert (cfg.role, cfg.workers, cfg.max_staleness, cfg.worker_patience, cfg.trainer_url) == (
            "sync", 0, 2, 60.0, "")
    cfg = train.parse(["--resume", str(tmp_path)])  # as a trainer again: its own flags
    assert (cfg.role, cfg.workers, cfg.max_staleness, cfg.worker_patience) == ("trainer", 2, 0, 5.0)


@pytest.mark.parametrize("saved, argv, need, undo", [
    ("kl_coef: 0.01\nkl_in_reward: true\n", ["--kl-coef", "0"], "--kl-in-reward needs --kl-coef > 0 (e.g. 0.01)",
     "--no-kl-in-reward"),
    ("loss_agg: constant\nloss_agg_constant: 100\n", ["--loss-agg", "token_mean"],
     "--loss-agg-constant needs --loss-agg constant", "--loss-agg-constant 0"),
    ("tis: token\ntis_cap: 3.0\n", ["--tis", "off"], "--tis-cap needs --tis token or sequence", "--tis-cap 2.0"),
])
def test_a_resumed_runs_own_option_that_is_refused_names_the_flag_that_turns_it_off(capsys, tmp_path, saved, argv,
                                                                                    need, undo):
    """Its config.yaml sets the option, so "drop it" (from a command line that never had it) could not work."""
    (tmp_path / "config.yaml").write_text("task: arith\n" + saved)
    err = one_line_error(capsys, ["--resume", str(tmp_path), *argv])
    assert err == f"error: {need}; add that or pass {undo}"
    train.validate(train.parse(["--resume", str(tmp_path), *argv, *undo.split()]))  # the fix it names works


def test_run_and_export_directories_that_cannot_be_made_stop_before_training(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    err = one_line_error(capsys, LLM + ["--export", str(tmp_path / "file" / "adapter")])  # before training
    assert "a file is in the way of that directory" in err
    for out in (tmp_path / "file", Path("/proc/nanorl-run")):  # /proc: the kernel refuses it to root too
        err = one_line_error(capsys, ["--out", str(out), "--steps", "1", "--no-progress"])
        assert err.startswith(f"error: {out}: cannot write the run there (")  # Not a directory; Permission...


def test_an_export_never_replaces_a_directory_that_holds_anything(capsys, tmp_path, monkeypatch):
    """--export DIR deleted what DIR held (rmtree, then rename): `--export .` the working directory, runs/
    and the new checkpoint with it. Now a directory with anything in it is refused, before training."""
    notes, empty = tmp_path / "notes", tmp_path / "empty"
    notes.mkdir()
    empty.mkdir()
    (notes / "my_notes.txt").write_text("keep me")
    monkeypatch.chdir(notes)
    for where in (str(notes), "."):
        err = one_line_error(capsys, LLM + ["--export", where])
        assert err == f"error: --export {where}: that directory is not empty; pick a new or empty directory"
    policy = LLMPolicy(train.parse(LLM))
    with pytest.raises(FileExistsError, match="that directory is not empty"):  # one made during training
        policy.export(str(notes), merged=True)
    assert [p.name for p in notes.iterdir()] == ["my_notes.txt"] and (notes / "my_notes.txt").read_text() == "keep me"
    for merged, where in ((False, empty), (True, tmp_path / "new" / "merged")):  # empty or new: written whole
        train.validate(train.parse(LLM + ["--export", str(where)]))
        policy.export(str(where), merged)
        assert (where / ("config.json" if merged else "adapter_config.json")).exists()
        assert where.stat().st_mode & 0o777 == 0o777 & ~utils.UMASK  # as mkdir makes it, not mkdtemp's 0700
        modes = {f.name: f.stat().st_mode & 0o777 for f in where.iterdir()}  # safetensors' own were 0600
        assert modes == dict.fromkeys(modes, 0o666 & ~utils.UMASK), modes


def test_an_export_that_would_hold_the_run_directory_is_refused_before_training(capsys, tmp_path, monkeypatch):
    """--export equal to --out, or above it, passed the up-front check while neither existed, trained the
    whole run, then failed at the end: the run had filled the directory it was to export into."""
    monkeypatch.chdir(tmp_path)  # empty: `--export .` is no "not empty" refusal here
    for out, export in (["--out", "run"], "run"), (["--out", "a/run"], "a"), ([], "."):  # [] -> runs/...
        err = one_line_error(capsys, LLM + out + ["--export", export])
        assert err == f"error: --export {export}: the run's directory is in it; pick a new or empty directory"
    assert list(tmp_path.iterdir()) == []  # refused before any directory was made
    train.validate(train.parse(LLM + ["--out", "run", "--export", "run/model"]))  # inside the run: fine


def test_an_export_that_fails_after_training_keeps_the_checkpoints_and_says_how_to_redo_it(
        capsys, tmp_path, monkeypatch):
    def full_disk(self, path, merged=False):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(LLMPolicy, "export", full_disk)
    out = tmp_path / "run"
    small = ["--steps", "1", "--batch", "4", "--group-size", "2", "--max-new-tokens", "4", "--eval-size", "2"]
    err = one_line_error(capsys, LLM + small + ["--out", str(out), "--export", str(tmp_path / "adapter")])
    assert "No space left on device" in err and "--resume RUN --eval-only --export DIR" in err
    assert [p.name for p in out.glob("ckpt-*")] == ["ckpt-0000001"]


def test_an_unwritable_model_cache_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("NANORL_CACHE", "/proc/nanorl-cache")  # the kernel refuses it, to root too
    err = one_line_error(capsys, LLM + ["--steps", "1"])
    assert "cannot write /proc/nanorl-cache/tiny-" in err and "point NANORL_CACHE" in err


def test_the_command_line_prints_no_traceback():
    run = subprocess.run([sys.executable, "train.py", "--task", "cartpole", "--sft-steps", "5"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "Traceback" not in run.stderr


def test_a_warning_on_the_command_line_is_one_line(tmp_path):
    """Python's format printed "/.../model.py:155: UserWarning: top_p=0.9: ..." and under it the source line
    of the warnings.warn call, cut mid-sentence. A warning now reads as an error does: one line."""
    run = subprocess.run([sys.executable, "train.py", *LLM, "--top-p", "0.9", "--steps", "0", "--eval-size", "1",
                          "--out", str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})  # one_thread, for a child
    warned = [line for line in run.stderr.splitlines() if "top_p" in line or "warn" in line.lower()]
    assert run.returncode == 0 and warned == ["warning: top_p=0.9: samples come from a truncated distribution the "
                                              "loss does not model, so the importance ratio is only approximate; "
                                              "top_p=1 keeps it exact"]


def test_a_new_run_never_writes_into_another_runs_directory(capsys, tmp_path):
    """Before, a second run with the same --out appended to its metrics.csv and replaced its checkpoints
    of equal step, so a later --resume mixed two runs. Now it is refused before anything is written."""
    out, quick = tmp_path / "run", ["--steps", "2", "--batch", "4", "--eval-episodes", "1", "--no-progress"]
    assert train.main(["--out", str(out), "--ckpt-every", "1", *quick]) == 0
    capsys.readouterr()
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    for again in (["--out", str(out), *quick], ["--out", str(out), "--eval-only", "--no-progress"]):
        err = one_line_error(capsys, again)
        assert err == f"error: {out} holds a run: --resume {out} continues it, or pick another --out"
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files  # not a byte changed
    # the fix it names works; a rollout worker with the run's config never writes there, so it may
    assert train.main(["--resume", str(out), "--steps", "3", "--no-progress"]) == 0
    assert sorted(p.name for p in out.glob("ckpt-*")) == ["ckpt-0000001", "ckpt-0000002", "ckpt-0000003"]
    train.validate(train.parse(["--task", "arith", "--role", "rollout", "--trainer-url", "http://127.0.0.1:9",
                                "--out", str(out)]))


def test_a_new_run_never_overwrites_a_users_own_files_of_a_runs_names(capsys, tmp_path):
    """--out DIR replaced a user's own config.yaml, report.html or curve.png there with the run's. Files that
    no run wrote (no .lock) are refused; a directory a failed start left (its .lock) still takes a rerun."""
    quick = ["--steps", "1", "--batch", "4", "--eval-episodes", "1", "--no-progress"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my: settings\n")
    (mine / "curve.png").write_bytes(b"my plot")
    err = one_line_error(capsys, ["--out", str(mine), *quick])
    assert err == (f"error: {mine} holds config.yaml, curve.png, not a run's, which a run would overwrite; "
                   "pick another --out")
    assert sorted(p.name for p in mine.iterdir()) == ["config.yaml", "curve.png"]
    assert (mine / "config.yaml").read_text() == "my: settings\n"
    failed = tmp_path / "failed"  # what a start that failed before its first log left
    failed.mkdir()
    (failed / ".lock").touch()
    (failed / "config.yaml").write_text("task: cartpole\n")
    assert train.main(["--out", str(failed), *quick]) == 0
    assert (failed / "ckpt-0000001").is_dir()
    (mine / "config.yaml").write_bytes(b"\xffmy: settings\n")  # not UTF-8: a traceback under --eval-only
    err = one_line_error(capsys, ["--eval-only", "--out", str(mine), "--eval-episodes", "1"])
    assert err.startswith(f"error: {mine} holds config.yaml, curve.png, not a run's")


def test_a_resume_refuses_an_out_elsewhere_and_takes_its_own(capsys, tmp_path):
    """--resume RUN --out OTHER silently went on in RUN, leaving OTHER empty. Now it is one line; the run's own
    directory as --out, as a script that names both passes it, still resumes."""
    run, quick = tmp_path / "run", ["--steps", "1", "--batch", "4", "--eval-episodes", "1", "--no-progress"]
    assert train.main(["--out", str(run), *quick]) == 0
    capsys.readouterr()
    other = tmp_path / "other"
    err = one_line_error(capsys, ["--resume", str(run), "--out", str(other), "--steps", "2"])
    assert err == f"error: --out {other}: a resumed run goes on in {run}; drop --out" and not other.exists()
    assert train.main(["--resume", str(run), "--out", str(run), "--steps", "2", "--no-progress"]) == 0
    assert sorted(p.name for p in run.glob("ckpt-*")) == ["ckpt-0000001", "ckpt-0000002"]


def test_an_eval_of_a_run_it_may_not_write_to_goes_to_an_out_of_its_own(capsys, tmp_path):
    """--resume RUN --eval-only writes RUN/eval-STEP; where RUN is read-only (a colleague's, an archive) that
    failed with "pick another", and --out was then refused. Now the eval goes to --out, RUN is left as it
    was, and the numbers are those of the eval in RUN/eval-STEP; an --out that holds a run is refused."""
    run, quick = tmp_path / "run", ["--steps", "2", "--batch", "4", "--eval-episodes", "2", "--no-progress"]
    assert train.main(["--out", str(run), *quick]) == 0
    files = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert train.main(["--resume", str(run), "--eval-only", "--out", str(tmp_path / "eval"), "--no-progress"]) == 0
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == files  # not a byte changed
    assert train.main(["--resume", str(run), "--eval-only", "--no-progress"]) == 0  # RUN/eval-0000002
    elsewhere, inside = (rundir.read_metrics(d / "metrics.csv") for d in (tmp_path / "eval", run / "eval-0000002"))
    assert list(elsewhere) == ["eval_return"] and elsewhere["eval_return"][0][::2] == inside["eval_return"][0][::2]
    other = tmp_path / "other"
    assert train.main(["--out", str(other), *quick]) == 0
    capsys.readouterr()
    err = one_line_error(capsys, ["--resume", str(run), "--eval-only", "--out", str(other)])
    assert err == f"error: {other} holds a run: --resume {other} continues it, or pick another --out"


def test_an_eval_only_may_log_again_into_its_own_out_but_never_into_a_training_runs(capsys, tmp_path):
    """A second `--resume RUN --eval-only --out X` (another checkpoint, or the same after a fix) was refused as
    "X holds a run". An eval's directory now takes it, each eval at its checkpoint's step (one of a step
    already there replaces it); a training run into an eval's directory is refused, as the reverse is
    (test_an_eval_of_a_run_it_may_not_write_to_goes_to_an_out_of_its_own)."""
    run, quick = tmp_path / "run", ["--steps", "2", "--batch", "4", "--eval-episodes", "2", "--no-progress"]
    assert train.main(["--out", str(run), "--ckpt-every", "1", "--keep-ckpts", "5", *quick]) == 0
    evals = tmp_path / "evals"
    for ckpt in ("ckpt-0000002", "ckpt-0000001", "ckpt-0000001"):
        assert train.main(["--resume", str(run / ckpt), "--eval-only", "--out", str(evals), "--no-progress"]) == 0
    # ckpt-1's eval keeps ckpt-2's (it dropped every step after its own, silently); its rerun replaces itself
    assert [s for s, _, _ in rundir.read_metrics(evals / "metrics.csv")["eval_return"]] == [1, 2]  # both kept, in step order
    capsys.readouterr()
    err = one_line_error(capsys, ["--out", str(evals), *quick])
    assert err == f"error: {evals} holds a run: --resume {evals} continues it, or pick another --out"
    # an eval's directory for a run: it said "no checkpoint of it loads (above)", with nothing above
    err = one_line_error(capsys, ["--resume", str(evals), "--eval-only", "--no-progress"])
    assert err == f"error: --resume {evals}: it holds no checkpoint; resume another run or ckpt-*"


def test_runs_started_in_the_same_second_without_out_each_get_a_directory(capsys, tmp_path, monkeypatch):
    """The default runs/<task>-<algo>-<time> was shared by a sweep's runs started in one second: the
    second appended to the first's metrics, or was refused once the first had logged a step."""
    monkeypatch.chdir(tmp_path)
    real = rundir.time.strftime  # the time module's own: logging's timestamps (vLLM's, say) still need it
    monkeypatch.setattr(rundir.time, "strftime", lambda fmt, *t: "20261202-000000" if fmt == "%Y%m%d-%H%M%S"
                        else real(fmt, *t))  # one second for all runs
    quick = ["--steps", "1", "--batch", "4", "--eval-episodes", "1", "--no-progress"]
    for seed in "12":
        assert train.main([*quick, "--seed", seed]) == 0
    first = tmp_path / "runs/cartpole-reinforce-20261202-000000"
    second = first.with_name(first.name + "-2")
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [first.name, second.name]
    for run, seed in ((first, 1), (second, 2)):  # each run's own files, each logged once
        assert train.parse(["--resume", str(run)]).seed == seed
        assert [line.split(",")[2] for line in (run / "metrics.csv").read_text().splitlines()].count("reward") == 1
    (tmp_path / "runs").rename(tmp_path / "moved")
    (tmp_path / "runs").write_text("a file where the runs directory goes")
    assert one_line_error(capsys, quick).startswith("error: cannot create the run directory runs/cartpole-")


class Unfinished(envs.CountdownEnv):  # a bug in an env, met at the first eval
    def respond(self, completion):
        return "no reward"


def test_a_start_that_failed_before_logging_a_step_leaves_its_directory_to_the_fixed_command(
        capsys, tmp_path, monkeypatch):
    """A start that fails at the first eval (an env's bug), after config.yaml is written: the fixed command
    (the same --out) must run there, not be told the run exists. A prompt over --max-len, which failed there
    too, stops before a run directory is made, naming the --max-len its eval problem needs."""
    out = tmp_path / "run"
    quick = ["--task", "countdown_multiturn", "--model", "tiny", "--sft-steps", "0", "--steps", "1", "--batch", "2",
             "--group-size", "2", "--eval-size", "1", "--max-new-tokens", "8", "--max-turns", "1", "--no-progress", "--out", str(out)]
    assert re.search(r"has no room for a turn: .* raise --max-len to \d+$", one_line_error(capsys, [*quick, "--max-len", "20"]))
    assert not out.exists()
    with monkeypatch.context() as patch:
        patch.setitem(envs.TEXT_ENVS, "countdown_multiturn", Unfinished)
        assert one_line_error(capsys, quick).startswith("error: Unfinished.respond returned 'no reward' for the ")
    assert (out / "config.yaml").exists() and (out / "metrics.csv").read_text().count("\n") <= 1  # a header
    assert train.main(quick) == 0
    assert {line.split(",")[0] for line in (out / "metrics.csv").read_text().splitlines()[1:]} == {"0", "1"}
    (out / "ckpt-0000001").rename(tmp_path / "moved")  # logged steps alone still make it a run
    assert "holds a run" in one_line_error(capsys, quick)
    header, first, *_ = (out / "metrics.csv").read_text().splitlines(keepends=True)
    (out / "metrics.csv").write_text(header + first)  # so does one logged number
    assert "holds a run" in one_line_error(capsys, quick)


@pytest.mark.parametrize("argv, fix", [
    (["--export", "adapter"], "--export is for LLM tasks, not cartpole"),  # CartPole's are its checkpoints
    (LLM + ["--export-merged"], "--export-merged needs --export DIR"),  # merged into no directory
    (LLM + ["--eval-only", "--role", "trainer"], "--eval-only runs in one process: drop torchrun and --role"),
    (["--log", "tensorbord"], "--log tensorbord: choose from tensorboard, wandb (metrics.csv is always"),
    (["--log", "wandb,,csv"], "--log wandb,,csv: choose from"),  # one unknown name among known ones
    (LLM + ["--prompt-reweight", "1.5"], "need 0 <= --prompt-reweight <= 1 (got 1.5)"),
    (LLM + ["--prompt-reweight", "-0.1"], "need 0 <= --prompt-reweight <= 1 (got -0.1)"),
    (["--task", "countdown_multiturn", "--prompt-reweight", "0.5"],
     "--prompt-reweight needs a single-turn --task (arith, gsm8k); add that or drop it"),
    (["--task", "countdown_multiturn", "--overlong-buffer", "4"], "--overlong-buffer needs a single-turn --task"),
    # a multi-turn env scores with its task's first reward itself: a judge's failure there never drops a group
    (["--task", "countdown_multiturn", "--sft-steps", "0", "--judge-down", "drop"], "--judge-down needs a single-turn --task"),
    # pure OPD (--opd-reward-coef 0) learns the teacher's log-probs alone: reward shaping went unused
    (LLM + ["--algo", "opd", "--teacher", "tiny", "--kl-coef", "0.1", "--kl-in-reward"],
     "--kl-in-reward needs --opd-reward-coef > 0 (pure OPD ignores rewards); add that or drop it"),
    (LLM + ["--algo", "opd", "--teacher", "tiny", "--overlong-buffer", "2"], "--overlong-buffer needs --opd-reward-coef > 0"),
    (LLM + ["--overlong-buffer", "-1"], "need --overlong-buffer 0 (off) or in 1..--max-new-tokens (got -1)"),
    # each of these went unused: only PPO's GAE reads --lam, only its critic --vf-coef, only GRPO --dr-grpo,
    # and full fine-tuning (--no-lora) has no adapter to shape
    (["--algo", "grpo", "--lam", "0.5"], "--lam needs --algo ppo (the only critic); add that or drop it"),
    (LLM + ["--vf-coef", "2"], "--vf-coef needs --algo ppo (the only critic)"),
    (LLM + ["--algo", "rloo", "--dr-grpo"], "--dr-grpo needs --algo grpo (RLOO never divides by its groups' std)"),
    (LLM + ["--no-lora", "--lora-rank", "8"], "--lora-rank needs --lora (full fine-tuning has no adapter); add"),
    (LLM + ["--no-lora", "--lora-targets", "q_proj"], "--lora-targets needs --lora"),
    (["--config", "configs/no_such.yaml"],
     "--config configs/no_such.yaml: no such file, nor a preset of that name"),
    # validate() leaves them to the policy, which refuses them before loading a model
    (LLM + ["--temperature", "0"],
     "need --temperature > 0 and 0 < --top-p <= 1 (got 0.0, 1.0); RL learns from samples (evals decode greedily)"),
    (LLM + ["--top-p", "1.5"], "need --temperature > 0 and 0 < --top-p <= 1 (got 1.0, 1.5)"),
    (LLM + ["--top-p", "0"], "need --temperature > 0 and 0 < --top-p <= 1 (got 1.0, 0.0)"),
])
def test_more_bad_flags_stop_in_one_line_naming_the_fix(capsys, tmp_path, argv, fix):
    evals = ["--eval-size", "1"] if "--task" in argv else ["--eval-episodes", "1"]  # an LLM task's, CartPole's
    quick = ["--steps", "0", *evals]  # a lost check: seconds, not a run
    assert fix in one_line_error(capsys, ["--out", str(tmp_path / "r"), "--no-progress", *quick, *argv])
    assert not (tmp_path / "r").exists()  # refused before the run directory is made


def test_export_merged_of_a_full_fine_tuning_run_is_refused_before_training(capsys, tmp_path):
    """--no-lora trains every weight, so --export writes the whole model either way: --export-merged went unused."""
    argv = [*LLM, "--no-lora", "--export", str(tmp_path / "model"), "--export-merged", "--steps", "0", "--eval-size", "1",
            "--out", str(tmp_path / "r")]
    assert one_line_error(capsys, argv) == ("error: --export-merged needs --export DIR and --lora (an adapter to merge); "
                                            "add that or drop it")
    assert not (tmp_path / "model").exists() and not (tmp_path / "r").exists()


def test_eval_only_under_torchrun_is_refused_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr(utils, "world", lambda: 2)  # as in a torchrun rank, once the process group is up
    err = one_line_error(capsys, ["--eval-only", "--no-progress"])
    assert err == "error: --eval-only runs in one process: drop torchrun and --role"


def test_a_preset_or_a_runs_config_that_is_no_mapping_names_the_file(capsys, tmp_path):
    preset = tmp_path / "list.yaml"
    preset.write_text("- task: arith\n- steps: 3\n")  # a YAML list: each key one item too far in
    err = one_line_error(capsys, ["--config", str(preset)])
    assert err == f"error: {preset}: expected a mapping of config keys"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("just a sentence\n")  # a string, e.g. an overwritten file
    err = one_line_error(capsys, ["--resume", str(tmp_path / "run")])
    assert err == f"error: {tmp_path / 'run' / 'config.yaml'}: expected a mapping of config keys"


def test_resume_of_a_directory_that_is_no_run_says_so(capsys, tmp_path):
    (tmp_path / "ckpt-0000001").mkdir()  # a checkpoint copied out of its run, without the run's config.yaml
    err = one_line_error(capsys, ["--resume", str(tmp_path)])
    assert err == f"error: --resume {tmp_path}: no config.yaml in {tmp_path}: not a run"
    err = one_line_error(capsys, ["--resume", str(tmp_path / "ckpt-0000001")])  # a ckpt-*: its run's config
    assert err == f"error: --resume {tmp_path / 'ckpt-0000001'}: no config.yaml in {tmp_path}: not a run"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-0000001"]  # nothing written there


def test_a_model_directory_whose_tokenizer_cannot_load_is_one_line(capsys, tmp_path):
    model = Path(build_tiny_model(str(tmp_path / "m"), layers=1, hidden=64, heads=1, intermediate=128))
    argv = ["--task", "arith", "--model", str(model), "--no-progress", "--out", str(tmp_path / "r")]
    (model / "tokenizer.json").write_text('{"version": ')  # cut short by a copy
    err = one_line_error(capsys, argv)
    assert err.startswith(f"error: --model {model}: cannot load its tokenizer (") and "tokenizer files" in err
    for name in ("tokenizer.json", "tokenizer_config.json"):  # none at all: a directory of weights only
        (model / name).unlink()
    assert one_line_error(capsys, argv).startswith(f"error: --model {model}: cannot load its tokenizer (")


@pytest.mark.parametrize("row", ['{"question": "What is 9?"}', '{"question": "What is 9?", "answer": null}'])
def test_a_data_row_without_an_answer_is_named_by_file_and_line(capsys, tmp_path, row):
    data = tmp_path / "rows.jsonl"
    good = [f'{{"question": "What is {a} plus 1?", "answer": "#### {a + 1}"}}' for a in range(4)]
    data.write_text("\n".join([*good[:2], row, *good[2:]]) + "\n")  # line 3
    argv = ["--task", "gsm8k", "--data", str(data), "--eval-size", "2", "--bad-rows", "error",
            "--no-progress", "--out", str(tmp_path / "r")]
    err = one_line_error(capsys, argv)
    assert err == (f"error: --task gsm8k: {data}:3: malformed row (missing field 'answer'); fix or delete "
                   "that line, or pass --bad-rows skip to drop such rows")
    skipped = f"gsm8k: skipped 1 malformed rows: {data}:3 (missing field 'answer')"
    with pytest.warns(UserWarning, match=f"^{re.escape(skipped)}$"):  # --bad-rows skip: counted and named
        task = tasks.make_task("gsm8k", seed=0, eval_size=2, data=str(data))
    assert len(task._eval) + len(task._train) == 4  # the four rows with an answer




def test_ref_logp_without_a_frozen_copy_refuses_rather_than_scoring_the_trained_weights(tmp_path):
    """train calls ref_logp only with --kl-coef, which makes full fine-tuning's frozen copy; a caller without
    one would get the policy's own log-probs back (a KL of 0 at every step), so it is refused."""
    tiny = build_tiny_model(str(tmp_path / "m"), layers=1, hidden=64, heads=1, intermediate=128)
    policy = LLMPolicy(train.Config(model=tiny, lora=False), device="cpu")
    prefix = [policy.encode_prompt("1+2=")]
    batch = make_batch(prefix, policy.generate(prefix, 3), [1.0], policy.pad_id)
    with pytest.raises(utils.ConfigError) as e:
        policy.ref_logp(batch, slice(0, 1))
    assert str(e.value) == "ref_logp under full fine-tuning needs kl_coef > 0 (its frozen copy)"


def test_resume_of_a_run_none_of_whose_checkpoints_loads_warns_and_starts_over_as_new(capsys, tmp_path):
    """--resume RUN (neither a named ckpt-* nor --eval-only) whose every checkpoint is damaged: each is
    named, then the run starts over at step 0 with its own config, and ends as the run did the first time."""
    out, quick = tmp_path / "run", ["--steps", "2", "--batch", "4", "--eval-episodes", "1", "--no-progress"]
    assert train.main(["--out", str(out), "--ckpt-every", "1", "--target", "0", *quick]) == 0
    first = (out / "ckpt-0000002" / "weights.safetensors").read_bytes()
    for ckpt in rundir.checkpoints(out):
        (ckpt / "weights.safetensors").write_bytes(b"")  # what a full disk leaves
    capsys.readouterr()
    assert train.main(["--resume", str(out), "--no-progress"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "--resume" in line or "skipping" in line]
    assert [line.split(":")[0] for line in err] == [f"skipping {out / 'ckpt-0000002'}",
                                                    f"skipping {out / 'ckpt-0000001'}", f"--resume {out}"]
    assert err[-1] == f"--resume {out}: no checkpoint loads; the run starts over"
    assert (out / "ckpt-0000002" / "weights.safetensors").read_bytes() == first  # step 0's seed: the same run
    steps = [s for s, _, _ in rundir.read_metrics(out / "metrics.csv")["loss"]]
    assert steps == [1, 2]  # the first attempt's rows were dropped, not logged twice


def test_resume_of_a_run_that_ran_all_its_steps_says_nothing_trains_and_how_to_go_on(capsys, tmp_path):
    """It printed the run's summary again, as a run that had trained does, and said nothing else."""
    out, quick = tmp_path / "run", ["--batch", "4", "--eval-episodes", "1", "--target", "0", "--no-progress"]
    assert train.main(["--out", str(out), "--steps", "2", *quick]) == 0
    logged = (out / "metrics.csv").read_bytes()
    capsys.readouterr()
    for extra in ([], ["--steps", "1"]):
        assert train.main(["--resume", str(out), "--no-progress", *extra]) == 0
        warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
        assert warned == [f"warning: the run is at step 2 of --steps {extra[-1] if extra else 2}; raise it to go on"]
        assert (out / "metrics.csv").read_bytes() == logged  # no step ran, none was logged again
    assert train.main(["--resume", str(out), "--eval-only", "--no-progress"]) == 0  # an eval is what it asks
    assert train.main(["--resume", str(out), "--steps", "3", "--no-progress"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert [s for s, _, _ in rundir.read_metrics(out / "metrics.csv")["loss"]] == [1, 2, 3]
    assert b"\r" not in (out / "metrics.csv").read_bytes()  # csv's "\r\n" rows beside the "\n" a resume kept


def test_an_eval_split_larger_than_a_tasks_distinct_problems_names_a_size_that_trains(capsys, tmp_path):
    """It said only "lower --eval-size": lowered to the count it found (all of them held out), the first
    training step failed with a traceback after 10,000 draws. It now names a size that leaves as many."""
    err = one_line_error(capsys, ["--task", "sql", "--model", "tiny", "--eval-size", "400", "--no-progress",
                                  "--out", str(tmp_path / "r")])  # sql has a few hundred distinct questions
    found = re.fullmatch(r"error: --task sql: found only (\d+) distinct problems; --eval-size 400 leaves too few "
                         r"to train on; lower it to (\d+) or less", err)
    assert found and int(found[2]) == int(found[1]) // 2, err
    task = envs.SQLTask(eval_size=int(found[2]))  # the size it names: held out, and the rest still trains
    assert len(task._eval) == int(found[2]) and task.train_problem(0).key not in task._eval_keys


def test_a_tiny_model_whose_heads_are_not_64_wide_names_dimensions_that_build(tmp_path):
    """hidden=100 was told "try heads=1" (100 / 1 is no more 64), and hidden=32 "try heads=0"."""
    for hidden, heads, fix in ((128, 4, "heads=2"), (100, 1, "hidden=64"), (32, 1, "hidden=64"),
                               (96, 2, "hidden=128")):
        with pytest.raises(utils.ConfigError) as e:
            build_tiny_model(str(tmp_path / "m"), layers=1, hidden=hidden, heads=heads, intermediate=128)
        assert str(e.value) == f"tiny model needs hidden / heads == 64 (got {hidden} / {heads}); try {fix}"
        assert not (tmp_path / "m").exists()  # refused before anything is written
        dims = {"hidden": hidden, "heads": heads, **{k: int(v) for k, v in [fix.split("=")]}}
        path = build_tiny_model(str(tmp_path / fix), layers=1, intermediate=128, **dims)  # the fix builds
        config = json.loads((Path(path) / "config.json").read_text())
        assert config["hidden_size"] == 64 * config["num_attention_heads"] and config["head_dim"] == 64


def test_memory_a_run_cannot_have_is_one_line_naming_the_flags_that_size_it(tmp_path):
    """--hidden 100000 (a typo's extra zeros) asks torch's CPU allocator for a 40 GB matrix: it was a
    traceback. The address space is capped, so the allocation fails alike on a machine with more memory."""
    def six_gib():
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, resource.RLIM_INFINITY))

    run = subprocess.run([sys.executable, "train.py", "--hidden", "100000", "--steps", "1", "--no-progress",
                          "--out", str(tmp_path / "r")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         preexec_fn=six_gib)
    assert run.returncode == 1 and run.stderr.splitlines() == [
        "error: out of memory (allocate 40000000000 bytes); lower --micro-batch, --gen-batch, --batch or an "
        "eval's size, then --resume the run or run again"], run.stderr


@pytest.mark.parametrize("error, asked", [
    (MemoryError("Unable to allocate 381. MiB for an array with shape (100000000, 4) and data type bool"),
     "allocate 381. MiB"),  # numpy's, e.g. --eval-episodes 100000000
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
                            "139.8 GiB of which 3.6 MiB is free."), "allocate 20.00 MiB"),
    (MemoryError(), "MemoryError"),  # Python's own says nothing
    (RuntimeError("shape '[2, 3]' is invalid for input of size 7"), None),  # a bug: shown whole
    (OSError(2, "No such file or directory"), None)])
def test_refused_tells_memory_a_run_lacks_from_a_bug(error, asked):
    said = utils.refused(error)
    assert said == (asked and f"out of memory ({asked}); lower --micro-batch, --gen-batch, --batch or an "
                    "eval's size, then --resume the run or run again")
    assert utils.refused(OSError(28, "No space left on device")) == (
        "a write failed ([Errno 28] No space left on device); make room, then --resume the run or run again")


def test_under_torchrun_the_resource_line_names_the_rank_that_lacked_it(capsys, monkeypatch):
    """One rank's GPU runs out (or its node's disk fills): the line said what, not where."""
    monkeypatch.setattr(utils, "world", lambda: 2)  # as in a torchrun rank, once the process group is up
    monkeypatch.setattr(utils, "rank", lambda: 1)

    def out_of_memory(cfg):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 1 has a total capacity")
    monkeypatch.setattr(train, "train", out_of_memory)
    assert train.main(["--no-progress"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "error: rank 1 of 2: out of memory (allocate 20.00 MiB); lower --micro-batch, --gen-batch, --batch or "
        "an eval's size, then --resume the run or run again"]


def test_resume_of_a_run_that_reached_its_target_trains_no_further_until_the_target_is_raised(capsys, tmp_path):
    """A run that stopped at its --target trained on when resumed (a requeued job, a --resume to export), to
    its next eval. Its checkpoint now holds its last eval: the resume says so and trains nothing, unless
    --target is raised (0: never)."""
    out = tmp_path / "run"
    quick = ["--batch", "4", "--eval-episodes", "1", "--eval-every", "2", "--no-progress"]
    assert train.main(["--out", str(out), "--steps", "6", "--target", "1", *quick]) == 0  # any return is >= 1
    logged = (out / "metrics.csv").read_bytes()
    assert [s for s, _, _ in rundir.read_metrics(out / "metrics.csv")["loss"]] == [1, 2]
    capsys.readouterr()
    assert train.main(["--resume", str(out), "--no-progress"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warned == ["warning: the run is at step 2 at its --target 1.0; raise it to go on"]
    assert (out / "metrics.csv").read_bytes() == logged  # no step ran, none was logged again
    assert train.main(["--resume", str(out), "--target", "0", "--no-progress"]) == 0
    assert [s for s, _, _ in rundir.read_metrics(out / "metrics.csv")["loss"]] == [1, 2, 3, 4, 5, 6]


def test_a_resume_that_changes_the_warm_start_is_refused_in_one_line(capsys, tmp_path):
    """The warm-start is fixed when a run starts: a changed --sft-steps on --resume was silently ignored."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(utils.dump_config(train.Config(task="arith", model="tiny", sft_steps=200)))
    err = one_line_error(capsys, ["--resume", str(run), "--sft-steps", "50"])
    assert err == "error: --sft-steps 50: its warm-start was 200; drop it"
    assert train.parse(["--resume", str(run), "--sft-steps", "200"]).sft_steps == 200  # the same is no change
    assert train.parse(["--resume", str(run), "--eval-only", "--sft-steps", "0"]).sft_steps == 0  # nothing trains


def test_a_path_fails_at_once_and_only_a_hub_id_is_asked_of_the_hub(tmp_path, monkeypatch):
    """configs/smollm2_add_opd_cpu.yaml run before its teacher was made: `runs/add-teacher` was asked of the
    hub (~25 s of retries offline) before its error. A hub id is NAME or OWNER/NAME; a longer path, or one
    into a directory here without models, is a missing directory at once; a run's directory is named as one."""
    import transformers
    import modeldir
    asked = []

    def hub(name, *args, **kwargs):
        asked.append(name)
        raise OSError(f"{name} is not on the hub")
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", hub)
    monkeypatch.setattr(utils, "hub_out_of_reach", lambda: False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "teacher").mkdir(parents=True)
    (tmp_path / "runs" / "teacher" / "config.yaml").write_text("task: arith\n")
    (tmp_path / "Qwen" / "Qwen3-8B").mkdir(parents=True)
    (tmp_path / "Qwen" / "Qwen3-8B" / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    for path in ("runs/add-teacher", "runs/x/ckpt-0000010", "models/a/b", "./x", "empty/x"):
        with pytest.raises(utils.ConfigError, match=rf"^--model {path}: no such directory; check the model"):
            modeldir.resolve_model(path)
    with pytest.raises(utils.ConfigError, match=r"^--model runs/teacher: a run directory, not a model; "
                       r"--resume runs/teacher --eval-only --export DIR --export-merged writes one that"):
        modeldir.resolve_model("runs/teacher")
    with pytest.raises(utils.ConfigError, match=r"^--model Qwen/Qwen3-0.6B: cannot load it \(Qwen/Qwen3"):
        modeldir.resolve_model("Qwen/Qwen3-0.6B")  # ./Qwen holds a model, no run: a hub id, asked of the hub
    with pytest.raises(utils.ConfigError, match=r"^--model gpt2: cannot load it \(gpt2"):
        modeldir.resolve_model("gpt2")  # a NAME alone is a hub id, whatever this directory holds
    assert asked == ["Qwen/Qwen3-0.6B", "gpt2"]


def test_a_resume_that_swaps_the_teacher_warns_as_one_that_swaps_the_model(capsys, tmp_path):
    """--algo opd trains toward --teacher: a resume with another one replaced it without a word."""
    run = tmp_path / "run"
    run.mkdir()
    saved = train.Config(task="arith", model="tiny", algo="opd", teacher="tiny", sft_steps=0, group_size=8)
    (run / "config.yaml").write_text(utils.dump_config(saved))
    capsys.readouterr()
    cfg = train.parse(["--resume", str(run), "--teacher", "/teachers/t2", "--opd-reward-coef", "0.5"])
    assert cfg.teacher == "/teachers/t2" and capsys.readouterr().err.splitlines() == [
        "warning: teacher '/teachers/t2' replaces the run's 'tiny'",
        "warning: opd_reward_coef 0.5 replaces the run's 0.0"]


def test_a_resume_that_rescales_the_adapter_warns_as_one_that_swaps_the_model(capsys, tmp_path):
    """LoRA's update is scaled by alpha / rank: a resume with another --lora-alpha loads the checkpoint (the
    tensors' shapes are alike) and changed what the trained adapter does without a word."""
    run = tmp_path / "run"
    run.mkdir()
    saved = train.Config(task="arith", model="tiny", algo="grpo", lora=True, sft_steps=0, group_size=8)
    (run / "config.yaml").write_text(utils.dump_config(saved))
    capsys.readouterr()
    cfg = train.parse(["--resume", str(run), "--lora-alpha", "64"])
    assert cfg.lora_alpha == 64
    assert capsys.readouterr().err.splitlines() == ["warning: lora_alpha 64 replaces the run's 32"]


def test_a_model_whose_files_lack_its_weights_is_refused_not_filled_at_random(capsys, tmp_path):
    """config.json and a tokenizer beside a weights file of another model (an adapter's, a wrong copy): the
    missing weights were drawn at random, and the run evaluated (or trained) that, exiting 0."""
    from safetensors.torch import save_file
    import shutil
    model = tmp_path / "model"
    shutil.copytree(build_tiny_model(str(tmp_path / "tiny"), layers=1, hidden=64, heads=1, intermediate=128), model)
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}, str(model / "model.safetensors"))
    cfg = utils.load_config(train.Config, ["--task", "arith", "--model", str(model)])
    with pytest.raises(utils.ConfigError) as e:  # (main prints it as one line; transformers logs its table)
        LLMPolicy(cfg)
    assert re.fullmatch(rf"--model {model}: its files hold no weights for \d+ of its tensors \(e\.g\. "
                        r"[\w.]+\); pass a whole model, not a vocab-only or adapter file", str(e.value))


@pytest.mark.parametrize("line", ["out: [/tmp/listed]", "task: [cartpole]", "log: {tensorboard: 1}"])
def test_a_yaml_list_or_mapping_for_a_text_setting_is_refused_naming_the_file(capsys, tmp_path, line):
    """`out: [dir]` ran, into a directory named "['dir']" in the working directory."""
    (tmp_path / "p.yaml").write_text(line + "\n")
    err = one_line_error(capsys, ["--config", str(tmp_path / "p.yaml"), "--steps", "1"])
    key, value = line.split(": ", 1)
    assert err.startswith(f"error: {tmp_path / 'p.yaml'}: '{key}' must be text, got ") and not Path("['/tmp").exists()


def test_a_data_row_past_the_models_context_is_a_malformed_row_named_by_file_and_line(capsys, tmp_path):
    """Nothing compared a prompt with the model's context: a 3,000-token row trained past the tiny model's
    1,024 positions, silently; a 2M-character one ended in an out-of-memory line naming no row; and async
    refused every batch that held it. Now it is a malformed row: skipped and named, or (error) one line."""
    tiny = build_tiny_model(str(tmp_path / "m"), layers=1, hidden=64, heads=1, intermediate=128, max_len=256)
    flags = ["--task", "gsm8k", "--model", tiny, "--max-new-tokens", "8", "--eval-size", "2"]
    policy = LLMPolicy(train.parse(flags))
    fits = [f"What is {a} plus 1?" for a in range(4)]
    size = lambda q: len(policy.encode_prompt(f"{q}\n{tasks.TASKS['gsm8k'].instruction}"))  # the row's prompt
    question = lambda n: "What is 1 plus 1" + "?" * (n - size("What is 1 plus 1?") + 1)  # n tokens: chars
    data = tmp_path / "rows.jsonl"
    rows = [*fits[:2], question(248), question(249), *fits[2:]]  # 256 positions less 8 new tokens: 248 fit
    data.write_text("".join(json.dumps({"question": q, "answer": "#### 2"}) + "\n" for q in rows))
    assert [size(q) for q in rows[2:4]] == [248, 249]
    why = ("prompt of 249 tokens after the chat template; the model's 256-token context less --max-new-tokens 8 "
           "leaves 248: shorten the question or delete the row")
    with pytest.warns(UserWarning, match=f"^{re.escape(f'gsm8k: skipped 1 malformed rows: {data}:4 ({why})')}$"):
        source = TaskRollouts(train.parse([*flags, "--data", str(data)]), policy)
    assert sorted(p.key for p in source.task._eval + source.task._train) == sorted(rows[:3] + rows[4:])
    argv = [*flags, "--data", str(data), "--bad-rows", "error", "--no-progress", "--out", str(tmp_path / "r")]
    assert one_line_error(capsys, argv) == (f"error: --task gsm8k: {data}:4: malformed row ({why}); fix or "
                                            "delete that line, or pass --bad-rows skip to drop such rows")


@pytest.mark.parametrize("registry, entry, says", [
    (tasks.TASKS, lambda: tasks.Add(), "tasks.TASKS['mine'] is <tasks.Add object at"),  # an instance
    (tasks.TASKS, lambda: tasks.int_correct, "tasks.TASKS['mine'] is <function int_correct at"),
    (envs.TEXT_ENVS, lambda: tasks.Add, "envs.TEXT_ENVS['mine'] is <class 'tasks.Add'>, not a TextEnv subclass"),
])
def test_a_registry_entry_that_is_no_task_class_is_named_in_one_line(capsys, monkeypatch, registry, entry, says):
    """A user's edit of tasks.py (or envs.py) that registers an instance or a function: it was a traceback
    (issubclass() arg 1 must be a class; 'function' object has no attribute 'max_new_tokens')."""
    monkeypatch.setitem(registry, "mine", entry())
    err = one_line_error(capsys, ["--task", "mine", "--steps", "0", "--no-progress"])
    assert says in err and err.endswith("register the class itself, not an instance or a function"), err


def test_a_resumed_runs_config_yaml_taken_as_a_preset_starts_a_new_run(capsys, tmp_path):
    """config.yaml kept the --resume that last continued the run: `--config RUN/config.yaml --out NEW` was
    refused ("a resumed run goes on in RUN; drop --out"), and without --out it trained RUN on instead."""
    run, quick = tmp_path / "run", ["--eval-episodes", "1", "--no-progress"]
    assert train.main(["--out", str(run), "--steps", "1", *quick]) == 0
    assert train.main(["--resume", str(run), "--steps", "2", *quick]) == 0
    assert train.main(["--config", str(run / "config.yaml"), "--out", str(tmp_path / "new"), "--steps", "1"]) == 0
    assert [c.name for c in rundir.checkpoints(tmp_path / "new")] == ["ckpt-0000001"]
    assert [c.name for c in rundir.checkpoints(run)] == ["ckpt-0000001", "ckpt-0000002"]  # untouched
