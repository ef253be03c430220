"""The attack suite against a live trainer: a real `python train.py --role trainer` process with the
tiny model and one local worker on 127.0.0.1, attacked over HTTP as a hostile client would, plus
the sandbox escapes and runaway SQL a hostile model would try. Prints one table row per attack:
attack | expected | observed | pass. Not part of the test suite (about 3 minutes on 2 cores).

    python bench/attacks.py
"""
import argparse
import os
import pickle
import re
import secrets
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
import rundir  # noqa: E402
import sandbox  # noqa: E402
import serve  # noqa: E402
import train  # noqa: E402
import transport  # noqa: E402
from envs import sql_database  # noqa: E402
from flood import flood  # noqa: E402
from modeldir import build_tiny_model  # noqa: E402
from sandbox_escapes import escapes  # noqa: E402

TOKEN = secrets.token_urlsafe(24)
ROWS: list[tuple[str, str, str, bool]] = []


def row(attack: str, expected: str, observed: str, ok: bool):
    ROWS.append((attack, expected, observed, ok))
    print(f"  {'pass' if ok else 'FAIL'}: {attack}: {observed}", file=sys.stderr, flush=True)


def train_py(args: list[str], log: Path, token: str | None = TOKEN) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("NANORL_TOKEN", "MKL_NUM_THREADS")}
    env.update({"OMP_NUM_THREADS": "1"} | ({"NANORL_TOKEN": token} if token else {}))
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"))


def flags(tiny: str, out: Path, *extra: str) -> list[str]:
    return ["--task", "arith", "--algo", "grpo", "--model", tiny, "--batch", "8", "--group-size", "4",
            "--max-new-tokens", "8", "--eval-size", "4", "--eval-every", "100000", "--lora-rank", "8",
            "--steps", "100000", "--no-progress", "--out", str(out), "--worker-patience", "30", *extra]


def steps(out: Path) -> int:
    path = out / "metrics.csv"
    return len({s for series in rundir.read_metrics(path).values() for s, _, _ in series}) if path.exists() else 0


def step_rate(out: Path, seconds: float) -> float:
    start, t = steps(out), time.monotonic()
    time.sleep(seconds)
    return (steps(out) - start) / (time.monotonic() - t)


def rss_mb(pid: int) -> int:
    return int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) >> 10


ME: dict = {}  # the worker id and run /hello gave this script, as a worker's: its batches pass the run check


def register(url: str, tiny: str, out: Path) -> None:
    cfg = train.parse(flags(tiny, out, "--role", "rollout", "--trainer-url", url))
    ME["worker"], ME["run"] = serve.hello(transport.Client(url, TOKEN, retries=1), cfg)


def meta(**extra) -> dict:
    """A batch's meta as a worker's: its id, the trainer's run and the next sequence number."""
    ME["seq"] = ME.get("seq", -1) + 1
    return {"worker": ME["worker"], "run": ME["run"], "seq": ME["seq"], **extra}


def post(url: str, body: bytes, token: str = TOKEN) -> tuple[int, str]:
    status, reply = transport.Client(url, token, retries=1).post("/batch", body)
    return status, bytes(reply[:160]).decode(errors="replace")


def newest(url: str) -> int:
    status, body = transport.Client(url, TOKEN, retries=1).get(f"/adapter?have=-1&worker={ME['worker']}"
                                                              f"&run={ME['run']}")
    return transport.decode(body)[1]["version"]


