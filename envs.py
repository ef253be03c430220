"""Environments. CartPole comes from gymnasium, stepped as one vectorised numpy env so a whole
batch of episodes advances with one policy forward per time step; that batching, not the
algorithm, is what makes CartPole train in seconds.

Below CartPole: multi-turn text environments (calculator countdown, a sandboxed Python tool,
read-only SQL, with the SQL task's generated databases). The rollouts that step them live in
rollouts.py.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import os
import random
import re
import sqlite3
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
from gymnasium.envs.classic_control.cartpole import CartPoleVectorEnv

from sandbox import run_python, run_sql
from tasks import (Countdown, ExprError, Problem, ProceduralTask, countdown_correct, extract_answer,
                   format_reward, numeric_correct, safe_eval)

EVAL_SEED = 1_000_000_000  # eval seeds live above this; training seeds stay below it


class CartPole:
    """CartPole-v1: +1 per step, terminal when the pole falls, truncated (not terminal) at 500."""

    obs_dim, n_actions = 4, 2

    def __init__(self, max_steps: int = 500):
        self.max_steps = max_steps

    def reset(self, n: int, seed: int, group_size: int = 1) -> CartPoleVectorEnv:
        """n episodes from `seed`, stepped as one vectorised env; the members of each group of
        `group_size` start from the same state, so GRPO/RLOO compare like with like."""
        env = CartPoleVectorEnv(num_envs=n, max_episode_steps=self.max_steps)
        env.reset(seed=seed)
        # [4, n]: every member copies its leader
        env.state = env.state[:, np.arange(n) // group_size * group_size]
        return env


# ================================================================ text environments (multi-turn)
# A text environment, in the spirit of gymnasium: reset(problem) -> (chat messages, info) and
# step(completion) -> (reply messages or None, reward, done, info). Rewards are per turn; an
# episode's reward is their sum, given to every token the model sampled (rollouts.rollout_multiturn).


class TextEnv:
    """Base class: the problem's prompt opens the chat and each model turn gets
    `respond(completion) -> (reply text or None, reward, solved)`. A solve, a reply of None or
    `max_turns` turns end the episode. `task` is the tasks.Task class that supplies problems."""

    max_turns = 4
    task: type | None = None

    def __init__(self, max_turns: int | None = None):
        self.max_turns = max_turns or self.max_turns

    def reset(self, problem: Problem) -> tuple[list[dict], dict]:
        self.problem, self.turn = problem, 0
        return [{"role": "user", "content": problem.prompt}], {}

    def step(self, completion: str) -> tuple[list[dict] | None, float, bool, dict]:
        self.turn += 1
        reply, reward, solved = self.respond(completion)
        done = solved or reply is None or self.turn >= self.max_turns
        info = {"turns": self.turn, "solved_at_turn": self.turn if solved else 0}
        return (None if done else [{"role": "user", "content": reply}]), reward, done, info

    def respond(self, completion: str) -> tuple[str | None, float, bool]:
        raise NotImplementedError


class CountdownEnv(TextEnv):
    """Countdown with a calculator: each wrong attempt comes back with the value it has."""

    task = Countdown

    def respond(self, completion):
        ref, expr = json.loads(self.problem.answer), extract_answer(completion)
        if countdown_correct(self.problem.prompt, completion, self.problem.answer):
            return None, 1.0, True
        if expr is None:
            return "Give your expression in <answer></answer> tags.", 0.0, False
        try:
            value, used = safe_eval(expr.split("=")[0])
        except ExprError as e:
            return f"{expr} is not a valid expression ({e}). Try again.", 0.0, False
        if sorted(used) != sorted(ref["numbers"]):
            return f"{expr} uses {sorted(used)}; use each of {ref['numbers']} exactly once. Try again.", 0.0, False
        return f"{expr} = {value}, but the target is {ref['target']}. Try again.", 0.0, False


# ---------------------------------------------------------------- SQL tool on read-only SQLite

def format_rows(columns: list[str], rows: list[tuple], more: bool, max_rows: int = 20, max_chars: int = 2000) -> str:
    """A query result as the observation the model sees next."""
    lines = [" | ".join(columns)] + [" | ".join(map(str, r)) for r in rows[:max_rows]] + ["(no rows)"] * (not rows)
    text = "\n".join(lines)
    if more or len(rows) > max_rows:
        text += f"\n... ({'more than ' if more else ''}{len(rows)} rows)"
    return text if len(text) <= max_chars else text[:max_chars] + "\n... (truncated)"


def _normal(rows: list[tuple]) -> list[tuple]:  # 2.0 == 2, and float noise below 1e-6 is ignored
    return [tuple(round(v, 6) if isinstance(v, float) else v for v in r) for r in rows]


@functools.lru_cache(maxsize=4096)
def _gold_rows(db: str, gold: str) -> list[tuple]:
    return _normal(run_sql(sql_database(db), gold, max_rows=100_000)[1])


def sql_correct(prompt: str, completion: str, answer: str) -> float:
    """1.0 iff the answer-tag query returns the gold query's rows: as a multiset, or in order when
    the gold query has ORDER BY. Column names do not matter, column order does. A query that
    fails, is denied or returns over 10,000 rows scores 0."""
    query, ref = extract_answer(completion), json.loads(answer)
    if query is None:
        return 0.0
    try:
        _, rows, more = run_sql(sql_database(ref["db"]), re.sub(r"^```\w*|```$", "", query.strip()), max_rows=10_000)
    except sqlite3.Error:  # the model's query is broken: a wrong answer, not a crash
        return 0.0
    gold = _gold_rows(ref["db"], ref["gold"])
    ordered = "ORDER BY" in ref["gold"].upper()
    return float(not more and (_normal(rows) == gold if ordered else Counter(_normal(rows)) == Counter(gold)))


# Three small databases with deterministic synthetic rows (no download), with question templates
# and gold queries whose {placeholders} are drawn from _SQL_PARAMS.
_PEOPLE = [f"{a} {b}" for a in "Ada Ben Cleo Dev Eva Finn Gia Hugo Ines Jon Kai Lena".split()
           for b in "Silva Chen Okafor Novak Kim Rossi".split()]
_CITIES = "Lisbon Oslo Lima Pune Osaka Accra Quito Perth".split()
_GOODS = {"Novel": "books", "Atlas": "books", "Puzzle": "games", "Chess Set": "games", "Rake": "garden",
          "Hose": "garden", "Kettle": "kitchen", "Mug": "kitchen", "Drone": "toys", "Kite": "toys"}
_COURSES = {"Algebra": "Math", "Calculus": "Math", "Statistics": "Math", "Biology": "Science", "Chemistry": "Science",
            "Physics": "Science", "History": "Humanities", "Literature": "Humanities", "Programming": "Computing"}
_AIRPORTS = [("LIS", "Lisbon", "Portugal"), ("OPO", "Porto", "Portugal"), ("OSL", "Oslo", "Norway"),
             ("LIM", "Lima", "Peru"), ("KIX", "Osaka", "Japan"), ("NRT", "Tokyo", "Japan"),
             ("ACC", "Accra", "Ghana"), ("PER", "Perth", "Australia"), ("SYD", "Sydney", "Australia")]
_AIRLINES = [("Atlantic Air", "Portugal"), ("Fjord Wings", "Norway"), ("Andes Jet", "Peru"),
             ("Sakura Sky", "Japan"), ("Gold Coast Air", "Ghana"), ("Southern Cross", "Australia")]
_TERMS = ["Fall 2023", "Spring 2024"]
_SQL_PARAMS = {
    "shop": {"city": _CITIES, "category": sorted(set(_GOODS.values())), "price": range(10, 95, 5),
             "k": range(2, 5), "month": range(1, 13), "year": range(2018, 2025)},
    "school": {"city": _CITIES, "course": list(_COURSES), "term": _TERMS, "grade": range(50, 100, 5),
               "year": range(1, 5)},
    "flights": {"city": [a[1] for a in _AIRPORTS], "country": sorted({a[2] for a in _AIRPORTS}),
                "airline": [a[0] for a in _AIRLINES], "minutes": range(120, 900, 60)},
}
_ON_C, _FROM_FL = "JOIN courses c ON c.id = e.course_id", "FROM flights f JOIN airlines l ON l.id = f.airline_id"
_SQL_QUESTIONS = {
    "shop": [
        ("How many customers live in {city}?", "SELECT COUNT(*) FROM customers WHERE city = '{city}'"),
        ("List the names of the {category} products that cost more than {price}.",
         "SELECT name FROM products WHERE category = '{category}' AND price > {price}"),
        ("What is the total quantity ordered by customers from {city}?",
         "SELECT SUM(o.quantity) FROM orders o JOIN customers c ON c.id = o.customer_id WHERE c.city = '{city}'"),
        ("Give the name and price of the {k} most expensive {category} products, most expensive first.",
         "SELECT name, price FROM products WHERE category = '{category}' ORDER BY price DESC LIMIT {k}"),
        ("How many orders were placed in month {month} of 2023?",
         "SELECT COUNT(*) FROM orders WHERE order_date LIKE '2023-{month:02d}-%'"),
        ("Which customers who signed up in {year} have never ordered anything? Give their names.",
         "SELECT name FROM customers WHERE signup_year = {year} AND id NOT IN (SELECT customer_id FROM orders)"),
    ],
    "school": [
        ("How many students are in year {year}?", "SELECT COUNT(*) FROM students WHERE year = {year}"),
        ("What is the average grade in {course}, rounded to 2 decimals?",
         f"SELECT ROUND(AVG(e.grade), 2) FROM enrollments e {_ON_C} WHERE c.title = '{{course}}'"),
        ("List the names of the students who took {course} in {term}.",
         f"SELECT s.name FROM students s JOIN enrollments e ON e.student_id = s.id {_ON_C} "
         "WHERE c.title = '{course}' AND e.term = '{term}'"),
        ("How many different students from {city} scored at least {grade} in some course?",
         "SELECT COUNT(DISTINCT s.id) FROM students s JOIN enrollments e ON e.student_id = s.id "
         "WHERE s.city = '{city}' AND e.grade >= {grade}"),
        ("For each department, give its name and its number of enrollments in {term}, by department name.",
         f"SELECT c.department, COUNT(*) FROM enrollments e {_ON_C} WHERE e.term = '{{term}}' "
         "GROUP BY c.department ORDER BY c.department"),
    ],
    "flights": [
        ("How many flights depart from {city}?",
         "SELECT COUNT(*) FROM flights f JOIN airports a ON a.code = f.origin WHERE a.city = '{city}'"),
        ("What is the lowest price of a flight operated by {airline}?",
         f"SELECT MIN(f.price) {_FROM_FL} WHERE l.name = '{{airline}}'"),
        ("List the names of the airlines that fly to {country}.",
         f"SELECT DISTINCT l.name {_FROM_FL} JOIN airports a ON a.code = f.destination "
         "WHERE a.country = '{country}'"),
        ("How many flights longer than {minutes} minutes does {airline} operate?",
         f"SELECT COUNT(*) {_FROM_FL} WHERE l.name = '{{airline}}' AND f.duration_min > {{minutes}}"),
    ],
}


@functools.cache
def _sql_tables(db: str) -> dict[str, tuple[str, list[tuple]]]:
    """table -> (column definitions, rows), deterministic in the database's name."""
    rng = random.Random(f"nanorl-sql:{db}")
    people = rng.sample(_PEOPLE, 40)
    date = lambda: f"2023-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"  # noqa: E731
    if db == "shop":
        adjectives = "Red Blue Tiny Grand Smart Quiet".split()
        goods = rng.sample([(f"{adj} {noun}", cat) for adj in adjectives for noun, cat in _GOODS.items()], 30)
        # distinct, so "most expensive" has no ties
        prices = [p / 100 for p in rng.sample(range(199, 9999), 30)]
        return {"customers": ("id INTEGER PRIMARY KEY, name TEXT, city TEXT, signup_year INTEGER",
                              [(i + 1, n, rng.choice(_CITIES), rng.randint(2018, 2024)) for i, n in enumerate(people)]),
                "products": ("id INTEGER PRIMARY KEY, name TEXT, category TEXT, price REAL",
                             [(i + 1, n, c, p) for i, ((n, c), p) in enumerate(zip(goods, prices))]),
                "orders": ("id INTEGER PRIMARY KEY, customer_id INTEGER, product_id INTEGER, quantity INTEGER, "
                           "order_date TEXT", [(i + 1, rng.randint(1, 34), rng.randint(1, 30), rng.randint(1, 5),
                                                date()) for i in range(200)])}
    if db == "school":
        return {"students": ("id INTEGER PRIMARY KEY, name TEXT, year INTEGER, city TEXT",
                             [(i + 1, n, rng.randint(1, 4), rng.choice(_CITIES)) for i, n in enumerate(people)]),
                "courses": ("id INTEGER PRIMARY KEY, title TEXT, department TEXT, credits INTEGER",
                            [(i + 1, t, d, rng.choice([3, 4, 5])) for i, (t, d) in enumerate(_COURSES.items())]),
                "enrollments": ("student_id INTEGER, course_id INTEGER, term TEXT, grade INTEGER",
                                [(s, c, rng.choice(_TERMS), rng.randint(40, 100)) for s in range(1, 41)
                                 for c in rng.sample(range(1, len(_COURSES) + 1), 4)])}
    routes = [rng.sample(_AIRPORTS, 2) for _ in range(150)]
    return {"airports": ("code TEXT PRIMARY KEY, city TEXT, country TEXT", _AIRPORTS),
            "airlines": ("id INTEGER PRIMARY KEY, name TEXT, country TEXT",
                         [(i + 1, *a) for i, a in enumerate(_AIRLINES)]),
            "flights": ("id INTEGER PRIMARY KEY, airline_id INTEGER, origin TEXT, destination TEXT, "
                        "departure_date TEXT, duration_min INTEGER, price REAL",
                        [(i + 1, rng.randint(1, len(_AIRLINES)), a[0], b[0], date(), rng.randint(45, 1200),
                          rng.randint(4000, 150000) / 100) for i, (a, b) in enumerate(routes)])}


