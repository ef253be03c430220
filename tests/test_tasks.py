"""Invariants of tasks.py: reward functions on hand-worked (and nasty) completions, the safe
evaluator's refusals, split disjointness and determinism, dataset loading, pass@k."""
import json
import math
import operator
import os
import re
import sys
import textwrap
import types
import warnings
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

import tasks
from judge import JudgeUnavailable
from tasks import (ExprError, Problem, countdown_correct, extract_answer, format_reward,
                   int_correct, last_boxed, completion_number, make_task,
                   numeric_correct, overlong_penalty, parse_number, pass_at_k, safe_eval,
                   solve_countdown)
from utils import ConfigError

DATA = Path(__file__).parent / "data"
MIXED = str(DATA / "gsm8k_mixed.jsonl")  # 9 good rows (+1 duplicate), bad lines 3, 5, 8, 15
NATALIA = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many "
           "clips in May. How many clips did Natalia sell altogether in April and May?")
CD24 = json.dumps({"target": 24, "numbers": [3, 5, 3]})


def mixed(bad_rows="skip", **kw):
    with pytest.warns(UserWarning, match="skipped 4 malformed rows"):
        return make_task("gsm8k", seed=0, eval_size=kw.pop("eval_size", 2), data=MIXED,
                         bad_rows=bad_rows, **kw)


def plus_one_rows(n):
    return [{"question": f"What is {i} plus 1?", "answer": str(i + 1)} for i in range(n)]


# ---------------------------------------------------------------- numbers and tags
@pytest.mark.parametrize("text, value", [
    ("72", 72), ("-3", -3), ("1,234", 1234), ("$1,000", 1000), ("$5", 5), ("\\$5", 5),
    ("3.25", Fraction(13, 4)), ("0.1", Fraction(1, 10)), ("3/4", Fraction(3, 4)),
    ("\\frac{3}{4}", Fraction(3, 4)), ("\\dfrac{3}{4}", Fraction(3, 4)),
    ("-\\frac{1}{2}", Fraction(-1, 2)), ("\\boxed{\\frac{1}{2}}", Fraction(1, 2)),
    ("\\boxed{1} then \\boxed{2}", 2), ("50%", 50), ("12.5%", Fraction(25, 2)),
    ("\\boxed{12.5\\%}", Fraction(25, 2)), ("72.", 72), ("1{,}000", 1000),
    ("abc", None), ("3 apples", None), ("1/0", None), ("", None), ("1,2345", None),
    ("9" * 5000, None), ("\\boxed{1", None),
    # a mixed number, an interval, a product: they read as 21/4, 100 and 23 (parentheses were dropped)
    ("\\boxed{2\\frac{1}{4}}", None), ("-2\\tfrac{1}{4}", None), ("\\boxed{(0,100)}", None), ("2(3)", None),
])
def test_parse_number_is_exact_and_accepts_only_one_number(text, value):
    assert parse_number(text) == value



def test_parse_number_takes_up_to_40_digits_counting_a_fractions_both_parts():
    assert parse_number("7" * 40) == int("7" * 40) and parse_number("7" * 41) is None
    assert parse_number("3" * 20 + "/" + "3" * 20) == 1 and parse_number("3" * 21 + "/" + "3" * 20) is None

def test_completion_number_takes_the_last_and_respects_separators_and_signs():
    assert completion_number("48 + 24 = 72") == 72
    assert completion_number("x = -3") == -3
    assert completion_number("5-3") == 3  # a minus right after a digit is subtraction, not a sign
    assert completion_number("1,234 and 3,4") == 4 and completion_number("sold 1,234 pens") == 1234
    assert completion_number("half is \\frac{1}{2}.") == Fraction(1, 2)
    assert completion_number("\\boxed{5} then 7") == 5  # a boxed answer wins over later numbers
    assert completion_number("no digits") is None and completion_number("9" * 100_000) is None
    assert completion_number("12 + 7 = <answer>19</answer>, not 20") == 19  # the answer tags win


def test_a_typeset_minus_sign_is_a_minus():
    """Models that learned from LaTeX-rendered text write U+2212 for minus: a right negative answer scored 0."""
    assert parse_number("\u221272") == -72 and parse_number("\\boxed{\u2212\\frac{1}{2}}") == Fraction(-1, 2)
    assert completion_number("so x = \u22123") == -3 and completion_number("5\u22123") == 3  # still subtraction
    assert numeric_correct("p", "<answer>\u221272</answer>", "-72") == 1.0
    assert numeric_correct("p", "<answer>\u221272</answer>", "72") == 0.0
    assert safe_eval("(9 \u2212 3) * \u22122") == (-12, [9, 3, 2])  # the expression evaluator too
    assert countdown_correct("p", "<answer>(9 \u2212 3) * 2</answer>", '{"target": 12, "numbers": [2, 3, 9]}')


@pytest.mark.parametrize("text, value", [
    ("- 12 / 4 %", -3), ("-\t$ 1,234 .", -1234), ("5 \n/\n 2", Fraction(5, 2)), ("$ 5", 5),
    ("-" + " " * 200_000 + "?", None), ("5" + " " * 200_000 + "?", None), ("$" + " " * 200_000 + "$5", None)],
    ids=["percent", "tab-dollar", "newline-fraction", "dollar", "run-after-minus", "run-after-5", "run-$"])
def test_whitespace_around_a_numbers_parts_parses_and_a_long_run_is_refused_at_once(text, value):
    """A run of n spaces before a non-number took O(n^2) (32,000: 26 s): the pattern had two optional
    whitespace runs in a row, and fullmatch tried every split of it. 200,000 would take many minutes."""
    assert parse_number(text) == value
    assert numeric_correct("p", f"<answer>{text}</answer>", "5") == float(value == 5)


def test_last_boxed_balances_braces_and_last_wins():
    assert last_boxed("\\boxed{\\frac{1}{2}} or \\boxed{\\dfrac{3}{4}}") == "\\dfrac{3}{4}"
    assert last_boxed("\\boxed{1") is None and last_boxed("none") is None


def test_extract_answer_needs_exactly_one_pair_in_order():
    assert extract_answer("think <answer> 1 </answer> done") == "1"
    assert extract_answer("<answer>a\nb</answer>") == "a\nb" and extract_answer("<answer></answer>") == ""
    assert extract_answer("<answer> 1 </answer> <answer>2</answer>") is None  # a hedge is no answer
    assert extract_answer("<answer>7") is None and extract_answer("7</answer>") is None
    assert extract_answer("</answer>7<answer>") is None and extract_answer("<answer><answer>7</answer>") is None
    assert extract_answer("<answer>" * 10**5 + "7</answer>") is None  # linear, not a backtracking regex


