"""Tasks: problems, prompts and reward functions `fn(prompt, completion, answer) -> float`.

`Task.rewards` lists (fn, weight), the correctness reward (1.0 = right) first. `eval_problems()` is fixed
by (seed, eval_size); `train_problem(index)` depends only on (seed, index) and never returns an eval `key`,
so rank r of W shards by asking for indices r, r+W, ... Answers go in one `<answer>...</answer>` pair,
except in `arith` and `add` (the bare number). Adding a task is one class and one registry entry:

    class Parity(ProceduralTask):
        name, rewards = "parity", [(int_correct, 1.0)]
        def generate(self, rng):
            bits = "".join(rng.choice("01") for _ in range(8))
            return Problem(f"parity {bits}=", str(bits.count("1") % 2), key=bits)
        def solve(self, problem):
            return problem.answer
    TASKS["parity"] = Parity
"""
import ast
import json
import math
import numbers
import operator
import random
import re
import warnings
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from judge import JudgeUnavailable
from utils import ConfigError, closest, hub_out_of_reach

Reward = Callable[[str, str, str], float]  # (prompt, completion, answer) -> reward


@dataclass(frozen=True)
class Problem:
    prompt: str  # the user message (chat template applied later by the policy)
    answer: str  # reference answer the reward functions read
    key: str  # identity that keeps the train and eval splits disjoint

    def __post_init__(self):  # a number as the answer would pass here and fail in a reward, much later
        if not all(isinstance(x, str) for x in (self.prompt, self.answer, self.key)):
            raise ConfigError(f"a Problem's prompt, answer and key are str (of a number too): {self!r:.200}")


# ---------------------------------------------------------------- answers and numbers
_NUM = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+"  # "1,234" is one number, "3,4" two
# Each whitespace run has one \s* to match it: two in a row made fullmatch try every split (quadratic)
_ONE = re.compile(rf"(-)?\s*(?:\$\s*)?({_NUM})\s*(?:/\s*({_NUM})\s*)?%?\.?")
_ANY = re.compile(rf"(?<![\d.])(-)?\$?({_NUM})(?:/({_NUM}))?")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_MAX_DIGITS = 40  # longer numbers are refused: int() of over 4300 digits raises anyway
_INT = re.compile(rf"\s*(-?\d{{1,{_MAX_DIGITS}}})(\.?)\s*")  # an integer and an optional final period


def extract_answer(completion: str) -> str | None:
    """Content of the one `<answer>...</answer>` pair, None unless there is exactly one, in
    order: a second answer is a hedge (or the prompt's example echoed), not an answer."""
    rest = completion.partition("<answer>")[2]
    text, closed, _ = rest.partition("</answer>")
    return text.strip() if closed and "<answer>" not in rest and completion.count("</answer>") == 1 else None


def last_boxed(text: str) -> str | None:
    r"""Content of the last `\boxed{...}`, braces balanced (so `\boxed{\frac{1}{2}}` works)."""
    if (start := text.rfind("\\boxed{")) < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None  # unbalanced: no answer rather than a guess


def _plain(text: str) -> str:  # the last \boxed{}'s content or the text; \frac{a}{b} -> a/b, 1{,}000 -> 1,000
    text = text if (boxed := last_boxed(text)) is None else boxed
    for tex, plain in (("\\$", "$"), ("\\%", "%"), ("{,}", ","), ("\\!", ""), ("\u2212", "-")):  # U+2212: −
        text = text.replace(tex, plain)
    return _FRAC.sub(r" \1/\2", text)  # 2\frac{1}{4} -> "2 1/4": two numbers, never 21/4


def _fraction(sign: str | None, num: str, den: str | None) -> Fraction | None:
    if len(num) + len(den or "") > _MAX_DIGITS:
        return None
    n, d = Fraction(num.replace(",", "")), Fraction((den or "1").replace(",", ""))  # den may be ""
    return None if d == 0 else (-n if sign else n) / d


