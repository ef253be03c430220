"""Multi-turn text environments: the protocol, the shipped environments on real SQLite and real
processes, and token-exact multi-turn rollouts (scripted policy, then the real tiny model)."""
import dataclasses
import hashlib
import itertools
import json
import math
import os
import re
import resource
import sqlite3
import string
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from envs import (TEXT_ENVS, CartPole, CountdownEnv, PythonTask, PythonToolEnv, SQLEnv, SQLTask, TextEnv, SQL,
                  _gold_rows, format_rows, run_sql, sql_correct, sql_database)
import train
import rundir
from exact import assert_sampled_ids_are_trained
from judge import JudgeUnavailable
from model import LLMPolicy, MLPPolicy, Sample
from modeldir import build_tiny_model
import tasks
from rollouts import (WIRE, EnvRollouts, Episode, TaskRollouts, collate, encode_reply, from_wire, make_batch,
                      rollout_control, rollout_multiturn, rollout_single, sample_rows)
from tasks import Problem, ProceduralTask, RewardError, Task, completion_number, countdown_correct
from utils import UMASK, ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")  # the tiny model's runs: conftest says why


# ---------------------------------------------------------------- the README example, run as printed
README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
GUESS = re.search(r"```python\n(import random\nfrom envs import TEXT_ENVS, TextEnv\n.*?)```", README, re.S)[1]
exec(GUESS, readme := {"__name__": __name__})  # this module's name: the classes pickle like its own
GuessTask, GuessNumber = readme["GuessTask"], readme["GuessNumber"]
del TEXT_ENVS["guess"]  # the block registers it at import; a test that trains it does so again


# ---------------------------------------------------------------- a chat tokenizer and a scripted policy
# ChatML-like, and like Qwen3 it drops <think>...</think> from assistant turns that are not last.
TEMPLATE = r"""{%- for m in messages -%}
{%- set c = m['content'] -%}
{%- if m['role'] == 'assistant' and not loop.last -%}{%- set c = c.split('</think>')[-1] -%}{%- endif -%}
{{- '<|im_start|>' + m['role'] + '\n' + c + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"""


def chat_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable character, plus <|im_start|> and <|im_end|> (the end token)."""
    chars = [c for c in string.printable if c not in "\x0b\x0c"]
    vocab = {t: i for i, t in enumerate(["<|pad|>", "<|unk|>", "<|im_start|>", "<|im_end|>"] + chars)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<|pad|>", unk_token="<|unk|>",
                                  eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"])
    tok.chat_template = TEMPLATE
    return tok


class ScriptedPolicy:
    """LLMPolicy's API with `script(conversation so far) -> next model turn` instead of a network.
    Prompt encoding, decoding and collation are LLMPolicy's own code. Sampled log-probs are
    distinct per position so a misplaced one shows; every generate() output is recorded."""

    encode_prompt, decode = LLMPolicy.encode_prompt, LLMPolicy.decode

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.sampled = tokenizer, script, []
        self.use_template, self.thinking, self.bos = tokenizer.chat_template is not None, False, []
        self.eos_ids, self.pad_id, self.positions = {tokenizer.eos_token_id}, tokenizer.pad_token_id, None
        self.context = None  # no network, so no context to fit

    def generate(self, prefixes, max_new_tokens, gen_batch=64, greedy=False):
        out = []
        for p in prefixes:
            ids = self.tokenizer.encode(self.script(self.tokenizer.decode(p)), add_special_tokens=False)
            ids = (ids + [self.tokenizer.eos_token_id])[:max_new_tokens]
            out.append(Sample(ids, [-1e-3 * (len(p) + i + 1) for i in range(len(ids))], len(ids) == max_new_tokens
                              and ids[-1] != self.tokenizer.eos_token_id))
        self.sampled.append(list(zip(prefixes, out)))
        return out


def bisect(conversation: str) -> str:
    """Guesses by bisection from the replies so far."""
    lo, hi = 1, 100
    for guess, reply in re.findall(r"(\d+)<\|im_end\|>\n<\|im_start\|>user\n(\w+)", conversation):
        lo, hi = (int(guess) + 1, hi) if reply == "higher" else (lo, int(guess) - 1)
    return str((lo + hi) // 2)


def countdown_problem(numbers, target):
    return Problem(f"Reach {target} with {numbers}.", json.dumps({"target": target, "numbers": numbers}), "k")


# ---------------------------------------------------------------- protocol
def test_text_env_protocol_on_the_readme_example():
    env = GuessNumber()
    messages, info = env.reset(Problem("Guess.", "37", "37"))
    assert messages == [{"role": "user", "content": "Guess."}] and info == {}
    assert env.step("50") == ([{"role": "user", "content": "lower"}], 0.0, False, {"turns": 1, "solved_at_turn": 0})
    assert env.step("I say 25") == ([{"role": "user", "content": "higher"}], 0.0, False,
                                    {"turns": 2, "solved_at_turn": 0})
    assert env.step("37") == (None, 1.0, True, {"turns": 3, "solved_at_turn": 3})
    short = GuessNumber(max_turns=2)
    short.reset(Problem("Guess.", "37", "37"))
    short.step("1")
    assert short.step("2") == (None, 0.0, True, {"turns": 2, "solved_at_turn": 0})  # out of turns


def test_an_env_whose_reward_is_no_finite_number_stops_naming_its_class():
    class Unscored(GuessNumber):
        def respond(self, completion):
            reply, reward, solved = super().respond(completion)
            return reply, None if reply == "lower" else reward, solved  # a bug: a path without a reward

    problems = GuessTask(seed=0, eval_size=1).eval_problems()  # under 50: the first guess, 50, is high
    assert int(problems[0].answer) < 50
    with pytest.raises(RewardError, match="^Unscored.step returned None for the completion '50'; a reward "
                                                "is a finite number"):
        rollout_multiturn(ScriptedPolicy(chat_tokenizer(), bisect), Unscored, problems, group_size=1,
                          max_turns=7, max_new_tokens=8, max_len=4096)


@pytest.mark.parametrize("wrong", ["number", "pair", "list"])
def test_an_env_whose_respond_returns_no_text_reply_triple_stops_naming_its_class(wrong):
    """A reply of 25 (the model's guess, not text) failed deep in encode_reply ("sequence item 0: expected
    str instance, Fraction found"); a pair failed to unpack inside TextEnv.step."""
    class Sloppy(GuessNumber):
        def respond(self, completion):
            reply, reward, solved = super().respond(completion)
            return {"number": (25, reward, solved), "pair": (reply, reward), "list": [reply, reward, solved]}[wrong]

    returned = {"number": "(25, 0.0, False)", "pair": "('lower', 0.0)", "list": "['lower', 0.0, False]"}[wrong]
    problems = GuessTask(seed=0, eval_size=1).eval_problems()  # under 50: the first guess, 50, is high
    with pytest.raises(RewardError) as e:
        rollout_multiturn(ScriptedPolicy(chat_tokenizer(), bisect), Sloppy, problems, group_size=1,
                          max_turns=7, max_new_tokens=8, max_len=4096)
    assert str(e.value) == (f"Sloppy.respond returned {returned} for the completion '50'; it returns (reply "
                            "text or None, reward, solved)")
    env = Sloppy()
    env.reset(problems[0])
    with pytest.raises(RewardError, match=f"for the completion '{'7' * 60}'; it returns"):  # 60 characters
        env.step("7" * 100)


def test_an_env_that_raises_keeps_its_traceback_noting_its_class_and_the_completion():
    class Buggy(GuessNumber):
        def respond(self, completion):
            return {}["no such key"]

    problems = GuessTask(seed=0, eval_size=1).eval_problems()
    with pytest.raises(KeyError) as e:
        rollout_multiturn(ScriptedPolicy(chat_tokenizer(), bisect), Buggy, problems, group_size=1,
                          max_turns=7, max_new_tokens=8, max_len=4096)
    assert e.value.__notes__ == ["in Buggy.respond, for the completion '50'"]
    env = Buggy()
    env.reset(problems[0])
    with pytest.raises(KeyError) as e:
        env.step("7" * 300)
    assert e.value.__notes__ == [f"in Buggy.respond, for the completion '{'7' * 200}'"]  # 200 characters


def test_an_env_without_its_task_class_is_named_when_its_source_is_built(monkeypatch):
    class Taskless(TextEnv):  # forgot `task = GuessTask`: "'NoneType' object is not callable"
        def respond(self, completion):
            return None, 1.0, True

    monkeypatch.setitem(TEXT_ENVS, "taskless", Taskless)
    cfg = train.Config(task="taskless", algo="grpo", batch=4, group_size=2, eval_size=4)
    with pytest.raises(ConfigError, match=r"^--task taskless: Taskless.task is None: set it to the tasks.Task "
                                          r"class it plays$"):
        EnvRollouts(cfg, ScriptedPolicy(chat_tokenizer(), bisect))


SHAPES = {  # what a user's own step or reset returned -> the start of the one line that names it
    "step, a pair": ("step", lambda env, c: (None, 1.0), "Shaped.step returned (None, 1.0)"),
    "step, text": ("step", lambda env, c: ("lower", 0.0, False, {}),
                   "Shaped.step returned ('lower', 0.0, False, {})"),
    "step, no info": ("step", lambda env, c: (None, 1.0, True, None),
                      "Shaped.step returned (None, 1.0, True, None)"),
    "reset, text": ("reset", lambda env, p: p.prompt, "Shaped.reset returned 'I picked a whole number"),
    "reset, content 5": ("reset", lambda env, p: ([{"role": "user", "content": 5}], {}),
                         "Shaped.reset returned ([{'role': 'user', 'content': 5}], {})"),
    "reset, no message": ("reset", lambda env, p: ([], {}), "Shaped.reset returned ([], {})"),  # no prompt
}


@pytest.mark.parametrize("case", SHAPES)
def test_an_env_whose_own_step_or_reset_returns_a_wrong_shape_stops_in_one_line_naming_it(case):
    """They failed deep in the rollout: "not enough values to unpack (expected 4, got 2)", "string indices
    must be integers", "'NoneType' object has no attribute 'get'"."""
    method, wrong, start = SHAPES[case]
    problems = GuessTask(seed=0, eval_size=1).eval_problems()  # under 50: bisection's first guess is wrong
    Shaped = type("Shaped", (GuessNumber,), {method: wrong})
    with pytest.raises(RewardError) as e:
        rollout_multiturn(ScriptedPolicy(chat_tokenizer(), bisect), Shaped, problems, group_size=1,
                          max_turns=7, max_new_tokens=8, max_len=4096)
    given = f"the problem {problems[0].key!r}" if method == "reset" else "the completion '50'"
    want = "(messages, info)" if method == "reset" else "(reply messages or None, reward, done, info)"
    assert str(e.value).startswith(start) and str(e.value).endswith(
        f" for {given}; it returns {want}, messages a list of {{'role': text, 'content': text}} dicts")


def test_an_env_whose_own_step_replies_none_ends_the_episode_as_a_reply_of_none_from_respond_does():
    """A step of (None, reward, False, info) failed in the rollout: "'NoneType' object is not iterable"."""
    class Silent(GuessNumber):
        def step(self, completion):
            return None, 0.5, False, {}

    policy = ScriptedPolicy(chat_tokenizer(), bisect)
    problems = GuessTask(seed=0, eval_size=1).eval_problems()
    batch = rollout_multiturn(policy, Silent, problems, group_size=1, max_turns=7, max_new_tokens=8, max_len=4096)
    (prompt, _), = policy.sampled[0]  # one turn, and no reply after it
    assert len(policy.sampled) == 1 and batch.attn.sum().item() == len(prompt) + 3  # "50" and the end token
    assert batch.stats["turns"].tolist() == [1] and batch.rewards.sum().item() == 0.5
    assert batch.truncated.tolist() == [False]


def test_an_env_whose_reset_returns_text_stops_the_run_with_one_line(monkeypatch, capsys, tmp_path):
    class Bare(GuessNumber):
        def reset(self, problem):
            return problem.prompt

    monkeypatch.setitem(TEXT_ENVS, "bare", Bare)
    argv = ["--task", "bare", "--eval-size", "50", "--steps", "1", "--sft-steps", "0", "--batch", "2",
            "--group-size", "2", "--max-new-tokens", "4", "--no-progress", "--out", str(tmp_path)]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: Bare.reset returned 'I picked a whole number from 1 to 100. Guess it.' "
                          "for the problem '")
    assert err.endswith("; it returns (messages, info), messages a list of {'role': text, 'content': text} dicts\n")