# ---------------------------------------------------------------- reward functions
@pytest.mark.parametrize("completion, reward", [
    ("<answer>72</answer>", 1.0), ("think... <answer> 72 </answer> trailing", 1.0),
    ("<answer>72", 0.5), ("<answer>1</answer><answer>2</answer>", 0.25),
    ("<answer>  </answer>", 0.25), ("</answer>72<answer>", 0.25), ("72</answer>", 0.25),
    ("<answer><answer>72</answer>", 0.25), ("72", 0.0), ("", 0.0), ("<Answer>72</Answer>", 0.0),
])
def test_format_reward_grades_tag_shape(completion, reward):
    assert format_reward("p", completion, "72") == reward


@pytest.mark.parametrize("completion, answer, reward", [
    ("<answer>72</answer>", "72", 1.0), ("<answer>$72.00</answer>", "72", 1.0),
    ("<answer>1,234</answer>", "1234", 1.0), ("<answer> 72. </answer>", "72", 1.0),
    ("<answer>\\boxed{\\frac{1}{2}}</answer>", "1/2", 1.0), ("<answer>0.5</answer>", "1/2", 1.0),
    ("<answer>50%</answer>", "50", 1.0), ("<answer>0.5</answer>", "50", 0.0),  # % is not /100
    ("48 + 24 = <answer>72</answer> since 48/2 = 24", "72", 1.0),  # work around the one pair is fine
    ("48/2 = 24, 48 + 24 = 72", "72", 0.0), ("so \\boxed{72}", "72", 0.0),  # no tags: no answer
    ("<answer>72 clips</answer>", "72", 0.0), ("<answer>48 + 24 = 72</answer>", "72", 0.0),  # not ONE number
    ("<answer>70 71 72</answer>", "72", 0.0), ("<answer>70 or 72</answer>", "72", 0.0),  # candidates listed
    ("<answer>72</answer><answer>72</answer>", "72", 0.0), ("<answer>70</answer><answer>72</answer>", "72", 0.0),
    ("<answer>72", "72", 0.0), ("72</answer>", "72", 0.0), ("</answer>72<answer>", "72", 0.0),  # malformed tags
    ("<Answer>72</Answer>", "72", 0.0), ("<answer><answer>72</answer>", "72", 0.0),
    ("<answer>" + "9" * 100_000 + "</answer>", "72", 0.0), ("<answer>72" + "0" * 60 + "</answer>", "72", 0.0),
    ("<answer>-72</answer>", "72", 0.0), ("<answer></answer>", "72", 0.0), ("", "72", 0.0),
])
def test_numeric_correct_hand_examples(completion, answer, reward):
    assert numeric_correct("p", completion, answer) == reward


def test_numeric_correct_is_not_fooled_by_echoing_the_prompt():
    prompt = NATALIA + "\nSolve the problem step by step."
    assert numeric_correct(prompt, prompt, "72") == 0.0
    assert numeric_correct(prompt, f"<answer>{NATALIA}</answer>", "72") == 0.0


def test_numeric_correct_raises_on_a_broken_reference_instead_of_scoring_zero():
    with pytest.raises(ValueError, match="not a number"):
        numeric_correct("p", "<answer>1</answer>", "seventy")


@pytest.mark.parametrize("prompt, completion, answer, reward", [
    ("12+7=", "19", "19", 1.0), ("12+7=", " 19\n", "19", 1.0), ("3-5=", "-2", "-2", 1.0), ("3-3=", "0", "0", 1.0),
    ("12+7=", "12+7=19", "19", 0.0), ("12+7=", "19=12+7", "19", 0.0),  # the prompt echoed around the answer
    ("0+7=", "///////7", "7", 0.0), ("8-5=", "tN/UO=><pad>;<PMT=N3!L", "3", 0.0),  # garbage around a digit
    ("12+7=", "19 20", "19", 0.0), ("12+7=", "19,19", "19", 0.0), ("12+7=", "1 9", "19", 0.0),  # several answers
    ("12+7=", "19.", "19", 0.0), ("12+7=", "019", "19", 0.0), ("12+7=", "+19", "19", 0.0),  # not as solve() writes it
    ("3-5=", "2", "-2", 0.0), ("3-5=", "- 2", "-2", 0.0), ("3-3=", "-0", "0", 0.0),
    ("12+7=", "<answer>19</answer>", "19", 0.0), ("12+7=", "91", "19", 0.0), ("12+7=", "", "19", 0.0),
    ("12+7=", "9" * 100_000, "19", 0.0), ("12+7=", "1" + "0" * 50, "1" + "0" * 50, 0.0),  # over 40 digits: refused
])
def test_int_correct_accepts_only_the_bare_integer(prompt, completion, answer, reward):
    assert int_correct(prompt, completion, answer) == reward


@pytest.mark.parametrize("expr, reward", [
    ("(3 + 5) * 3", 1.0), ("3 * (5 + 3)", 1.0), ("(3+5)*3 = 24", 1.0), ("((3 + 5)) * 3", 1.0),
    ("(3+5)*3 = 25", 0.0), ("(3+5)*3 = 24 = 24", 0.0), ("24 = (3+5)*3", 0.0),  # a wrong or backwards claim
    ("(3 + 5) * 3</answer><answer>(3 + 5) * 3", 0.0),  # two answers
    ("24", 0.0),  # echoes the target, uses no numbers
    ("3 5 3 24", 0.0), ("8 * 3", 0.0),  # 5 missing, 8 not given
    ("(3 + 5) * 3 * 3 / 3", 0.0),  # 3 reused
    ("(3 + 5) * 3 + 0", 0.0),  # an extra number
    ("3 * 5 + 3", 0.0),  # all numbers once, wrong value (18)
    ("(3 + 5) * 3.0", 0.0), ("3 / (5 - 5) * 3", 0.0),  # float literal; division by zero
    ("9**9**9", 0.0), ("10**100000", 0.0), ("(" * 10_000 + "24" + ")" * 10_000, 0.0),
    ("__import__('os').system('true')", 0.0), ("", 0.0),
])
def test_countdown_correct_hand_examples(expr, reward):
    assert countdown_correct("p", f"<answer>{expr}</answer>", CD24) == reward


def test_countdown_correct_needs_tags_and_ignores_an_echoed_prompt():
    assert countdown_correct("p", "(3 + 5) * 3", CD24) == 0.0
    problem = make_task("countdown", seed=0, eval_size=0).train_problem(0)
    assert "<answer>(1 + 2) * 3</answer>" in problem.prompt  # the prompt's own example tag
    assert countdown_correct(problem.prompt, problem.prompt, problem.answer) == 0.0


