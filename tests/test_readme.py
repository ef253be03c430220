"""The README's "Add your own reward" blocks, run exactly as printed, and its layout table's line counts."""
import re
from pathlib import Path

import pytest

import rundir
import tasks
import train
import utils

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def blocks() -> list[str]:
    section = README.split("## Add your own reward", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(tasks.Arith, "rewards", list(tasks.Arith.rewards))  # the blocks edit the class
    monkeypatch.setattr(tasks, "TASKS", dict(tasks.TASKS))


def test_the_section_has_the_two_blocks():
    assert len(blocks()) == 2


def test_an_extra_weighted_reward_joins_the_existing_one(registry):
    exec(blocks()[0], {})
    arith = tasks.make_task("arith", seed=0, eval_size=4)
    # int_correct 1 + 0.2 * brevity 1; a rambling right answer earns neither (int_correct takes the bare
    # number only); "12" is wrong but short
    assert arith.score("3+4=", "7", "7") == (pytest.approx(1.2), {"int_correct": 1.0, "brevity": 1.0})
    assert arith.score("3+4=", "it is 7", "7") == (0.0, {"int_correct": 0.0, "brevity": 0.0})
    assert arith.score("3+4=", "12", "7") == (pytest.approx(0.2), {"int_correct": 0.0, "brevity": 1.0})


def test_a_new_task_scores_hand_worked_examples_and_trains(registry, tmp_path):
    exec(blocks()[1], {})
    task = tasks.make_task("reverse", seed=0, eval_size=4)
    p = task.train_problem(0)
    assert p.answer == p.prompt.removeprefix("Reverse ").removesuffix(":")[::-1]
    assert task.score("Reverse abc:", " cba\n", "cba") == (1.0, {"reversed_exactly": 1.0})
    assert task.score("Reverse abc:", "abc", "cba")[0] == 0.0 and task.correct(p, task.solve(p))
    out = train.train(utils.load_config(train.Config, [
        "--task", "reverse", "--algo", "grpo", "--model", "tiny", "--batch", "8", "--group-size", "4",
        "--max-new-tokens", "6", "--eval-size", "4", "--steps", "2", "--sft-steps", "1", "--no-progress",
        "--out", str(tmp_path / "run")]))
    metrics = rundir.read_metrics(out / "metrics.csv")
    assert [s for s, _, _ in metrics["loss"]] == [1, 2] and "reward_reversed_exactly" in metrics
    assert [s for s, _, _ in metrics["eval_accuracy"]] == [0, 2]


def test_the_layout_table_gives_each_modules_line_count_and_their_total():
    """A row per top-level module with its `wc -l`, and the total: a stale count misleads a reader."""
    rows = dict(re.findall(r"^\| `(\w+\.py)` \| ([\d,]+) \|", README, re.M))
    modules = sorted(Path(__file__).resolve().parent.parent.glob("*.py"))
    counts = {p.name: str(len(p.read_text().splitlines())) for p in modules}
    assert {name: n.replace(",", "") for name, n in rows.items()} == counts
    total = re.search(r"^\| total \| ([\d,]+) \|", README, re.M)[1]
    assert int(total.replace(",", "")) == sum(map(int, counts.values()))
