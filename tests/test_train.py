"""The loop on CartPole: config handling, validation, invariants of one update, resume."""
import copy
import dataclasses
import errno
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import rollouts
import rundir
import train
import utils
from envs import EVAL_SEED, CartPole
from model import MLPPolicy
from rollouts import rollout_control

pytestmark = pytest.mark.usefixtures("one_thread")  # the tiny models' runs: conftest says why

CONFIGS = sorted(Path(__file__).parent.parent.glob("configs/cartpole_*.yaml"))


def cfg_from(argv):
    return utils.load_config(train.Config, argv)


def quick(tmp_path, *argv):
    return cfg_from(["--out", str(tmp_path / "run"), "--no-progress", "--batch", "4", "--eval-episodes", "2", *argv])


def weights(run: Path) -> dict:
    return load_file(str(rundir.checkpoints(run)[-1] / "weights.safetensors"))


# ---------------------------------------------------------------- config
def test_cli_flags_override_yaml_preset_which_overrides_defaults(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("algo: grpo\ngroup_size: 4\nlr: 0.5\n")
    cfg = cfg_from(["--config", str(preset), "--lr", "0.25", "--no-progress"])
    assert (cfg.algo, cfg.group_size, cfg.lr, cfg.progress, cfg.gamma) == ("grpo", 4, 0.25, False, 0.99)


@dataclasses.dataclass
class Documented:
    """A config in train.Config's style: --help reads each field's comment and section from the source."""
    steps: int = 1  # on its own line
    # ---- LLM tasks
    # a comment too long for its field's line sits above it
    model: str = "tiny"
    lr: float = 0.5
    # ---- second section
    lora: bool = True  # its own, not the one above


def test_field_docs_read_a_comment_beside_its_field_or_above_it_within_the_section_it_sits_in():
    assert utils.field_docs(Documented) == {
        "steps": ("run", "on its own line"),
        "model": ("LLM tasks", "a comment too long for its field's line sits above it"),
        "lr": ("LLM tasks", ""),  # the comment above was model's alone
        "lora": ("second section", "its own, not the one above")}


def test_config_round_trips_through_yaml(tmp_path):
    cfg = cfg_from(["--algo", "rloo", "--group-size", "4", "--dr-grpo", "--lr", "3e-4"])
    (tmp_path / "c.yaml").write_text(utils.dump_config(cfg))
    assert cfg_from(["--config", str(tmp_path / "c.yaml")]) == cfg


def test_unknown_yaml_key_names_the_closest_valid_key_and_none_when_none_is_close(tmp_path):
    (tmp_path / "bad.yaml").write_text("lrr: 0.1\n")
    with pytest.raises(utils.ConfigError, match="unknown key 'lrr'.*'lr'"):
        cfg_from(["--config", str(tmp_path / "bad.yaml")])
    (tmp_path / "bad.yaml").write_text("xyzzy: 0.1\n")  # 'dtype' is its likeliest, yet far from it
    with pytest.raises(utils.ConfigError) as e:
        cfg_from(["--config", str(tmp_path / "bad.yaml")])
    assert str(e.value) == f"{tmp_path / 'bad.yaml'}: unknown key 'xyzzy'"


@pytest.mark.parametrize("key", ["1", "null", "yes"])  # YAML reads them as 1, None, True: no text
def test_a_yaml_key_that_is_no_text_is_an_unknown_key(tmp_path, key):
    (tmp_path / "bad.yaml").write_text(f"{key}: 2\n")  # difflib failed on it: 'int' object is not iterable
    with pytest.raises(utils.ConfigError, match=r"bad.yaml: unknown key '(1|None|True)'"):
        cfg_from(["--config", str(tmp_path / "bad.yaml")])


def test_an_int_is_taken_whole_up_to_int64_and_refused_past_it(tmp_path):
    """2**63 - 1 (past a float's 53 bits) was 'must be int', compared with its float; past int64 a --seed or
    --batch was a traceback (Overflow when unpacking long long; numpy's Maximum allowed dimension exceeded)."""
    (tmp_path / "p.yaml").write_text(f"steps: 3.0\nbatch: {2**53 + 1}\n")
    cfg = cfg_from(["--config", str(tmp_path / "p.yaml"), "--seed", str(2**63 - 1)])
    assert (cfg.steps, cfg.batch, cfg.seed) == (3, 2**53 + 1, 2**63 - 1)
    for argv, got in ((["--seed", str(2**63)], "'9223372036854775808'"), (["--batch", str(10**20)], f"'{10**20}'")):
        with pytest.raises(utils.ConfigError, match=f"must be an int within \\+-2\\*\\*63, got {got}"):
            cfg_from(argv)
    for line, says in (("steps: 3.5", "'steps' must be int, got 3.5"),  # YAML floats: not whole, or past
                       ("batch: 1.0e+20", "'batch' must be an int within")):
        (tmp_path / "p.yaml").write_text(line)
        with pytest.raises(utils.ConfigError, match=says):
            cfg_from(["--config", str(tmp_path / "p.yaml")])


@pytest.mark.parametrize("name", ["arith_tiny_cpu", "configs/arith_tiny_cpu", "arith_tiny_cpu.yml"])
def test_a_preset_named_without_its_yaml_suffix_is_named_whole(name):
    with pytest.raises(utils.ConfigError) as e:  # it said "nor a preset of that name", and no name
        cfg_from(["--config", name])
    assert str(e.value) == (f"--config {name}: no such file, nor a preset of that name (presets live in configs/); "
                            "did you mean 'arith_tiny_cpu.yaml'?")


def test_unknown_flag_names_the_closest_valid_flag():
    with pytest.raises(utils.ConfigError, match="unknown flag --group-sise.*'--group-size'"):
        cfg_from(["--group-sise", "4"])


def test_a_flag_is_never_taken_as_an_abbreviation():  # --step 3 is a typo, not a silent --steps 3
    with pytest.raises(utils.ConfigError, match="unknown flag --step; did you mean '--steps'"):
        cfg_from(["--step", "3"])


@pytest.mark.parametrize("argv, said", [
    (["arith"], "unexpected value 'arith': did you mean '--task arith'?"),  # the flag's name left out
    (["--steps", "3", "grpo"], "unexpected value 'grpo': did you mean '--algo grpo'?"),
    (["--lora", "false"], "unexpected value 'false': --lora is a switch, without a value: --lora turns it on, "
                          "--no-lora off"),
    (["--steps", "3", "4"], "unexpected value '4': a flag takes a value, a switch (--lora) none"),
])
def test_a_value_without_its_flag_is_named_as_a_value_never_as_an_unknown_flag(argv, said):
    with pytest.raises(utils.ConfigError) as e:  # it was "unknown flag arith; did you mean '--batch'?"
        utils.load_config(train.Config, argv, train.choices())
    assert str(e.value) == said


def test_badly_typed_value_names_the_key():
    with pytest.raises(utils.ConfigError, match="'batch' must be int"):
        cfg_from(["--batch", "many"])


@pytest.mark.parametrize("data", [b"lr: [\n", b"\xff\xfebinary", None])  # None: a directory
def test_an_unreadable_preset_is_one_config_error(tmp_path, data):
    path = tmp_path / "preset.yaml"
    if data is None:
        path.mkdir()
    else:
        path.write_bytes(data)
    with pytest.raises(utils.ConfigError, match="preset.yaml: cannot read it as YAML"):
        cfg_from(["--config", str(path)])


def test_a_preset_key_given_twice_is_refused_naming_its_second_line_while_a_merge_may_override(tmp_path):
    """PyYAML kept the later value silently: an lr appended at the end overrode the one at the top."""
    (tmp_path / "twice.yaml").write_text("task: arith\nlr: 0.001\nsteps: 3\nlr: 0.01\n")
    with pytest.raises(utils.ConfigError) as e:
        cfg_from(["--config", str(tmp_path / "twice.yaml")])
    assert str(e.value) == f"{tmp_path / 'twice.yaml'}: cannot read it as YAML ('lr' is given twice (again on " \
                           "line 4); keep one)"
    (tmp_path / "merge.yaml").write_text("task: arith\n<<: {lr: 0.001, steps: 3}\nlr: 0.01\n")
    cfg = cfg_from(["--config", str(tmp_path / "merge.yaml")])  # YAML's merge: its keys are defaults here
    assert (cfg.lr, cfg.steps) == (0.01, 3)


def test_a_flag_that_is_no_yaml_names_the_flag_and_its_type():
    with pytest.raises(utils.ConfigError, match="--lr: 'lr' must be float, got '\\['"):
        cfg_from(["--lr", "["])


def test_a_yaml_nan_or_inf_is_no_float_setting(tmp_path):
    (tmp_path / "nan.yaml").write_text("lr: .nan\ntis_cap: .inf\n")
    with pytest.raises(utils.ConfigError, match="nan.yaml: 'lr' must be a finite float, got nan"):
        cfg_from(["--config", str(tmp_path / "nan.yaml")])


@pytest.mark.parametrize("text, message", [
    ("steps: true\n", "'steps' must be int, got True"),  # YAML's true is no number
    ("lora: 1\n", "'lora' must be bool, got 1"),  # nor its 1 a bool
    ("steps: 3.5\n", "'steps' must be int, got 3.5"),  # not rounded down to 3 steps
    ("tis: off\n", "'tis' must be text, got False: quote it, as in 'off'"),  # was "unknown --tis 'False'"
    ("export: null\n", "'export' must be text, got None"),  # was an export into a directory named None
    ("out: [runs]\n", "'out' must be text, got \\['runs'\\]$"),  # not a run written into "['runs']"
])
def test_a_yaml_value_of_another_type_names_the_key_and_the_fix(tmp_path, text, message):
    (tmp_path / "p.yaml").write_text(text)
    with pytest.raises(utils.ConfigError, match=f"p.yaml: {message}"):
        cfg_from(["--config", str(tmp_path / "p.yaml")])


def test_a_whole_yaml_float_is_an_int_a_quoted_off_is_text_and_a_flag_takes_no_float_for_an_int(tmp_path):
    (tmp_path / "p.yaml").write_text("steps: 3.0\ntis: 'off'\nlora: off\n")
    cfg = cfg_from(["--config", str(tmp_path / "p.yaml")])
    assert (cfg.steps, type(cfg.steps), cfg.tis, cfg.lora) == (3, int, "off", False)
    with pytest.raises(utils.ConfigError, match="--steps: 'steps' must be int, got '3.0'"):
        cfg_from(["--steps", "3.0"])


@pytest.mark.parametrize("argv, message", [
    (["--algo", "grpo"], "--algo grpo needs --group-size >= 2 \\(got 1\\); try --group-size 8"),
    (["--algo", "rloo", "--group-size", "1"], "--algo rloo needs --group-size >= 2"),
    (["--algo", "ppx"], "unknown --algo 'ppx'; did you mean 'ppo'"),
    (["--task", "cartpol"], "unknown --task 'cartpol'; did you mean 'cartpole'"),
    (["--batch", "10", "--group-size", "4", "--algo", "grpo"], "need a multiple of 4, whole groups of --group-size 4.*try --batch 12"),
    (["--minibatches", "3"], "--batch 16 is the global batch: 1 rank\\(s\\) need a multiple of 3.*--minibatches 3 each; try --batch 18"),
    (["--gamma", "1.5"], "0 < --gamma <= 1"),
    (["--resume", "/nonexistent/run"], "no such run directory"),
    (["--vf-clip", "0.2"], "--vf-clip needs --algo ppo \\(the only critic\\); add that or drop it"),
])
def test_validate_rejects_impossible_combinations_with_the_fix(argv, message):
    with pytest.raises(utils.ConfigError, match=message):
        train.validate(cfg_from(argv))


def test_main_reports_config_errors_without_a_traceback(capsys):
    assert train.main(["--algo", "grpo", "--group-size", "1"]) == 2
    assert "try --group-size 8" in capsys.readouterr().err


@pytest.mark.parametrize("algo", ["grpo", "rloo"])
def test_a_grouped_estimator_on_cartpole_gets_its_presets_groups_by_default_and_solves(tmp_path, algo):
    cfg = train.parse(["--algo", algo])
    assert (cfg.group_size, cfg.batch) == (8, 32)  # configs/cartpole_grpo.yaml's and cartpole_rloo.yaml's
    given = train.parse(["--algo", algo, "--group-size", "4", "--batch", "8"])
    assert (given.group_size, given.batch) == (4, 8)  # what is given wins
    assert train.main(["--algo", algo, "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    assert rundir.read_metrics(tmp_path / "run" / "metrics.csv")["eval_return"][-1][2] >= 475


# ---------------------------------------------------------------- environment
def test_mlp_policy_samples_from_its_softmax_and_greedy_takes_the_likeliest_action():
    """Three actions: with two, argmax(logp - Gumbel) would sample the softmax too (a logistic is symmetric)."""
    policy, probs = MLPPolicy(4, 3), torch.tensor([0.1, 0.3, 0.6])
    with torch.no_grad():
        policy.pi[-1].weight.zero_()
        policy.pi[-1].bias.copy_(probs.log())
    torch.manual_seed(0)
    actions, logp = policy.act(torch.zeros(40_000, 4))
    assert (torch.bincount(actions, minlength=3) / 40_000 - probs).abs().max() < 0.01  # sd <= 0.0025
    torch.testing.assert_close(logp, probs.log()[actions])
    assert policy.act(torch.randn(5, 4), greedy=True)[0].tolist() == [2] * 5


def test_mlp_policy_rescores_its_rollouts_logps_and_its_entropy_is_the_softmaxs():
    torch.manual_seed(0)
    policy = MLPPolicy(4, 2, critic=True)
    b = rollout_control(CartPole(), policy, 4, seed=1)
    logp, entropy, values = policy.score(b, slice(None))  # [4, T] each
    mask = b.mask > 0
    torch.testing.assert_close(logp[mask], b.logp[mask])  # what act() recorded for the actions it took
    torch.testing.assert_close(entropy, torch.distributions.Categorical(logits=policy.pi(b.obs)).entropy())
    assert values.shape == logp.shape and values.requires_grad  # the critic trains through them


def test_cartpole_rollout_masks_steps_after_each_episode_ends():
    torch.manual_seed(0)
    policy = MLPPolicy(4, 2)
    b = rollout_control(CartPole(), policy, 6, seed=1)
    lengths = b.mask.sum(1)
    assert torch.equal(b.rewards.sum(1), lengths)  # +1 per live step and nothing after
    for row, n in zip(b.mask, lengths.long()):
        assert row[:n].all() and not row[n:].any()  # a contiguous prefix
    assert not b.truncated.any()  # a random policy drops the pole long before 500 steps


def test_cartpole_time_limit_is_truncation_not_termination():
    b = rollout_control(CartPole(max_steps=5), MLPPolicy(4, 2), 3, seed=0)
    assert b.mask.shape == (3, 5) and b.mask.all() and b.truncated.all()


def test_grouped_episodes_start_from_their_leaders_state():
    b = rollout_control(CartPole(), MLPPolicy(4, 2), 8, seed=3, group_size=4)
    assert torch.equal(b.obs[0, 0].expand(4, 4), b.obs[:4, 0])
    assert not torch.equal(b.obs[0, 0], b.obs[4, 0])
    assert b.group.tolist() == [0, 0, 0, 0, 4, 4, 4, 4]


def test_training_seeds_never_reach_the_held_out_eval_seeds():
    src = rollouts.ControlRollouts(cfg_from(["--seed", "99999"]), MLPPolicy(4, 2))
    seeds = []
    for step in range(50):
        seeds.append((src.cfg.seed * 100_003 + src.position) % EVAL_SEED)
        src.position += 1
    assert max(seeds) < EVAL_SEED


# ---------------------------------------------------------------- one update
def prepared(cfg, seed=0):
    torch.manual_seed(seed)
    policy = MLPPolicy(4, 2, critic=cfg.algo == "ppo")
    batch = rollout_control(CartPole(), policy, cfg.batch, seed=seed, group_size=cfg.group_size)
    return policy, train.prepare(policy, batch, cfg)


def test_first_inner_epoch_ratio_is_exactly_one():
    cfg = cfg_from(["--algo", "ppo", "--inner-epochs", "3", "--micro-batch", "5"])
    policy, batch = prepared(cfg)
    for rows in train.micro_slices(torch.arange(cfg.batch), cfg.micro_batch):
        logp = policy.score(batch, rows)[0] * batch.mask[rows]
        assert torch.equal(logp, batch.old_logp[rows])
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    stats = train.update(policy, opt, batch, dataclasses.replace(cfg, inner_epochs=1))
    assert stats["ratio"] == pytest.approx(1.0, abs=1e-6) and stats["clip_frac_low"] == stats["clip_frac_high"] == 0.0


def test_later_epochs_move_the_ratio_away_from_one():
    cfg = cfg_from(["--algo", "ppo", "--inner-epochs", "4", "--lr", "0.05"])
    policy, batch = prepared(cfg)
    stats = train.update(policy, torch.optim.Adam(policy.parameters(), lr=cfg.lr), batch, cfg)
    assert stats["clip_frac_low"] + stats["clip_frac_high"] > 0  # off-policy epochs really are off-policy


@pytest.mark.parametrize("algo", ["reinforce", "ppo", "grpo"])
def test_microbatched_backward_matches_one_shot(algo):
    base = cfg_from(["--algo", algo, "--group-size", "4" if algo == "grpo" else "1", "--max-grad-norm", "1e9"])
    grads = []
    for micro in (0, 3):
        cfg = copy.copy(base)
        cfg.micro_batch = micro
        policy, batch = prepared(cfg)
        opt = torch.optim.SGD(policy.parameters(), lr=1.0)
        before = [p.detach().clone() for p in policy.parameters()]
        train.update(policy, opt, batch, cfg)
        grads.append([b - p.detach() for b, p in zip(before, policy.parameters())])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)


def test_max_grad_norm_0_turns_clipping_off():
    after = {}
    for norm in ("0", "1e9", "1e-3"):
        cfg = cfg_from(["--max-grad-norm", norm])
        policy, batch = prepared(cfg)
        stats = train.update(policy, torch.optim.SGD(policy.parameters(), lr=1.0), batch, cfg)
        after[norm] = torch.cat([p.detach().flatten() for p in policy.parameters()])
    assert stats["grad_norm"] > 1e-3  # so 1e-3 clips, and the unclipped steps differ from it
    assert torch.equal(after["0"], after["1e9"]) and not torch.equal(after["0"], after["1e-3"])


def test_nan_loss_skips_the_update_and_keeps_weights_finite(monkeypatch):
    cfg = cfg_from([])
    policy, batch = prepared(cfg)
    before = [p.detach().clone() for p in policy.parameters()]
    real = policy.score
    monkeypatch.setattr(policy, "score", lambda b, rows: (real(b, rows)[0] * float("nan"),) + real(b, rows)[1:])
    stats = train.update(policy, torch.optim.Adam(policy.parameters(), lr=1e-2), batch, cfg)
    assert stats["skipped"] == 1
    for b, p in zip(before, policy.parameters()):
        assert torch.equal(b, p) and torch.isfinite(p).all()


@pytest.mark.parametrize("preset", sorted(CONFIGS[0].parent.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_preset_gives_its_own_values_and_passes_validate(preset):
    """Each preset as `--config` reads it: a rule added to validate() that a preset breaks fails here."""
    cfg = train.parse(["--config", str(preset)])
    assert {k: getattr(cfg, k) for k in yaml.safe_load(preset.read_text())} == yaml.safe_load(preset.read_text())
    train.validate(cfg)


@pytest.mark.parametrize("preset", sorted(CONFIGS[0].parent.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_preset_states_its_warm_start(preset):
    """countdown_multiturn_tiny, a 4-step smoke run, silently got the tiny model's default 200-step warm-start
    when that default came: each step runs countdown's solver on 16 problems, minutes before RL's step 1."""
    stated = yaml.safe_load(preset.read_text()).get("sft_steps", 0)
    assert train.parse(["--config", str(preset)]).sft_steps == stated


# ---------------------------------------------------------------- end to end
@pytest.mark.parametrize("preset", CONFIGS, ids=lambda p: p.stem)
def test_every_algorithm_trains_two_steps_end_to_end(tmp_path, preset):
    grouped = yaml.safe_load(preset.read_text()).get("group_size", 1) > 1
    cfg = quick(tmp_path, "--config", str(preset), "--steps", "2", "--eval-every", "1", "--batch", "8",
                "--group-size", "4" if grouped else "1")
    torch.manual_seed(cfg.seed)
    init = MLPPolicy(4, 2, cfg.hidden, critic=cfg.algo == "ppo").state_dict()
    out = train.train(cfg)
    metrics = rundir.read_metrics(out / "metrics.csv")
    assert [s for s, _, _ in metrics["loss"]] == [1, 2]
    assert [s for s, _, _ in metrics["eval_return"]] == [0, 1, 2] and metrics["skipped"][-1][2] == 0  # step 0: the starting point
    trained = weights(out)
    assert any(not torch.equal(trained[k], init[k]) for k in trained)
    assert yaml.safe_load((out / "config.yaml").read_text())["algo"] == cfg.algo
    assert (out / "curve.png").stat().st_size > 1000


def test_four_steps_equal_two_steps_plus_resume_plus_two_bitwise(tmp_path):
    full = train.train(quick(tmp_path / "a", "--steps", "4", "--algo", "ppo", "--inner-epochs", "2", "--minibatches", "2"))
    half = train.train(quick(tmp_path / "b", "--steps", "2", "--algo", "ppo", "--inner-epochs", "2", "--minibatches", "2"))
    train.train(cfg_from(["--resume", str(half), "--steps", "4", "--no-progress", "--batch", "4", "--eval-episodes", "2",
                          "--algo", "ppo", "--inner-epochs", "2", "--minibatches", "2"]))
    a, b = weights(full), weights(half)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps = [s for s, _, _ in rundir.read_metrics(half / "metrics.csv")["loss"]]
    assert steps == [1, 2, 3, 4]


def test_checkpoints_keep_only_the_newest_k(tmp_path):
    out = train.train(quick(tmp_path, "--steps", "5", "--ckpt-every", "1", "--keep-ckpts", "2"))
    assert sorted(p.name for p in out.glob("ckpt-*")) == ["ckpt-0000004", "ckpt-0000005"]
    assert not list(out.glob(".tmp-*"))


def test_second_ctrl_c_stops_a_source_that_never_returns_and_keeps_the_checkpoints(tmp_path, monkeypatch):
    real_next = rollouts.ControlRollouts.next

    def next_then_hang(self, step):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)  # pressed again: the wait below must end now
            while True:  # like a trainer whose workers never come
                time.sleep(0.01)
        return real_next(self, step)

    monkeypatch.setattr(rollouts.ControlRollouts, "next", next_then_hang)
    cfg = quick(tmp_path, "--steps", "50", "--ckpt-every", "1")
    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN under nohup / a background job
    with pytest.raises(KeyboardInterrupt):
        train.train(cfg)
    out = Path(cfg.out)
    assert rundir.checkpoints(out)[-1].name == "ckpt-0000002"  # steps 1 and 2 finished; step 3 never did
    assert signal.getsignal(signal.SIGINT) is before  # the handler was put back


def test_refused_names_a_full_disk_exhausted_memory_or_a_lost_rank_and_nothing_else():
    fix = "then --resume the run or run again"
    lost = utils.RankLost("another rank died or hung (gloo: timed out), not this one: ...; then --resume")
    assert utils.refused(lost) == str(lost)  # one line, not a traceback of this healthy rank's collective
    assert utils.refused(OSError(errno.ENOSPC, "No space left on device")) == (
        f"a write failed ([Errno 28] No space left on device); make room, {fix}")
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you "
                       "tried to allocate 40000000000 bytes. Error code 12 (Cannot allocate memory)")
    assert utils.refused(cpu) == ("out of memory (allocate 40000000000 bytes); lower --micro-batch, --gen-batch, "
                                  f"--batch or an eval's size, {fix}")
    assert utils.refused(MemoryError()).startswith("out of memory (MemoryError); lower --micro-batch")
    for bug in (OSError(errno.ENOENT, "No such file"), ValueError("a bug"), RuntimeError("shape mismatch")):
        assert utils.refused(bug) is None  # shown whole: a bug's traceback is what fixes it


class Planted:
    """Pickled as a call: a full unpickler (torch.load(weights_only=False)) writes `path` while loading."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return Path.write_text, (self.path, "code ran")


def test_a_state_file_that_would_run_code_is_skipped_unrun(tmp_path, capsys):
    policy = MLPPolicy(4, 2)
    opt, marker = torch.optim.Adam(policy.parameters()), tmp_path / "ran"
    for step in (1, 2):
        rundir.save_checkpoint(tmp_path, step, policy, opt, {"wall_s": 0.0, "source": {"position": step}}, keep=3)
    state = torch.load(tmp_path / "ckpt-0000002" / "state.pt", weights_only=True)
    torch.save({**state, "extra": Planted(marker)}, tmp_path / "ckpt-0000002" / "state.pt")  # all keys present
    assert rundir.resume_checkpoint(tmp_path, policy, opt)["step"] == 1 and not marker.exists()
    assert "skipping " + str(tmp_path / "ckpt-0000002") + ": UnpicklingError" in capsys.readouterr().err


def test_resume_refuses_a_checkpoint_of_another_policy(tmp_path):
    out = train.train(quick(tmp_path, "--steps", "1"))
    with pytest.raises(ValueError, match="do not match this policy"):
        train.train(cfg_from(["--resume", str(out), "--algo", "ppo", "--steps", "2", "--no-progress", "--batch", "4"]))


def test_ctrl_c_finishes_the_step_then_checkpoints(tmp_path, monkeypatch):
    real_next = rollouts.ControlRollouts.next

    def next_then_interrupt(self, step):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # arrives mid-step, like a user's Ctrl-C
        return real_next(self, step)

    monkeypatch.setattr(rollouts.ControlRollouts, "next", next_then_interrupt)
    cfg = quick(tmp_path, "--steps", "50")
    assert train.train(cfg) is None  # stopped, not finished (main: exit 130)
    out = Path(cfg.out)
    assert rundir.checkpoints(out)[-1].name == "ckpt-0000003"
    assert [s for s, _, _ in rundir.read_metrics(out / "metrics.csv")["loss"]][-1] == 3


def test_sigterm_finishes_the_step_then_checkpoints_like_ctrl_c(tmp_path, monkeypatch, capfd):
    """kill, a scheduler's stop or a preempted node's notice send SIGTERM, which used to end the run at
    once, losing every step since the last checkpoint (50 by default)."""
    real_next = rollouts.ControlRollouts.next

    def next_then_terminate(self, step):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives mid-step
        return real_next(self, step)

    monkeypatch.setattr(rollouts.ControlRollouts, "next", next_then_terminate)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    cfg = quick(tmp_path, "--steps", "50")
    assert train.train(cfg) is None
    out = Path(cfg.out)
    assert rundir.checkpoints(out)[-1].name == "ckpt-0000003"  # step 3 (index 2) finished, then saved
    assert [s for s, _, _ in rundir.read_metrics(out / "metrics.csv")["loss"]][-1] == 3
    assert "SIGTERM: finishing this step and checkpointing; SIGTERM again stops now" in capfd.readouterr().err
    assert {s: signal.getsignal(s) for s in before} == before  # both handlers were put back


def test_evaluating_a_checkpoint_again_replaces_the_eval_instead_of_adding_a_second(tmp_path):
    out = train.train(quick(tmp_path, "--steps", "2"))
    for _ in range(2):
        assert train.main(["--resume", str(out), "--eval-only", "--no-progress"]) == 0
    evals = rundir.read_metrics(out / "eval-0000002" / "metrics.csv")
    assert list(evals) == ["eval_return"] and [s for s, _, _ in evals["eval_return"]] == [2]  # was [2, 2]
