"""Throughput of the text environments without a model, and the sandbox's cost per call.

    python bench/envs.py [--problems 16] [--group-size 4] [--calls 30]

A scripted policy (tests/test_envs.py) plays each environment: one wrong or exploratory turn,
then the right answer, so every episode takes two turns and runs the environment's tool once
(countdown: the calculator; python_tool: the sandbox; sql: a query on SQLite). Episodes per
second is for a whole rollout_multiturn call: tokenizing, env steps (in threads), collation.
"""
import argparse
import json
import os
import re
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # tests/: the scripted policy and its helpers

import envs  # noqa: E402
import rollouts  # noqa: E402
import sandbox  # noqa: E402
from tasks import solve_countdown  # noqa: E402
from test_envs import ScriptedPolicy, chat_tokenizer  # noqa: E402


def first_turn(text: str) -> bool:
    return text.count("<|im_start|>assistant") == 1


def countdown_script(problems):
    def script(text):
        numbers, target = re.search(r"numbers \[([\d, ]+)\], create an equation that equals (\d+)", text).groups()
        numbers = [int(n) for n in numbers.split(",")]
        if first_turn(text):
            return f"<answer>{' + '.join(map(str, numbers))} + 1</answer>"  # always wrong: one extra 1
        return f"<answer>{solve_countdown(numbers, int(target))}</answer>"
    return script


def python_script(problems):
    answers = {p.prompt.split("\n")[0]: p.answer for p in problems}

    def script(text):
        if first_turn(text):
            return f"```python\nprint({answers[next(q for q in answers if q in text)]})\n```"
        printed = re.findall(r"stdout:\n(\S+)", text)[-1]
        return f"<answer>{printed}</answer>"
    return script


def sql_script(problems):
    golds = {p.key.split(": ", 1)[1]: json.loads(p.answer)["gold"] for p in problems}

    def script(text):
        gold = next(g for q, g in golds.items() if f"Question: {q}\n" in text)
        return f"```sql\n{gold}\n```" if first_turn(text) else f"<answer>{gold}</answer>"
    return script


SCRIPTS = {"countdown_multiturn": countdown_script, "python_tool": python_script, "sql": sql_script}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--calls", type=int, default=30, help="sandbox calls for the overhead median (>= 20)")
    args = ap.parse_args()
    for flag, value, least in (("--problems", args.problems, 1), ("--group-size", args.group_size, 1),
                               ("--calls", args.calls, 2)):  # 2: the fewest the p10 / p90 quantiles take
        if value < least:
            ap.exit(2, f"error: {flag} {value}: need at least {least}\n")
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])  # 2 cores, inherited by the sandboxes too
    print(f"load average {os.getloadavg()[0]:.1f} on {len(os.sched_getaffinity(0))} cores")
    tok = chat_tokenizer()
    python, flags, uid_base = sandbox.sandbox_plan("strict")
    print(f"sandbox: {python}, unshare flags {flags:#x}, {'a uid per run' if uid_base else 'no uid drop'}")
    print(f"{'environment':<22}{'episodes':>9}{'seconds':>9}{'episodes/s':>12}{'solved':>8}{'turns':>7}")
    for name, make_script in SCRIPTS.items():
        env_cls = envs.TEXT_ENVS[name]
        problems = env_cls.task(seed=0, eval_size=args.problems).eval_problems()
        policy = ScriptedPolicy(tok, make_script(problems))
        start = time.perf_counter()
        batch = rollouts.rollout_multiturn(policy, env_cls, problems, args.group_size, max_turns=3,
                                           max_new_tokens=512, max_len=8192)
        took = time.perf_counter() - start
        m, n = {k: v.mean().item() for k, v in batch.stats.items()}, len(problems) * args.group_size
        print(f"{name:<22}{n:>9}{took:>9.2f}{n / took:>12.1f}{m['solved']:>8.2f}{m['turns']:>7.2f}")
    for code in ("pass", "print(sum(range(10**6)))"):
        times, cpu = [], 0.0
        for _ in range(args.calls):
            start, used = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
            r = sandbox.run_python(code)
            times.append((time.perf_counter() - start) * 1000)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)  # CPU time does not grow on a busy machine
            cpu += (after.ru_utime + after.ru_stime - used.ru_utime - used.ru_stime) * 1000 / args.calls
            assert r.returncode == 0, r.stderr
        q = statistics.quantiles(times, n=10)
        print(f"run_python({code!r}): median {statistics.median(times):.1f} ms, p10 {q[0]:.1f}, p90 {q[-1]:.1f}, "
              f"CPU {cpu:.1f} ms per call, over {args.calls} calls")


if __name__ == "__main__":
    main()
