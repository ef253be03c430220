"""Running model-written code: Python in a throw-away sandboxed process tree, and SQL on a
read-only SQLite connection. Nothing here runs model code inside the trainer's own process."""
from __future__ import annotations

import contextlib
import functools
import itertools
import os
import selectors
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

# ---------------------------------------------------------------- sandbox for model-written code
@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int  # negative: killed by that signal (-9 after a timeout)
    timed_out: bool  # the wall clock ran out (or, a bug, the launcher hung and was killed)
    truncated: bool  # output past max_output characters was dropped


SANDBOX_UID_BASE = 2_000_000_000  # as root, a run gets uid BASE + its launcher's pid: assumed unused
_NEWNS, _NEWIPC, _NEWUSER, _NEWPID, _NEWNET = 0x20000, 0x8000000, 0x10000000, 0x20000000, 0x40000000

# Runs as the child process, never in the trainer. It forks the model's process (pid 1 of a new
# pid namespace when there is one), which mounts, limits and drops its uid before running the
# code; the launcher enforces the wall clock, kills everything and writes "returncode timed_out".
# As pid 1 the code ignores signals it has no handler for: past RLIMIT_FSIZE its writes fail with
# EFBIG instead of SIGXFSZ killing it; the CPU limit's SIGKILL and the launcher's still end it.
_LAUNCHER = r"""
import ctypes, os, resource, select, signal, sys
status, flags, uid_base, cpu, mem, fsize, nofile, nproc = map(int, sys.argv[1:9])
NEWNS, NEWPID, NOSUID, NODEV, NOEXEC, REC_PRIVATE = 0x20000, 0x20000000, 2, 4, 8, 0x44000
libc = ctypes.CDLL(None, use_errno=True)
def check(ok, what):
    if not ok:
        sys.stderr.write(f"sandbox setup failed: {what}: {os.strerror(ctypes.get_errno())}\n")
        os._exit(125)
check(not flags or libc.unshare(flags) == 0, "unshare")
uid = uid_base + os.getpid() if uid_base else 0
src = open("main.py", encoding="utf-8").read()
pid = os.fork()
if pid == 0:
    os.close(status)
    os.setpgid(0, 0)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: dies with the launcher
    if flags & NEWNS:  # own mounts: /proc of the new pid namespace, a small fresh tmpfs on writable dirs
        check(libc.mount(b"none", b"/", None, REC_PRIVATE, None) == 0, "private mounts")
        check(not flags & NEWPID or libc.mount(b"proc", b"/proc", b"proc", NOSUID | NODEV | NOEXEC, None) == 0, "/proc")
        for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):  # the cwd, made under /tmp, stays reachable
            opts = b"size=%dk,mode=1777" % max(64, fsize >> 10)
            check(not os.path.isdir(d) or libc.mount(b"tmpfs", d.encode(), b"tmpfs", NOSUID | NODEV, opts) == 0, d)
    for r, v in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, mem), (resource.RLIMIT_FSIZE, fsize),
                 (resource.RLIMIT_NOFILE, nofile), (resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(r, (v, v))
    if uid:
        for path in (".", "main.py"):
            os.chown(path, uid, uid)
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    check(libc.prctl(38, 1, 0, 0, 0) == 0, "no_new_privs")  # setuid binaries cannot give root back
    sys.argv = ["main.py"]
    os.environ.clear()  # started with none, but bubblewrap sets PWD
    try:
        exec(compile(src, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException as e:  # the usual traceback, minus this launcher's frame
        import traceback
        traceback.print_exception(e.with_traceback(e.__traceback__.tb_next))
        sys.exit(1)
    sys.exit(0)
timed_out = not select.select([os.pidfd_open(pid)], [], [], float(sys.argv[9]))[0]
os.kill(pid, signal.SIGKILL)  # as pid 1 of its namespace, its death kills every process in it
try:
    os.killpg(pid, signal.SIGKILL)  # without a namespace: its process group
except ProcessLookupError:
    pass
# and as root every process of the run's uid, setsid'd ones too. Not needed with a pid namespace,
# which nothing escapes, and impossible: no fork works in one whose pid 1 is dead.
if uid and not flags & NEWPID and (killer := os.fork()) == 0:
    try:
        os.setuid(uid)
        os.kill(-1, signal.SIGKILL)
    finally:
        os._exit(0)
if uid and not flags & NEWPID:
    os.waitpid(killer, 0)
os.write(status, b"%d %d" % (os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), timed_out))
"""


