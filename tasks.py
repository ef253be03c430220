"""Tasks: where problems come from, how prompts look and how completions are rewarded.

A task samples `Problem`s (prompt, reference answer, identity key) and lists reward functions
`fn(prompt, completion, answer) -> float` with weights; `Task.score` returns the weighted sum
and a per-function breakdown. By convention `rewards[0]` is the correctness reward (1.0 means
right), which `Task.correct`, `greedy_accuracy` and pass@k counting use.

Splits: `eval_problems()` is fixed by (seed, eval_size) and `train_problem(index)` is a pure
function of (seed, index) that never returns a problem whose `key` is in the eval split. To
shard across ranks, rank r of W simply asks for indices r, r+W, r+2W, ...: no communication.

Answers are given in `<answer>...</answer>` tags (except `arith`, whose tiny character-level
model just emits the number). Adding a task is one class and one `TASKS` entry:

    class Parity(ProceduralTask):
        rewards = [(int_correct, 1.0)]
        def generate(self, rng):
            bits = "".join(rng.choice("01") for _ in range(8))
            return Problem(f"parity {bits}=", str(bits.count("1") % 2), key=bits)
        def solve(self, problem):
            return problem.answer
    TASKS["parity"] = Parity
"""
from __future__ import annotations

import ast
import difflib
import json
import math
import operator
import random
import re
import warnings
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Iterable, Iterator, Sequence

Reward = Callable[[str, str, str], float]  # (prompt, completion, answer) -> reward


@dataclass(frozen=True)
class Problem:
    prompt: str  # the user message (chat template applied later by the policy)
    answer: str  # reference answer the reward functions read
    key: str  # identity used to keep the train and eval splits disjoint


# ---------------------------------------------------------------- answer extraction and numbers
_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
_NUM = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+"  # "1,234" is one number, "3,4" two
_FULL = re.compile(rf"(-)?\s*\$?\s*({_NUM})\s*(?:/\s*({_NUM}))?\s*(%)?\.?")
_ANY = re.compile(rf"(?<![\d.)])(-)?\$?({_NUM})(?:/({_NUM}))?")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_MAX_NUMBER_CHARS = 40  # longer digit strings are refused: int() of >4300 digits raises anyway


def extract_answer(completion: str) -> str | None:
    """Content of the LAST complete `<answer>...</answer>` pair (so hedging with several answers
    gains nothing), stripped; None when there is no complete pair."""
    found = _TAG.findall(completion)
    return found[-1].strip() if found else None