def forge(version: int, groups: int = 1, length: int = 12, k: int = 4, **extra) -> dict:
    """A batch that passes every check (tokens 1, a 4-token prompt), for the variants below to break."""
    n = groups * k
    t = {"tokens": torch.ones(n, length, dtype=torch.int64), "attn": torch.ones(n, length),
         "mask": torch.cat([torch.zeros(n, 4), torch.ones(n, length - 4)], 1), "logp": torch.zeros(n, length),
         "rewards": torch.zeros(n, length), "truncated": torch.zeros(n, dtype=torch.bool),
         "group": torch.arange(n) // k, "version": torch.full((n,), version), "reward_int_correct": torch.zeros(n)}
    return {**t, **extra}


def http_attacks(url: str, proc: subprocess.Popen, out: Path, undisturbed: float):
    host, port = re.match(r"http://([^:]+):(\d+)", url).groups()
    result, stop = {}, threading.Event()
    threading.Timer(30.0, stop.set).start()
    flooder = threading.Thread(target=lambda: result.update(opened=flood(host, int(port), stop)))
    flooder.start()
    time.sleep(5.0)
    rate = step_rate(out, 20.0)
    flooder.join()
    row("slow-header flood: 192 sockets (3x the cap), reopened as dropped, 30 s", "training continues",
        f"{rate:.2f} steps/s vs {undisturbed:.2f} undisturbed; {result['opened']} connections", rate > 0.3 * undisturbed)

    base, socks = rss_mb(proc.pid), []
    for _ in range(2):  # announce 1 GiB - 1 MiB, send 64 MiB, stall
        s = socket.create_connection((host, int(port)))
        s.sendall(f"POST /batch HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: {(1 << 30) - (1 << 20)}"
                  "\r\n\r\n".encode() + b"x" * (64 << 20))
        socks.append(s)
    time.sleep(3.0)
    grew = rss_mb(proc.pid) - base
    for s in socks:
        s.close()
    row("2 authenticated uploads announce 1 GiB - 1 MiB, send 64 MiB, stall", "memory grows by what was sent",
        f"trainer RSS +{grew} MB (was {base} MB)", grew < 300)

    head = b"POST /batch HTTP/1.1\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\nContent-Length: 2147483648\r\n\r\n"
    with socket.create_connection((host, int(port))) as s:
        s.sendall(head)
        status = s.recv(200).split(b" ")[1].decode()
    row("2 GB Content-Length", "413 from the headers", status, status == "413")
    status, _ = post(url, transport.encode(forge(0), meta()), token="wrong-" + TOKEN)
    row("wrong token", "401", str(status), status == 401)
    evil = pickle.dumps({"tokens": torch.ones(1)})
    status, _ = post(url, evil)
    row("a pickle as the body", "400, never unpickled", str(status), status == 400)


def batch_attacks(url: str):
    v = newest(url)  # the batches below are fresh: none is dropped as stale before the trainer takes it
    cases = [("turns without solved and solved_first_turn", forge(v, turns=torch.ones(4))),
             ("reward keys unlike the run's", forge(v, reward_other=torch.zeros(4))),
             ("sequences of 1,500 tokens on a 1,024-position model", forge(v, length=1500)),
             ("200 groups in one POST", forge(v, groups=200)),
             ("NaN rewards", forge(v, rewards=torch.full((4, 12), float("nan")))),
             ("token ids past the vocabulary", forge(v, tokens=torch.full((4, 12), 10**6)))]
    for name, batch in cases:
        status, reply = post(url, transport.encode(batch, meta()))
        row(f"batch: {name}", "4xx, counted, training continues", f"{status} {reply[:70]}", 400 <= status < 500)
    status, reply = post(url, transport.encode(forge(v), {**meta(), "run": "another-trainer"}))
    row("a batch of a worker another trainer registered", "412, never queued", f"{status} {reply[:60]}",
        status == 412)
    body = transport.encode(forge(v), meta())
    first, again = post(url, body), post(url, body)  # as a worker resends one whose reply was lost
    row("the same batch posted twice", "taken once", f"{first[1][:30]} then {again[1][:40]}",
        first[0] == again[0] == 200 and '"duplicate": true' in again[1])
    status, _ = post(url, transport.encode(forge(v), meta(apply_s=float("inf"))))
    row("apply_s = 1e400 (inf) in a valid batch's meta", "the time ignored, not logged", str(status), status < 500)


def startup_attacks(tiny: str, tmp: Path):
    for name, args, token in (("a 5-character NANORL_TOKEN", [], "short"),
                              ("bind 0.0.0.0 without a token", ["--trainer-url", "http://0.0.0.0:0"], None)):
        log = tmp / "refused.log"
        code = train_py(flags(tiny, tmp / "refused", "--role", "trainer", *args), log, token).wait(300)
        text = log.read_text()  # above the error, at most a model-loading progress bar
        lines = [line for line in text.splitlines() if "rror" in line]
        row(f"start-up: {name}", "refused, one line", f"exit {code}: {lines[-1][:70] if lines else ''}",
            code == 2 and len(lines) == 1 and "Traceback" not in text)


def model_attacks(tmp: Path):
    work = Path(tempfile.mkdtemp(dir=Path.home()))
    try:
        for name, (ok, seen) in escapes(sandbox.run_python, work).items():
            row(f"sandbox as uid {os.getuid()}: {name}", "contained", seen, ok)
    finally:
        shutil.rmtree(work)
    if os.geteuid() == 0 and shutil.which("setpriv"):
        from test_sandbox import escape_suite_as

        for name, (ok, seen) in escape_suite_as("nanorl-tester").items():
            row(f"sandbox as an ordinary user: {name}", "contained", seen, ok)
    db = sql_database("shop")
    for name, query in (("printf('%.*c', 999999999, x) over 5 rows", "SELECT length(printf('%.*c', 999999999, name)) "
                                                                     "FROM customers LIMIT 5"),
                        ("a 2.7 GB sort of zeroblob(900000) rows", "WITH RECURSIVE r(i, b) AS (SELECT 1, zeroblob(900000) "
                         "UNION ALL SELECT i + 1, zeroblob(900000) FROM r LIMIT 3000) SELECT i FROM r ORDER BY b")):
        start = time.monotonic()
        try:
            sandbox.run_sql(db, query, timeout_s=2.0)
            seen = "ran to the end"
        except sqlite3.Error as e:
            seen = str(e)
        took = time.monotonic() - start
        row(f"SQL: {name}", "stopped within timeout_s=2 + 1 s", f"{took:.1f} s: {seen[:50]}", took < 3.0)


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="nanorl-attacks-"))
    tiny = build_tiny_model(str(tmp / "tiny"), layers=2, hidden=128, heads=2, intermediate=256)
    proc = train_py(flags(tiny, tmp / "run", "--role", "trainer", "--workers", "1"), tmp / "trainer.log")
    try:
        while not (found := re.search(r"trainer listening on (\S+);", (tmp / "trainer.log").read_text())):
            assert proc.poll() is None, (tmp / "trainer.log").read_text()
            time.sleep(0.2)
        while steps(tmp / "run") < 3:
            time.sleep(0.5)
        undisturbed = step_rate(tmp / "run", 20.0)
        register(found.group(1), tiny, tmp / "run")
        http_attacks(found.group(1), proc, tmp / "run", undisturbed)
        batch_attacks(found.group(1))
        before = steps(tmp / "run")
        time.sleep(10)
        alive, after = proc.poll() is None, steps(tmp / "run")
        row("after all of the above", "the trainer still trains", f"alive {alive}, {after - before} steps in 10 s",
            alive and after > before)
    finally:
        proc.kill()
        proc.wait()
    startup_attacks(tiny, tmp)
    model_attacks(tmp)
    print("| attack | expected | observed | pass |\n|---|---|---|---|")
    for attack, expected, observed, ok in ROWS:
        observed = " ".join(observed.replace("|", "/").split())
        print(f"| {attack} | {expected} | {observed} | {'pass' if ok else 'FAIL'} |")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0 if all(ok for *_, ok in ROWS) else 1


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()  # --help only
    sys.exit(main())