def run_python(code: str, *, timeout_s: float = 5.0, cpu_s: int = 5, mem_mb: int = 512, fsize_mb: int = 16,
               nofile: int = 64, nproc: int = 8, max_output: int = 4000) -> SandboxResult:
    """Runs model-written Python (`python -I -S`, stdlib only) in a throwaway process tree: empty
    environment, a temporary working directory, rlimits on CPU seconds, address space, file
    size, open files and processes, `max_output` characters kept per stream, and a wall-clock
    timeout. Every process of the run is dead when this returns. The limits are per process, so
    a run can hold nproc * mem_mb of memory (4 GB by default). See `sandbox_plan` for what else
    holds on this machine."""
    python, flags, uid_base, bwrap = sandbox_plan()
    limits = (cpu_s, mem_mb << 20, fsize_mb << 20, nofile, nproc)
    return _sandboxed(python, flags, uid_base, code, timeout_s, limits, max_output, bwrap)


@functools.cache
def sandbox_plan() -> tuple[str, int, int, bool]:
    """(interpreter, unshare flags, uid base or 0, bubblewrap or not): the strongest setup that
    runs here, found once. Bubblewrap, when installed, adds a read-only view of the host's files
    and a minimal /dev around the launcher, which still sets up everything below itself.
    Namespaces: pid (the run sees and signals only its own processes, and all of them die with
    its first), network (none at all), mount (its own /proc and /tmp) and ipc. As root each run
    also gets its own unused uid, so RLIMIT_NPROC binds and root's files stay unreadable; without
    root the namespaces need an unprivileged user namespace. Warns when there are none."""
    root = os.geteuid() == 0
    uid_base = SANDBOX_UID_BASE if root else 0
    # As root the code runs under another uid, so the interpreter must be readable by others
    # (a pyenv Python under /root is not): then the system's python3 runs it.
    system = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    pythons = dict.fromkeys(p for p in (sys.executable, system) if p)
    tried, full = [], _NEWPID | _NEWNET | _NEWNS | _NEWIPC | (0 if root else _NEWUSER)
    for flags, bwrap in ((full, bool(shutil.which("bwrap"))), (full, False), (0, False)):
        for python in pythons:  # importing json, not loaded at start-up, proves the uid can read the stdlib
            r = _sandboxed(python, flags, uid_base, "import json\nprint(json.dumps(6 * 7))", 30.0,
                           (10, 512 << 20, 1 << 20, 64, 32), 999, bwrap)
            if r.stdout == "42\n":
                if not flags:
                    warnings.warn(f"sandbox: no namespaces ({tried[-1]}): model code can use the network and write "
                                  "to /tmp" + ("" if root else "; and as it runs as you, it can signal your processes "
                                  "(the trainer too), read their environment and leave setsid'd children running")
                                  + ". Run as root, or allow unprivileged user namespaces.")
                return python, flags, uid_base, bwrap
            tried.append(f"{python} with flags {flags:#x}{' in bwrap' * bwrap}: {r.stderr.strip()[-300:] or f'exit {r.returncode}'}")
    raise RuntimeError("no Python interpreter runs in the sandbox: " + "; ".join(tried) + ". As root the code runs "
                       "under an unprivileged uid, so install a world-readable python3 (e.g. apt install python3).")