def last_boxed(text: str) -> str | None:
    r"""Content of the last `\boxed{...}`, with balanced braces (`\boxed{\frac{1}{2}}` works)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None  # unbalanced: no answer rather than a guess


def _latex_plain(text: str) -> str:
    text = text.replace("\\$", "$").replace("\\%", "%").replace("\\!", "").replace("{,}", ",")
    return _FRAC.sub(r"(\1)/(\2)", text).replace("(", "").replace(")", "")


def _fraction(sign: str | None, num: str, den: str | None) -> Fraction | None:
    if len(num) + len(den or "") > _MAX_NUMBER_CHARS:
        return None
    value = Fraction(num.replace(",", ""))
    if den is not None:
        d = Fraction(den.replace(",", ""))
        if d == 0:
            return None
        value /= d
    return -value if sign else value


def parse_number(text: str) -> Fraction | None:
    r"""The exact value of a string that IS one number, else None. Accepts "-12", "1,234",
    "3.25", "3/4", "\frac{3}{4}", "\dfrac", "\boxed{...}" (last wins), "$1,000", "12.5%".
    A percent sign is dropped: "12.5%" is 12.5 (not 0.125), because GSM8K-style references
    state percentages as the number of percent; the model must answer in the same unit."""
    boxed = last_boxed(text)
    m = _FULL.fullmatch(_latex_plain(boxed if boxed is not None else text).strip())
    return _fraction(m.group(1), m.group(2), m.group(3)) if m else None


def last_number(text: str) -> Fraction | None:
    r"""The last number written anywhere in `text` (after the last `\boxed{}` if any)."""
    boxed = last_boxed(text)
    if boxed is not None:
        return parse_number(boxed)
    found = _ANY.findall(_latex_plain(text))
    return _fraction(*found[-1]) if found else None


def completion_number(completion: str) -> Fraction | None:
    """The number a completion commits to: its answer-tag content when tags are present (the
    whole content if it is one number, else its last number), otherwise the LAST number in
    the completion, so echoing the question's numbers before answering costs nothing and
    echoing them instead of answering earns nothing."""
    text = extract_answer(completion)
    if text is None:
        return last_number(completion)
    value = parse_number(text)
    return value if value is not None else last_number(text)


# ---------------------------------------------------------------- safe arithmetic
class ExprError(ValueError):
    """The safe evaluator refused an expression (not + - * /, too big, malformed) or could not
    value it (division by zero)."""


_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_EXPR_CHARS = frozenset("0123456789+-*/() \t")


def safe_eval(src: str, *, max_chars: int = 200, max_nodes: int = 100, max_depth: int = 32,
              max_bits: int = 64) -> tuple[Fraction, list[int]]:
    """Value of an integer expression over + - * / (unary minus, parentheses) as an exact
    Fraction, plus the integer literals it uses. Never calls eval; everything else raises
    ExprError. Limits are checked before any arithmetic: length before parsing (10,000 nested
    parentheses never reach the parser), then node count, depth and literal size; `**` is not
    an operator here, so `9**9**9` is refused, not computed."""
    src = src.replace("×", "*").replace("÷", "/").strip()
    if len(src) > max_chars:
        raise ExprError(f"expression longer than {max_chars} characters")
    if not set(src) <= _EXPR_CHARS:
        raise ExprError(f"characters outside '0-9 + - * / ( )': {sorted(set(src) - _EXPR_CHARS)}")
    try:
        tree = ast.parse(src, mode="eval")
    except (SyntaxError, RecursionError, MemoryError) as e:
        raise ExprError(f"unparseable expression ({type(e).__name__})") from None
    literals: list[int] = []
    nodes = 0

    def value(node: ast.AST, depth: int) -> Fraction:
        nonlocal nodes
        nodes += 1
        if nodes > max_nodes or depth > max_depth:
            raise ExprError(f"expression exceeds {max_nodes} nodes or depth {max_depth}")
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
        raise ExprError(f"not allowed in an expression: {type(node).__name__}")

    return value(tree.body, 0), literals


# ---------------------------------------------------------------- reward functions
def format_reward(prompt: str, completion: str, answer: str) -> float:
    """1.0 for exactly one `<answer>` `</answer>` pair, in order, with non-blank content;
    0.5 for one opening tag and no closing tag (typically cut off by the length limit);
    0.25 for any other use of the tags (several pairs, empty, out of order, stray closer);
    0.0 without tags. Text after the closing tag is not penalised."""
    opens, closes = completion.count("<answer>"), completion.count("</answer>")
    if opens == closes == 1:
        i, j = completion.index("<answer>"), completion.index("</answer>")
        if i < j and completion[i + len("<answer>") : j].strip():
            return 1.0
    if opens == 1 and closes == 0:
        return 0.5
    return 0.25 if opens or closes else 0.0


def numeric_correct(prompt: str, completion: str, answer: str) -> float:
    """1.0 iff the completion's number (see `completion_number`) equals the reference exactly."""
    ref = parse_number(answer)
    if ref is None:  # references are validated at load time: this is a bug, not a bad sample
        raise ValueError(f"reference answer {answer!r} is not a number")
    return float(completion_number(completion) == ref)


_INT = re.compile(r"-?\d+")


def int_correct(prompt: str, completion: str, answer: str) -> float:
    """1.0 iff the FIRST integer of the completion (of the answer-tag content if tags are
    present) equals the reference. First, not last: "12+7=19" echoes the prompt and scores 0."""
    text = extract_answer(completion)
    m = _INT.search(completion if text is None else text)
    if m is None or len(m.group()) > _MAX_NUMBER_CHARS:
        return 0.0
    return float(int(m.group()) == int(answer))