def parse_number(text: str) -> Fraction | None:
    r"""Exact value of a text that is ONE number (in its last \boxed{} if any), else None: "-12", "1,234",
    "3/4", "\frac{3}{4}", "$1,000", "12.5%" (12.5, never 0.125: GSM8K-style references count in percent)."""
    m = _ONE.fullmatch(_plain(text).strip())
    return _fraction(*m.groups()) if m else None


def completion_number(completion: str) -> Fraction | None:
    r"""The LAST number of the answer-tag content if there are tags, else of the whole completion (in
    its last \boxed{} if any): echoing the question's numbers before answering earns nothing."""
    text = extract_answer(completion)
    found = _ANY.findall(_plain(completion if text is None else text))
    return _fraction(*found[-1]) if found else None


# ---------------------------------------------------------------- safe arithmetic
class ExprError(ValueError):
    """An expression refused (not + - * /, too big, malformed) or without value (x/0)."""


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_EXPR_CHARS = frozenset("0123456789+-*/() \t")


def safe_eval(src: str, *, max_chars: int = 200, max_nodes: int = 100, max_depth: int = 32,
              max_bits: int = 64) -> tuple[Fraction, list[int]]:
    """Exact value and literals of an integer expression over + - * / ( ) and unary minus, else ExprError.
    Each limit comes before the work it bounds: 10,000 nested parentheses never parse, 9**9**9 never runs."""
    src = src.replace("×", "*").replace("÷", "/").replace("\u2212", "-").strip()  # U+2212: −, as _plain
    if len(src) > max_chars:
        raise ExprError(f"expression longer than {max_chars} characters")
    if not set(src) <= _EXPR_CHARS:
        raise ExprError(f"characters besides 0-9 + - * / ( ): {sorted(set(src) - _EXPR_CHARS)}")
    try:
        tree = ast.parse(src, mode="eval")
    except (SyntaxError, RecursionError, MemoryError) as e:
        raise ExprError(f"unparseable expression ({type(e).__name__})") from None
    literals, nodes = [], 0

    def value(node: ast.AST, depth: int) -> Fraction:
        nonlocal nodes
        nodes += 1
        if nodes > max_nodes or depth > max_depth:
            raise ExprError(f"expression has over {max_nodes} nodes or depth {max_depth}")
        if isinstance(node, ast.Constant) and type(node.value) is int:
            if node.value.bit_length() > max_bits:
                raise ExprError(f"literal larger than {max_bits} bits")
            literals.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand, depth + 1)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left, depth + 1), value(node.right, depth + 1)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ExprError("division by zero")
            return _OPS[type(node.op)](left, right)
        raise ExprError(f"not allowed in an expression: {type(getattr(node, 'op', node)).__name__}")

    return value(tree.body, 0), literals


# ---------------------------------------------------------------- reward functions
def format_reward(prompt: str, completion: str, answer: str) -> float:
    """1.0: one `<answer>`...`</answer>` pair, in order, not blank. 0.5: an opening tag cut off by the
    length limit. 0.25: other uses (several pairs, empty, out of order, stray closer). Text after is free."""
    if extract_answer(completion):
        return 1.0
    opens, closes = completion.count("<answer>"), completion.count("</answer>")
    if opens == 1 and closes == 0:
        return 0.5
    return 0.25 if opens or closes else 0.0


def numeric_correct(prompt: str, completion: str, answer: str) -> float:
    """1.0 iff the answer-tag content is ONE number (`parse_number`) equal to the reference. No tags, or
    words beside the number, score 0: the last number of free text would pay for listing candidates."""
    ref = parse_number(answer)
    if ref is None:  # references are validated at load time: this is a bug, not a bad sample
        raise ValueError(f"reference answer {answer!r} is not a number")
    return float(parse_number(extract_answer(completion) or "") == ref)  # no answer: "" parses to None