def _sandboxed(python, flags, uid_base, code, timeout_s, limits, max_output, bwrap=False) -> SandboxResult:
    work = tempfile.mkdtemp(prefix="nanorl-sandbox-")
    try:
        Path(work, "main.py").write_text(code, encoding="utf-8", errors="replace")
        r, w = os.pipe()
        args = [python, "-I", "-S", "-c", _LAUNCHER, *map(str, (w, flags, uid_base, *limits, timeout_s))]
        if bwrap:  # no pid namespace of its own: the launcher's host pid names the run's uid
            args = [shutil.which("bwrap"), "--die-with-parent", *(["--unshare-user"] if flags & _NEWUSER else []),
                    "--ro-bind", "/", "/", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/var/tmp",
                    "--bind", work, work, "--chdir", work, "--", *args]
        pipe = subprocess.PIPE
        with open(r, "rb") as status, subprocess.Popen(args, cwd=work, env={}, stdin=subprocess.DEVNULL, stdout=pipe,
                                                       stderr=pipe, pass_fds=(w,), start_new_session=True) as proc:
            os.close(w)
            stuck, backstop = True, time.monotonic() + timeout_s + 10
            try:  # the launcher enforces timeout_s; the backstop only catches a launcher that hangs
                (out, err, st), cut, stuck = _read_all((proc.stdout, proc.stderr, status), max_output, backstop)
            finally:
                if stuck:  # or the trainer was interrupted: kill the group, and as root every process of the uid
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    if uid_base:
                        uid = uid_base + proc.pid
                        subprocess.run(["/bin/sh", "-c", "kill -9 -1"], user=uid, group=uid, extra_groups=[], env={})
        rc, timed_out = map(int, st.split()) if st else (proc.returncode, stuck)
        text = [b.decode("utf-8", "replace")[:max_output] for b in (out, err)]
        return SandboxResult(text[0], text[1], rc, bool(timed_out) or stuck, cut)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _read_all(files, cap: int, deadline: float) -> tuple[list[bytes], bool, bool]:
    """Reads the pipes to their ends, keeping at most `cap` bytes of each (the rest is drained and
    dropped). Returns (what was kept, whether anything was dropped, whether the deadline hit)."""
    out, cut = [bytearray() for _ in files], False
    with selectors.DefaultSelector() as sel:
        for i, f in enumerate(files):
            sel.register(f, selectors.EVENT_READ, i)
        while sel.get_map():
            if (left := deadline - time.monotonic()) <= 0:
                return out, cut, True
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                keep = max(0, cap - len(out[key.data]))
                out[key.data] += chunk[:keep]
                cut |= len(chunk) > keep
    return out, cut, False


# ---------------------------------------------------------------- SQL tool on read-only SQLite
_SQL_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}


def run_sql(path: str, query: str, *, max_rows: int = 1000, max_steps: int = 10_000_000,
            timeout_s: float = 2.0) -> tuple[list[str], list[tuple], bool]:
    """(column names, at most max_rows rows, whether more exist) of one query on a read-only
    connection whose authorizer allows only reading (no ATTACH, PRAGMA, writes or DDL); a query
    past `max_steps` VM steps or `timeout_s` seconds is interrupted. Raises sqlite3.Error ("not
    authorized", "interrupted", syntax errors, more than one statement)."""
    con = sqlite3.connect(Path(path).resolve().as_uri() + "?mode=ro", uri=True)
    try:
        con.set_authorizer(lambda action, *_: sqlite3.SQLITE_OK if action in _SQL_ALLOWED else sqlite3.SQLITE_DENY)
        con.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 1_000_000)  # zeroblob(1e9) cannot fill the trainer's memory
        deadline, calls = time.monotonic() + timeout_s, itertools.count(1)
        con.set_progress_handler(lambda: next(calls) * 1000 > max_steps or time.monotonic() > deadline, 1000)
        cur = con.execute(query)
        rows = cur.fetchmany(max_rows + 1)
        return [d[0] for d in cur.description or []], rows[:max_rows], len(rows) > max_rows
    finally:
        con.close()