def test_overlong_penalty_is_zero_then_linear_to_minus_one():
    fn = overlong_penalty(10, 4)
    assert [fn("p", "x" * n, "a") for n in (0, 6, 7, 8, 10, 50)] == [0, 0, -0.25, -0.5, -1, -1]
    by_words = overlong_penalty(4, 2, length=lambda s: len(s.split()))
    assert by_words("p", "a b c", "a") == -0.5 and by_words("p", "abcdefgh", "a") == 0
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(4, 5)
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(4, 0)
    assert [overlong_penalty(4, 1)("p", "x" * n, "a") for n in (3, 4)] == [0, -1]  # the smallest buffer
    whole = overlong_penalty(4, 4)  # a buffer of the whole length is allowed: linear from the first character
    assert [whole("p", "x" * n, "a") for n in (0, 1, 4)] == [0, -0.25, -1]


# ---------------------------------------------------------------- safe evaluator
def test_safe_eval_is_exact_and_reports_literals():
    assert safe_eval("(3 + 5) * 3") == (24, [3, 5, 3])
    assert safe_eval("1/3 + 1/3 + 1/3") == (1, [1, 3, 1, 3, 1, 3])
    assert safe_eval("-(2 - 7) / 2") == (Fraction(5, 2), [2, 7, 2])
    assert safe_eval("6 × 4 ÷ 3") == (8, [6, 4, 3])


@pytest.mark.parametrize("src, reason", [
    ("9**9**9", "Pow"), ("10**100000", "Pow"),  # refused by operator, never computed
    ("(" * 10_000 + "1" + ")" * 10_000, "longer than"),  # refused before parsing
    ("9" * 30, "64 bits"), ("-" * 40 + "1", "depth"), ("1" + "+1" * 60, "nodes"),
    ("1 / (2 - 2)", "division by zero"), ("abs(-1)", "characters"), ("x", "characters"),
    ("1.5", "characters"), ("1 2", "SyntaxError"), ("05", "SyntaxError"), ("()", "Tuple"),
    ("2 (3)", "Call"), ("1 % 2", "characters"), ("+1", "UAdd"), ("1 // 2", "FloorDiv"),
])
def test_safe_eval_refuses_with_the_reason(src, reason):
    with pytest.raises(ExprError, match=reason):
        safe_eval(src)



@pytest.mark.parametrize("src, limit, fits", [
    ("1+1", "max_chars", 3), ("1+1", "max_nodes", 3), ("-(1)", "max_nodes", 2),  # -(1): UnaryOp, Constant
    ("1+1", "max_depth", 1), ("-(1)", "max_depth", 1),  # the operator at depth 0, its operands at 1
    ("(1+1)+1", "max_depth", 2), ("1+(1+1)", "max_depth", 2),  # either side's depth counts
])
def test_safe_eval_limits_are_inclusive(src, limit, fits):
    assert safe_eval(src, **{limit: fits})[0] == eval(src)
    with pytest.raises(ExprError, match="longer|nodes|depth"):
        safe_eval(src, **{limit: fits - 1})


def test_safe_eval_takes_literals_up_to_64_bits_and_every_allowed_character():
    assert safe_eval(str(2**64 - 1)) == (2**64 - 1, [2**64 - 1])
    with pytest.raises(ExprError, match="64 bits"):
        safe_eval(str(2**64))
    assert safe_eval("(0 + 1 - 2)\t* 3 / (4 + 5 * 6 + 7 - 8 - 9)")[0] == Fraction(-3, 24)

def test_safe_eval_catches_parser_errors_on_pathological_nesting():
    with pytest.raises(ExprError, match="SyntaxError"):  # parser's own nesting limit
        safe_eval("(" * 10_000 + "1" + ")" * 10_000, max_chars=10**6)
    with pytest.raises(ExprError, match="RecursionError|MemoryError"):  # parser stack runs out
        safe_eval("-" * 10_000 + "1", max_chars=10**6)
    with pytest.raises(ExprError, match="SyntaxError"):  # over int's 4300-digit limit
        safe_eval("9" * 5000, max_chars=10**6)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789+-*/() .%x×÷", max_size=60) | st.text(max_size=40))
def test_safe_eval_returns_a_fraction_or_refuses_never_anything_else(src):
    try:
        value, literals = safe_eval(src)
    except ExprError:
        return
    assert isinstance(value, Fraction) and all(type(n) is int for n in literals)


_leaf = st.integers(0, 50).map(lambda n: (str(n), Fraction(n)))


def _combine(children):
    def build(a, op, b):
        (ea, va), (eb, vb) = a, b
        if op == "/" and vb == 0:
            return (f"({ea}) + ({eb})", va + vb)
        ops = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
        return (f"({ea}) {op} ({eb})", ops[op](va, vb))
    return st.builds(build, children, st.sampled_from("+-*/"), children)


@settings(max_examples=200, deadline=None)
@given(st.recursive(_leaf, _combine, max_leaves=8))
def test_safe_eval_agrees_with_exact_fraction_arithmetic(pair):
    expr, value = pair
    assert safe_eval(expr, max_chars=10_000)[0] == value


# ---------------------------------------------------------------- procedural tasks
def test_countdown_problems_are_always_solved_by_their_own_solver():
    task = make_task("countdown", seed=3, eval_size=50)
    for p in task.eval_problems() + [task.train_problem(i) for i in range(250)]:
        ref = json.loads(p.answer)
        assert 3 <= len(ref["numbers"]) <= 4 and all(1 <= n <= 25 for n in ref["numbers"])
        assert str(ref["numbers"]) in p.prompt and f"equals {ref['target']}." in p.prompt
        assert task.score(p.prompt, task.solve(p), p.answer) == (
            pytest.approx(1.1), {"countdown_correct": 1.0, "format_reward": 1.0})


def test_countdown_targets_are_positive_integers_and_an_unsolvable_problem_is_refused():
    task, drawn = make_task("countdown", seed=1, eval_size=10), set()
    for p in [task.train_problem(i) for i in range(300)]:
        ref = json.loads(p.answer)
        # at most (a*b) + (c*d), each product capped at max_target
        assert type(ref["target"]) is int and 1 <= ref["target"] <= 2 * task.max_target
        assert 3 <= len(ref["numbers"]) <= 4 and all(1 <= n <= task.max_number for n in ref["numbers"])
        drawn.update(ref["numbers"])
    assert drawn == set(range(1, task.max_number + 1))
    with pytest.raises(ValueError, match="countdown problem has no solution"):
        task.solve(Problem("p", json.dumps({"target": 7, "numbers": [2, 2]}), key="k"))  # 4, 4, 0, 1 only


def test_solve_countdown_finds_exact_solutions_and_reports_none():
    assert safe_eval(solve_countdown([4, 7, 8, 8], 24))[0] == 24  # (7 - 8/8) * 4
    assert safe_eval(solve_countdown([3, 3, 8, 8], 24))[0] == 24  # 8 / (3 - 8/3): needs fractions
    assert solve_countdown([1, 1], 5) is None