def int_correct(prompt: str, completion: str, answer: str) -> float:
    """1.0 iff the whole completion, give or take whitespace, is the reference integer as `solve` writes
    it ("-2", never "02" or "+2"): "12+7=19", "19 20" or "///7" would pay garbage around a lucky digit."""
    m = _INT.fullmatch(completion)
    return float(m is not None and m.groups() == (answer, ""))


def bare_int_correct(prompt: str, completion: str, answer: str) -> float:
    """int_correct that also allows one final period: "81", " 81."; "The answer is 81", "081" score 0."""
    m = _INT.fullmatch(completion)
    return float(m is not None and m.group(1) == answer)


def countdown_correct(prompt: str, completion: str, answer: str) -> float:
    """1.0 iff the answer-tag expression equals the target and uses the given numbers once each
    (as a multiset); "expr = target" is accepted, "expr = anything else" is not. Refusals and x/0 score 0."""
    ref = json.loads(answer)
    lhs, eq, rhs = (extract_answer(completion) or "").partition("=")  # no answer: safe_eval refuses ""
    if eq and rhs.strip() != str(ref["target"]):
        return 0.0
    try:
        value, used = safe_eval(lhs)
    except ExprError:  # the model wrote an invalid expression: a wrong answer, not a bug
        return 0.0
    return float(value == ref["target"] and sorted(used) == sorted(ref["numbers"]))


def overlong_penalty(max_len: int, buffer: int, length: Callable[[str], int] = len) -> Reward:
    """DAPO's soft overlong penalty: 0 up to max_len - buffer, then linear to -1 at max_len and
    beyond. Length in CHARACTERS; for tokens pass `length=lambda s: len(tok.encode(s))`."""
    if not 0 < buffer <= max_len:
        raise ValueError(f"overlong_penalty needs 0 < buffer <= max_len (got {buffer}, {max_len})")

    def overlong_penalty(prompt: str, completion: str, answer: str) -> float:
        return max(-1.0, min(0.0, (max_len - buffer - length(completion)) / buffer))

    return overlong_penalty


FLOAT32_MAX = 3.4028234663852886e38  # rewards live in float32 tensors


class RewardError(ValueError):
    """A reward that is not a finite number, or an env's reply that is not text: a bug in what it names."""


def checked(reward, who: str, completion: str) -> float:
    """`reward` as a float. Anything but a finite number stops the run: a NaN would mask its group as a
    judge's missing score does, None would fail deep in the loop, and neither says which reward erred."""
    # abs(), not isfinite(10**400), which overflows; past float32's range a reward is inf in the batch
    if isinstance(reward, numbers.Real) and abs(reward) <= FLOAT32_MAX:  # and its group's advantages NaN
        return float(reward)
    try:
        shown = f"{reward!r:.80}"
    except ValueError:  # repr() refuses an int past 4,300 digits (a reward of 10**5000)
        shown = f"a value too large to print ({type(reward).__name__})"
    raise RewardError(f"{who} returned {shown} for the completion {completion[:60]!r}; a reward is a "
                      "finite number within float32's range (0.0 for a wrong or malformed answer)")


def reward_names(rewards: list) -> list[str]:
    """Task.score's keys (and an async trainer's reward_* stats): each function's name, a repeat's with _i."""
    names = []
    for i, (fn, _) in enumerate(rewards):
        name = getattr(fn, "__name__", f"reward{i}")
        names.append(name if name not in {*names, "mean", "std"} else f"{name}_{i}")  # std: reward_std's
    return names