def test_an_env_over_a_dataset_task_plays_the_rows_of_its_data_file(monkeypatch):
    """--data was refused ("this task generates its own problems; drop --data"), and without it the run
    loaded the hub and, offline, said to pass --data: a dataset's env could not run from a file."""
    class Retry(TextEnv):
        task = tasks.GSM8K

        def respond(self, completion):
            return "Not right. Try again.", 0.0, False

    monkeypatch.setitem(TEXT_ENVS, "gsm8k_retry", Retry)
    data = str(Path(__file__).with_name("data") / "gsm8k_mixed.jsonl")  # 9 good rows
    cfg = train.Config(task="gsm8k_retry", algo="grpo", data=data, eval_size=2, batch=4, group_size=2,
                       max_new_tokens=8, max_len=4096, max_turns=2)
    train.validate(cfg)
    source = EnvRollouts(cfg, ScriptedPolicy(chat_tokenizer(), lambda text: "0"))
    single = tasks.GSM8K(seed=0, eval_size=2, data=data)  # the rows a single-turn run reads
    assert source.task.eval_problems() == single.eval_problems() and len(single.eval_problems()) == 2
    assert source.next(0).stats["turns"].tolist() == [2.0] * 4  # 2 rows' prompts, each played twice


class LongRowRetry(TextEnv):  # multi-turn GSM8K: every answer is met with "Try again."
    task = tasks.GSM8K

    def respond(self, completion):
        return "Try again.", 0.0, False


def long_rows(tmp_path, *extra: str, short: bool = True) -> tuple[list[str], list[str]]:
    """Flags for the tiny model (1,024 positions, a token a character) under --max-len 160 and
    --max-new-tokens 8, over a --data file of 4 short questions (or none) and `extra`; and the questions."""
    rows = [f"What is {a} plus 1?" for a in range(4 * short)] + list(extra)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": "#### 2"}) + "\n" for q in rows))
    tiny = build_tiny_model(layers=1, hidden=64, heads=1, intermediate=128)
    return ["--task", "gsm8k_long", "--model", tiny, "--data", str(data), "--eval-size", "2", "--batch", "2",
            "--group-size", "2", "--max-new-tokens", "8", "--max-len", "160", "--max-turns", "2",
            "--sft-steps", "0", "--no-progress"], rows


def test_a_dataset_envs_row_with_no_room_for_a_turn_is_skipped_at_load_so_training_goes_past_it(
        monkeypatch, tmp_path):
    """A row whose prompt filled --max-len stopped a multi-turn run when it was drawn (a checkpoint and one
    line), and --resume drew it again and stopped again: the run never got past it. Now, as a single-turn
    row past the context, it is a malformed row, skipped when the rows load: held out of training and eval."""
    monkeypatch.setitem(TEXT_ENVS, "gsm8k_long", LongRowRetry)
    size = lambda q: 1 + len(q) + 1 + len(tasks.GSM8K.instruction)  # bos, question, newline, instruction
    edge, over = "What is 5 plus 1?" + "?" * 60, "What is 6 plus 1?" + "?" * 61
    huge = "What is 7 plus 1?" * 12
    assert [size(q) for q in (edge, over, huge)] == [152, 153, 279]  # 160 less one turn of 8 leaves 152
    flags, rows = long_rows(tmp_path, edge, over, huge)
    out = str(tmp_path / "run")
    # 5 steps of one problem each draw every training row (all 7 rows less the 2 held out, before)
    assert train.main([*flags, "--steps", "5", "--out", out]) == 0
    assert train.main(["--resume", out, "--steps", "7"]) == 0  # on again, past every row once more
    assert [s for s, _, _ in rundir.read_metrics(Path(out) / "metrics.csv")["loss"]] == [1, 2, 3, 4, 5, 6, 7]
    data = flags[flags.index("--data") + 1]
    why = ("prompt of {} tokens after the chat template; --max-len 160 less --max-new-tokens 8 leaves 152: "
           "raise --max-len to {}")
    with pytest.warns(UserWarning) as caught:
        source = EnvRollouts(train.parse(flags), LLMPolicy(train.parse(flags)))
    skipped = f"gsm8k: skipped 2 malformed rows: {data}:6 ({why.format(153, 161)}); {data}:7 ({why.format(279, 287)})"
    assert [str(w.message) for w in caught] == [skipped]
    assert sorted(p.key for p in source.task.eval_problems() + source.task._train) == sorted(rows[:5])