def test_arith_defaults_are_tiny_single_digit_sums_in_the_char_vocabulary():
    task = make_task("arith", seed=0, eval_size=50)
    vocab = set("0123456789+-*/=() abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ<>/.,?!:")
    for p in task.eval_problems() + [task.train_problem(i) for i in range(300)]:
        a, op, b = p.prompt[0], p.prompt[1], p.prompt[2]
        assert len(p.prompt) == 4 and p.prompt[3] == "=" and set(p.prompt) <= vocab
        assert int(p.answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        assert task.solve(p) == p.answer and int_correct(p.prompt, task.solve(p), p.answer) == 1.0
        assert len(p.answer) + 1 <= task.max_new_tokens  # the number plus an end token fits


def test_arith_difficulty_knobs_keep_answers_integral():
    task = make_task("arith", seed=1, eval_size=20, max_operand=12, n_operands=3, ops="*/")
    for p in [task.train_problem(i) for i in range(200)]:
        assert p.prompt.count("*") + p.prompt.count("/") == 2
        assert safe_eval(p.prompt[:-1])[0] == int(p.answer) and task.correct(p, task.solve(p))


def test_arith_rejects_an_eval_split_that_starves_training():
    with pytest.raises(ValueError, match="--eval-size to 100 or less"):
        make_task("arith", seed=0, eval_size=101)  # 10 * 10 * 2 = 200 distinct problems


def test_arith_counts_its_problems_and_refuses_knobs_below_the_smallest_task():
    # four operands 0..2 and three signs between them: 3^4 * 2^3; the smallest task (a+b, 0..1) is allowed
    assert make_task("arith", seed=0, eval_size=1, max_operand=2, n_operands=4).n_distinct() == 81 * 8
    assert make_task("arith", seed=0, eval_size=1, max_operand=1, n_operands=2, ops="+").n_distinct() == 4
    for knobs in ({"max_operand": 0}, {"n_operands": 1}, {"ops": ""}, {"ops": "+%"}):
        with pytest.raises(ValueError, match="needs max_operand >= 1, n_operands >= 2 and ops from"):
            make_task("arith", seed=0, eval_size=1, **knobs)


@pytest.mark.parametrize("knobs", [{"n_operands": 34}, {"n_operands": 60, "ops": "+"}, {"max_operand": 2**70},
                                   {"max_operand": 10**15, "n_operands": 3, "ops": "*"}])
def test_arith_knobs_past_what_safe_eval_and_int_correct_take_are_refused_not_drawn_forever(knobs):
    """34 operands nest 33 deep, past safe_eval's 32: every draw raised ExprError, which generate() took
    for a division by zero and redrew forever. Three 16-digit factors made answers int_correct scores 0."""
    with pytest.raises(ValueError, match=r"n_operands <= 33 and max_operand \*\* n_operands < 10\*\*33"):
        make_task("arith", seed=0, eval_size=1, **knobs)
    for edge in ({"n_operands": 33}, {"max_operand": 99, "n_operands": 16, "ops": "*/"}):  # the largest ones
        task = make_task("arith", seed=0, eval_size=1, **edge)
        assert all(task.correct(p, task.solve(p)) for p in map(task.train_problem, range(50)))


@pytest.mark.parametrize("name, size", [("arith", 10 * 10 * 2), ("add", 21 * 21)])
def test_every_problem_of_a_procedural_task_is_drawn_operands_from_zero(name, size):
    task = make_task(name, seed=0, eval_size=50)
    keys = {p.key for p in task.eval_problems()} | {task.train_problem(i).key for i in range(5000)}
    assert task.n_distinct() == size and len(keys) == size  # 0+0 and the largest sums included

def test_arith_chain_answers_three_signed_digits_within_four_tokens():
    task = make_task("arith_chain", seed=0, eval_size=200)
    assert task.n_distinct() == 10 * 10 * 10 * 2 * 2  # three digits, two + or - signs
    for prompt, answer in [("3+5-2=", "6"), ("0-9-9=", "-18"), ("9+9+9=", "27"), ("7-7+0=", "0")]:
        p = Problem(prompt, answer, key=prompt[:-1])
        assert task.solve(p) == answer and task.correct(p, answer) and not task.correct(p, "1" + answer)
    for p in task.eval_problems() + [task.train_problem(i) for i in range(300)]:
        a, op1, b, op2, c, eq = p.prompt
        assert {a, b, c} <= set("0123456789") and {op1, op2} <= set("+-") and eq == "="
        signed = [int(a), int(b) if op1 == "+" else -int(b), int(c) if op2 == "+" else -int(c)]
        assert int(p.answer) == sum(signed) and len(p.answer) + 1 <= 4  # "-18" + end token: the config's budget


def test_arith_chain_held_out_chains_are_never_trained_on():
    task = make_task("arith_chain", seed=0, eval_size=200)
    eval_keys = {p.key for p in task.eval_problems()}
    train_keys = {task.train_problem(i).key for i in range(5000)}
    assert len(eval_keys) == 200 and not eval_keys & train_keys
    # uniform draws over the other 3,800 chains: about 3,800 * (1 - exp(-5000 / 3800)) = 2,781 distinct
    assert 2600 < len(train_keys) < 2980


@pytest.mark.parametrize("name, eval_size, n", [("arith", 100, 3000), ("countdown", 200, 3000)])
def test_train_problems_never_come_from_the_eval_split(name, eval_size, n):
    task = make_task(name, seed=7, eval_size=eval_size)
    eval_keys = {p.key for p in task.eval_problems()}
    assert len(eval_keys) == eval_size  # distinct
    assert not eval_keys & {task.train_problem(i).key for i in range(n)}


@pytest.mark.parametrize("name", ["arith", "countdown"])
def test_splits_depend_only_on_seed_index_and_eval_size(name):
    a, b = make_task(name, seed=5, eval_size=30), make_task(name, seed=5, eval_size=30)
    assert a.eval_problems() == b.eval_problems()
    # any call order gives the same problem per index: that is what makes sharding trivial
    backwards = [b.train_problem(i) for i in reversed(range(100))]
    assert [a.train_problem(i) for i in range(100)] == backwards[::-1]
    assert make_task(name, seed=6, eval_size=30).eval_problems() != a.eval_problems()
    assert make_task(name, seed=5, eval_size=40).eval_problems()[:30] == a.eval_problems()


def test_score_weights_and_breaks_down_each_reward():
    task = make_task("countdown", seed=0, eval_size=0)
    assert task.score("p", "<answer>(3 + 5", CD24) == (
        pytest.approx(0.05), {"countdown_correct": 0.0, "format_reward": 0.5})
    task.rewards = [(format_reward, 1.0), (format_reward, 2.0), (overlong_penalty(4, 2), 1.0)]
    total, parts = task.score("p", "<answer>1</answer>", CD24)
    assert parts == {"format_reward": 1.0, "format_reward_1": 1.0, "overlong_penalty": -1.0}
    assert total == pytest.approx(2.0)



def test_score_raises_a_judges_outage_unless_asked_to_drop_the_sample():
    warned = set()

    def judge(prompt, completion, answer):  # as a Judge raises it: a cause's kind, the kinds it warned of
        raise JudgeUnavailable(f"judge down ({completion})", "down", warned)

    task = make_task("countdown", seed=0, eval_size=0)
    task.rewards = [(format_reward, 1.0), (judge, 0.5)]
    with pytest.raises(JudgeUnavailable, match=r"^judge down \(<answer>1</answer>\); or pass --judge-down drop"):
        task.score("p", "<answer>1</answer>", CD24)
    with pytest.warns(UserWarning, match=r"^samples are dropped: judge down \(<answer>1</answer>\)$") as said:
        total, parts = task.score("p", "<answer>1</answer>", CD24, drop=True)
        task.score("p", "<answer>2</answer>", CD24, drop=True)  # another text, the same cause: said once
    assert len(said) == 1
    assert math.isnan(total) and parts["format_reward"] == 1.0 and math.isnan(parts["judge"])


@pytest.mark.parametrize("value, ok", [(None, None), (math.nan, None), (-math.inf, None), ("1", None),
                                       ([1.0], None), (True, 1.0), (3, 3.0), (0.25, 0.25)])
def test_a_reward_that_is_not_a_finite_number_stops_naming_its_function(value, ok):
    """A NaN once masked the whole group as a judge's missing score does, silently; None failed in the loop."""
    def mine(prompt, completion, answer):
        return value

    task = make_task("countdown", seed=0, eval_size=0)
    task.rewards = [(format_reward, 1.0), (mine, 2.0)]
    if ok is not None:
        assert task.score("p", "<answer>1</answer>", CD24) == (1.0 + 2 * ok, {"format_reward": 1.0, "mine": ok})
        return
    with pytest.raises(tasks.RewardError) as e:
        task.score("p", "<answer>1</answer>", CD24)
    assert str(e.value) == (f"reward mine returned {value!r} for the completion '<answer>1</answer>'; a reward "
                            "is a finite number within float32's range (0.0 for a wrong or malformed answer)")


@pytest.mark.parametrize("value, shown", [(10**400, "1" + "0" * 79), (-(10**400), "-1" + "0" * 78),
                                          (Fraction(10**400, 3), "Fraction(1" + "0" * 70),
                                          (10**5000, "a value too large to print (int)"),  # repr() raised ValueError
                                          (Fraction(10**5000, 3), "a value too large to print (Fraction)")],
                         ids=["int", "negative", "fraction", "past repr", "fraction past repr"])
def test_a_reward_past_a_floats_range_stops_naming_its_function_as_a_nan_does(value, shown):
    """10**400 raised a bare OverflowError from math.isfinite, naming neither the reward nor the fix."""
    task = make_task("countdown", seed=0, eval_size=0)
    task.rewards = [(lambda prompt, completion, answer: value, 1.0)]
    with pytest.raises(tasks.RewardError) as e:
        task.score("p", "<answer>1</answer>", CD24)
    assert str(e.value) == (f"reward <lambda> returned {shown} for the completion '<answer>1</answer>'; a "
                            "reward is a finite number within float32's range (0.0 for a wrong or malformed answer)")
    assert tasks.checked(2**127, "r", "c") == 2.0**127  # a huge int float32 holds still counts


@pytest.mark.parametrize("value", [1e39, -(2**128), 2.0**1023])
def test_a_reward_past_float32s_range_stops_the_run_as_it_would_be_inf_in_the_batch(value):
    """float32(1e39) is inf: its group's advantages were NaN and every such step was skipped, unexplained."""
    with pytest.raises(tasks.RewardError, match="within float32's range"):
        tasks.checked(value, "reward big", "c")


def test_a_reward_that_raises_shows_its_traceback_noting_the_completion_it_failed_on():
    def mine(prompt, completion, answer):
        return len(completion.split()[3])  # a bug: short completions have no fourth word

    task = make_task("countdown", seed=0, eval_size=0)
    task.rewards = [(mine, 1.0)]
    with pytest.raises(IndexError) as e:
        task.score("p", "<answer>1</answer>", CD24)
    assert e.value.__notes__ == ["in reward mine, scoring the completion '<answer>1</answer>'"]

# ---------------------------------------------------------------- dataset tasks
def test_dataset_rows_parse_to_exact_canonical_answers():
    task = mixed(eval_size=2)
    problems = task.eval_problems() + [task.train_problem(i) for i in range(7)]
    answers = {p.key[:20]: p.answer for p in problems}
    assert answers == {"Natalia sold clips t": "72", "A shop sold 1,000 pe": "1234",
                       "What is half of one?": "1/2", "A $5 toy is sold at ": "5/2",
                       "What percent of 8 is": "25/2", "What is 7 times 6?": "42",
                       "What is 100 minus 10": "-1", "What is 3 divided by": "3/4",
                       "What is 2 plus 2?": "4"}  # line 10 repeats line 1 (whitespace aside)
    p = next(p for p in problems if p.answer == "72")
    assert p.prompt.startswith(NATALIA) and "<answer></answer>" in p.prompt
    assert task.correct(p, task.solve(p)) and not task.correct(p, p.prompt)


def test_malformed_rows_are_skipped_with_file_and_line():
    with pytest.warns(UserWarning) as record:
        task = make_task("gsm8k", seed=0, eval_size=2, data=MIXED)
    message = str(record[0].message)
    for line in (3, 5, 8, 15):
        assert f"gsm8k_mixed.jsonl:{line} " in message
    assert [s.split(" (")[0].rsplit(":", 1)[1] for s in task.skipped] == ["3", "5", "8", "15"]
    assert "invalid JSON" in task.skipped[0] and "'question'" in task.skipped[1]
    assert "'about minus ten' is not a number" in task.skipped[2]
    assert "not a JSON object" in task.skipped[3]


def test_data_lines_are_read_as_jsonl_bytes(tmp_path):
    """A line that is not UTF-8 is one malformed row (it stopped the whole file); U+2028 inside a question
    does not end its line (str.splitlines split it); an editor's BOM does not spoil the first row."""
    rows = plus_one_rows(4)
    lines = [json.dumps(r, ensure_ascii=False).encode() for r in rows]
    lines[0] = b"\xef\xbb\xbf" + lines[0]  # BOM
    lines[1] = json.dumps({"question": "Two\u2028lines: 5 + 5?", "answer": "10"}, ensure_ascii=False).encode()
    lines[2] = b'{"question": "caf\xe9 bill: 2 + 2?", "answer": "4"}'  # Latin-1, not UTF-8
    lines.append(json.dumps({"question": 7, "answer": "7"}).encode())
    (path := tmp_path / "rows.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    with pytest.warns(UserWarning):
        task = make_task("gsm8k", seed=0, eval_size=1, data=str(path))
    assert task.skipped == [f"{path}:3 (not UTF-8 text; save the file as UTF-8)",
                            f"{path}:5 (field 'question' is missing, empty or not text)"]
    problems = task.eval_problems() + [task.train_problem(i) for i in range(2)]
    assert sorted(p.key for p in problems) == ["Two lines: 5 + 5?", "What is 0 plus 1?", "What is 3 plus 1?"]
    assert any(p.prompt.startswith("Two\u2028lines: 5 + 5?\n") for p in problems)


def test_a_bom_alone_on_the_first_line_is_no_malformed_row(tmp_path):
    """An editor that writes a BOM and then a newline (the file's first row on line 2): the BOM line was
    'invalid JSON' at line 1, which --bad-rows error made a stop."""
    lines = [json.dumps(r).encode() for r in plus_one_rows(4)]
    (path := tmp_path / "rows.jsonl").write_bytes(b"\xef\xbb\xbf\n" + b"\n".join(lines) + b"\n")
    task = make_task("gsm8k", seed=0, eval_size=1, data=str(path), bad_rows="error")
    assert task.skipped == [] and sorted(task.where.values()) == [f"{path}:{n}" for n in (2, 3, 4, 5)]


def test_malformed_rows_are_rejected_with_file_line_and_fix():
    match = r"gsm8k_mixed.jsonl:3: malformed row \(invalid JSON.*--bad-rows skip"
    with pytest.raises(ValueError, match=match):
        make_task("gsm8k", seed=0, eval_size=2, data=MIXED, bad_rows="error")


def test_dataset_split_is_disjoint_deterministic_and_cycles():
    task = mixed(eval_size=3)
    eval_keys = {p.key for p in task.eval_problems()}
    train = [task.train_problem(i) for i in range(12)]
    assert len(eval_keys) == 3 and not eval_keys & {p.key for p in train}
    assert len({p.key for p in train}) == 6 and train[:6] == train[6:]  # 9 unique rows - 3 eval
    assert mixed(eval_size=3).eval_problems() == task.eval_problems()
    with pytest.warns(UserWarning):
        other = [make_task("gsm8k", seed=s, eval_size=3, data=MIXED) for s in (1, 2)]
    assert other[0].eval_problems() != other[1].eval_problems()


def test_dataset_eval_size_must_leave_training_rows():
    with pytest.raises(ValueError, match="^9 usable rows: --eval-size 9 leaves none to train on; lower it to 4 or less$"):
        mixed(eval_size=9)
    with pytest.raises(ValueError, match="0 usable rows: --eval-size 1 leaves none to train on; add rows$"):  # no eval size helps
        make_task("gsm8k", seed=0, eval_size=1, data=os.devnull)



def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_clean_file_loads_silently_and_many_bad_rows_are_listed_twenty_at_most(tmp_path):
    good = plus_one_rows(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning at all for a file without a bad row
        task = make_task("gsm8k", seed=0, eval_size=1, data=write_rows(tmp_path / "ok.jsonl", good))
    assert task.skipped == []
    for bad, more in ((20, False), (21, True)):  # twenty are listed in full, more end in " ..."
        path = write_rows(tmp_path / "bad.jsonl", [{"question": f"q{i}"} for i in range(bad)] + good)
        with pytest.warns(UserWarning, match=f"skipped {bad} malformed rows") as record:
            task = make_task("gsm8k", seed=0, eval_size=1, data=path)
        shown = str(record[0].message)
        assert f"{path}:20 (missing field 'answer')" in shown and f"{path}:21 " not in shown
        assert shown.endswith(" ...") == more and len(task.skipped) == bad


def test_a_long_answer_that_is_not_a_number_is_named_by_its_last_40_characters(tmp_path):
    answer = "x" * 50 + "the answer is forty-two and no digits at all"
    path = write_rows(tmp_path / "rows.jsonl", [{"question": "q", "answer": answer}])
    with pytest.raises(ValueError, match="rows.jsonl:1: malformed row") as e:
        make_task("gsm8k", seed=0, eval_size=1, data=path, bad_rows="error")
    assert f"(answer {answer[-40:]!r} is not a number)" in str(e.value)


def test_a_json_integer_past_pythons_4300_digits_is_a_malformed_row_that_names_no_python_setting(tmp_path):
    """json.loads raises a bare ValueError there, whose text advised sys.set_int_max_str_digits(): no fix
    for a user of the command line, and answers are 40 digits at most anyway."""
    (path := tmp_path / "rows.jsonl").write_text('{"question": "q", "answer": ' + "9" * 5000 + "}\n")
    with pytest.raises(ValueError) as e:
        make_task("gsm8k", seed=0, eval_size=1, data=str(path), bad_rows="error")
    assert str(e.value) == (f"{path}:1: malformed row (invalid JSON: Exceeds the limit (4300 digits) for "
                            "integer string conversion: value has 5000 digits); fix or delete that line, or "
                            "pass --bad-rows skip to drop such rows")


def test_a_row_nested_past_pythons_recursion_limit_is_one_malformed_row_not_a_crash(tmp_path):
    """json.loads raises RecursionError on 100,000 nested brackets: no ValueError, so it escaped the row
    loop and stopped the run with a traceback, under --bad-rows skip too."""
    rows = [json.dumps(r) for r in plus_one_rows(3)]
    rows[1] = '{"question": "q", "answer": ' + "[" * 100_000 + "]" * 100_000 + "}"
    (path := tmp_path / "rows.jsonl").write_text("\n".join(rows) + "\n")
    with pytest.warns(UserWarning, match="skipped 1 malformed rows"):
        task = make_task("gsm8k", seed=0, eval_size=1, data=str(path))
    assert task.skipped == [f"{path}:2 (invalid JSON: maximum recursion depth exceeded while decoding a JSON "
                            "array from a unicode string)"]


def test_a_json_number_answer_in_exponent_form_reads_as_the_decimal_it_is(tmp_path):
    """json.dumps writes 0.00001 as 1e-05 (and 1e+20, 1.5e-07): each row was "not a number"."""
    answers = {"a": 0.00001, "b": 1e20, "c": 1.5e-07, "d": 0.75, "e": 72.0, "f": 4}
    path = write_rows(tmp_path / "rows.jsonl", [{"question": q, "answer": a} for q, a in answers.items()])
    assert "1e-05" in Path(path).read_text() and "1e+20" in Path(path).read_text()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no row is malformed
        task = make_task("gsm8k", seed=0, eval_size=1, data=path)
    assert {p.key: p.answer for p in task._eval + task._train} == {
        "a": "1/100000", "b": "100000000000000000000", "c": "3/20000000", "d": "3/4", "e": "72", "f": "4"}


def test_a_question_repeated_with_another_answer_is_a_malformed_row_and_a_same_one_merges(tmp_path):
    """The second answer was dropped in silence: which of two references is right is the user's call."""
    rows = [*plus_one_rows(2), {"question": "What is 0  plus 1?", "answer": "#### 1"},  # the same: merged
            {"question": " What is 0 plus 1?", "answer": "3"}]  # line 4: another answer to line 1's question
    path = write_rows(tmp_path / "rows.jsonl", rows)
    why = f"question already at {path}:1 with answer '1'"
    with pytest.warns(UserWarning, match=f"^gsm8k: skipped 1 malformed rows: {re.escape(path)}:4 \\("):
        task = make_task("gsm8k", seed=0, eval_size=1, data=path)
    assert task.skipped == [f"{path}:4 ({why})"]
    assert sorted((p.key, p.answer) for p in task._eval + task._train) == [("What is 0 plus 1?", "1"),
                                                                         ("What is 1 plus 1?", "2")]
    with pytest.raises(ConfigError) as e:
        make_task("gsm8k", seed=0, eval_size=1, data=path, bad_rows="error")
    assert str(e.value) == (f"{path}:4: malformed row ({why}); fix or delete that line, or pass --bad-rows "
                            "skip to drop such rows")


@pytest.mark.parametrize("usable, fix", [(1, "add rows"), (2, "lower it to 1 or less")])
def test_too_few_rows_for_the_eval_split_name_the_fix_that_helps(tmp_path, usable, fix):
    rows = plus_one_rows(usable)
    with pytest.raises(ValueError, match=rf"^{usable} usable rows: --eval-size {usable} leaves none to train on; {fix}$"):
        make_task("gsm8k", seed=0, eval_size=usable, data=write_rows(tmp_path / "rows.jsonl", rows))

def test_missing_datasets_package_says_to_pass_data(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ValueError, match=r"^the hub's rows need the datasets package: pip install -e '\.\[hub\]', or "
                                         r"pass --data FILE$"):
        make_task("gsm8k", seed=0, eval_size=2)  # refused by data_problem, before any row is read
    with pytest.raises(ValueError, match=r"pip install datasets, or pass a local file with --data"):
        tasks.GSM8K(seed=0, eval_size=2)  # a task built directly says so when it reads the hub


def test_unreachable_hub_says_to_pass_data(monkeypatch):
    def load_dataset(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.setattr(tasks, "hub_out_of_reach", lambda: False)  # e.g. a proxy that cannot reach it
    with pytest.raises(ValueError, match=r"could not load 'openai/gsm8k'.*ConnectionError.*--data"):
        make_task("gsm8k", seed=0, eval_size=2)


def test_a_hub_out_of_reach_stops_at_once_unless_hf_hub_offline_reads_the_cache(monkeypatch, hub_out_of_reach):
    """Offline (no DNS), datasets' hub client retried for 24 s before its error."""
    from huggingface_hub import constants
    asked = []

    def load_dataset(path, config, split):
        asked.append(path)
        return [{"question": f"What is {i} plus 1?", "answer": f"... #### {i + 1}"} for i in range(5)]
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    with pytest.raises(ValueError, match=r"^could not load 'openai/gsm8k' from the Hugging Face hub \(ConnectionError: "
                       r"it takes no connection; HF_HUB_OFFLINE=1 reads rows a run cached\); pass a local file "
                       r"with --data path/to/gsm8k\.jsonl"):
        make_task("gsm8k", seed=0, eval_size=2)
    assert asked == []
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # datasets reads the rows it cached
    assert len(make_task("gsm8k", seed=0, eval_size=2).eval_problems()) == 2 and asked == ["openai/gsm8k"]


def test_hub_rows_go_through_the_same_validation(monkeypatch):
    calls = []
    rows = [{"question": f"What is {i} plus 1?", "answer": f"... #### {i + 1}"} for i in range(5)]
    rows.insert(2, {"question": "broken", "answer": "#### ?"})

    def load_dataset(path, config, split):
        calls.append((path, config, split))
        return rows
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.setattr(tasks, "hub_out_of_reach", lambda: False)
    with pytest.warns(UserWarning, match=r"openai/gsm8k\[train\]:row 2 "):
        task = make_task("gsm8k", seed=0, eval_size=1)
    assert calls == [("openai/gsm8k", "main", "train")]
    assert len({task.train_problem(i).key for i in range(10)}) == 4  # 5 good rows - 1 eval
    with pytest.warns(UserWarning, match="row 2"):
        make_task("math", seed=0, eval_size=1)
    assert calls[-1] == ("DigitalLearningGmbH/MATH-lighteval", "default", "train")


# ---------------------------------------------------------------- registry and evaluation
@pytest.mark.parametrize("typo, suggestion", [("countdwn", "countdown"), ("gsm8", "gsm8k"),
                                              ("arithmetic", "arith"), ("Math", "math")])
def test_make_task_suggests_the_closest_name(typo, suggestion):
    with pytest.raises(ValueError, match=f"did you mean '{suggestion}'"):
        make_task(typo, seed=0, eval_size=1)


def test_make_task_checks_its_arguments():
    with pytest.raises(ValueError, match="drop --data"):
        make_task("arith", seed=0, eval_size=1, data=MIXED)
    with pytest.raises(ValueError, match="'skip' or 'error'"):
        make_task("gsm8k", seed=0, eval_size=1, data=MIXED, bad_rows="ignore")
    with pytest.raises(TypeError):
        make_task("arith", seed=0, eval_size=1, max_operandd=5)
    assert make_task("arith", seed=0, eval_size=1, max_operand=99).max_operand == 99
    assert set(tasks.TASKS) == {"add", "arith", "arith_chain", "countdown", "gsm8k", "math"}


@pytest.mark.parametrize("n, c, k, expected", [
    (10, 0, 1, 0.0), (10, 10, 1, 1.0), (10, 3, 1, 0.3), (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2)
    (4, 1, 4, 1.0), (100, 1, 10, 0.1), (3, 1, 2, 2 / 3),  # 1 - C(99,10)/C(100,10) = 1 - 90/100
])
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


@pytest.mark.parametrize("n, c, k", [(5, 6, 1), (5, 1, 0), (5, 1, 6), (5, -1, 1)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k needs"):
        pass_at_k(n, c, k)


def greedy_accuracy(task, problems, completions) -> float:  # an eval's score of greedy completions
    hits = [task.correct(p, c) for p, c in zip(problems, completions, strict=True)]
    if not hits:
        raise ValueError("greedy_accuracy needs at least one problem")
    return sum(hits) / len(hits)


def test_greedy_accuracy_counts_correctness_reward_hits():
    task = make_task("arith", seed=0, eval_size=4)
    problems = task.eval_problems()
    completions = [task.solve(p) for p in problems[:3]] + ["x"]
    assert greedy_accuracy(task, problems, completions) == 0.75
    with pytest.raises(ValueError):
        greedy_accuracy(task, problems, completions[:2])
    with pytest.raises(ValueError, match="at least one"):
        greedy_accuracy(task, [], [])


def test_problem_is_an_immutable_value():
    p = Problem("1+1=", "2", "1+1")
    assert p == Problem("1+1=", "2", "1+1") and hash(p) == hash(Problem("1+1=", "2", "1+1"))
    with pytest.raises(ConfigError, match=r"^a Problem's prompt, answer and key are str \(of a number too\)"):
        Problem("1+1=", 2, "1+1")  # a user's generate(): one line (was a ValueError's traceback)


def test_reward_names_are_never_the_totals_reward_mean_or_reward_std():
    """A reward named std replaced the logged reward_std of the totals with its own value."""
    fns = [types.SimpleNamespace(__name__=n) for n in ("mean", "std", "same", "same")]
    assert tasks.reward_names([(fn, 1.0) for fn in fns]) == ["mean_0", "std_1", "same", "same_3"]
    assert tasks.reward_names([(lambda p, c, a: 0.0, 1.0), (object(), 1.0)]) == ["<lambda>", "reward1"]


def test_the_docstring_example_adds_a_task_with_one_class_and_one_entry(monkeypatch):
    monkeypatch.setattr(tasks, "TASKS", dict(tasks.TASKS))  # the example writes to the registry
    example = textwrap.dedent(tasks.__doc__.split("registry entry:")[1])
    exec(example, {**vars(tasks)})  # noqa: S102 - our own docstring, run as documentation
    task = make_task("parity", seed=0, eval_size=10)
    p = task.train_problem(0)
    assert p.key not in {q.key for q in task.eval_problems()}
    assert task.score(p.prompt, task.solve(p), p.answer) == (1.0, {"int_correct": 1.0})


def test_adding_a_reward_to_one_task_leaves_the_class_alone():
    task = make_task("countdown", seed=0, eval_size=0)
    task.rewards.append((overlong_penalty(100, 20), 1.0))
    assert len(make_task("countdown", seed=0, eval_size=0).rewards) == 2


class Three(tasks.ProceduralTask):
    """A task of three distinct problems."""

    name = "three"

    def generate(self, rng):
        k = str(rng.randint(1, 3))
        return Problem(k, k, key=k)


def test_an_eval_split_that_holds_every_problem_is_refused_when_the_task_is_built():
    # before: a RuntimeError at the first step; then "10,000 draws all hit the eval split", no size named
    with pytest.raises(ValueError, match=r"^found only 3 distinct problems; --eval-size 3 leaves too few to "
                                         r"train on; lower it to 1 or less$"):
        Three(eval_size=3)
    task = Three(eval_size=2)  # one problem left to train on: every draw is that one
    (left,) = {"1", "2", "3"} - {p.key for p in task.eval_problems()}
    assert {task.train_problem(i).key for i in range(20)} == {left}
    with pytest.raises(ValueError, match="found only 3 distinct problems; --eval-size 4 leaves too few "):
        Three(eval_size=4)


def test_a_task_whose_problems_are_malformed_or_all_one_is_refused_when_built_naming_the_fix():
    """A tuple failed with "'tuple' object has no attribute 'key'"; an int answer trained silently (and broke
    numeric rewards later); one key for all advised "lower --eval-size to 0 or less", which validate refuses."""
    class Odd(tasks.ProceduralTask):
        def __init__(self, make, **kw):
            self.make = make
            super().__init__(**kw)

        def generate(self, rng):
            return self.make(str(rng.randint(1, 9)))

    # the first draw of seed 0 is 4: random.Random("0:eval:0").randint(1, 9)
    with pytest.raises(ValueError, match=r"^Odd.generate\(\) returned \('4', '4'\), not a tasks.Problem$"):
        Odd(lambda k: (k, k), eval_size=4)
    with pytest.raises(ValueError, match=r"^a Problem's prompt, answer and key are str \(of a number too\): "
                                         r"Problem\(prompt='4', answer=4, key='4'\)$"):
        Odd(lambda k: Problem(k, int(k), key=k), eval_size=4)
    with pytest.raises(ValueError, match=r"^found only 1 distinct problems; generate\(\) must vary "
                                         r"Problem.key \(the split needs 5\)$"):
        Odd(lambda k: Problem(k, k, key="same"), eval_size=4)
    assert len(Odd(lambda k: Problem(k, k, key=k), eval_size=4).eval_problems()) == 4
    with pytest.raises(ValueError, match=r"^found only 2 distinct problems; --eval-size 2 leaves too few to train "
                                         r"on; lower it to 1 or less$"):  # two: one held out, one to train on
        Odd(lambda k: Problem(k, k, key=str(int(k) % 2)), eval_size=2)


def test_an_eval_split_past_the_cap_or_past_the_problems_a_task_holds_is_refused_at_once():
    """countdown --eval-size 100000000 generated problems until memory ran out; sql --eval-size 100000 drew
    10^7 problems from its few hundred (100 draws per problem asked) before it said how many it had."""
    with pytest.raises(ValueError, match=r"^eval_size=100000001: 100000 at most; lower --eval-size$"):
        make_task("countdown", seed=0, eval_size=100_000_001)
    draws = []

    class Counted(Three):
        def generate(self, rng):
            draws.append(1)
            return super().generate(rng)

    with pytest.raises(ValueError, match=r"^found only 3 distinct problems; --eval-size 100000 leaves too few "
                                         r"to train on; lower it to 1 or less$"):
        Counted(eval_size=100_000)
    assert 1000 < len(draws) <= 1000 + 3 + 20  # 1,003 in a row found nothing new; the 3 keys came within 20


def test_make_task_refuses_a_data_path_without_a_file_and_data_for_a_task_that_makes_its_own(tmp_path):
    with pytest.raises(ValueError, match=f"^no file at {tmp_path}/no.jsonl; fix the --data path, or drop it"):
        make_task("gsm8k", seed=0, eval_size=1, data=str(tmp_path / "no.jsonl"))
    with pytest.raises(ValueError, match="^no file at"):  # a directory
        make_task("math", seed=0, eval_size=1, data=str(tmp_path))
    with pytest.raises(ValueError, match="^this task generates its own problems; drop --data$"):
        make_task("arith", seed=0, eval_size=1, data=str(tmp_path / "no.jsonl"))