def countdown_correct(prompt: str, completion: str, answer: str) -> float:
    """1.0 iff the answer-tag expression evaluates (safely, exactly) to the target and uses the
    given numbers exactly once each, as a multiset. A trailing "= 24" is allowed and ignored:
    only the left side is evaluated. Refused expressions and division by zero score 0."""
    ref = json.loads(answer)
    expr = extract_answer(completion)
    if expr is None:
        return 0.0
    try:
        value, used = safe_eval(expr.split("=")[0])
    except ExprError:  # the model's expression is invalid: a wrong answer, not an error
        return 0.0
    return float(value == ref["target"] and sorted(used) == sorted(ref["numbers"]))


def overlong_penalty(max_len: int, buffer: int, length: Callable[[str], int] = len) -> Reward:
    """DAPO's soft overlong penalty: 0 up to max_len - buffer, then linear down to -1 at max_len
    (and -1 beyond). Length is in CHARACTERS by default; pass `length=lambda s:
    len(tokenizer.encode(s))` to measure tokens, as DAPO does."""
    if not 0 < buffer <= max_len:
        raise ValueError(f"overlong_penalty needs 0 < buffer <= max_len (got {buffer}, {max_len})")

    def overlong_penalty(prompt: str, completion: str, answer: str) -> float:
        return max(-1.0, min(0.0, (max_len - buffer - length(completion)) / buffer))

    return overlong_penalty


# ---------------------------------------------------------------- tasks
class Task:
    """Base class: subclasses define `rewards`, the splits, and `solve`."""

    name = "task"
    rewards: list[tuple[Reward, float]] = [(numeric_correct, 1.0), (format_reward, 0.1)]
    max_new_tokens = 512  # enough for a short chain of thought on GSM8K-level problems

    def __init__(self, *, seed: int = 0, eval_size: int = 100):
        if eval_size < 0:
            raise ValueError(f"eval_size must be >= 0 (got {eval_size})")
        self.seed, self.eval_size = seed, eval_size

    def train_problem(self, index: int) -> Problem:
        raise NotImplementedError

    def eval_problems(self) -> list[Problem]:
        raise NotImplementedError

    def solve(self, problem: Problem) -> str:
        raise NotImplementedError

    def score(self, prompt: str, completion: str, answer: str) -> tuple[float, dict[str, float]]:
        """Weighted total and the unweighted value of each reward, keyed by function name."""
        total, parts = 0.0, {}
        for i, (fn, weight) in enumerate(self.rewards):
            name = getattr(fn, "__name__", f"reward{i}")
            r = float(fn(prompt, completion, answer))
            parts[name if name not in parts else f"{name}_{i}"] = r
            total += weight * r
        return total, parts

    def correct(self, problem: Problem, completion: str) -> bool:
        return self.rewards[0][0](problem.prompt, completion, problem.answer) >= 1.0


class ProceduralTask(Task):
    """A task whose problems come from `generate(rng)`. Problem i of the eval split uses the
    rng stream (seed, "eval", i), skipping duplicate keys; train problem i uses (seed, "train",
    i, attempt) and regenerates while its key is in the eval split."""

    def __init__(self, *, seed: int = 0, eval_size: int = 100):
        super().__init__(seed=seed, eval_size=eval_size)
        size = self.n_distinct()
        if size is not None and eval_size > size // 2:
            raise ValueError(f"eval_size={eval_size} leaves too few training problems: {self.name} "
                             f"with these settings has only {size} distinct problems; lower "
                             f"--eval-size to at most {size // 2} or make the task harder")
        self._eval: list[Problem] = []
        seen: set[str] = set()
        for i in range(100 * eval_size + 1000):
            if len(self._eval) == eval_size:
                break
            p = self.generate(random.Random(f"{seed}:eval:{i}"))
            if p.key not in seen:
                seen.add(p.key)
                self._eval.append(p)
        else:
            raise ValueError(f"could only generate {len(self._eval)} distinct eval problems; "
                             f"lower --eval-size (got {eval_size})")
        self._eval_keys = frozenset(seen)

    def generate(self, rng: random.Random) -> Problem:
        raise NotImplementedError

    def n_distinct(self) -> int | None:
        """Number of distinct problems when small enough to matter (None: effectively infinite)."""
        return None

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)

    def train_problem(self, index: int) -> Problem:
        if index < 0:
            raise ValueError(f"train_problem index must be >= 0 (got {index})")
        for attempt in range(10_000):
            p = self.generate(random.Random(f"{self.seed}:train:{index}:{attempt}"))
            if p.key not in self._eval_keys:
                return p
        raise RuntimeError(f"{self.name}: 10,000 draws all hit the eval split; lower --eval-size")