def test_a_dataset_env_whose_every_row_is_too_long_stops_when_its_rows_load(monkeypatch, capsys, tmp_path):
    """Every row too long for a turn: the run stopped at its first step naming one prompt. Now every row is
    skipped when the rows load (each named, with the budget, in the warning), and the run stops there."""
    monkeypatch.setitem(TEXT_ENVS, "gsm8k_long", LongRowRetry)
    flags, rows = long_rows(tmp_path, *[f"What is {a} plus 1?" * 60 for a in range(4)], short=False)
    with pytest.warns(UserWarning, match=r"skipped 4 malformed rows: .*prompt of 1,095 tokens after the chat "
                      r"template; --max-len 160 less --max-new-tokens 8 leaves 152"):
        assert train.main([*flags, "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: --task gsm8k_long: 0 usable rows: --eval-size 2 leaves none to train on; add rows")
    assert not (tmp_path / "run").exists()  # before a step, or a run directory


def python_tool_flags(max_len: int) -> list[str]:
    """python_tool for the tiny model (a token a character, no template: a prompt is 1 + len(prompt) tokens),
    seed 1: its eval problems open with 170 tokens each, its training problem 7 with 205."""
    tiny = build_tiny_model(layers=1, hidden=64, heads=1, intermediate=128)
    return ["--task", "python_tool", "--model", tiny, "--seed", "1", "--eval-size", "2", "--max-len", str(max_len),
            "--max-new-tokens", "8", "--batch", "2", "--group-size", "2", "--max-turns", "2", "--sft-steps", "0",
            "--no-progress"]


def test_a_procedural_envs_draw_with_no_room_for_a_turn_is_redrawn_so_the_run_and_its_resume_go_past_it(
        tmp_path, capsys):
    """Training problem 7 opens with 205 tokens: under --max-len 200 it stopped the run at step 8 ("a prompt
    has 205 tokens, not fewer than max_len=200", ckpt-0000007 saved), and --resume drew it again and stopped
    again: the run never got past it. Now a draw that leaves no room (an opening of --max-len or more) is named
    in a warning, with the --max-len that holds a whole turn, and redrawn from the same index: on resume too.
    One that leaves room for less than a turn (193 to 199 tokens) plays a shorter first turn, as later turns do."""
    flags, out = python_tool_flags(200), str(tmp_path / "run")
    assert train.main([*flags, "--steps", "8", "--out", out]) == 0
    assert train.main(["--resume", out, "--steps", "9"]) == 0  # step 9 plays problem 8, redrawn too
    assert [s for s, _, _ in rundir.read_metrics(Path(out) / "metrics.csv")["loss"]] == list(range(1, 10))
    warned = re.findall(r"warning: training problem (\d+) draw (\d+) '(.*)' redrawn: prompt of (\d+) tokens after "
                        r"the chat template; --max-len 200 less --max-new-tokens 8 leaves 192: raise --max-len to "
                        r"(\d+)\n", capsys.readouterr().err)
    source = EnvRollouts(train.parse(flags), LLMPolicy(train.parse(flags)))
    for index, draw, key, n, fix in warned:  # each the draw it names, too long by the hand count
        problem = list(itertools.islice(source.task.draws(int(index)), int(draw)))[-1]
        assert problem.key == key and int(n) == 1 + len(problem.prompt) >= 200 and int(fix) == int(n) + 8
    assert [(i, d, n) for i, d, _, n, _ in warned] == [("7", "1", "205"), ("8", "1", "205")]  # one in each run
    played = [json.loads(line) for line in (Path(out) / "samples.jsonl").read_text().splitlines()]
    played = {r["step"]: r["prompt"] for r in played if r["kind"] == "train"}
    assert sorted(played) == list(range(1, 10)) and all(1 + len(p) < 200 for p in played.values())
    assert [played[i + 1] for i in range(9)] == [source.train_problem(i).prompt for i in range(9)]


def test_a_procedural_envs_eval_problem_with_no_room_for_a_turn_stops_the_run_before_a_step_naming_the_fix(
        tmp_path, capsys):
    """Its eval split is fixed: an eval problem of 170 tokens under --max-len 170 stopped the step-0 eval ("a
    prompt has 170 tokens, not fewer than max_len=170", ckpt-0000000 and a run directory), and every eval of a
    resume. Now the run stops before a step, in one line naming the problem and the --max-len it needs. Under
    --max-len 175 (less 8 leaves 167) it plays a shorter first turn: the tiny model's 1,024 positions less the
    default 512 new tokens leave less than a turn to sql's longest openings, which must still train."""
    out = tmp_path / "run"
    assert train.main([*python_tool_flags(170), "--steps", "1", "--out", str(out)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: --task python_tool: the eval problem 'What is the sum of the decimal digits of 485 factorial?' has "
        "no room for a turn: prompt of 170 tokens after the chat template; --max-len 170 less --max-new-tokens 8 "
        "leaves 162: raise --max-len to 178")
    assert not out.exists()
    cfg = train.parse(python_tool_flags(175))
    source = EnvRollouts(cfg, LLMPolicy(cfg))
    assert [len(source.prompt_ids(p)) for p in source.task.eval_problems()] == [170, 170]
    assert [source.too_long(p) for p in source.task.eval_problems()] == [None, None]


class ShortOrLong(ProceduralTask):  # two problems: under seed 1 the eval split holds the short one
    name = "short_or_long"

    def generate(self, rng):
        long = rng.random() < 0.5
        return Problem("Guess." + "?" * 100 * long, "1", key="long" if long else "short")


class ShortOrLongEnv(TextEnv):
    task = ShortOrLong

    def respond(self, completion):
        return None, 0.0, False


def test_a_procedural_env_whose_every_training_draw_has_no_room_for_a_turn_stops_after_100_naming_the_fix(
        monkeypatch, capsys):
    """A task whose every training draw is too long stopped the run with "a prompt has 125 tokens, not fewer
    than max_len=64" (the redraws must end). Now 100 draws in a row stop it, each named, the fix in the line.
    Under the chat template a prompt is 19 tokens and its text: the long one 125, of 64 less 8."""
    monkeypatch.setitem(TEXT_ENVS, "short_or_long", ShortOrLongEnv)
    cfg = train.Config(task="short_or_long", algo="grpo", seed=1, batch=2, group_size=2, eval_size=1,
                       max_new_tokens=8, max_len=64)
    source = EnvRollouts(cfg, ScriptedPolicy(chat_tokenizer(), lambda text: "1"))
    assert [p.key for p in source.task.eval_problems()] == ["short"]
    with pytest.raises(ConfigError, match=re.escape(
            "100 draws in a row have no room for a turn, the last a prompt of 125 tokens after the chat template; "
            "--max-len 64 less --max-new-tokens 8 leaves 56: raise --max-len to 133")):
        source.next(0)
    assert capsys.readouterr().err.count("warning: training problem 0 draw ") == 100  # each named


def test_an_env_without_max_turns_in_its_init_plays_the_runs_max_turns(monkeypatch):
    """EnvRollouts called env(cfg.max_turns): "__init__() takes 1 positional argument but 2 were given"."""
    class NoArgs(GuessNumber):  # max_turns = 7, GuessNumber's
        def __init__(self):
            self.guesses = []

    monkeypatch.setitem(TEXT_ENVS, "noargs", NoArgs)
    for max_turns in (2, 9):  # under and over the class's 7: --max-turns decides both ways
        cfg = train.Config(task="noargs", algo="grpo", batch=4, group_size=2, eval_size=4, max_new_tokens=8,
                           max_turns=max_turns)
        batch = EnvRollouts(cfg, ScriptedPolicy(chat_tokenizer(), lambda text: "0")).next(0)  # never right
        assert batch.stats["turns"].tolist() == [max_turns] * 4 and batch.stats["solved"].sum() == 0


def test_an_env_with_its_own_step_is_solved_by_its_info_solved_at_turn_as_documented():
    class OwnStep(GuessNumber):
        def step(self, completion):
            self.turn += 1
            right = completion_number(completion) == int(self.problem.answer)
            return None, 1.0, True, {"solved_at_turn": self.turn} if right else {}  # absent: unsolved

    problems = [Problem("Guess.", "50", "50"), Problem("Guess.", "7", "7")]
    batch = rollout_multiturn(ScriptedPolicy(chat_tokenizer(), bisect), OwnStep, problems, group_size=1,
                              max_turns=7, max_new_tokens=8, max_len=4096)
    assert batch.stats["solved"].tolist() == [1.0, 0.0] and batch.rewards.sum(1).tolist() == [1.0, 1.0]
    assert batch.stats["solved_first_turn"].tolist() == [1.0, 0.0]
    assert 'info["solved_at_turn"]' in TextEnv.__doc__ and '`info["solved_at_turn"]`' in README


@pytest.mark.parametrize("wrong", [None, "yes", True, 9])
def test_an_envs_info_solved_at_turn_that_is_no_turn_stops_in_one_line_naming_it(wrong):
    """None failed deep in the rollout ("float() argument must be a string or a real number, not 'NoneType'"),
    naming neither the env nor its step; True passed as turn 1, and 9 as a turn not yet played."""
    class Said(GuessNumber):
        def step(self, completion):
            return None, 1.0, True, {"solved_at_turn": wrong}

    with pytest.raises(RewardError) as e:
        rollout_multiturn(ScriptedPolicy(chat_tokenizer(), bisect), Said, [Problem("Guess.", "37", "37")],
                          group_size=1, max_turns=7, max_new_tokens=8, max_len=4096)
    assert str(e.value) == f"Said.step's info['solved_at_turn'] is {wrong!r}: the turn that solved, from 1, or 0"


@pytest.mark.parametrize("rewards", [[], [(len, math.nan)], [(len, "1")], [len], [(len, 1.0, 2.0)]])
def test_rewards_that_are_no_function_weight_pairs_stop_in_one_line_when_the_task_is_made(monkeypatch, rewards):
    """A NaN weight made every total NaN, every sample "unscored": nothing trained and the run ended 0; a
    string weight or a bare function failed mid-step (TypeError) naming nothing."""
    class Weighed(tasks.Arith):
        name = "weighed"

    Weighed.rewards = rewards
    monkeypatch.setitem(tasks.TASKS, "weighed", Weighed)
    with pytest.raises(ConfigError) as e:
        TaskRollouts(train.Config(task="weighed"), policy=None)
    assert str(e.value) == (f"--task weighed: Weighed.rewards is {rewards!r:.100}: list (function, weight) "
                            "pairs, at least one, each weight a finite number")


def test_rewards_whose_weighted_total_passes_float32_stop_naming_the_task_and_the_completion():
    """Two rewards of 3e38, each in float32's range: their total failed in make_batch ("value cannot be
    converted to type float without overflow")."""
    class Huge(Task):
        name, rewards = "huge", [(lambda p, c, a: 3e38, 1.0), (lambda p, c, a: 3e38, 1.0)]

    with pytest.raises(RewardError) as e:
        rollout_single(Recording(chat_tokenizer(), lambda text: "a"), Huge(), [Problem("say a", "a", "ka")], 2,
                       train.Config(max_new_tokens=8, gen_batch=4))
    assert str(e.value) == "huge's weighted total 6e+38 for the completion 'a' is past float32's range; scale " \
                           "its rewards or weights"


def test_a_solver_that_returns_no_text_stops_the_warm_start_in_one_line_naming_it(monkeypatch):
    """An int from solve() failed inside the tokenizer ("text input must be of type str"), naming nothing."""
    class Mute(tasks.Arith):
        name = "mute"

        def solve(self, problem):
            return int(problem.answer)

    monkeypatch.setitem(tasks.TASKS, "mute", Mute)
    source = TaskRollouts(train.Config(task="mute", sft_steps=1), ScriptedPolicy(chat_tokenizer(), bisect))
    with pytest.raises(ConfigError) as e:
        source.demonstrations(2)
    assert re.fullmatch(r"--sft-steps: Mute.solve\(\) gave -?\d+, not an answer's text to imitate \(a judged "
                        r"task's rows may have none\); make it return one, or --sft-steps 0", str(e.value))


def test_a_huge_reply_is_tokenized_only_as_far_as_max_len_can_hold_and_ends_the_episode():
    """A 2 MB reply was tokenized whole (seconds and GBs with a real tokenizer) to end the episode anyway."""
    class Dump(GuessNumber):
        def respond(self, completion):
            return "x" * 2_000_000, 0.0, False

    policy, seen = ScriptedPolicy(chat_tokenizer(), bisect), []
    encode = policy.tokenizer.encode
    policy.tokenizer.encode = lambda text, **kw: seen.append(len(text)) or encode(text, **kw)
    batch = rollout_multiturn(policy, Dump, [Problem("Guess.", "37", "37")], group_size=1, max_turns=7,
                              max_new_tokens=8, max_len=100)
    assert batch.stats["turns"].tolist() == [1] and batch.truncated.tolist() == [True]
    assert batch.attn.sum().item() == len(policy.encode_prompt("Guess.")) + len("50") + 1  # no reply in it
    # 100 positions at most: the reply's content is cut to under 101 * 12 characters (<|im_start|>, the
    # longest token, has 12), plus the template's 50 around it
    assert max(seen) < 101 * 12 + 50


def test_the_warm_start_of_an_env_task_imitates_after_the_envs_own_opening(monkeypatch):
    """It imitated after problem.prompt alone, a prefix the rollouts never show (here: no system message)."""
    monkeypatch.setitem(TEXT_ENVS, "brief", WithSystem)
    cfg = train.Config(task="brief", algo="grpo", batch=2, group_size=2, eval_size=4, sft_steps=1)
    source = EnvRollouts(cfg, ScriptedPolicy(chat_tokenizer(), bisect))
    problem = source.task.train_problem(0)
    tok, demo = source.policy.tokenizer, source.demonstrations(1)
    assert tok.decode(demo.tokens[0][demo.attn[0] > 0]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n" + problem.prompt
        + "<|im_end|>\n<|im_start|>assistant\n" + source.task.solve(problem) + "<|im_end|>")


class Buggy(ProceduralTask):
    name = "buggy"

    def generate(self, rng):
        return Problem("p", str(int("x3")), "k")  # a bug in the user's own task code


def test_a_bug_in_a_tasks_own_code_keeps_its_traceback_and_a_bad_split_stays_one_line(monkeypatch, tmp_path):
    """int("x3") in generate() stopped the run as "error: --task buggy: invalid literal for int() ...", no
    traceback: every ValueError from building the task was taken for a data or flag problem."""
    monkeypatch.setitem(tasks.TASKS, "buggy", Buggy)
    with pytest.raises(ValueError, match=r"^invalid literal for int\(\) with base 10: 'x3'$") as e:
        TaskRollouts(train.Config(task="buggy"), policy=None)
    assert type(e.value) is ValueError and e.traceback[-1].name == "generate"
    argv = ["--task", "buggy", "--model", "tiny", "--sft-steps", "0", "--no-progress", "--out", str(tmp_path)]
    with pytest.raises(ValueError, match=r"^invalid literal for int\(\)") as e:  # main shows a bug whole
        train.main(argv)
    assert type(e.value) is ValueError
    with pytest.raises(ConfigError, match=r"^--task countdown: eval_size=100001: 100000 at most; lower "
                                          r"--eval-size$"):
        TaskRollouts(train.Config(task="countdown", eval_size=100_001), policy=None)


class Poems(tasks.DatasetTask):  # the README's judged task, with a reward that needs no judge server
    name, instruction, numeric = "poems", "", False
    rewards = [(lambda prompt, completion, answer: 0.5, 1.0)]


def test_rows_without_an_answer_for_the_warm_start_are_named_by_file_and_line_before_any_step(
        monkeypatch, tmp_path):
    """The warm-start stopped when it first drew such a row (at step 7 of 20, say), naming none of them."""
    monkeypatch.setitem(tasks.TASKS, "poems", Poems)
    rows = [{"question": f"Haiku {i}", "answer": f"ref {i}"} for i in range(1, 9)]
    for i in (2, 6, 8):
        del rows[i - 1]["answer"]
    rows[2]["answer"], rows[4]["answer"] = None, ""  # lines 3 and 5: no answer either
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = train.Config(task="poems", data=str(data), eval_size=1, sft_steps=20)
    assert [p.key for p in tasks.make_task("poems", seed=0, eval_size=1, data=str(data))._eval] == ["Haiku 6"]
    with pytest.raises(ConfigError) as e:  # line 6 is held out: the warm-start never draws it
        TaskRollouts(cfg, policy=None)
    assert str(e.value) == (f"--sft-steps: poems has 4 rows without an answer to imitate ({data}:2, "
                            f"{data}:3, {data}:5, ...); add answers to its rows, or --sft-steps 0")
    rows[2]["answer"], rows[7]["answer"] = "ref 3", "ref 8"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError, match=rf"^--sft-steps: poems has 2 rows .* \({data}:2, {data}:5\); add"):
        TaskRollouts(cfg, policy=None)
    assert TaskRollouts(dataclasses.replace(cfg, sft_steps=0), policy=None).task.unanswered() == [
        f"{data}:2", f"{data}:5"]  # without a warm-start they are fine: a judge needs no reference


def test_readme_example_solves_in_a_rollout_by_bisection(monkeypatch):
    monkeypatch.setitem(TEXT_ENVS, "guess", GuessNumber)  # the README registers it at import time
    task = TEXT_ENVS["guess"].task(seed=0, eval_size=4)
    problems = task.eval_problems()
    policy = ScriptedPolicy(chat_tokenizer(), bisect)
    batch = rollout_multiturn(policy, GuessNumber, problems, group_size=2, max_turns=7, max_new_tokens=8, max_len=4096)
    turns = []  # bisection by hand: guess 50, then the middle of what is left
    for p in problems:
        lo, hi, n = 1, 100, 1
        while (guess := (lo + hi) // 2) != int(p.answer):
            lo, hi, n = (guess + 1, hi, n + 1) if guess < int(p.answer) else (lo, guess - 1, n + 1)
        turns += [n, n]
    assert batch.stats["solved"].tolist() == [1.0] * 8 and batch.stats["turns"].tolist() == turns
    assert batch.group.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert batch.rewards.sum(1).tolist() == [1.0] * 8
    assert {k: v.mean().item() for k, v in batch.stats.items()} == {"solved": 1.0, "solved_first_turn": 0.0,
                                                                  "turns": sum(turns) / 8}


def test_a_multi_turn_source_generates_in_chunks_of_gen_batch(monkeypatch):
    """--gen-batch reaches every generate call of a sync multi-turn run, as it does in a worker's."""
    monkeypatch.setitem(TEXT_ENVS, "guess", GuessNumber)
    cfg = train.Config(task="guess", algo="grpo", batch=4, group_size=2, gen_batch=3, eval_size=4, max_new_tokens=8)
    policy, chunks = ScriptedPolicy(chat_tokenizer(), bisect), []
    scripted = policy.generate
    policy.generate = lambda prefixes, n, gen_batch, greedy=False: chunks.append(gen_batch) or scripted(prefixes, n)
    batch = EnvRollouts(cfg, policy).next(0)
    assert len(batch) == 4 and len(chunks) == int(batch.stats["turns"].max()) and set(chunks) == {3}


@pytest.mark.parametrize("max_turns", [1, 6])
def test_a_multi_turn_source_plays_exactly_max_turns_turns(max_turns):
    """--max-turns, not the env class's default of 4, ends an episode that never solves."""
    cfg = train.Config(task="countdown_multiturn", algo="grpo", batch=4, group_size=2, eval_size=4,
                       max_new_tokens=32, max_turns=max_turns)
    batch = EnvRollouts(cfg, ScriptedPolicy(chat_tokenizer(), lambda text: "<answer>1 + 1</answer>")).next(0)
    assert batch.stats["turns"].tolist() == [max_turns] * 4 and batch.stats["solved"].sum() == 0


def test_the_readme_env_with_its_100_secrets_refuses_100_held_out_and_trains_with_the_size_named(
        monkeypatch, capsys, tmp_path):
    """The default --eval-size 100 held out every secret: "10,000 draws all hit the eval split; lower
    --eval-size", without a size. The README's command, --eval-size 50, trains."""
    monkeypatch.setitem(TEXT_ENVS, "guess", GuessNumber)
    small = ["--task", "guess", "--steps", "1", "--sft-steps", "1", "--batch", "4", "--group-size", "2",
             "--max-new-tokens", "4", "--max-turns", "2", "--no-progress"]
    assert train.main([*small, "--out", str(tmp_path / "a")]) == 2
    assert capsys.readouterr().err == ("error: --task guess: found only 100 distinct problems; --eval-size 100 "
                                       "leaves too few to train on; lower it to 50 or less\n")
    assert "python train.py --task guess --eval-size 50" in README
    assert train.main([*small, "--eval-size", "50", "--out", str(tmp_path / "b")]) == 0
    task = GuessTask(eval_size=50)
    assert len(task.eval_problems()) == 50 and task.train_problem(0).key not in task._eval_keys


def test_an_envs_own_max_turns_is_the_tasks_default_and_the_flag_overrides_it(monkeypatch):
    monkeypatch.setitem(TEXT_ENVS, "guess", GuessNumber)  # the README's env: max_turns = 7
    assert [train.parse(argv).max_turns for argv in (["--task", "guess"], ["--task", "guess", "--max-turns", "2"],
                                                      ["--task", "sql"], ["--task", "arith"])] == [7, 2, 4, 4]


class HalfStubborn(ScriptedPolicy):
    """Greedy: bisection. Sampled: the odd episodes of each group guess 1 on every turn instead."""

    def generate(self, prefixes, max_new_tokens, gen_batch=64, greedy=False):
        rows = iter(range(len(prefixes)))
        self.script = lambda text: "1" if not greedy and stubborn(next(rows), text) else bisect(text)
        return super().generate(prefixes, max_new_tokens)


def stubborn(row: int, conversation: str) -> bool:
    turns = conversation.split("<|im_start|>assistant\n")[1:]  # the model's turns so far, then the open one
    return bool(row % 2) if len(turns) == 1 else turns[0].startswith("1<|im_end|>")


def test_a_multi_turn_eval_reports_pass_at_k_and_shows_debug_samples(monkeypatch, capsys):
    """--pass-k and --debug-samples work for multi-turn tasks as for single-turn ones."""
    monkeypatch.setitem(TEXT_ENVS, "guess", GuessNumber)
    cfg = train.Config(task="guess", algo="grpo", batch=4, group_size=2, eval_size=4, max_new_tokens=8,
                       max_turns=7, pass_k=2, debug_samples=1)
    source = EnvRollouts(cfg, HalfStubborn(chat_tokenizer(), bisect))
    secrets = [int(p.answer) for p in source.task.eval_problems()]
    metrics = source.evaluate()
    # bisection solves every problem; of each pair of samples one bisects, the other solves only a secret 1
    assert metrics["eval_accuracy"] == 1.0 and metrics["eval_pass@2"] == 1.0
    assert metrics["eval_pass@1"] == sum((1 + (s == 1)) / 2 for s in secrets) / 4
    assert capsys.readouterr().out.count("--- eval prompt:") == 1  # tqdm.write: stdout


# ---------------------------------------------------------------- token-exact multi-turn episodes
def think_then_answer(conversation: str) -> str:
    return "<think>try</think><answer>3 + 5</answer>" if "Try again" not in conversation else \
        "<think>again</think><answer>3 * 5</answer>"


def test_trained_tokens_are_the_sampled_tokens_under_a_template_that_rewrites_history():
    tok = chat_tokenizer()
    policy = ScriptedPolicy(tok, think_then_answer)
    problem = countdown_problem([3, 5], 15)
    batch = rollout_multiturn(policy, CountdownEnv, [problem], 1, max_turns=3, max_new_tokens=64, max_len=512)
    (_, turn1), = policy.sampled[0]
    (prefix2, turn2), = policy.sampled[1]
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": problem.prompt}], tokenize=False,
                                                add_generation_prompt=True), add_special_tokens=False)
    reply = tok.encode("\n<|im_start|>user\n3 + 5 = 8, but the target is 15. Try again.<|im_end|>\n"
                       "<|im_start|>assistant\n", add_special_tokens=False)
    assert prefix2 == prompt + turn1.ids + reply  # the second turn was sampled after exactly these tokens
    row = prompt + turn1.ids + reply + turn2.ids
    n = len(row)
    assert batch.tokens[0, :n].tolist() == row and batch.attn[0].sum() == n
    mask = batch.mask[0].bool()
    assert batch.tokens[0][mask].tolist() == turn1.ids + turn2.ids  # what is trained is what was sampled
    assert batch.logp[0][mask].tolist() == pytest.approx(turn1.logps + turn2.logps)
    # The template rewrites history: re-rendering the chat drops turn 1's <think>, so re-encoding
    # the conversation (instead of appending the reply's tokens) would train on other tokens.
    chat = [{"role": "user", "content": problem.prompt}, {"role": "assistant", "content": tok.decode(turn1.ids[:-1])},
            {"role": "user", "content": "3 + 5 = 8, but the target is 15. Try again."},
            {"role": "assistant", "content": tok.decode(turn2.ids[:-1])}]
    rerendered = tok.encode(tok.apply_chat_template(chat, tokenize=False), add_special_tokens=False)
    assert "<think>try</think>" not in tok.decode(rerendered) and rerendered[:n] != row


