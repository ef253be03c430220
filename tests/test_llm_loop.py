"""The one loop on language-model tasks: GRPO on the tiny model, warm-start, multi-turn, debug samples."""
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import rundir
import tasks
import train
import utils
from modeldir import build_tiny_model


def digit_share(prompt, completion, answer):
    """A dense reward a random model already earns sometimes, so every group has spread."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


class Digits(tasks.Arith):
    name, rewards = "digits", [(digit_share, 1.0)]


@pytest.fixture(autouse=True)
def digits_task(monkeypatch):
    monkeypatch.setitem(tasks.TASKS, "digits", Digits)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "m"), layers=2, hidden=128, heads=2, intermediate=256)


pytestmark = pytest.mark.usefixtures("one_thread")


def run(tmp_path, tiny, *argv):
    cfg = utils.load_config(train.Config, ["--model", tiny, "--out", str(tmp_path / "run"), "--no-progress",
                                           "--batch", "8", "--group-size", "4", "--eval-size", "4", *argv])
    return train.train(cfg)


def adapter(out):
    return load_file(str(rundir.checkpoints(out)[-1] / "weights.safetensors"))


def test_tiny_grpo_run_changes_only_the_adapter(tmp_path, tiny):
    torch.manual_seed(0)
    policy, _, _ = train.build(utils.load_config(train.Config, ["--task", "digits", "--model", tiny]))
    init = policy.trainable_state()
    out = run(tmp_path, tiny, "--task", "digits", "--algo", "grpo", "--steps", "3", "--max-new-tokens", "4", "--lr", "1e-2")
    trained = adapter(out)
    assert set(trained) == set(init) and all("lora_" in k for k in trained)
    assert any(not torch.equal(trained[k], init[k]) for k in trained)
    metrics = rundir.read_metrics(out / "metrics.csv")
    assert [s for s, _, _ in metrics["loss"]] == [1, 2, 3]
    assert [s for s, _, _ in metrics["eval_accuracy"]][0] == 0  # the RL curve starts at step 0
    assert all(v == pytest.approx(1.0, abs=1e-5) for _, _, v in metrics["ratio"])  # on-policy, one epoch


def test_warm_start_logs_before_and_after_and_rl_starts_at_step_zero(tmp_path, tiny, capsys):
    out = run(tmp_path, tiny, "--task", "arith", "--algo", "rloo", "--steps", "1", "--max-new-tokens", "4",
              "--sft-steps", "3", "--no-lora", "--lr", "1e-4", "--progress")
    assert "warm-start: 100%" in (err := capsys.readouterr().err) and "| 3/3 [" in err  # its own progress bar
    metrics = rundir.read_metrics(out / "metrics.csv")
    assert [s for s, _, _ in metrics["sft_loss"]] == [-2, -1, 0]
    assert [s for s, _, _ in metrics["eval_accuracy_before_sft"]] == [-3]
    assert metrics["sft_loss"][-1][2] < metrics["sft_loss"][0][2]  # supervised steps on solver demos reduce the loss


def test_kl_to_the_adapter_free_reference_is_logged_and_starts_at_zero(tmp_path, tiny):
    out = run(tmp_path, tiny, "--task", "digits", "--algo", "grpo", "--steps", "2", "--max-new-tokens", "4", "--kl-coef", "0.1",
              "--lr", "1e-2")
    kl = rundir.read_metrics(out / "metrics.csv")["kl"]
    assert kl[0][2] == pytest.approx(0.0, abs=1e-6)  # LoRA B starts at 0: policy == reference
    assert kl[1][2] > 0


def test_debug_samples_print_prompt_completion_and_reward_breakdown(tmp_path, tiny, capsys):
    run(tmp_path, tiny, "--task", "arith", "--algo", "grpo", "--steps", "1", "--max-new-tokens", "3",
        "--debug-samples", "2", "--eval-every", "1")
    err = capsys.readouterr().out
    assert err.count("--- step 0 prompt:") == 2 and "'int_correct':" in err and "answer:" in err


def test_multiturn_grpo_run_completes_with_the_tiny_model(tmp_path, tiny):
    out = run(tmp_path, tiny, "--task", "countdown_multiturn", "--algo", "grpo", "--steps", "1", "--max-new-tokens", "6",
              "--max-turns", "2", "--max-len", "400", "--eval-size", "2")
    metrics = rundir.read_metrics(out / "metrics.csv")
    assert 1 <= metrics["turns"][0][2] <= 2
    assert {"eval_accuracy", "eval_accuracy_first_turn"} <= set(metrics)


def test_no_progress_silences_transformers_own_bars_too(tiny):
    """--no-progress (logs, CI) left transformers' "Loading weights: 100%|####| 39/39" in every log."""
    code = ("import sys, train\nfrom model import LLMPolicy\n"
            "for flag in ('--progress', '--no-progress'):\n"
            "    print('--', flag, file=sys.stderr, flush=True)\n"
            f"    LLMPolicy(train.parse(['--task', 'arith', '--model', {tiny!r}, flag]))\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=Path(train.__file__).parent, capture_output=True,
                         text=True, timeout=300)  # a process of its own: the setting is transformers' global
    shown, silent = run.stderr.split("-- --no-progress")
    assert run.returncode == 0 and "Loading weights" in shown and "Loading weights" not in silent, run.stderr