@functools.cache
def sql_database(db: str) -> str:
    """Path of generated database `db`, built on first use; the name carries a hash of the
    content, so a changed generator never reads a stale file."""
    tables = _sql_tables(db)
    digest = hashlib.sha256(repr(sorted(tables.items())).encode()).hexdigest()[:16]
    path = Path(os.environ.get("NANORL_CACHE") or Path.home() / ".cache" / "nanorl") / "sql" / f"{db}-{digest}.db"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")  # one per builder, threads included
        os.close(fd)
        with sqlite3.connect(tmp) as con:
            for name, (columns, rows) in tables.items():
                con.execute(f"CREATE TABLE {name} ({columns})")
                con.executemany(f"INSERT INTO {name} VALUES ({', '.join('?' * len(rows[0]))})", rows)
        con.close()
        os.replace(tmp, path)  # atomic, and concurrent builders write identical files
    return str(path)


_HINT = "You can run {} in a ```{} block and see its {}. Give the final {} in <answer></answer> tags."


class SQLTask(ProceduralTask):
    """Text-to-SQL on three generated SQLite databases (shop, school, flights)."""

    name = "sql"
    rewards = [(sql_correct, 1.0), (format_reward, 0.1)]

    def generate(self, rng: random.Random) -> Problem:
        db = rng.choice(sorted(_SQL_QUESTIONS))
        question, gold = rng.choice(_SQL_QUESTIONS[db])
        params = {k: rng.choice(v) for k, v in _SQL_PARAMS[db].items()}
        question = question.format(**params)
        schema = "\n".join(f"CREATE TABLE {t} ({cols});" for t, (cols, _) in _sql_tables(db).items())
        hint = _HINT.format("read-only SQLite queries", "sql", "result", "SQL query")
        return Problem(f"SQLite database:\n{schema}\n\nQuestion: {question}\n{hint}",
                       json.dumps({"db": db, "gold": gold.format(**params)}), key=f"{db}: {question}")

    def solve(self, problem: Problem) -> str:
        return f"<answer>{json.loads(problem.answer)['gold']}</answer>"