def test_mask_covers_exactly_the_model_turns_and_the_reward_sits_on_the_last_one():
    tok = chat_tokenizer()
    policy = ScriptedPolicy(tok, think_then_answer)
    problem = countdown_problem([3, 5], 15)
    batch = rollout_multiturn(policy, CountdownEnv, [problem], 2, max_turns=3, max_new_tokens=64, max_len=512)
    # One token per character; S, E: the single tokens <|im_start|>, <|im_end|> (E also ends a turn).
    S = E = 1
    prompt = S + len("user\n" + problem.prompt) + E + len("\n") + S + len("assistant\n")
    turn1 = len("<think>try</think><answer>3 + 5</answer>") + E
    reply = len("\n") + S + len("user\n3 + 5 = 8, but the target is 15. Try again.") + E + len("\n") + S
    reply += len("assistant\n")
    turn2 = len("<think>again</think><answer>3 * 5</answer>") + E
    expected = [0] * prompt + [1] * turn1 + [0] * reply + [1] * turn2
    n = len(expected)
    assert batch.mask.tolist() == [expected] * 2 and batch.attn.sum(1).tolist() == [n, n]
    assert (batch.logp != 0).float().tolist() == batch.mask.tolist()
    assert batch.rewards[:, n - 1].tolist() == [1.0, 1.0] and batch.rewards.sum().item() == 2.0
    assert batch.stats["turns"].tolist() == [2, 2] and batch.stats["solved"].tolist() == [1, 1]
    assert batch.stats["solved_first_turn"].tolist() == [0, 0]
    assert batch.truncated.tolist() == [False, False] and batch.group.tolist() == [0, 0]


