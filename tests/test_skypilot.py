"""The SkyPilot recipes in configs/skypilot/ launch commands that train.py accepts: every flag is a
train.Config field, every value parses and validates, every shell variable is defined."""
import dataclasses
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

import tasks
import train
import utils

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted((ROOT / "configs" / "skypilot").glob("*.yaml"))
# Flags of the async trainer/worker (serve.py, branch `async`), allowed while train.Config lacks
# them; once a field lands, its flag is checked like any other. Value: how many values it takes.
PENDING = {"--role": 1, "--trainer-url": 1, "--vllm": 0}
SKYPILOT_VARS = {"SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2", "SKYPILOT_NODE_RANK": "0", "SKYPILOT_NUM_NODES": "2"}


def recipe(path: Path) -> dict:
    spec = yaml.safe_load(path.read_text())
    assert isinstance(spec, dict), f"{path.name}: not a mapping"
    return spec


def gpus(spec: dict) -> int:
    return int(str(spec["resources"]["accelerators"]).split(":")[1])


def train_commands(spec: dict) -> list[list[str]]:
    """The argv after `train.py` of every command in `run` that starts train.py, with shell
    variables replaced by the recipe's envs (secrets and SkyPilot's own variables by stand-ins)."""
    values = {**SKYPILOT_VARS, "SKYPILOT_NUM_GPUS_PER_NODE": str(gpus(spec)), "HEAD": "10.0.0.1",
              **{k: str(v) for k, v in (spec.get("envs") or {}).items()}, **{k: "secret" for k in spec.get("secrets") or {}},
              "START": "--out"}  # set by the recipe itself: a first launch (test_a_relaunch_continues_the_run)

    def substitute(match):
        name = match.group(1) or match.group(2)
        assert name in values, f"${name} is used in run but defined neither in envs, secrets nor by SkyPilot"
        return values[name]

    script = spec["run"].replace("\\\n", " ")
    commands = []
    for line in script.splitlines():
        line = re.sub(r"\$\{(\w+)\}|\$(\w+)", substitute, line.split("#")[0])
        words = shlex.split(line)
        if "train.py" in words:
            assert (ROOT / "train.py").exists()
            commands.append(words[words.index("train.py") + 1 :])
    return commands


def config_argv(argv: list[str]) -> list[str]:
    """argv minus the pending async flags train.Config does not have yet."""
    fields = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(train.Config)}
    out, i = [], 0
    while i < len(argv):
        flag = argv[i].split("=")[0]
        if flag in PENDING and flag not in fields:
            i += 1 + (PENDING[flag] if "=" not in argv[i] else 0)
        else:
            out.append(argv[i])
            i += 1
    return out


def test_recipes_exist_for_one_node_torchrun_and_trainer_plus_workers():
    assert {p.name for p in RECIPES} == {"sync_torchrun.yaml", "async_vllm.yaml"}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_has_the_keys_sky_launch_needs(path):
    spec = recipe(path)
    for key in ("name", "resources", "num_nodes", "workdir", "setup", "run"):
        assert key in spec, f"{path.name} lacks '{key}'"
    assert gpus(spec) >= 1 and spec["workdir"] == "." and "pip install -e " in spec["setup"]  # the repo itself
    assert set(spec) <= {"name", "resources", "num_nodes", "workdir", "envs", "secrets", "setup", "run", "file_mounts"}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_train_py_flag_is_a_config_field_and_the_config_validates(path, monkeypatch):
    spec = recipe(path)
    commands = train_commands(spec)
    assert commands, f"{path.name} never runs train.py"
    torchrun = "torchrun" in spec["run"]
    monkeypatch.setattr(utils, "world", lambda: gpus(spec) if torchrun else 1)  # the batch must split over the node's GPUs
    # the cluster's packages and secrets: a task that reads the hub needs datasets, which setup installs
    monkeypatch.setitem(sys.modules, "datasets", types.ModuleType("datasets"))
    for name in spec.get("secrets") or {}:  # NANORL_TOKEN: a trainer bound to 0.0.0.0 needs it
        monkeypatch.setenv(name, "a-secret-of-32-characters-0123456")
    for argv in commands:
        cfg = utils.load_config(train.Config, config_argv(argv))  # unknown flags raise ConfigError naming the closest
        train.validate(cfg)
        if issubclass(tasks.TASKS.get(cfg.task, tasks.Task), tasks.DatasetTask) and not cfg.data:
            assert re.search(r"pip install -e \"\.\[(\w+,)?hub\]\"", spec["setup"]), spec["setup"]


def test_the_torchrun_recipe_starts_one_rank_per_gpu():
    spec = recipe(ROOT / "configs/skypilot/sync_torchrun.yaml")
    assert spec["num_nodes"] == 1
    assert "torchrun --standalone --nproc_per_node=$SKYPILOT_NUM_GPUS_PER_NODE train.py" in spec["run"]


def test_the_worker_recipe_passes_the_token_only_as_a_launch_time_secret():
    spec = recipe(ROOT / "configs/skypilot/async_vllm.yaml")
    assert spec["secrets"] == {"NANORL_TOKEN": None}  # no value in the file: `sky launch --secret NANORL_TOKEN`
    assert "NANORL_TOKEN" not in (spec.get("envs") or {})
    trainer, worker = train_commands(spec)
    assert trainer[:4] == ["--role", "trainer", "--trainer-url", "http://0.0.0.0:8765"]  # listens on every interface
    assert worker[:5] == ["--role", "rollout", "--trainer-url", "http://10.0.0.1:8765", "--vllm"]
    assert spec["num_nodes"] >= 2  # a trainer plus at least one worker


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_a_relaunch_continues_the_run(path, tmp_path):
    """A second `sky launch` finds the first launch's run directory: the recipe then resumes it, since
    train.py refuses to start a new run there. Runs the recipe's own line with bash, both ways."""
    spec = recipe(path)
    [choose] = [line.strip() for line in spec["run"].splitlines() if "START=" in line]
    assert "$START $OUT" in spec["run"].replace("\\\n", " ")  # the trainer's run directory flag
    ran = lambda out: subprocess.run(["bash", "-c", f'OUT={out}; {choose}; echo "$START $OUT"'],
                                     capture_output=True, text=True, check=True).stdout.strip()
    assert ran(tmp_path / "run") == f"--out {tmp_path / 'run'}"  # the first launch
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("task: gsm8k\n")
    assert ran(tmp_path / "run") == f"--resume {tmp_path / 'run'}"


def test_the_workers_run_the_trainers_config_but_for_their_role():
    """The workers' line lacked the trainer's --dtype bf16, so each worker's vLLM engine held and ran the
    model in fp32 on its GPU, while the trainer scored in bf16."""
    spec = recipe(ROOT / "configs/skypilot/async_vllm.yaml")
    trainer, worker = (dataclasses.asdict(utils.load_config(train.Config, config_argv(argv)))
                       for argv in train_commands(spec))
    own = {"role", "trainer_url", "vllm", "steps", "out", "resume"}  # a worker's own, or the trainer's alone
    assert {k: (trainer[k], worker[k]) for k in trainer if k not in own and trainer[k] != worker[k]} == {}