# ---------------------------------------------------------------- tasks
class Task:
    """Base class; subclasses fill `self._eval` and define `train_problem(index) -> Problem`."""

    name = "task"
    rewards: list[tuple[Reward, float]] = [(numeric_correct, 1.0), (format_reward, 0.1)]
    max_new_tokens = 512  # room for a short chain of thought on GSM8K-level problems
    _eval: list[Problem]

    def __init__(self, *, seed: int = 0):
        self.seed = seed
        self.rewards = list(self.rewards)  # per instance: appending must not change the class

    def solve(self, problem: Problem) -> str:  # the supervised warm-start's target
        return f"<answer>{problem.answer}</answer>"

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)

    def score(self, prompt: str, completion: str, answer: str,
              drop: bool = False) -> tuple[float, dict[str, float]]:
        """Weighted total, and each reward's unweighted value keyed by its function's name. A judge
        without a score raises JudgeUnavailable, or with drop=True scores NaN (and so does the total)."""
        total, parts = 0.0, {}
        for (fn, weight), name in zip(self.rewards, reward_names(self.rewards)):
            try:
                r = fn(prompt, completion, answer)
            except JudgeUnavailable as e:
                if not drop:
                    raise
                e.warn_dropped()  # once per cause
                r = math.nan
            except Exception as e:  # a bug in the reward: its traceback, and the completion that found it
                e.add_note(f"in reward {name}, scoring the completion {completion[:200]!r}")
                raise
            else:
                r = checked(r, f"reward {name}", completion)  # a judge's missing score alone is NaN
            parts[name] = r
            total += weight * r
        return total, parts

    def correct(self, problem: Problem, completion: str, parts: dict[str, float] | None = None) -> bool:
        """Whether rewards[0] gives 1 or more. `parts`: score()'s of this completion, read so that a judge is
        not asked again (under --judge-down drop its NaN, a sample dropped, is not correct)."""
        if parts:
            return next(iter(parts.values())) >= 1.0
        return self.rewards[0][0](problem.prompt, completion, problem.answer) >= 1.0

    def lenient(self, problem: Problem, completion: str) -> bool | None:
        """Whether the right answer appears anywhere in the completion, whatever the format (None: not
        defined). Logged beside the strict accuracy, it tells a gain in correctness from one in format."""
        return None


class ProceduralTask(Task):
    """Problems from a subclass's `generate(rng)`; a train draw whose key is in the eval split is redrawn."""

    MAX_EVAL = 100_000  # an eval decodes every problem (1,000 give +-1.6%); a typo's 10^8 would fill memory

    def __init__(self, *, seed: int = 0, eval_size: int = 100):
        super().__init__(seed=seed)
        if eval_size > self.MAX_EVAL:
            raise ConfigError(f"eval_size={eval_size}: {self.MAX_EVAL} at most; lower --eval-size")
        found: dict[str, Problem] = {}
        i = last_new = 0
        # one key past the split, else training has no problem: a task of 100 numbers, --eval-size 100
        while len(found) <= eval_size and i - last_new <= 1000 + len(found):  # then the space is spent
            p = self.generate(random.Random(f"{seed}:eval:{i}"))
            if not isinstance(p, Problem):
                raise ConfigError(f"{type(self).__name__}.generate() returned {p!r:.80}, not a tasks.Problem")
            if found.setdefault(p.key, p) is p:  # a new key
                last_new = i
            i += 1
        if (n := len(found)) <= eval_size:  # half of them leaves as many to train on; one problem leaves none
            fix = (f"--eval-size {eval_size} leaves too few to train on; lower it to {n // 2} or less"
                   if n > 1 else f"generate() must vary Problem.key (the split needs {eval_size + 1})")
            raise ConfigError(f"found only {n} distinct problems; {fix}")
        self._eval = list(found.values())[:eval_size]
        self._eval_keys = frozenset(p.key for p in self._eval)
        self.train_problem(0)  # a split that holds all but rare problems fails here, not at the first step

    def train_problem(self, index: int) -> Problem:
        return next(self.draws(index))

    def draws(self, index: int) -> Iterator[Problem]:  # its draws in turn, for a source that cannot play one
        for attempt in range(10_000):
            p = self.generate(random.Random(f"{self.seed}:train:{index}:{attempt}"))
            if p.key not in self._eval_keys:
                yield p
        raise ConfigError(f"{self.name}: 10,000 draws all hit the eval split; lower --eval-size")