class WithSystem(CountdownEnv):
    """An env of the user's own that opens with a system message, then the task's prompt."""

    def reset(self, problem):
        messages, info = super().reset(problem)
        return [{"role": "system", "content": "Be brief."}, *messages], info


@pytest.mark.parametrize("template", [True, False])
def test_an_env_that_opens_with_a_system_message_is_sampled_after_both_messages(template):
    tok = chat_tokenizer()
    tok.chat_template = TEMPLATE if template else None
    policy = ScriptedPolicy(tok, think_then_answer)
    problem = countdown_problem([3, 5], 15)
    batch = rollout_multiturn(policy, WithSystem, [problem], 1, max_turns=1, max_new_tokens=64, max_len=512)
    (prefix, turn), = policy.sampled[0]
    opening = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n" + problem.prompt
               + "<|im_end|>\n<|im_start|>assistant\n") if template else "Be brief.\n\n" + problem.prompt
    assert tok.decode(prefix) == opening  # the system message is in the prompt, as the template renders it
    n = len(prefix) + len(turn.ids)
    assert batch.tokens[0, :n].tolist() == prefix + turn.ids and batch.mask[0].sum() == len(turn.ids)


def test_episode_that_would_pass_max_len_ends_early_and_truncated():
    policy = ScriptedPolicy(chat_tokenizer(), think_then_answer)
    problem = countdown_problem([3, 5], 15)
    prompt = len(policy.encode_prompt(problem.prompt))
    turn = len("<think>try</think><answer>3 + 5</answer>") + 1
    # room for turn 1 but not for the reply: the episode stops after one turn, no reply appended
    batch = rollout_multiturn(policy, CountdownEnv, [problem], 1, 3, max_new_tokens=64, max_len=prompt + turn + 10)
    assert batch.attn[0].sum() == prompt + turn and batch.stats["turns"].tolist() == [1]
    assert batch.truncated.tolist() == [True] and batch.rewards.sum() == 0
    # room for only 5 tokens of turn 1: the sample is cut (still exactly what was sampled)
    batch = rollout_multiturn(policy, CountdownEnv, [problem], 1, max_turns=3, max_new_tokens=64, max_len=prompt + 5)
    assert batch.tokens[0, prompt:].tolist() == policy.sampled[-1][0][1].ids[:5]
    assert batch.truncated.tolist() == [True]
    # no room at all: a source never draws it (EnvRollouts.too_long names the --max-len it needs)
    with pytest.raises(ValueError, match=f"^a prompt has {prompt} tokens, not fewer than max_len or context {prompt}$"):
        rollout_multiturn(policy, CountdownEnv, [problem], 1, max_turns=3, max_new_tokens=64, max_len=prompt)


# ---------------------------------------------------------------- countdown_multiturn
def test_the_multiturn_presets_turn_budget_holds_every_demonstrated_answer_so_the_calculator_can_reply():
    """configs/countdown_multiturn_tiny.yaml gave each turn 24 tokens, and every solver answer (28 to 38
    characters, one token each on the tiny model, and the end token) was cut: no turn ever ended, so the
    calculator never answered and the "multi-turn" smoke run played one truncated turn per episode."""
    cfg = train.parse(["--config", str(Path(__file__).resolve().parent.parent / "configs"
                                       / "countdown_multiturn_tiny.yaml")])
    tok = AutoTokenizer.from_pretrained(build_tiny_model(layers=1, hidden=64, heads=1, intermediate=128))
    task = tasks.Countdown(seed=cfg.seed, eval_size=cfg.eval_size)
    problems = task.eval_problems() + [task.train_problem(i) for i in range(500)]
    longest = max(len(tok.encode(task.solve(p), add_special_tokens=False)) + 1 for p in problems)  # + end
    assert cfg.task == "countdown_multiturn" and longest == 39 and cfg.max_new_tokens >= longest


def test_countdown_calculator_answers_with_the_value_and_the_target():
    env = CountdownEnv(max_turns=6)
    env.reset(countdown_problem([3, 5, 7], 22))
    replies = [env.step(c) for c in ["I think 22", "<answer>3 + 5 + 7</answer>", "<answer>3 * 5</answer>",
                                     "<answer>3 / 5 + 7</answer>", "<answer>3 * (5</answer>"]]
    assert [r[0][0]["content"] for r in replies[:4]] == [
        "Give your expression in <answer></answer> tags.",
        "3 + 5 + 7 = 15, but the target is 22. Try again.",
        "3 * 5 uses [3, 5]; use each of [3, 5, 7] exactly once. Try again.",
        "3 / 5 + 7 = 38/5, but the target is 22. Try again."]
    assert replies[4][0][0]["content"].startswith("3 * (5 is not a valid expression")
    assert all(r[1:3] == (0.0, False) for r in replies)
    assert env.step("<answer>3 * 5 + 7</answer>") == (None, 1.0, True, {"turns": 6, "solved_at_turn": 6})


def test_countdown_calculator_says_what_to_change_when_only_the_part_after_equals_is_refused():
    """"(1 + 2) * 3 = 9.0" for target 9 (refused, as in single-turn countdown) was told "(1 + 2) * 3 = 9.0
    = 9, but the target is 9": the reply contradicted itself. A left side that misses shows alone."""
    env = CountdownEnv(max_turns=9)
    env.reset(problem := countdown_problem([1, 2, 3], 9))
    fix = "(1 + 2) * 3 = 9; answer with it alone or as (1 + 2) * 3 = 9. Try again."
    for tail in (" = 9.0", " == 9", " = 9 exactly", " = 10"):
        completion = f"<answer>(1 + 2) * 3{tail}</answer>"
        assert countdown_correct(problem.prompt, completion, problem.answer) == 0.0
        assert env.step(completion)[:3] == ([{"role": "user", "content": fix}], 0.0, False)
    reply = env.step("<answer>(1 + 3) * 2 = 9</answer>")[0][0]["content"]
    assert reply == "(1 + 3) * 2 = 8, but the target is 9. Try again."
    assert env.step("<answer>(1 + 2) * 3 = 9</answer>")[:3] == (None, 1.0, True)
    env.reset(countdown_problem([2, 3, 9], 12))
    assert env.step("<answer>(9 \u2212 3) * 2</answer>")[:3] == (None, 1.0, True)  # a typeset minus


# ---------------------------------------------------------------- python_tool
def test_python_tool_runs_code_then_scores_the_final_answer():
    env = PythonToolEnv()
    env.reset(Problem("What is 6 * 7?", "42", "k"))
    assert env.step("Let me think.")[0][0]["content"].startswith("Run code in a ```python block")
    two = env.step("```python\nprint('first')\n```\nOr rather:\n```python\nprint('second')\n```")
    assert two[0][0]["content"] == "stdout:\nsecond\n\n(exit code 0)"  # the last block: a model's correction
    obs, reward, done, _ = env.step("```python\nprint(6 * 7)\nimport sys; print('warn', file=sys.stderr)\n```")
    assert obs[0]["content"] == "stdout:\n42\n\nstderr:\nwarn\n\n(exit code 0)" and (reward, done) == (0.0, False)
    assert env.step("<answer>42</answer>") == (None, 1.0, True, {"turns": 4, "solved_at_turn": 4})
    env.reset(Problem("What is 6 * 7?", "42", "k"))
    assert env.step("<answer>41</answer>") == (None, 0.0, True, {"turns": 1, "solved_at_turn": 0})


