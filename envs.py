"""Environments: CartPole from gymnasium, stepped as one vectorised env so that a whole batch of episodes
advances with one policy forward per time step (that batching, not the algorithm, trains it in seconds);
then multi-turn text environments for rollouts.py: calculator countdown, sandboxed Python, read-only SQL."""
import contextlib
import functools
import hashlib
import json
import math
import os
import random
import re
import sqlite3
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gymnasium.envs.classic_control.cartpole import CartPoleVectorEnv

from modeldir import cache_root
from sandbox import run_python, run_sql
from tasks import (Countdown, ExprError, Problem, ProceduralTask, RewardError, countdown_correct,
                   extract_answer, format_reward, safe_eval)
from utils import UMASK, ConfigError, data_file

EVAL_SEED = 1_000_000_000  # eval seeds live above this; training seeds stay below it


@dataclass
class CartPole:
    """CartPole-v1: +1 per step, terminal when the pole falls, truncated (not terminal) at max_steps."""

    obs_dim, n_actions = 4, 2
    max_steps: int = 500

    def reset(self, n: int, seed: int, group_size: int = 1) -> CartPoleVectorEnv:
        """n episodes from `seed`; each group of `group_size` starts from one state, as GRPO/RLOO need."""
        env = CartPoleVectorEnv(num_envs=n, max_episode_steps=self.max_steps)
        env.reset(seed=seed)
        env.state = env.state[:, np.arange(n) // group_size * group_size]  # [4, n]: members copy leaders
        return env


# ================================================================ text environments (multi-turn)
class TextEnv:
    """In the spirit of gymnasium: reset(problem) -> (chat messages, info), step(completion) ->
    (reply messages or None, reward, done, info). Subclasses define `respond(completion) -> (reply
    text or None, reward, solved)`; a solve, a reply of None or `max_turns` turns (the rollout sets
    --max-turns on each instance) end the episode, whose reward is the sum of its turns'. A step of
    one's own reports a solve as info["solved_at_turn"] = its turn, from 1 (0 or absent: unsolved),
    which the `solved` metric and eval accuracy count. `task`: the tasks.Task class of its problems."""

    max_turns = 4
    task: type | None = None

    def __init__(self, max_turns: int | None = None):
        self.max_turns = max_turns or self.max_turns

    def reset(self, problem: Problem) -> tuple[list[dict], dict]:
        self.problem, self.turn = problem, 0
        return [{"role": "user", "content": problem.prompt}], {}

    def step(self, completion: str) -> tuple[list[dict] | None, float, bool, dict]:
        self.turn += 1
        try:
            out = self.respond(completion)  # the reward is checked where the rollout adds it up
        except Exception as e:  # a bug in the env: its traceback, and the completion that found it
            e.add_note(f"in {type(self).__name__}.respond, for the completion {completion[:200]!r}")
            raise
        if not (isinstance(out, tuple) and len(out) == 3 and (out[0] is None or isinstance(out[0], str))):
            raise RewardError(f"{type(self).__name__}.respond returned {out!r:.80} for the completion "
                              f"{completion[:60]!r}; it returns (reply text or None, reward, solved)")
        reply, reward, solved = out
        done = solved or reply is None or self.turn >= self.max_turns
        info = {"turns": self.turn, "solved_at_turn": self.turn if solved else 0}
        return (None if done else [{"role": "user", "content": reply}]), reward, done, info


class CountdownEnv(TextEnv):
    """Countdown with a calculator: each wrong attempt comes back with the value it has."""

    task = Countdown

    def respond(self, completion):
        ref, expr = json.loads(self.problem.answer), extract_answer(completion)
        if countdown_correct(self.problem.prompt, completion, self.problem.answer):
            return None, 1.0, True
        if expr is None:
            return "Give your expression in <answer></answer> tags.", 0.0, False
        lhs, target = expr.partition("=")[0].strip(), ref["target"]  # as countdown_correct splits it
        try:
            value, used = safe_eval(lhs)
        except ExprError as e:
            return f"{expr} is not a valid expression ({e}). Try again.", 0.0, False
        if sorted(used) != sorted(ref["numbers"]):
            reply = f"{expr} uses {sorted(used)}; use each of {ref['numbers']} exactly once. Try again."
            return reply, 0.0, False
        if value == target:  # so what follows "=" was refused ("= 9.0", "== 9")
            return f"{lhs} = {target}; answer with it alone or as {lhs} = {target}. Try again.", 0.0, False
        return f"{lhs} = {value}, but the target is {target}. Try again.", 0.0, False


# ---------------------------------------------------------------- SQL tool on read-only SQLite
def format_rows(columns: list[str], rows: list[tuple], more: bool, max_rows: int = 20,
                max_chars: int = 2000) -> str:
    """A query result as the observation the model sees next."""
    lines = [" | ".join(columns)] + [" | ".join(map(str, r)) for r in rows[:max_rows]]
    text = "\n".join(lines + ["(no rows)"] * (not rows))
    if more or len(rows) > max_rows:
        text += f"\n... ({'more than ' if more else ''}{len(rows)} rows)"
    return text if len(text) <= max_chars else text[:max_chars] + "\n... (truncated)"


def _normal(rows: list[tuple]) -> list[tuple]:  # 2.0 == 2, and float noise below 1e-6 is ignored
    return [tuple(round(v, 6) if isinstance(v, float) else v for v in r) for r in rows]


@functools.lru_cache(maxsize=4096)
def _gold_rows(db: str, gold: str) -> list[tuple]:  # our own query: read here, not in run_sql's child
    with contextlib.closing(sqlite3.connect(Path(sql_database(db)).as_uri() + "?mode=ro", uri=True)) as con:
        return _normal(con.execute(gold).fetchall())


def sql_correct(prompt: str, completion: str, answer: str) -> float:
    """1.0 iff the answer-tag query returns the gold query's rows: as a multiset, or in order when
    the gold query has ORDER BY. Column names do not matter, column order does. A query that
    fails, is denied or returns over 10,000 rows scores 0, and so does an answer with no statement
    ("", ";", a comment): it has no columns, and its no rows must not match an empty gold result."""
    query, ref = extract_answer(completion), json.loads(answer)
    if query is None:
        return 0.0
    query = re.sub(r"^```\w*|```$", "", query)  # extract_answer has stripped it
    try:
        columns, rows, more = run_sql(sql_database(ref["db"]), query, max_rows=10_000)
    except sqlite3.Error:  # the model's query is broken: a wrong answer, not a crash
        return 0.0
    gold, rows = _gold_rows(ref["db"], ref["gold"]), _normal(rows)
    same = rows == gold if "ORDER BY" in ref["gold"].upper() else Counter(rows) == Counter(gold)
    return float(bool(columns) and not more and same)


# Three small databases of synthetic rows, drawn once from a seeded generator (no download):
# {db: {"tables": {name: {"columns", "rows"}}, "params": {name: values}, "questions": [[q, gold]]}},
# the gold queries' {placeholders} taking the params.
SQL = json.loads(data_file("data/sql.json").read_text(encoding="utf-8"))


@functools.cache
def sql_database(db: str) -> str:
    """Path of database `db`, built on first use; the name carries a hash of the content, so an
    edited data file never reads a stale database."""
    tables = SQL[db]["tables"]
    digest = hashlib.sha256(json.dumps(tables, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_root() / "sql" / f"{db}-{digest}.db"
    if path.exists():
        return str(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")  # one per builder, threads included
        os.fchmod(fd, 0o666 & ~UMASK)  # as open() would (mkstemp's is 0600): a cache that users share
        os.close(fd)
        with contextlib.closing(sqlite3.connect(tmp)) as con, con:
            for name, t in tables.items():
                con.execute(f"CREATE TABLE {name} ({t['columns']})")
                marks = ", ".join("?" * len(t["rows"][0]))
                con.executemany(f"INSERT INTO {name} VALUES ({marks})", t["rows"])
        os.replace(tmp, path)  # atomic, and concurrent builders write identical files
    except (OSError, sqlite3.Error) as e:  # a full or unwritable cache: never a model's failed query (a 0)
        if tmp:
            os.unlink(tmp)
        raise ConfigError(f"cannot write {path} ({e}); point NANORL_CACHE (the model cache) at a writable "
                          "directory with room") from None
    return str(path)


_HINT = "You can run {} in a ```{} block and see its {}. Give the final {} in <answer></answer> tags."


class SQLTask(ProceduralTask):
    """Text-to-SQL on three small SQLite databases (shop, school, flights)."""

    name, rewards = "sql", [(sql_correct, 1.0), (format_reward, 0.1)]

    def generate(self, rng: random.Random) -> Problem:
        while True:  # redrawn while the gold result is empty: any query returning nothing would match it
            db = rng.choice(sorted(SQL))
            question, gold = rng.choice(SQL[db]["questions"])
            params = {k: rng.choice(v) for k, v in SQL[db]["params"].items()}
            if _gold_rows(db, gold := gold.format(**params)):
                break
        question = question.format(**params)
        schema = "\n".join(f"CREATE TABLE {t} ({v['columns']});" for t, v in SQL[db]["tables"].items())
        hint = _HINT.format("read-only SQLite queries", "sql", "result", "SQL query")
        return Problem(f"SQLite database:\n{schema}\n\nQuestion: {question}\n{hint}",
                       json.dumps({"db": db, "gold": gold}), key=f"{db}: {question}")

    def solve(self, problem: Problem) -> str:
        return f"<answer>{json.loads(problem.answer)['gold']}</answer>"


class PythonTask(ProceduralTask):
    """Questions with a computed numeric answer: easy with code, tedious without. Task's rewards."""

    name = "python_tool"

    def generate(self, rng: random.Random) -> Problem:
        kind = rng.randrange(4)
        if kind == 0:
            n = rng.randint(1_000, 200_000)
            sieve = bytearray([0, 0]) + bytearray([1]) * (n - 2)
            for i in range(2, math.isqrt(n) + 1):
                if sieve[i]:
                    sieve[i * i :: i] = bytes(len(range(i * i, n, i)))
            q = f"What is the sum of all prime numbers below {n}?"
            a = sum(i for i, prime in enumerate(sieve) if prime)
        elif kind == 1:
            n, m, fib = rng.randint(100, 3000), rng.choice([1000, 998_244_353, 1_000_000_007]), (0, 1)
            for _ in range(n - 1):
                fib = (fib[1], (fib[0] + fib[1]) % m)
            q = f"What is F({n}) modulo {m}, where F is the Fibonacci sequence with F(1) = F(2) = 1?"
            a = fib[1]
        elif kind == 2:
            n = rng.randint(30, 500)
            q = f"What is the sum of the decimal digits of {n} factorial?"
            a = sum(map(int, str(math.factorial(n))))
        else:
            x, y, n = rng.randint(3, 19), rng.randint(20, 60), rng.randint(10_000, 10_000_000)
            q = f"How many integers from 1 to {n} are divisible by {x} or by {y}, but not by both?"
            a = n // x + n // y - 2 * (n // math.lcm(x, y))
        return Problem(f"{q}\n{_HINT.format('Python code', 'python', 'output', 'number')}", str(a), key=q)


class ToolEnv(TextEnv):
    """Each model turn either runs code in a ```<lang> block, whose output (`run(code) -> text`) is
    the next observation, or ends the episode with a final answer in <answer></answer> tags."""

    lang = ""

    def respond(self, completion):
        if extract_answer(completion) is not None:
            reward = self.task.rewards[0][0](self.problem.prompt, completion, self.problem.answer)
            return None, reward, reward >= 1.0
        blocks = re.findall(rf"```{self.lang}[ \t]*\n(.*?)```", completion, re.S)
        hint = f"Run code in a ```{self.lang} block, or give the answer in <answer></answer> tags."
        return (self.run(blocks[-1]) if blocks else hint), 0.0, False


class PythonToolEnv(ToolEnv):
    task, lang, timeout_s = PythonTask, "python", 5.0

    def run(self, code):
        r = run_python(code, timeout_s=self.timeout_s)
        parts = [f"{name}:\n{text}" for name, text in (("stdout", r.stdout), ("stderr", r.stderr)) if text]
        status = "timed out and was killed" if r.timed_out else f"exit code {r.returncode}"
        return "\n".join(parts + [f"({status}{', output truncated' if r.truncated else ''})"])


class SQLEnv(ToolEnv):
    task, lang = SQLTask, "sql"

    def run(self, query):
        try:
            return format_rows(*run_sql(sql_database(json.loads(self.problem.answer)["db"]), query))
        except sqlite3.Error as e:  # shown to the model, which may fix its query
            return f"error: {e}"


TEXT_ENVS: dict[str, type[TextEnv]] = {"countdown_multiturn": CountdownEnv, "python_tool": PythonToolEnv,
                                       "sql": SQLEnv}
