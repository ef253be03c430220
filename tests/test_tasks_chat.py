"""The `add` task for pretrained chat models: its strict reward accepts the bare sum only, its
lenient score finds the sum anywhere and is logged at every eval, and its held-out problems never
reach training."""
import pytest

import tasks
import train
from model import Sample
from rollouts import TaskRollouts
from tasks import Problem, bare_int_correct, make_task

P = Problem("Compute 23 + 58. Write only the result, as digits.", "81", key="23+58")


@pytest.mark.parametrize("completion", ["81", " 81", "81.", "81\n", " 81. \n"])
def test_bare_int_correct_takes_the_bare_sum(completion):
    assert bare_int_correct(P.prompt, completion, P.answer) == 1.0


@pytest.mark.parametrize("completion", [
    "23 + 58 = 81",  # the untrained model's usual answer: right sum, wrong format
    "The answer is 81.",
    "81 is the answer",
    "81.0", "081", "+81", "-81", "81!", "81..", "8 1", "81 81",
    "",  # an empty completion
    "23", "58", "2358",  # numbers echoed from the prompt
    "<answer>81</answer>",  # a format the prompt did not ask for
    "9" * 41,  # longer than any integer the reward parses
    "８１",  # full-width digits: \d would take them, the reward must not
])
def test_bare_int_correct_refuses_everything_else(completion):
    assert bare_int_correct(P.prompt, completion, P.answer) == 0.0


def test_correct_is_the_strict_reward_and_lenient_finds_the_sum_anywhere():
    task = make_task("add", seed=0, eval_size=10)
    hand = {"81": (True, True), "23 + 58 = 81.": (False, True), "The sum is 81, I think": (False, True),
            "23 + 58 = 71": (False, False), "81.5": (False, False), "181": (False, False),
            "810": (False, False), "-81": (False, False), "0.81": (False, False)}
    for completion, (strict, lenient) in hand.items():
        assert (task.correct(P, completion), task.lenient(P, completion)) == (strict, lenient), completion


def test_lenient_never_finds_the_sum_inside_a_longer_decimal():
    """\\d+ backtracked out of the lookahead: in "813.5" it took "81" (then "3." is no decimal point and
    digit), so a completion of another number counted as the sum written somewhere."""
    task = make_task("add", seed=0, eval_size=10)
    hand = {"813.5": False, "x = 8100.25": False, "81.": True, "is 81.\n": True, "81.5 or 81": True,
            "8.81": False}
    assert {c: task.lenient(P, c) for c in hand} == hand


def test_tasks_without_a_lenient_score_say_so():
    task = make_task("arith", seed=0, eval_size=5)
    assert task.lenient(task.eval_problems()[0], "12") is None


def test_add_problems_are_right_and_held_out_ones_never_train():
    task = make_task("add", seed=3, eval_size=100, max_operand=20)
    held_out = {p.key for p in task.eval_problems()}
    assert len(held_out) == 100
    for i in range(500):
        p = task.train_problem(i)
        a, b = (int(x) for x in p.key.split("+"))
        assert p.key not in held_out and 0 <= a <= 20 and 0 <= b <= 20
        assert p.prompt.endswith(f"\nQ: What is {a} + {b}?\nA:") and p.answer == str(a + b)
        assert p.prompt.startswith("Answer with the number only.\nQ: What is 2 + 3?\nA: 5\n")
        assert task.correct(p, task.solve(p))
    assert task.train_problem(7) == make_task("add", seed=3, eval_size=100, max_operand=20).train_problem(7)


def test_add_refuses_an_eval_split_that_leaves_too_little_to_train_on():
    with pytest.raises(ValueError, match="lower --eval-size to 18"):
        make_task("add", seed=0, eval_size=20, max_operand=5)  # 36 problems: at most 18 held out
    with pytest.raises(ValueError, match="max_operand >= 1"):
        make_task("add", seed=0, eval_size=1, max_operand=0)


def test_add_is_registered():
    assert tasks.TASKS["add"] is tasks.Add


def test_only_a_bare_right_sum_pays():  # a bonus for the bare form alone was learnt as "2" for all
    task = make_task("add", seed=0, eval_size=10)
    assert task.score(P.prompt, "81", P.answer) == (1.0, {"bare_int_correct": 1.0})
    for completion in ("80", "23 + 58 = 81", "2", ""):
        assert task.score(P.prompt, completion, P.answer)[0] == 0.0, completion


class Answers:
    """A stand-in policy whose greedy answer to eval problem i is the bare sum (i % 3 == 0), the sum
    written out as "a + b = s" (i % 3 == 1: right, wrong format) or a wrong bare number (i % 3 == 2)."""

    pad_id = 0

    def __init__(self, task):
        self.problems = task.eval_problems()
        self.index = {p.prompt: i for i, p in enumerate(self.problems)}

    def encode_prompt(self, prompt):
        return [self.index[prompt]]

    def generate(self, prefixes, max_new_tokens, gen_batch, greedy=False):
        return [Sample([p[0]], [0.0], False) for p in prefixes]

    def decode(self, ids):
        p = self.problems[ids[0]]
        return [p.answer, f"{p.key.replace('+', ' + ')} = {p.answer}", str(int(p.answer) + 1)][ids[0] % 3]


def test_every_add_eval_logs_the_strict_and_the_lenient_accuracy():
    source = TaskRollouts(train.parse(["--task", "add", "--eval-size", "12"]), policy=None)
    source.policy = Answers(source.task)
    assert source.evaluate() == {"eval_accuracy": 4 / 12, "eval_accuracy_lenient": 8 / 12}
    arith = TaskRollouts(train.parse(["--task", "arith", "--eval-size", "12"]), policy=None)
    arith.policy = Answers(arith.task)
    assert set(arith.evaluate()) == {"eval_accuracy"}  # a task without a lenient score logs none