def test_python_task_answers_match_an_independent_computation():
    seen = set()
    for p in PythonTask(seed=0, eval_size=16).eval_problems():
        nums = [int(x) for x in re.findall(r"\d+", p.prompt.split("\n")[0])]
        if "prime" in p.prompt:
            n = nums[0]
            is_prime = np.ones(n, bool)
            is_prime[:2] = False
            for i in range(2, int(n**0.5) + 1):
                is_prime[i * i :: i] &= ~is_prime[i]  # noqa: E203 (numpy sieve, unlike the task's bytearray one)
            want, kind = int(np.nonzero(is_prime)[0].sum()), "primes"
        elif "Fibonacci" in p.prompt:
            n, m = nums[0], nums[1]
            a, b = 1, 1  # F(1), F(2)
            for _ in range(n - 1):
                a, b = b, a + b
            want, kind = a % m, "fib"
        elif "factorial" in p.prompt:
            want, kind = sum(int(d) for d in str(math.prod(range(1, nums[0] + 1)))), "digits"
        else:
            n, x, y = nums[1], nums[2], nums[3]
            r = np.arange(1, n + 1)
            want, kind = int(((r % x == 0) ^ (r % y == 0)).sum()), "divisible"
        assert p.answer == str(want), p.prompt
        seen.add(kind)
    assert seen == {"primes", "fib", "digits", "divisible"}


class Lowest:
    """An rng that draws problem `kind`, then each range's lowest value and each list's first."""

    def __init__(self, kind):
        self.randrange = lambda n: kind

    randint, choice = staticmethod(lambda a, b: a), staticmethod(lambda xs: xs[0])


@pytest.mark.parametrize("kind, answer", [
    (0, 76127),  # the primes below 1000: 961 = 31^2 sits just under it, and 31 is the last prime to sieve
    (1, 75),  # F(100) = 354224848179261915075
    (2, 117),  # 30! = 265252859812191058636308480000000
    (3, 3501),  # 3333 + 500 - 2 x 166 (multiples of 60) in 1..10000
])
def test_python_task_answers_at_the_low_end_of_each_range_by_hand(kind, answer):
    assert PythonTask(seed=0, eval_size=1).generate(Lowest(kind)).answer == str(answer)


# ---------------------------------------------------------------- sql
def db_hash(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.mark.parametrize("query", ["DELETE FROM customers", "DROP TABLE customers", "UPDATE customers SET city = 'x'",
                                   "INSERT INTO customers VALUES (99, 'x', 'y', 2020)", "CREATE TABLE t (x)",
                                   "CREATE TEMP TABLE t (x)", "ATTACH DATABASE '/tmp/nanorl-attached.db' AS x",
                                   "PRAGMA user_version = 7", "PRAGMA writable_schema = ON",
                                   "PRAGMA table_info(customers)"])
def test_sql_tool_denies_everything_but_reading(query):
    path = sql_database("shop")
    before = db_hash(path)
    with pytest.raises(sqlite3.DatabaseError, match="not authorized"):
        run_sql(path, query)
    assert db_hash(path) == before and not Path("/tmp/nanorl-attached.db").exists()


def test_a_built_database_is_readable_by_the_users_who_share_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NANORL_CACHE", str(tmp_path))
    sql_database.cache_clear()
    try:
        path = Path(sql_database("shop"))
        assert path.parent == tmp_path / "sql" and path.stat().st_mode & 0o777 == 0o666 & ~UMASK  # mkstemp's: 0600
        rows = SQL["shop"]["tables"]["customers"]["rows"]
        assert run_sql(str(path), "SELECT COUNT(*) FROM customers")[1] == [(len(rows),)]
        assert Path(sql_database("school")).parent == path.parent  # a second one beside it
    finally:
        sql_database.cache_clear()  # the other tests' cache again


def test_a_cache_that_is_a_file_stops_the_run_in_one_line(tmp_path, monkeypatch):
    (tmp_path / "cache").write_text("")
    monkeypatch.setenv("NANORL_CACHE", str(tmp_path / "cache"))
    sql_database.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"cannot write .*/cache/sql/shop-\w+\.db \(\[Errno 20\] Not a dir"):
            sql_database("shop")
    finally:
        sql_database.cache_clear()


FULL_CACHE = """
import json, resource, sys
from envs import SQLEnv, sql_correct
from utils import ConfigError
answer = json.dumps({"db": "shop", "gold": "SELECT 1"})
env = SQLEnv.__new__(SQLEnv)
env.problem = type("P", (), {"answer": answer})
for use in (lambda: sql_correct("", "<answer>SELECT 1</answer>", answer), lambda: env.run("SELECT 1")):
    try:
        print(repr(use()))
    except ConfigError as e:
        print("ConfigError:", e)
"""


def test_a_database_the_cache_has_no_room_for_stops_the_run_and_never_scores_0(tmp_path):
    """sqlite's "database or disk is full" (on a full disk) and "disk I/O error" (past RLIMIT_FSIZE, here) are
    sqlite3.Errors, which sql_correct read as the model's broken query: a cache without room scored every
    answer 0, and the SQL tool showed the model the error. Now the run stops in one line."""
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 10, resource.RLIM_INFINITY))  # 8 KB
    out = subprocess.run([sys.executable, "-c", FULL_CACHE], capture_output=True, text=True, preexec_fn=limit,
                         cwd=Path(__file__).parent.parent, env={**os.environ, "NANORL_CACHE": str(tmp_path)})
    db, lines = re.escape(str(tmp_path / "sql")) + r"/shop-\w+\.db", out.stdout.splitlines()
    fix = r"point NANORL_CACHE \(the model cache\) at a writable directory with room"
    assert len(lines) == 2, out  # the reward, then the tool: each raised, neither returned
    assert all(re.fullmatch(rf"ConfigError: cannot write {db} \(disk I/O error\); {fix}", x) for x in lines)
    assert list((tmp_path / "sql").iterdir()) == []  # no database, no .tmp left


def test_sql_tool_interrupts_an_endless_recursive_cte_and_huge_blobs():
    path = sql_database("shop")
    with pytest.raises(sqlite3.OperationalError, match=r"^interrupted: the query ran over 2\.0 s$"):
        run_sql(path, "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c")
    with pytest.raises(sqlite3.DataError, match="too big"):
        run_sql(path, "SELECT zeroblob(1000000000)")
    five = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c LIMIT 5) SELECT SUM(x) FROM c"
    assert run_sql(path, five) == (["SUM(x)"], [(15,)], False)


def test_sql_reward_compares_result_sets_with_the_gold_query():
    customers = SQL["shop"]["tables"]["customers"]["rows"]
    oslo = sorted(name for _, name, city, _ in customers if city == "Oslo")
    answer = json.dumps({"db": "shop", "gold": "SELECT name FROM customers WHERE city = 'Oslo'"})
    assert len(oslo) >= 2  # the order checks below need at least two rows
    assert sql_correct("", "<answer>SELECT name FROM customers WHERE city = 'Oslo'</answer>", answer) == 1.0
    assert sql_correct("", "<answer>SELECT name FROM customers WHERE city IN ('Oslo') ORDER BY name DESC</answer>",
                       answer) == 1.0  # no ORDER BY in the gold query: order does not matter
    assert sql_correct("", "<answer>```sql\nSELECT name FROM customers WHERE 'Oslo' = city\n```</answer>",
                       answer) == 1.0
    assert sql_correct("", "<answer>SELECT name, city FROM customers WHERE city = 'Oslo'</answer>", answer) == 0.0
    assert sql_correct("", "<answer>SELECT name FROM customers WHERE city = 'Lima'</answer>", answer) == 0.0
    assert sql_correct("", "<answer>SELEC name FROM customers</answer>", answer) == 0.0
    assert sql_correct("", "SELECT name FROM customers WHERE city = 'Oslo'", answer) == 0.0  # no answer tags
    hedge = "<answer>SELECT name FROM customers</answer><answer>SELECT name FROM customers WHERE city = 'Oslo'</answer>"
    assert sql_correct("", hedge, answer) == 0.0  # two answers: neither counts
    assert sql_correct("", "<answer>SELECT name FROM customers WHERE city = 'Oslo'", answer) == 0.0  # unclosed tag
    ordered = json.dumps({"db": "shop", "gold": "SELECT name FROM customers WHERE city = 'Oslo' ORDER BY name"})
    assert sql_correct("", "<answer>SELECT name FROM customers WHERE city = 'Oslo' ORDER BY name</answer>",
                       ordered) == 1.0
    assert sql_correct("", "<answer>SELECT name FROM customers WHERE city = 'Oslo' ORDER BY name DESC</answer>",
                       ordered) == 0.0
    count = json.dumps({"db": "shop", "gold": "SELECT COUNT(*) FROM customers WHERE city = 'Oslo'"})
    assert sql_correct("", f"<answer>SELECT {len(oslo)}.0</answer>", count) == 1.0  # 2.0 == 2, as numbers


@pytest.mark.parametrize("answer", ["<answer></answer>", "<answer>;</answer>", "<answer>-- no idea</answer>",
                                    "<answer>```sql\n```</answer>"])
def test_an_answer_with_no_sql_statement_never_matches_an_empty_gold_result(answer):
    nobody = json.dumps({"db": "shop", "gold": "SELECT name FROM customers WHERE city = 'Atlantis'"})
    assert sql_correct("", "<answer>SELECT name FROM customers WHERE city = 'Atlantis'</answer>", nobody) == 1.0
    assert sql_correct("", "<answer>SELECT name FROM customers WHERE 0</answer>", nobody) == 1.0  # a query, no rows
    assert sql_correct("", answer, nobody) == 0.0  # it paid 1.0: no columns and no rows "matched"