class Arith(ProceduralTask):
    """"12+7=" -> "19", sized for a tiny random-init character-level model trained on a CPU."""

    name, rewards = "arith", [(int_correct, 1.0)]
    max_new_tokens = 8  # a sign, a few digits and the end token

    def __init__(self, *, seed: int = 0, eval_size: int = 50, max_operand: int = 9,
                 n_operands: int = 2, ops: str = "+-"):
        if (max_operand < 1 or n_operands < 2 or not ops or set(ops) - set("+-*/")  # and so that each draw
                or n_operands > 33 or max_operand ** n_operands >= 10**33):  # fits safe_eval and int_correct
            raise ConfigError(f"{self.name} needs max_operand >= 1, n_operands >= 2 and ops from '+-*/'; "
                              f"also n_operands <= 33 and max_operand ** n_operands < 10**33 (got "
                              f"{max_operand}, {n_operands}, {ops!r})")
        self.max_operand, self.n_operands, self.ops = max_operand, n_operands, ops
        if eval_size > (size := self.n_distinct()) // 2:
            raise ConfigError(f"eval_size={eval_size} leaves too few training problems: {self.name} "
                              f"with these settings has at most {size} distinct problems; lower "
                              f"--eval-size to {size // 2} or less, or make the task harder")
        super().__init__(seed=seed, eval_size=eval_size)

    def n_distinct(self) -> int:  # an upper bound: "/" drops inexact quotients
        return (self.max_operand + 1) ** self.n_operands * len(self.ops) ** (self.n_operands - 1)

    def generate(self, rng: random.Random) -> Problem:
        while True:  # with "/", redraw x/0 ("/" takes the next literal: only 0 starts "/0") and inexact x/y
            expr = str(rng.randint(0, self.max_operand))
            for _ in range(self.n_operands - 1):
                expr += rng.choice(self.ops) + str(rng.randint(0, self.max_operand))
            if "/0" not in expr and (value := safe_eval(expr)[0]).denominator == 1:
                return Problem(prompt=expr + "=", answer=str(value), key=expr)

    def solve(self, problem: Problem) -> str:
        return problem.answer


class ArithChain(Arith):
    """"3+5-2=" -> "6". A held-out a+b is a fact never seen; a held-out chain (of 4,000) is new only as a
    combination, each signed digit adding the same wherever it stands: a rule the tiny model carries over."""

    name = "arith_chain"

    def __init__(self, *, seed: int = 0, eval_size: int = 200, n_operands: int = 3, ops: str = "+-"):
        super().__init__(seed=seed, eval_size=eval_size, n_operands=n_operands, ops=ops)