class Arith(ProceduralTask):
    """"12+7=" -> "19": sized for a tiny random-init character-level model trained on a CPU.
    The completion is just the number (the policy appends its end token)."""

    name = "arith"
    rewards = [(int_correct, 1.0)]
    max_new_tokens = 8  # a few digits, a sign and the end token

    def __init__(self, *, seed: int = 0, eval_size: int = 50, max_operand: int = 9,
                 n_operands: int = 2, ops: str = "+-"):
        if max_operand < 1 or n_operands < 2 or not ops or set(ops) - set("+-*/"):
            raise ValueError(f"arith needs max_operand >= 1, n_operands >= 2 and ops from '+-*/' "
                             f"(got {max_operand}, {n_operands}, {ops!r})")
        self.max_operand, self.n_operands, self.ops = max_operand, n_operands, ops
        super().__init__(seed=seed, eval_size=eval_size)

    def n_distinct(self) -> int:  # an upper bound: "/" drops inexact quotients
        return (self.max_operand + 1) ** self.n_operands * len(self.ops) ** (self.n_operands - 1)

    def generate(self, rng: random.Random) -> Problem:
        while True:  # "/" must divide exactly; redraw (with "/" alone about half the draws do)
            expr = str(rng.randint(0, self.max_operand))
            for _ in range(self.n_operands - 1):
                expr += rng.choice(self.ops) + str(rng.randint(0, self.max_operand))
            try:
                value, _ = safe_eval(expr)
            except ExprError:  # division by zero
                continue
            if value.denominator == 1:
                return Problem(prompt=expr + "=", answer=str(value), key=expr)

    def solve(self, problem: Problem) -> str:
        return str(safe_eval(problem.prompt.rstrip("="))[0])