class PythonTask(ProceduralTask):
    """Questions with a computed numeric answer: easy with code, tedious without."""

    name = "python_tool"
    rewards = [(numeric_correct, 1.0), (format_reward, 0.1)]

    def generate(self, rng: random.Random) -> Problem:
        kind = rng.randrange(4)
        if kind == 0:
            n = rng.randint(1_000, 200_000)
            sieve = bytearray([0, 0]) + bytearray([1]) * (n - 2)
            for i in range(2, math.isqrt(n) + 1):
                if sieve[i]:
                    sieve[i * i :: i] = bytes(len(range(i * i, n, i)))
            q, a = f"What is the sum of all prime numbers below {n}?", sum(itertools.compress(range(n), sieve))
        elif kind == 1:
            n, m, fib = rng.randint(100, 3000), rng.choice([1000, 998_244_353, 1_000_000_007]), (0, 1)
            for _ in range(n - 1):
                fib = (fib[1], (fib[0] + fib[1]) % m)
            q, a = f"What is F({n}) modulo {m}, where F is the Fibonacci sequence with F(1) = F(2) = 1?", fib[1]
        elif kind == 2:
            n = rng.randint(30, 500)
            q, a = f"What is the sum of the decimal digits of {n} factorial?", sum(map(int, str(math.factorial(n))))
        else:
            x, y, n = rng.randint(3, 19), rng.randint(20, 60), rng.randint(10_000, 10_000_000)
            q = f"How many integers from 1 to {n} are divisible by {x} or by {y}, but not by both?"
            a = n // x + n // y - 2 * (n // math.lcm(x, y))
        return Problem(f"{q}\n{_HINT.format('Python code', 'python', 'output', 'number')}", str(a), key=q)

    def solve(self, problem: Problem) -> str:
        return f"<answer>{problem.answer}</answer>"


class ToolEnv(TextEnv):
    """Each model turn either runs code in a ```<lang> block, whose output is the next
    observation, or ends the episode with a final answer in <answer></answer> tags."""

    lang = ""

    def respond(self, completion):
        if extract_answer(completion) is not None:
            reward = self.task.rewards[0][0](self.problem.prompt, completion, self.problem.answer)
            return None, reward, reward >= 1.0
        blocks = re.findall(rf"```{self.lang}[ \t]*\n(.*?)```", completion, re.S)
        if not blocks:
            return f"Run code in a ```{self.lang} block, or give the answer in <answer></answer> tags.", 0.0, False
        return self.run(blocks[-1]), 0.0, False

    def run(self, code: str) -> str:
        raise NotImplementedError


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


TEXT_ENVS: dict[str, type[TextEnv]] = {"countdown_multiturn": CountdownEnv, "python_tool": PythonToolEnv, "sql": SQLEnv}
