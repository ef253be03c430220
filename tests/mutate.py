"""Mutation testing: do the tests notice when the code is wrong? Not part of the suite; run by hand.

    python tests/mutate.py algos.py tests/test_algos.py [--only grpo,rloo] [--jobs 2] [--again survivors.json]

Each mutant changes one thing in one function (an operator, a comparison, a constant, a branch, a raise, a
return value), is spliced back into the module in a copy of the working tree, and the given tests run on it.
A mutant the tests pass on "survives": either the tests miss a behaviour, or the change does not alter one
(an equivalent mutant: a default argument every caller overrides, `x[:, :1]` vs `x[:, :2]` of zeros).
Survivors are printed and saved as JSON, which --again reruns after the tests have been strengthened.
"""
import argparse
import ast
import concurrent.futures
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BINARY = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.Pow: ast.Mult,
          ast.FloorDiv: ast.Div, ast.Mod: ast.FloorDiv}
COMPARE = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
           ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}


def _set(field, value):
    return lambda node: setattr(node, field, value(node))


def _swap_compare(k):
    def swap(node):
        node.ops[k] = COMPARE[type(node.ops[k])]()
    return swap


def sites(fn: ast.AST):
    """(index of the node in ast.walk order, description, line, edit(node) or "unwrap"/"drop")."""
    for i, n in enumerate(ast.walk(fn)):
        if isinstance(n, (ast.BinOp, ast.AugAssign)) and type(n.op) in BINARY:
            yield i, f"{type(n.op).__name__}->{BINARY[type(n.op)].__name__}", n.lineno, \
                _set("op", lambda m: BINARY[type(m.op)]())
        if isinstance(n, ast.Compare):
            for k, op in enumerate(n.ops):
                if type(op) in COMPARE:
                    yield i, f"{type(op).__name__}->{COMPARE[type(op)].__name__}", n.lineno, _swap_compare(k)
        if isinstance(n, ast.BoolOp):
            other = ast.Or if isinstance(n.op, ast.And) else ast.And
            yield i, "and<->or", n.lineno, _set("op", lambda m, other=other: other())
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.Not, ast.USub)):
            yield i, f"drop {type(n.op).__name__}", n.lineno, "unwrap"
        if isinstance(n, ast.Constant) and type(n.value) in (int, float):
            yield i, f"{n.value}->{n.value + 1}", n.lineno, _set("value", lambda m: m.value + 1)
            if n.value:
                yield i, f"{n.value}->0", n.lineno, _set("value", lambda m: 0)
        if isinstance(n, ast.Constant) and type(n.value) is bool:
            yield i, f"{n.value}->{not n.value}", n.lineno, _set("value", lambda m: not m.value)
        if isinstance(n, ast.If):
            for always in (True, False):
                yield i, f"if {always}", n.lineno, _set("test", lambda m, a=always: ast.Constant(a))
        if isinstance(n, ast.Raise):
            yield i, "drop raise", n.lineno, "drop"
        if isinstance(n, ast.Return) and not (n.value is None or isinstance(n.value, ast.Constant)):
            yield i, "return None", n.lineno, _set("value", lambda m: ast.Constant(None))


def mutate(fn: ast.AST, index: int, edit) -> ast.AST:
    fn = copy.deepcopy(fn)
    target = list(ast.walk(fn))[index]
    if callable(edit):
        edit(target)
        return fn
    new = target.operand if edit == "unwrap" else ast.Pass()
    for parent in ast.walk(fn):
        for field, value in ast.iter_fields(parent):
            if value is target:
                setattr(parent, field, new)
            elif isinstance(value, list) and any(v is target for v in value):
                value[[v is target for v in value].index(True)] = new
    return fn


def mutants(source: str, only: set[str] | None):
    """(function, line, description, the module's new source) for every mutant of every top-level function
    and method (nested functions are mutated as part of theirs), the rest of the file left as written."""
    lines, tree = source.splitlines(keepends=True), ast.parse(source)
    outer = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    nested = {id(m) for f in outer for m in ast.walk(f) if m is not f and m in outer}
    for fn in outer:
        if id(fn) in nested or (only and fn.name not in only):
            continue
        start = min([fn.lineno] + [d.lineno for d in fn.decorator_list]) - 1
        indent = " " * (len(lines[fn.lineno - 1]) - len(lines[fn.lineno - 1].lstrip()))
        for index, what, line, edit in sites(fn):
            body = textwrap.indent(ast.unparse(mutate(fn, index, edit)), indent) + "\n"
            yield fn.name, line, what, "".join(lines[:start]) + body + "".join(lines[fn.end_lineno:])


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("module", help="a library file, e.g. algos.py")
    ap.add_argument("tests", nargs="+", help="pytest arguments, e.g. tests/test_algos.py -k grpo")
    ap.add_argument("--only", default="", help="comma-separated function names (default: all)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=120, help="seconds: a mutant that hangs counts as caught")
    ap.add_argument("--again", help="a survivors file: run only those mutants")
    ap.add_argument("--out", default="survivors.json")
    args = ap.parse_args(argv)
    todo = list(mutants((ROOT / args.module).read_text(), set(filter(None, args.only.split(","))) or None))
    if args.again:
        keep = {tuple(s) for s in json.loads(Path(args.again).read_text())}
        todo = [m for m in todo if m[:3] in keep]
    print(f"{len(todo)} mutants of {args.module}", flush=True)
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    files = listed.stdout.split()
    copies = [tempfile.mkdtemp(prefix="mutate-") for _ in range(args.jobs)]
    for d in copies:  # the working tree as it is now: edited tests included
        subprocess.run(["cp", "--parents", *files, d], cwd=ROOT, check=True)
        os.symlink(ROOT / ".venv", Path(d) / ".venv")

    def run(job):
        k, (name, line, what, source) = job
        d = copies[k % args.jobs]  # job k runs in copy k mod jobs: the pool never runs two in one copy
        (Path(d) / args.module).write_text(source)
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
               *args.tests]
        try:
            passed = subprocess.run(cmd, cwd=d, capture_output=True, timeout=args.timeout).returncode == 0
        except subprocess.TimeoutExpired:
            passed = False  # hung: the tests notice (CI's own timeout would)
        (Path(d) / args.module).write_text((ROOT / args.module).read_text())
        return [name, line, what], passed

    survivors = []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for k in range(0, len(todo), args.jobs):  # one round of `jobs` mutants at a time, one per copy
            for mutant, passed in pool.map(run, enumerate(todo[k:k + args.jobs], k)):
                if passed:
                    survivors.append(mutant)
                    print("survived {}:{} {}".format(*mutant), flush=True)
    for d in copies:
        shutil.rmtree(d)
    print(f"{len(todo) - len(survivors)} of {len(todo)} killed, {len(survivors)} survived")
    Path(args.out).write_text(json.dumps(survivors, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