class Countdown(ProceduralTask):
    """Reach a target from 3-4 numbers with + - * / and parentheses, each number used once.
    The target is built by combining the numbers at random, so every problem is solvable."""

    name = "countdown"
    rewards = [(countdown_correct, 1.0), (format_reward, 0.1)]

    def __init__(self, *, seed: int = 0, eval_size: int = 100, min_numbers: int = 3,
                 max_numbers: int = 4, max_number: int = 25, max_target: int = 1000):
        if not 2 <= min_numbers <= max_numbers <= 6 or max_number < 2:
            raise ValueError("countdown needs 2 <= min_numbers <= max_numbers <= 6 and "
                             f"max_number >= 2 (got {min_numbers}, {max_numbers}, {max_number})")
        self.min_numbers, self.max_numbers = min_numbers, max_numbers
        self.max_number, self.max_target = max_number, max_target
        super().__init__(seed=seed, eval_size=eval_size)

    def generate(self, rng: random.Random) -> Problem:
        numbers = [rng.randint(1, self.max_number)
                   for _ in range(rng.randint(self.min_numbers, self.max_numbers))]
        pool = list(numbers)
        while len(pool) > 1:  # fold two random numbers into one, keeping positive integers
            a, b = sorted((pool.pop(rng.randrange(len(pool))), pool.pop(rng.randrange(len(pool)))))
            options = [a + b] + [b - a] * (a != b) + [a * b] * (a * b <= self.max_target)
            options += [b // a] * (a > 1 and b % a == 0)
            pool.append(rng.choice(options))
        target = pool[0]
        prompt = (f"Using the numbers {numbers}, create an equation that equals {target}. Use + - * / "
                  "and parentheses, and each number exactly once. Give the final expression in "
                  "<answer></answer> tags, for example <answer>(1 + 2) * 3</answer>.")
        answer = json.dumps({"target": target, "numbers": numbers})
        return Problem(prompt, answer, key=f"{sorted(numbers)}->{target}")

    def solve(self, problem: Problem) -> str:
        ref = json.loads(problem.answer)
        expr = solve_countdown(ref["numbers"], ref["target"])
        if expr is None:
            raise ValueError(f"countdown problem has no solution: {problem.answer}")
        return f"<answer>{expr}</answer>"


def solve_countdown(numbers: Sequence[int], target: int) -> str | None:
    """Exhaustive search (fine for <= 5 numbers): an expression string hitting `target`, or None."""
    def search(items: list[tuple[Fraction, str]]) -> str | None:
        if len(items) == 1:
            return items[0][1] if items[0][0] == target else None
        for i in range(len(items)):
            for j in range(i + 1, len(items)):
                (a, ea), (b, eb) = items[i], items[j]
                rest = items[:i] + items[i + 1 : j] + items[j + 1 :]
                combos = [(a + b, f"{ea} + {eb}"), (a * b, f"{ea} * {eb}"),
                          (a - b, f"{ea} - {eb}"), (b - a, f"{eb} - {ea}")]
                combos += [(a / b, f"{ea} / {eb}")] * (b != 0) + [(b / a, f"{eb} / {ea}")] * (a != 0)
                for v, e in combos:
                    found = search(rest + [(v, f"({e})" if rest else e)])
                    if found is not None:
                        return found
        return None

    return search([(Fraction(n), str(n)) for n in numbers])


class DatasetTask(Task):
    """Numeric-answer problems from a local JSONL file (`data=path`, one {"question": ...,
    "answer": ...} object per line; "problem"/"solution" are accepted too) or, without a path,
    from the Hugging Face hub via `datasets`. The reference answer is the text after the last
    "####" (GSM8K style) or the last \\boxed{} (MATH style) or the whole field, and must parse
    as one number. Rows are deduplicated by question; a seeded shuffle of them puts the first
    eval_size in the eval split and the rest, in that order and cycled, in the train stream.
    Malformed rows are reported with file:line and skipped (bad_rows="skip") or rejected
    ("error"). The SFT demo from `solve` is the dataset's own final answer in tags."""

    hub: tuple[str, str, str] = ("", "", "")  # (path, config, split) for datasets.load_dataset
    instruction = "Solve the problem step by step, then give the final number in <answer></answer> tags."

    def __init__(self, *, seed: int = 0, eval_size: int = 100, data: str | None = None,
                 bad_rows: str = "skip"):
        super().__init__(seed=seed, eval_size=eval_size)
        if bad_rows not in ("skip", "error"):
            raise ValueError(f"bad_rows must be 'skip' or 'error' (got {bad_rows!r})")
        rows = _read_jsonl(data) if data is not None else self._read_hub()
        problems: dict[str, Problem] = {}
        self.skipped: list[str] = []  # "file:line (reason)" for every malformed row
        for where, row in rows:
            problem = self._problem(row) if isinstance(row, dict) else "not a JSON object"
            if isinstance(problem, str):
                if bad_rows == "error":
                    raise ValueError(f"{where}: malformed row ({problem}); fix or delete that line, "
                                     "or pass --bad-rows skip to drop malformed rows with a warning")
                self.skipped.append(f"{where} ({problem})")
            else:
                problems.setdefault(problem.key, problem)
        if self.skipped:
            warnings.warn(f"{self.name}: skipped {len(self.skipped)} malformed rows: "
                          + "; ".join(self.skipped[:20]) + (" ..." if len(self.skipped) > 20 else ""))
        unique = list(problems.values())
        random.Random(f"{seed}:split").shuffle(unique)
        if len(unique) <= eval_size:
            raise ValueError(f"{self.name}: eval_size={eval_size} leaves no training problems "
                             f"({len(unique)} usable rows); lower --eval-size")
        self._eval, self._train = unique[:eval_size], unique[eval_size:]

    def _problem(self, row: dict) -> Problem | str:
        """The row as a Problem, or the reason it is malformed."""
        question = row.get("question", row.get("problem"))
        answer = row.get("answer", row.get("solution"))
        if not isinstance(question, str) or not question.strip():
            return "missing or non-string field 'question'"
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            return "missing or non-string field 'answer'"
        text = str(answer).split("####")[-1]
        value = parse_number(text)
        if value is None:
            return f"answer {text.strip()[:40]!r} is not a number"
        key = " ".join(question.split())
        return Problem(f"{question.strip()}\n{self.instruction}", _canonical(value), key)

    def _read_hub(self) -> Iterator[tuple[str, Any]]:
        path, config, split = self.hub
        hint = (f"pass a local file with --data path/to/{self.name}.jsonl (one "
                '{"question": ..., "answer": ...} object per line)')
        try:
            import datasets  # optional heavy dependency, only needed without a local --data file
        except ImportError:
            raise ValueError(f"task {self.name!r}: the `datasets` package is not installed; {hint}, "
                             "or pip install datasets") from None
        try:
            ds = datasets.load_dataset(path, config, split=split)
        except (OSError, ValueError) as e:  # no network, hub down, dataset moved (ConnectionError is an OSError)
            raise ValueError(f"task {self.name!r}: could not load {path!r} from the Hugging Face "
                             f"hub ({type(e).__name__}: {e}); {hint}") from e
        return ((f"{path}[{split}]:row {i}", row) for i, row in enumerate(ds))

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)

    def train_problem(self, index: int) -> Problem:
        if index < 0:
            raise ValueError(f"train_problem index must be >= 0 (got {index})")
        return self._train[index % len(self._train)]

    def solve(self, problem: Problem) -> str:
        return f"<answer>{problem.answer}</answer>"