@pytest.mark.parametrize("query", ["SELECT 1 AS one\x00", "SELECT 1 AS one -- " + "x" * 200_000])
def test_a_query_with_a_nul_byte_or_over_the_argv_limit_is_an_error_for_the_model_not_a_crash(query):
    """A byte-level BPE model can write a NUL, a long generation 128 KiB: passed in argv, both failed to
    start the query's process (UnboundLocalError / E2BIG out of the rollout)."""
    env, gold = SQLEnv(), json.dumps({"db": "shop", "gold": "SELECT 1 AS one"})
    env.reset(Problem("q", gold, "k"))
    obs, reward, done, _ = env.step(f"```sql\n{query}\n```")
    assert (reward, done) == (0.0, False)
    assert obs[0]["content"] == ("error: the query contains a null character" if "\x00" in query else "one\n1")
    assert sql_correct("", f"<answer>{query}</answer>", gold) == float("\x00" not in query)


def test_no_sql_problem_has_an_empty_gold_result_that_a_query_returning_nothing_would_match():
    task = SQLTask(seed=0, eval_size=100)
    problems = task.eval_problems() + [task.train_problem(i) for i in range(400)]
    assert all(_gold_rows(**json.loads(p.answer)) for p in problems)
    # The empty query's result is the same on every problem of a database (no rows, one column), so one
    # problem per database and kind of comparison (in order or as a multiset) scores what all 500 would:
    # 5 query processes, not 500. Every gold result above is non-empty; none of them may match it.
    answers = [json.loads(p.answer) for p in problems]
    kinds = {(a["db"], "ORDER BY" in a["gold"].upper()): p for a, p in zip(answers, problems)}
    assert len(kinds) == 5  # 3 databases; one of them has no ORDER BY question
    assert sum(sql_correct("", "<answer>SELECT 1 WHERE 0</answer>", p.answer) for p in kinds.values()) == 0


def test_sql_env_returns_errors_and_rows_so_the_model_can_fix_its_query():
    env = SQLEnv()
    env.reset(Problem("q", json.dumps({"db": "shop", "gold": "SELECT COUNT(*) FROM customers"}), "k"))
    obs, reward, done, _ = env.step("```sql\nSELEC name FROM customers\n```")
    assert obs[0]["content"] == 'error: near "SELEC": syntax error' and (reward, done) == (0.0, False)
    first = SQL["shop"]["tables"]["customers"]["rows"][:2]
    obs, _, _, _ = env.step("```sql\nSELECT name, city FROM customers WHERE id <= 2\n```")
    assert obs[0]["content"] == "name | city\n" + "\n".join(f"{n} | {c}" for _, n, c, _ in first)
    assert env.step("<answer>SELECT COUNT(id) FROM customers</answer>") == (None, 1.0, True,
                                                                             {"turns": 3, "solved_at_turn": 3})


def test_format_rows_truncates_rows_and_characters():
    assert format_rows(["a"], [], False) == "a\n(no rows)"
    thirty = [(i, "x") for i in range(30)]
    assert format_rows(["a", "b"], thirty, False, max_rows=2) == "a | b\n0 | x\n1 | x\n... (30 rows)"
    assert format_rows(["a"], [(1,)], True, max_rows=5) == "a\n1\n... (more than 1 rows)"
    assert format_rows(["a"], [("y" * 50,)], False, max_chars=10) == "a\nyyyyyyyy\n... (truncated)"


def test_sql_task_is_deterministic_its_splits_disjoint_and_every_gold_query_runs():
    task = SQLTask(seed=3, eval_size=40)
    assert task.eval_problems() == SQLTask(seed=3, eval_size=40).eval_problems()
    eval_keys = {p.key for p in task.eval_problems()}
    train = [task.train_problem(i) for i in range(200)]
    assert not eval_keys & {p.key for p in train} and train[7] == task.train_problem(7)
    assert Counter(json.loads(p.answer)["db"] for p in train).keys() == {"shop", "school", "flights"}
    assert all(sql_correct("", task.solve(p), p.answer) == 1.0 for p in task.eval_problems() + train[:50])


# ---------------------------------------------------------------- the real tiny model


def test_multiturn_rollout_on_the_tiny_model_rescores_to_the_sampled_logps(one_thread):
    torch.manual_seed(0)
    policy = LLMPolicy(train.Config(model=build_tiny_model(layers=1, hidden=64, heads=1, intermediate=128)))
    # A random model almost never ends a turn. Point the end token's output row along the mean
    # final hidden state, so its logit is about 2 everywhere: an end every dozen tokens or so.
    with torch.no_grad():
        ids = torch.tensor([policy.encode_prompt("Reach 3 with [1, 2]. Try again.")])
        mean = policy.model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0].mean(0)  # [D]
        policy.model.get_output_embeddings().weight[policy.tokenizer.eos_token_id] = 2 * mean / mean.norm() ** 2
    sampled, generate = [], policy.generate
    policy.generate = lambda prefixes, n, **kw: sampled.append(list(zip(prefixes, generate(prefixes, n, **kw)))) or \
        [s for _, s in sampled[-1]]
    problems = [countdown_problem([i, 2], i + 2) for i in range(1, 5)]
    batch = rollout_multiturn(policy, CountdownEnv, problems, group_size=1, max_turns=3, max_new_tokens=16, max_len=300)
    assert batch.stats["turns"].max() >= 2  # some episodes really had several turns
    assert_sampled_ids_are_trained(batch, sampled)
    with torch.no_grad():
        logp, _, _ = policy.score(batch, slice(None))
    mask = batch.mask.bool()
    torch.testing.assert_close(logp[mask], batch.logp[mask], atol=2e-4, rtol=0)