def test_ppo_on_an_llm_task_is_accepted_now_that_the_policy_has_a_critic():
    train.validate(utils.load_config(train.Config, ["--task", "arith", "--algo", "ppo"]))  # trained in test_variants.py


# ---------------------------------------------------------------- defaults by kind of task
def parse(*argv):
    return utils.load_config(train.Config, list(argv), defaults=train.task_defaults)


def test_an_llm_run_without_flags_records_the_llm_defaults_in_its_config_yaml(tmp_path, tiny):
    argv = ["--task", "arith", "--model", tiny, "--steps", "1", "--eval-size", "4", "--out", str(tmp_path / "run"),
            "--no-progress"]
    assert train.main(argv) == 0
    used = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert {k: used[k] for k in ("algo", "group_size", "batch", "lr", "max_new_tokens", "lora")} == \
        {"algo": "grpo", "group_size": 8, "batch": 64, "lr": 5e-4, "max_new_tokens": 8, "lora": True}


def test_defaults_follow_the_task_and_lora_and_never_override_what_was_given(tmp_path, monkeypatch):
    cartpole = parse("--task", "cartpole")
    assert (cartpole.algo, cartpole.lr, cartpole.batch, cartpole.group_size) == ("reinforce", 0.005, 16, 1)
    assert parse("--task", "countdown").max_new_tokens == tasks.Countdown.max_new_tokens == 512
    assert parse("--task", "countdown_multiturn").max_new_tokens == 512  # the env's task's budget
    assert parse("--task", "arith", "--no-lora").lr == 5e-5  # full fine-tuning moves every weight
    # per token, CartPole's 0.99 gave a correct 300-token answer's first tokens negative reinforce_pp advantages
    assert [parse(*a).gamma for a in (("--task", "gsm8k", "--algo", "reinforce_pp"), ("--task", "countdown_multiturn"),
                                      ("--task", "arith", "--gamma", "0.9"))] == [1.0, 1.0, 0.9]
    given = parse("--task", "arith", "--algo", "rloo", "--lr", "0.003", "--group-size", "4", "--batch", "8",
                  "--max-new-tokens", "5")
    assert (given.algo, given.lr, given.group_size, given.batch, given.max_new_tokens) == ("rloo", 0.003, 4, 8, 5)
    preset = parse("--config", "configs/arith_tiny_cpu.yaml")  # a preset's keys win too
    assert (preset.lr, preset.batch, preset.max_new_tokens, preset.algo) == (5e-5, 128, 4, "grpo")
    (tmp_path / "p.yaml").write_text("task: arith\nlora: false\n")
    assert parse("--config", str(tmp_path / "p.yaml")).lr == 5e-5  # defaults read the preset's lora
    monkeypatch.setitem(sys.modules, "datasets", types.ModuleType("datasets"))  # installed (.[hub]), as gsm8k needs
    train.validate(parse("--task", "gsm8k"))  # the LLM defaults pass validation as they are