class Countdown(ProceduralTask):
    """Reach a target from 3-4 numbers with + - * / and parentheses, each number used once.
    The target is made by combining the numbers at random, so every problem is solvable."""

    name, rewards = "countdown", [(countdown_correct, 1.0), (format_reward, 0.1)]
    min_numbers, max_numbers, max_number, max_target = 3, 4, 25, 1000  # solve() is exhaustive: <= 5 numbers

    def generate(self, rng: random.Random) -> Problem:
        numbers = [rng.randint(1, self.max_number)
                   for _ in range(rng.randint(self.min_numbers, self.max_numbers))]
        pool = list(numbers)
        while len(pool) > 1:  # fold two random numbers into one, staying a positive integer
            a, b = sorted((pool.pop(rng.randrange(len(pool))), pool.pop(rng.randrange(len(pool)))))
            options = [a + b] + [b - a] * (a != b) + [a * b] * (a * b <= self.max_target)
            pool.append(rng.choice(options + [b // a] * (a > 1 and b % a == 0)))
        prompt = (f"Using the numbers {numbers}, create an equation that equals {pool[0]}. "
                  "Use + - * / and parentheses, and each number exactly once. Give the final "
                  "expression in <answer></answer> tags, for example <answer>(1 + 2) * 3</answer>.")
        answer = json.dumps({"target": pool[0], "numbers": numbers})
        return Problem(prompt, answer, key=f"{sorted(numbers)}->{pool[0]}")

    def solve(self, problem: Problem) -> str:
        expr = solve_countdown(**json.loads(problem.answer))  # {"target": ..., "numbers": ...}
        if expr is None:
            raise ValueError(f"countdown problem has no solution: {problem.answer}")
        return f"<answer>{expr}</answer>"


def solve_countdown(numbers: Sequence[int], target: int) -> str | None:
    """Exhaustive search (fine up to 5 numbers): an expression equal to `target`, or None."""
    def search(items: list[tuple[Fraction, str]]) -> str | None:
        if len(items) == 1:
            return items[0][1] if items[0][0] == target else None
        for i in range(len(items)):
            for j in range(i + 1, len(items)):
                (a, ea), (b, eb) = items[i], items[j]
                rest = items[:i] + items[i + 1 : j] + items[j + 1 :]
                combos = [(a + b, f"{ea} + {eb}"), (a * b, f"{ea} * {eb}"),
                          (a - b, f"{ea} - {eb}"), (b - a, f"{eb} - {ea}")]
                combos += [(a / b, f"{ea} / {eb}")] if b else []
                combos += [(b / a, f"{eb} / {ea}")] if a else []
                for v, e in combos:
                    if (found := search(rest + [(v, f"({e})" if rest else e)])) is not None:
                        return found
        return None

    return search([(Fraction(n), str(n)) for n in numbers])


class DatasetTask(Task):
    """Numeric-answer problems from a JSONL file (`data=path`, rows {"question", "answer"} or {"problem",
    "solution"}) or else the hub; the reference (after the last "####", or in the last \\boxed{}) must be
    one number. Distinct questions, shuffled by seed: the first eval_size are held out, the rest train."""

    hub = ("", "", "")  # (path, config, split) for datasets.load_dataset
    instruction = "Solve step by step, then give the final number in <answer></answer> tags."
    numeric = True  # the answer must be one number; False (a judge's task): any text, or none at all

    def __init__(self, *, seed: int = 0, eval_size: int = 100, data: str | None = None,
                 bad_rows: str = "skip", too_long: Callable[[Problem], str | None] | None = None):
        super().__init__(seed=seed)
        if bad_rows not in ("skip", "error"):
            raise ConfigError(f"bad_rows must be 'skip' or 'error' (got {bad_rows!r})")
        found: dict[str, Problem] = {}
        self.where: dict[str, str] = {}  # key -> "file:line" of the row it came from
        self.skipped: list[str] = []  # "file:line (reason)" of every malformed row
        for where, row in self._rows(data):
            try:
                problem = self._problem(row)
                if too_long and (why := too_long(problem)):  # past the model's context: skip or error
                    raise ValueError(why)
                first = found.setdefault(problem.key, problem)
                if first.answer != problem.answer:  # a duplicate merges; two answers to one question conflict
                    raise ValueError(f"question already at {self.where[first.key]} with answer "
                                     f"{first.answer[:60]!r}")
                self.where.setdefault(problem.key, where)
            except ValueError as e:  # the message says why the row is malformed
                if bad_rows == "error":
                    raise ConfigError(f"{where}: malformed row ({e}); fix or delete that line, or "
                                      "pass --bad-rows skip to drop such rows") from None
                self.skipped.append(f"{where} ({e})")
        if self.skipped:
            shown = "; ".join(self.skipped[:20]) + " ..." * (len(self.skipped) > 20)
            warnings.warn(f"{self.name}: skipped {len(self.skipped)} malformed rows: {shown}")
        problems = list(found.values())
        random.Random(f"{seed}:split").shuffle(problems)
        if (n := len(problems)) <= eval_size:  # half of them leaves as many to train on, as ProceduralTask
            fix = f"lower it to {n // 2} or less" if n > 1 else "add rows"
            raise ConfigError(f"{n} usable rows: --eval-size {eval_size} leaves none to train on; {fix}")
        self._eval, self._train = problems[:eval_size], problems[eval_size:]

    def _rows(self, data: str | None) -> Iterator[tuple[str, Any]]:  # (where, row): file lines or hub records
        if data is not None:  # _problem parses each line: invalid JSON or UTF-8 is one more malformed row
            lines = Path(data).read_bytes().removeprefix(b"\xef\xbb\xbf").splitlines()  # bytes: U+2028 stays
            return ((f"{data}:{n}", line) for n, line in enumerate(lines, 1) if line.strip())
        path, config, split = self.hub
        try:
            import datasets  # optional heavy dependency: only needed without a local --data file
            if hub_out_of_reach():  # at once, not after the hub client's minutes of retries
                raise ConnectionError("it takes no connection; HF_HUB_OFFLINE=1 reads rows a run cached")
            ds = datasets.load_dataset(path, config, split=split)
        # Broad on purpose (the cause is attached): offline, the hub raises OSError, httpx or datasets errors
        except Exception as e:
            install = "pip install datasets, or " if isinstance(e, ImportError) else ""
            raise ConfigError(f"could not load {path!r} from the Hugging Face hub "
                              f"({type(e).__name__}: {e}); {install}pass a local file with --data path/to/"
                              f'{self.name}.jsonl (one {{"question": ..., "answer": ...}} per line)') from e
        return ((f"{path}[{split}]:row {i}", row) for i, row in enumerate(ds))

    def _problem(self, row: Any) -> Problem:
        if isinstance(row, bytes):
            try:
                row = json.loads(row.decode("utf-8-sig"))  # -sig: an editor's BOM
            except UnicodeDecodeError:
                raise ValueError("not UTF-8 text; save the file as UTF-8") from None
            except (ValueError, RecursionError) as e:  # JSONDecodeError, int()'s 4,300 digits (not its advice
                # after ";"), brackets nested past the interpreter's stack
                raise ValueError(f"invalid JSON: {getattr(e, 'msg', str(e).split(';')[0])}") from None
        if not isinstance(row, dict):
            raise ValueError("not a JSON object")
        question = row.get("question", row.get("problem"))
        answer = row.get("answer", row.get("solution"))
        if not isinstance(question, str) or not question.strip():
            raise ValueError("field 'question' is missing, empty or not text")
        key = " ".join(question.split())  # whitespace variants of a question are one problem
        prompt = "\n".join(filter(None, (question.strip(), self.instruction)))
        if not self.numeric:  # the rewards get the answer as it is (a reference text), "" without one
            return Problem(prompt, "" if answer is None else str(answer), key)
        if answer is None:  # any other value must read as a number below
            raise ValueError("missing field 'answer'")
        if isinstance(answer, float):  # json.dumps writes 0.00001 as 1e-05, which parse_number refuses
            answer = format(Decimal(repr(answer)), "f")
        text = str(answer).split("####")[-1]
        if (value := parse_number(text)) is None:
            raise ValueError(f"answer {text.strip()[-40:]!r} is not a number")
        return Problem(prompt, str(value), key)  # "72", "1/2"

    def solve(self, problem: Problem) -> str:  # a reference text is imitated as it is
        return super().solve(problem) if self.numeric else problem.answer

    def unanswered(self) -> list[str]:
        """Where the training rows are that have no answer to imitate (a judged task's), in file order."""
        keys = {p.key for p in self._train if not self.solve(p)}
        return [where for key, where in self.where.items() if key in keys]

    def train_problem(self, index: int) -> Problem:
        return self._train[index % len(self._train)]


class GSM8K(DatasetTask):
    name, hub = "gsm8k", ("openai/gsm8k", "main", "train")


class MATH(DatasetTask):
    r"""Only numeric final \boxed{} answers; others ("\sqrt{2}") are malformed rows: keep --bad-rows skip."""

    name, hub = "math", ("DigitalLearningGmbH/MATH-lighteval", "default", "train")


class Add(Arith):
    """a + b for a pretrained chat model, the format shown by two examples. SmolLM2-135M-Instruct mostly
    answers "13 + 8 = 21": the strict score (bare sum) starts low, the lenient one (sum anywhere) does not."""

    # Only a bare right sum pays: a bonus for the bare form (right or wrong) was learnt in 4 steps, every
    # answer "2". The prompt's examples make the untrained model sample it (9 of 128) for GRPO to see spread.
    name, rewards = "add", [(bare_int_correct, 1.0)]
    max_new_tokens = 12  # the bare sum is 2-3 tokens; "13 + 18 = 31" (for the lenient score) fits
    FORMAT = "Answer with the number only.\nQ: What is 2 + 3?\nA: 5\nQ: What is 11 + 7?\nA: 18\n"

    # Operands to 20 (441 problems): with operands to 50 the model's sampled sums were mostly wrong
    # (greedy 38% right anywhere, sampled 8-20%), leaving GRPO almost no bare AND right sample.
    def __init__(self, *, seed: int = 0, eval_size: int = 100, max_operand: int = 20):
        super().__init__(seed=seed, eval_size=eval_size, max_operand=max_operand, ops="+")

    def generate(self, rng: random.Random) -> Problem:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        return Problem(f"{self.FORMAT}Q: What is {a} + {b}?\nA:", str(a + b), key=f"{a}+{b}")

    def lenient(self, problem: Problem, completion: str) -> bool:
        return problem.answer in re.findall(r"(?<![\d.-])\d+(?!\d|\.\d)", completion)  # never 81 of 813.5


# ---------------------------------------------------------------- registry and evaluation
TASKS: dict[str, type[Task]] = {task.name: task for task in (Arith, ArithChain, Countdown, GSM8K, MATH, Add)}


def make_task(name: str, *, seed: int, eval_size: int, data: str | None = None,
              bad_rows: str = "skip", too_long: Callable[[Problem], str | None] | None = None,
              **options: Any) -> Task:
    """Build a registered task; `options` go to its constructor (e.g. max_operand=99 for arith)."""
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}{closest(name, TASKS)} (valid: {', '.join(sorted(TASKS))})")
    if why := data_problem(name, data, bad_rows):
        raise ConfigError(why)
    if issubclass(TASKS[name], DatasetTask):
        options.update(data=data, bad_rows=bad_rows, too_long=too_long)
    return TASKS[name](seed=seed, eval_size=eval_size, **options)


def data_problem(name: str, data: str | None, bad_rows: str, env: type | None = None) -> str | None:
    """Why --data / --bad-rows cannot serve this task (None: they can): only a task that reads rows (a
    DatasetTask: TASKS[name], or a text env's `task`) takes them, and the file must be there."""
    given = [flag for flag, on in (("--data", data), ("--bad-rows", bad_rows != "skip")) if on]
    reads_rows = issubclass(getattr(env, "task", None) or TASKS.get(name, Task), DatasetTask)
    if given and not reads_rows:  # either would go unused
        return f"this task generates its own problems; drop {' and '.join(given)}"
    if data and (not Path(data).exists() or Path(data).is_dir()):  # /dev/stdin, a FIFO: readable
        return f"no file at {data}; fix the --data path, or drop it to read {name} from the hub"
    if reads_rows and not data:
        try:  # optional (the hub's rows only); missing, it stops a run before a model loads, not after
            import datasets  # noqa: F401
        except ImportError:
            return "the hub's rows need the datasets package: pip install -e '.[hub]', or pass --data FILE"
    return None


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)