# ---------------------------------------------------------------- make_batch and the wire, by hand
def test_make_batch_without_a_loss_mask_trains_every_completion_token_with_neutral_defaults():
    samples = [Sample([7, 8, 9], [-1.0, -2.0, -3.0], False), Sample([4], [-0.5], True)]
    batch = make_batch([[1, 2], [3]], samples, [5.0, 6.0], pad_id=0)
    assert batch.tokens.tolist() == [[1, 2, 7, 8, 9], [3, 4, 0, 0, 0]]
    assert batch.mask.tolist() == [[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]
    assert batch.logp.tolist() == [[0, 0, -1, -2, -3], [0, -0.5, 0, 0, 0]]
    assert batch.rewards.tolist() == [[0, 0, 0, 0, 5], [0, 6, 0, 0, 0]]
    # no group_size: every row its own group; no version: 0; LLM rows have no obs and no bootstrap value
    assert batch.group.tolist() == [0, 1] and batch.version.tolist() == [0, 0]
    assert batch.obs.shape == (2, 0, 0) and batch.last_value.tolist() == [0, 0]
    assert batch.stats == {} and batch.texts == [("", "", "")] * 2
    assert batch.truncated.tolist() == [False, True]


def test_make_batch_groups_consecutive_rows_and_keeps_version_stats_and_texts():
    samples = [Sample([5], [-1.0], False)] * 4
    texts = [(f"p{i}", f"c{i}", f"a{i}") for i in range(4)]
    batch = make_batch([[1]] * 4, samples, [0.0] * 4, 0, group_size=2, version=7,
                       stats={"turns": torch.ones(4)}, texts=texts)
    assert batch.group.tolist() == [0, 0, 1, 1] and batch.version.tolist() == [7] * 4
    assert batch.texts == texts and list(batch.stats) == ["turns"]


def test_make_batch_puts_a_fully_masked_rows_reward_on_its_last_token_and_checks_mask_lengths():
    # A row with no policy token (a dropped judge group) still has a place for its (zeroed) reward:
    # its last real token, not past it and not the token before.
    samples = [Sample([7, 8, 9], [-1.0, -2.0, -3.0], False), Sample([4, 5, 6, 7, 8], [-1.0] * 5, False)]
    batch = make_batch([[1], [1]], samples, [3.0, 0.0], 0, [[0, 0, 0], [1, 1, 1, 1, 1]])
    assert batch.rewards[0].tolist() == [0, 0, 0, 3, 0, 0] and batch.mask[0].sum() == 0
    with pytest.raises(ValueError, match="row 1: loss_mask has 4 entries for 5 completion tokens"):
        make_batch([[1], [1]], samples, [0.0, 0.0], 0, [[1, 1, 1], [1, 1, 1, 1]])


def test_a_batch_sent_over_the_wire_comes_back_as_the_same_rows():
    policy = ScriptedPolicy(chat_tokenizer(), think_then_answer)
    batch = rollout_multiturn(policy, CountdownEnv, [countdown_problem([3, 5], 15)], 2, max_turns=3,
                              max_new_tokens=64, max_len=512, version=4)
    wire = batch.wire()
    assert set(wire) == set(WIRE) | {"solved", "solved_first_turn", "turns"}  # stats under their own names
    back = from_wire({k: v.double() if k == "turns" else v for k, v in wire.items()}, batch.texts)
    for name in WIRE:
        assert torch.equal(getattr(back, name), getattr(batch, name)), name
    # stats only (no wire field among them), as float32; no obs and no bootstrap value for LLM rows
    assert back.stats.keys() == batch.stats.keys() and back.stats["turns"].dtype == torch.float32
    assert back.obs.shape == (2, 0, 0) and back.last_value.tolist() == [0, 0] and back.texts == batch.texts
    half = back.select(slice(1, 2))
    assert half.tokens.tolist() == batch.tokens[1:].tolist() and half.texts == batch.texts[1:]
    assert half.stats["turns"].tolist() == [2.0] and half.version.tolist() == [4]


# ---------------------------------------------------------------- rollout functions at their boundaries
def test_rollout_control_rows_are_their_own_groups_by_default_and_nothing_is_logged_after_an_end():
    torch.manual_seed(0)
    b = rollout_control(CartPole(), MLPPolicy(4, 2), 4, seed=1)
    assert b.group.tolist() == [0, 1, 2, 3] and b.version.tolist() == [0] * 4
    assert (b.mask == 0).any() and (b.logp[b.mask == 0] == 0).all()  # ended rows: logp 0, not inf or NaN
    short = rollout_control(CartPole(max_steps=3), MLPPolicy(4, 2), 2, seed=1, version=5)
    assert short.version.tolist() == [5, 5]


class Recording(ScriptedPolicy):
    """Records each generate call's (gen_batch, greedy)."""

    def __init__(self, tokenizer, script):
        super().__init__(tokenizer, script)
        self.calls = []

    def generate(self, prefixes, max_new_tokens, gen_batch=64, greedy=False):
        self.calls.append((gen_batch, greedy))
        return super().generate(prefixes, max_new_tokens)


def exact(prompt, completion, answer):
    return float(completion == answer)


def judged(prompt, completion, answer):
    if completion == "?":
        raise JudgeUnavailable("the judge is down")
    return 1.0


class Judged(Task):
    name, rewards = "judged", [(exact, 1.0), (judged, 0.5)]


def test_rollout_single_groups_scores_and_masks_each_completion():
    outputs = iter(["a", "x", "?", "b"])  # rows in order: problem a twice, then problem b twice
    policy = Recording(chat_tokenizer(), lambda text: next(outputs))
    pa, pb = Problem("say a", "a", "ka"), Problem("say b", "b", "kb")
    cfg = train.Config(max_new_tokens=8, gen_batch=4, judge_down="drop")
    with pytest.warns(UserWarning, match="dropped"):
        groups = rollout_single(policy, Judged(), [pa, pb], 2, cfg)
    assert [[e.problem for e in g] for g in groups] == [[pa, pa], [pb, pb]] and policy.calls == [(4, False)]
    assert [[e.text for e in g] for g in groups] == [["a", "x"], ["?", "b"]]
    rewards = [e.reward for g in groups for e in g]
    # 1 * exact + 0.5 * judged; the unscored sample: NaN
    assert rewards[:2] == [1.5, 0.5] and math.isnan(rewards[2]) and rewards[3] == 1.5
    assert groups[0][1].parts == {"exact": 0.0, "judged": 1.0}
    first = groups[0][0]
    assert first.prompt == policy.encode_prompt("say a") and first.mask == [1, 1] and len(first.ids) == 2
    outputs = iter(["a", "x", "?", "b"])
    with pytest.raises(JudgeUnavailable):  # --judge-down fail: the run stops
        rollout_single(policy, Judged(), [pa, pb], 2, train.Config(max_new_tokens=8))


def test_collate_masks_out_a_group_with_an_unscored_sample_and_counts_it_when_dropping():
    problem = Problem("q", "a", "k")
    ep = lambda reward, n: Episode(problem, [1, 2], None, [5] * n, [-1.0] * n, [1] * n, reward,
                                   {"judge": reward})
    groups = [[ep(1.0, 2), ep(0.0, 3)], [ep(math.nan, 2), ep(1.0, 2)]]
    batch = collate(groups, 0, 3, drop=True)
    assert batch.stats["judge_dropped_frac"].tolist() == [0, 0, 1, 1]
    assert batch.rewards.sum(1).tolist() == [1, 0, 0, 0] and batch.mask.sum(1).tolist() == [2, 3, 0, 0]
    assert batch.group.tolist() == [0, 0, 1, 1] and batch.version.tolist() == [3] * 4
    assert "judge_dropped_frac" not in collate(groups, 0, 3).stats


NO_END = """{%- for m in messages -%}{{- m['role'] + ': ' + m['content'] + '\n' -}}{%- endfor -%}
{%- if add_generation_prompt -%}{{- 'assistant: ' -}}{%- endif -%}"""


def test_encode_reply_keeps_everything_after_the_turn_when_the_template_writes_no_end_token():
    tok = chat_tokenizer()
    tok.chat_template = NO_END
    reply = encode_reply(ScriptedPolicy(tok, bisect), [{"role": "user", "content": "hi"}], tok.eos_token_id)
    assert reply == tok.encode("\nuser: hi\nassistant: ", add_special_tokens=False)


def test_encode_reply_adds_no_bos_with_a_tokenizer_that_would():
    tok = AutoTokenizer.from_pretrained(build_tiny_model(layers=1, hidden=64, heads=1, intermediate=128))
    assert tok.encode("a")[0] == tok.bos_token_id  # this tokenizer adds one unless told not to
    reply = encode_reply(ScriptedPolicy(tok, bisect), [{"role": "user", "content": "hi"}], tok.eos_token_id)
    assert reply == tok.encode("\nhi\n", add_special_tokens=False)


PROMPT = len(ScriptedPolicy(chat_tokenizer(), bisect).encode_prompt(countdown_problem([3, 5], 15).prompt))


def countdown_episode(script, **kw):
    policy = Recording(chat_tokenizer(), script)
    problem = countdown_problem([3, 5], 15)
    kw = {"max_turns": 3, "max_new_tokens": 64, "max_len": 512} | kw
    batch = rollout_multiturn(policy, CountdownEnv, [problem], 1, **kw)
    return policy, batch


TURN1 = len("<think>try</think><answer>3 + 5</answer>") + 1  # + the end token
REPLY = len(chat_tokenizer().encode("\n<|im_start|>user\n3 + 5 = 8, but the target is 15. Try again."
                                   "<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False))


def test_a_multiturn_episode_solved_on_turn_one_counts_as_solved_first_turn_with_default_options():
    policy, batch = countdown_episode(lambda text: "<answer>3 * 5</answer>")
    assert batch.stats["solved"].tolist() == [1] and batch.stats["solved_first_turn"].tolist() == [1]
    assert batch.stats["turns"].tolist() == [1] and batch.version.tolist() == [0]
    assert policy.calls == [(64, False)]  # gen_batch 64, sampled (not greedy) unless asked


def test_a_turn_that_ends_exactly_at_its_token_budget_is_not_truncated():
    _, batch = countdown_episode(think_then_answer, max_new_tokens=TURN1)
    # turn 1 (end token included) fits exactly and goes on; turn 2 is 3 tokens longer and is cut
    assert batch.stats["turns"].tolist() == [2] and batch.truncated.tolist() == [True]


def test_a_turn_cut_by_its_token_budget_ends_the_episode():
    _, batch = countdown_episode(think_then_answer, max_new_tokens=5)
    assert batch.stats["turns"].tolist() == [1] and batch.truncated.tolist() == [True]
    assert batch.attn.sum(1).tolist() == [PROMPT + 5]


def test_a_reply_that_would_reach_max_len_exactly_ends_the_episode_without_it():
    _, batch = countdown_episode(think_then_answer, max_len=PROMPT + TURN1 + REPLY)
    assert batch.stats["turns"].tolist() == [1] and batch.truncated.tolist() == [True]
    assert batch.attn.sum(1).tolist() == [PROMPT + TURN1]


def test_a_later_turns_budget_is_what_is_left_of_max_len():
    _, batch = countdown_episode(think_then_answer, max_len=PROMPT + TURN1 + REPLY + 10)
    # the reply fits, then turn 2 gets the last 10 positions: the row is exactly max_len long
    assert batch.stats["turns"].tolist() == [2] and batch.truncated.tolist() == [True]
    assert batch.attn.sum(1).tolist() == [PROMPT + TURN1 + REPLY + 10] and batch.mask.sum() == TURN1 + 10


def test_sample_rows_count_trained_tokens_and_report_advantage_version_and_staleness():
    policy = ScriptedPolicy(chat_tokenizer(), think_then_answer)
    batch = rollout_multiturn(policy, CountdownEnv, [countdown_problem([3, 5], 15)], 2, max_turns=3,
                              max_new_tokens=64, max_len=512, version=3)
    batch.adv = batch.mask * torch.tensor([[0.5], [-1.0]])
    row, = sample_rows(batch, 1, "train", step=5)
    turn2 = len("<think>again</think><answer>3 * 5</answer>") + 1
    assert (row["tokens"], row["finish"], row["reward"], row["adv"]) == (TURN1 + turn2, "end", 1.0, 0.5)
    assert (row["version"], row["staleness"]) == (3, 1)  # sampled by version 3, trained at step 5
    evals = sample_rows(batch, 2, "eval", step=5)
    assert len(evals) == 2 and "version" not in evals[0] and evals[1]["adv"] == -1.0
    batch.adv = None
    assert sample_rows(batch, 1, "eval", step=5)[0]["adv"] is None


def test_env_rollouts_episodes_are_version_0_unless_given_one():
    cfg = train.Config(task="countdown_multiturn", algo="grpo", batch=2, group_size=1, eval_size=4,
                       max_new_tokens=32, max_turns=1)
    source = EnvRollouts(cfg, ScriptedPolicy(chat_tokenizer(), lambda text: "<answer>1 + 1</answer>"))
    problems = source.task.eval_problems()[:2]
    assert source.episodes(problems, 1).version.tolist() == [0, 0]
    assert source.episodes(problems, 1, version=2).version.tolist() == [2, 2]


def test_format_rows_shows_20_rows_and_2000_characters_whole_by_default():
    twenty = [(i,) for i in range(20)]
    assert format_rows(["n"], twenty, False) == "\n".join(["n"] + [str(i) for i in range(20)])  # no footer
    assert format_rows(["n"], twenty + [(20,)], False).endswith("\n18\n19\n... (21 rows)")
    exact = format_rows(["a"], [("y" * 1998,)], False)  # "a\n" and 1998: 2000 characters
    assert len(exact) == 2000 and "truncated" not in exact
    assert format_rows(["a"], [("y" * 1999,)], False) == "a\n" + "y" * 1998 + "\n... (truncated)"


def test_sql_reward_ignores_float_noise_below_a_millionth_and_no_more():
    gold = json.dumps({"db": "shop", "gold": "SELECT 0.3"})
    assert sql_correct("", "<answer>SELECT 0.1 + 0.2</answer>", gold) == 1.0  # 0.30000000000000004
    assert sql_correct("", "<answer>SELECT 0.3000004</answer>", gold) == 1.0
    assert sql_correct("", "<answer>SELECT 0.300004</answer>", gold) == 0.0


def test_a_query_of_10000_rows_can_score_and_one_of_10001_cannot():
    count = lambda n: f"WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < {n}) SELECT x FROM c"
    for n, score in ((10_000, 1.0), (10_001, 0.0)):
        gold = json.dumps({"db": "shop", "gold": count(n)})
        assert sql_correct("", f"<answer>{count(n)}</answer>", gold) == score


def test_cartpole_episodes_start_from_distinct_states_unless_grouped():
    assert len({tuple(s) for s in CartPole().reset(4, seed=0).state.T.tolist()}) == 4
    assert len({tuple(s) for s in CartPole().reset(4, seed=0, group_size=2).state.T.tolist()}) == 2