def test_the_random_init_tiny_model_gets_a_warm_start_and_full_fine_tuning_by_default():
    tiny = parse("--task", "arith")  # --model tiny is the default: every reward 0 until it imitates the solver
    assert (tiny.model, tiny.sft_steps, tiny.lora, tiny.lr) == ("tiny", 200, False, 5e-5)
    assert (parse("--task", "sql").sft_steps, parse("--task", "cartpole").sft_steps) == (200, 0)
    real = parse("--task", "arith", "--model", "smollm2-135m")  # a pretrained model starts from RL
    assert (real.sft_steps, real.lora, real.lr) == (0, True, 5e-4)
    lora = parse("--task", "arith", "--lora", "--sft-steps", "0")  # what is given still wins
    assert (lora.sft_steps, lora.lora, lora.lr) == (0, True, 5e-4)
    train.validate(tiny)
    for flag, value in (("--lora-rank", "8"), ("--lora-alpha", "8"), ("--lora-targets", "q_proj")):
        shaped = parse("--task", "arith", flag, value)  # a LoRA option asks for LoRA: it was silently unused
        assert (shaped.lora, shaped.lr) == (True, 5e-4)
    assert parse("--task", "arith", "--no-lora", "--lora-rank", "8").lora is False  # given: it wins


@pytest.mark.parametrize("argv, rows", [
    (["--task", "countdown", "--model", "smollm2-135m"], 4),  # 2048 // 512: was the whole batch of 64 rows
    (["--task", "countdown", "--model", "smollm2-135m", "--max-new-tokens", "64"], 32),  # the given budget
    (["--task", "countdown", "--model", "smollm2-135m", "--max-new-tokens", "683"], 2),  # 3 x 683 = 2049
    (["--task", "countdown", "--model", "smollm2-135m", "--max-new-tokens", "4096"], 1),  # at least a row
    (["--task", "arith", "--model", "smollm2-135m"], 256),  # 8 tokens: one pass for the batch
    (["--task", "sql", "--model", "smollm2-135m"], 1),  # an episode may run to --max-len 2048
    (["--task", "sql", "--model", "smollm2-135m", "--max-len", "512"], 4),  # the given one (was ignored: 1)
    (["--task", "countdown", "--model", "smollm2-135m", "--micro-batch", "0"], 0),  # what is given wins
    (["--task", "countdown"], 0),  # the tiny model: a few MB of activations, one pass is fastest
    (["--task", "cartpole"], 0),
])
def test_a_pretrained_models_update_runs_in_micro_batches_of_about_2048_tokens(argv, rows):
    """At the default batch, countdown's update on SmolLM2 needed over 24 GiB: 16 rows of 512 tokens
    peaked at 20 GiB; 4 at 8.8 GiB, 3x faster (bench/memory.py). A micro-batch never changes the gradient."""
    assert type(parse(*argv).micro_batch) is int and parse(*argv).micro_batch == rows


def test_eval_sampling_never_changes_the_training_run(tmp_path, tiny):
    """--pass-k samples at every eval from a fork of the RNG, so neither it nor --eval-every changes what
    training samples: the two runs below train alike. (A stop during an eval saves the step's checkpoint
    with the RNG as the step left it; with the fork, that is the RNG the next step draws from.)"""
    common = ["--task", "digits", "--algo", "grpo", "--steps", "3", "--max-new-tokens", "4", "--lr", "1e-2"]
    sampled = run(tmp_path / "a", tiny, *common, "--eval-every", "1", "--pass-k", "2")
    greedy = run(tmp_path / "b", tiny, *common, "--eval-every", "3")
    a, b = (rundir.read_metrics(out / "metrics.csv") for out in (sampled, greedy))
    assert [s for s, _, _ in a["eval_pass@2"]] == [0, 1, 2, 3] and "eval_pass@2" not in b
    assert [v for _, _, v in a["reward"]] == [v for _, _, v in b["reward"]]
    assert [v for _, _, v in a["loss"]] == [v for _, _, v in b["loss"]]
    assert all(torch.equal(w, adapter(greedy)[k]) for k, w in adapter(sampled).items())