def _read_jsonl(path: str) -> Iterator[tuple[str, Any]]:
    """(\"file:line\", parsed row or the string reason it is not JSON) for each non-blank line."""
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()  # read eagerly so an open error surfaces at construction
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                yield f"{path}:{n}", json.loads(line)
            except json.JSONDecodeError as e:
                yield f"{path}:{n}", f"invalid JSON: {e.msg}"


def _canonical(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else str(value)


class GSM8K(DatasetTask):
    name = "gsm8k"
    hub = ("openai/gsm8k", "main", "train")


class MATH(DatasetTask):
    r"""MATH problems with a numeric final answer (the \boxed{} of the solution); rows whose
    answer is not a number (e.g. "\sqrt{2}", "x+1") are malformed for this task."""

    name = "math"
    hub = ("DigitalLearningGmbH/MATH-lighteval", "default", "train")

    def _problem(self, row: dict) -> Problem | str:
        if isinstance(row.get("solution"), str) and "answer" not in row:
            boxed = last_boxed(row["solution"])
            row = {**row, "solution": boxed if boxed is not None else row["solution"]}
        return super()._problem(row)


# ---------------------------------------------------------------- registry and evaluation
TASKS: dict[str, type[Task]] = {"arith": Arith, "countdown": Countdown, "gsm8k": GSM8K, "math": MATH}


def make_task(name: str, *, seed: int, eval_size: int, data: str | None = None,
              bad_rows: str = "skip", **options: Any) -> Task:
    """Build a registered task; `options` go to its constructor (e.g. max_operand for arith)."""
    if name not in TASKS:
        close = difflib.get_close_matches(name, list(TASKS), n=1, cutoff=0.0)
        raise ValueError(f"unknown task {name!r}; did you mean {close[0]!r}? "
                         f"(valid: {', '.join(sorted(TASKS))})")
    cls = TASKS[name]
    if issubclass(cls, DatasetTask):
        return cls(seed=seed, eval_size=eval_size, data=data, bad_rows=bad_rows, **options)
    if data is not None:
        raise ValueError(f"task {name!r} generates its own problems; drop --data {data}")
    return cls(seed=seed, eval_size=eval_size, **options)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def greedy_accuracy(task: Task, problems: Iterable[Problem], completions: Iterable[str]) -> float:
    """Fraction of problems whose (greedy) completion the task's correctness reward accepts."""
    hits = [task.correct(p, c) for p, c in zip(problems, completions, strict=True)]
    if not hits:
        raise ValueError("greedy_accuracy needs at least one problem")
    return sum(hits) / len(hits)
