"""Running model-written code: Python in a throw-away sandboxed process tree, and SQL on a
read-only SQLite connection. Nothing here runs model code inside the trainer's own process."""
import contextlib
import functools
import json
import os
import selectors
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
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
MODES = ("strict", "weak")  # train's --sandbox; weak: rlimits alone where namespaces fail
_mode = "strict"  # this process's --sandbox, set once at start-up by use()


class SandboxUnavailable(RuntimeError):
    """This machine cannot isolate model code and the user did not opt in to the weak mode."""


# Runs as the child process. It forks the model's process (pid 1 of a new pid namespace), which
# mounts, limits and drops its uid and capabilities before running the code; the launcher enforces
# the wall clock, kills everything and writes "returncode timed_out". As pid 1 the code ignores
# signals it has no handler for: past RLIMIT_FSIZE its writes fail with EFBIG, not SIGXFSZ.
_LAUNCHER = r"""
import ctypes, os, resource, select, signal, struct, sys  # all runs need these; rare paths import theirs
status, flags, uid_base, cpu, mem, fsize, nofile, nproc, files = map(int, sys.argv[1:10])
NEWNS, NEWUSER, NEWPID = 0x20000, 0x10000000, 0x20000000
NOSUID, NODEV, NOEXEC, BIND, REC, REC_PRIVATE = 2, 4, 8, 4096, 0x4000, 0x44000
# (audit arch, pivot_root, socket and socketpair, the calls that fail with EPERM). Those hold what no
# limit bounds: SysV shm, semaphores, message queues, memfds and secret memfds hold memory past the
# mappings RLIMIT_AS counts, keys live in the caller's keyrings (a token, say), and io_uring opens
# sockets past this filter. A socket may be local or IP (the network namespace confines those), never
# vsock and the like, which no namespace confines. Any other syscall ABI is killed.
ABI = {"x86_64": (0xC000003E, 155, (41, 53), (29, 64, 68, 319, 447, 248, 249, 250, 425)),
       "aarch64": (0xC00000B7, 41, (198, 199), (194, 190, 186, 279, 447, 217, 218, 219, 425))}
FAMILIES = (1, 2, 10, 16)  # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")  # all the code sees
libc = ctypes.CDLL(None, use_errno=True)
def check(ok, what):
    if not ok:
        sys.stderr.write(f"sandbox setup failed: {what}: {os.strerror(ctypes.get_errno())}\n")
        os._exit(125)
def own_userns():  # mapping only our ids (all an ordinary user may map), and allowing no nested one
    ids = os.getuid(), os.getgid()
    check(libc.unshare(NEWUSER) == 0, "unshare")
    for name, text in (("self/setgroups", "deny"), ("self/uid_map", f"{ids[0]} {ids[0]} 1"),
                       ("self/gid_map", f"{ids[1]} {ids[1]} 1"), ("sys/user/max_user_namespaces", "0")):
        with open(f"/proc/{name}", "w") as f:
            f.write(text)
def tasks_of(uid):  # RLIMIT_NPROC counts every thread of a uid on the machine, the trainer's too
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
        except (OSError, ValueError):  # it exited meanwhile
            continue
        n += int(fields["Threads"]) if int(fields["Uid"].split()[0]) == uid else 0
    return n
def mount(src, dst, kind=None, flags=BIND, opts=None):
    check(libc.mount(src, dst.encode(), kind, flags, opts) == 0, dst)
def read_only(path):  # recursively: mount_setattr(2), Linux >= 5.12
    check(libc.syscall(442, -100, path, 0x8000, struct.pack("4Q", 1, 0, 0, 0), 32) == 0, f"read-only {path}")
def seccomp(arch, _, sockets, denied):  # classic BPF, [(code, jump if true, jump if false, k)]: a jump
    ALLOW, EPERM, KILL = 0x7FFF0000, 0x50001, 0x80000000  # names the label it goes to (forward only)
    prog = [(0x20, 0, 0, 4), (0x15, 0, "kill", arch), (0x20, 0, 0, 0), (0x35, "deny", 0, 0x40000000),
            *[(0x15, "deny", 0, nr) for nr in denied], *[(0x15, "family", 0, nr) for nr in sockets],
            (6, 0, 0, ALLOW), "family", (0x20, 0, 0, 16), *[(0x15, "allow", 0, f) for f in FAMILIES],
            "deny", (6, 0, 0, EPERM), "allow", (6, 0, 0, ALLOW), "kill", (6, 0, 0, KILL)]
    code, at = [], {}
    for item in prog:
        if isinstance(item, str):
            at[item] = len(code)
        else:
            code.append(item)
    jump = lambda i, to: at[to] - i - 1 if to else 0
    buf = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", c, jump(i, t), jump(i, f), k)
                                               for i, (c, t, f, k) in enumerate(code)))
    check(libc.prctl(22, 2, struct.pack("HxxxxxxQ", len(code), ctypes.addressof(buf))) == 0, "seccomp")
if flags & NEWUSER:
    own_userns()
check(not flags or libc.unshare(flags & ~NEWUSER) == 0, "unshare")
uid = uid_base + os.getpid() if uid_base else 0
src = open("main.py", encoding="utf-8").read()
pid = os.fork()
if pid == 0:
    os.close(status)
    os.setpgid(0, 0)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: dies with the launcher
    if flags & NEWNS:  # a new root: the system's files read-only, its own /proc and /dev, a small scratch
        nodes = [(n, os.open(f"/dev/{n}", os.O_PATH)) for n in ("null", "zero", "full", "random", "urandom")]
        mount(b"none", "/", None, REC_PRIVATE)
        new = "/tmp"  # (the host's /tmp, hidden in this namespace)
        mount(b"tmpfs", new, b"tmpfs", NOSUID | NODEV, b"size=64k,nr_inodes=256,mode=755")
        for d in dict.fromkeys((*SYSTEM, sys.base_prefix, sys.base_exec_prefix)):  # the interpreter's too
            if os.path.islink(d):  # /bin -> usr/bin where /usr is merged
                os.symlink(os.readlink(d), new + d)
            elif os.path.isdir(d):
                os.makedirs(new + d, exist_ok=True)
                mount(d.encode(), new + d, flags=BIND | REC)
        for d in ("proc", "dev", "tmp"):
            os.mkdir(f"{new}/{d}")
        read_only(new.encode())
        mount(b"proc", new + "/proc", b"proc", NOSUID | NODEV | NOEXEC)
        mount(b"tmpfs", new + "/dev", b"tmpfs", NOSUID | NOEXEC, b"size=64k,nr_inodes=64,mode=755")
        for name, fd in nodes:  # the host's nodes, each bound onto an empty file
            open(f"{new}/dev/{name}", "w").close()
            mount(b"/proc/self/fd/%d" % fd, f"{new}/dev/{name}")
        for name, fd in (("fd", ""), ("stdin", "/0"), ("stdout", "/1"), ("stderr", "/2")):
            os.symlink("/proc/self/fd" + fd, f"{new}/dev/{name}")
        os.mkdir(new + "/dev/shm")
        read_only(f"{new}/dev".encode())
        opts = b"size=%dk,nr_inodes=%d,mode=1777" % (max(64, fsize >> 10), files)
        mount(b"tmpfs", new + "/tmp", b"tmpfs", NOSUID | NODEV, opts)
        mount(new.encode() + b"/tmp", new + "/dev/shm")  # the same scratch: one bound on bytes and files
        os.chdir(new)  # the old root goes: stacked under the new one, then detached
        pivot_root = ABI[os.uname().machine][1]
        check(libc.syscall(pivot_root, b".", b".") == 0 and libc.umount2(b".", 2) == 0, "pivot_root")
        os.chdir("/tmp")
        with open("main.py", "w", encoding="utf-8") as f:  # for tracebacks' source lines
            f.write(src)
    if not (uid or flags & NEWUSER):  # the caller's own uid, without a namespace's count: the run's on top
        nproc += tasks_of(os.getuid()) - 1  # (this process is the run's first)
    for r, v in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, mem), (resource.RLIMIT_FSIZE, fsize),
                 (resource.RLIMIT_NOFILE, nofile), (resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(r, (v, v))
    if uid:
        if not flags & NEWNS:
            for path in (".", "main.py"):
                os.chown(path, uid, uid)
        check(libc.setgroups(0, None) == 0 and libc.setgid(uid) == 0 and libc.setuid(uid) == 0,
              f"uid {uid} (a root whose user namespace maps fewer ids: run as an ordinary user)")
        if flags & NEWNS:  # forbids nested user namespaces, as for ordinary users
            libc.prctl(4, 1)  # PR_SET_DUMPABLE, which setuid cleared: else /proc/self/uid_map stays root's
            own_userns()
    # No capabilities left (in its own user namespace the code holds all of them: it could remount the
    # host writable), and setuid binaries cannot give any back.
    check(libc.capset(struct.pack("Ii", 0x20080522, 0), bytes(24)) == 0, "dropping capabilities")
    check(libc.prctl(38, 1, 0, 0, 0) == 0, "no_new_privs")
    check(os.uname().machine in ABI or not flags, f"no syscall numbers for {os.uname().machine}")
    if os.uname().machine in ABI:
        seccomp(*ABI[os.uname().machine])
    sys.argv = ["main.py"]
    os.environ.clear()
    # an uncaught error prints the usual traceback, minus this launcher's frame
    sys.excepthook = lambda kind, e, tb: sys.__excepthook__(kind, e.with_traceback(tb.tb_next), tb.tb_next)
    exec(compile(src, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    sys.exit(0)
timed_out = not select.select([os.pidfd_open(pid)], [], [], float(sys.argv[10]))[0]
os.kill(pid, signal.SIGKILL)  # as pid 1 of its namespace, its death kills every process in it
try:
    os.killpg(pid, signal.SIGKILL)  # without a namespace: its process group
except ProcessLookupError:
    pass
# and as root every process of the run's uid, setsid'd ones too. Not needed with a pid namespace,
# which nothing escapes, and impossible: no fork works in one whose pid 1 is dead.
if uid and not flags & NEWPID:
    import subprocess
    subprocess.run(["/bin/sh", "-c", "kill -9 -1"], user=uid, group=uid, extra_groups=[], env={})
os.write(status, b"%d %d" % (os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), timed_out))
"""


def run_python(code: str, *, timeout_s: float = 5.0, cpu_s: int = 5, mem_mb: int = 512, fsize_mb: int = 16,
               files: int = 256, nofile: int = 64, nproc: int = 8, max_output: int = 4000,
               plan: tuple[str, int, int] | None = None) -> SandboxResult:
    """Runs model-written Python (`python -I -S`, stdlib only) in a throwaway process tree: empty environment,
    per-process rlimits (so up to nproc * mem_mb of memory, 4 GB by default), `max_output` characters per
    stream, a wall-clock timeout, and as its only writable place a fresh tmpfs of fsize_mb and `files`
    inodes. No process of the run outlives it. `plan`: sandbox_plan's, by default for this --sandbox."""
    python, flags, uid_base = plan or sandbox_plan(_mode)
    limits = (cpu_s, mem_mb << 20, fsize_mb << 20, nofile, nproc, files)
    with tempfile.TemporaryDirectory(prefix="nanorl-sandbox-", ignore_cleanup_errors=True) as work:
        Path(work, "main.py").write_text(code, encoding="utf-8", errors="replace")
        r, w = os.pipe()
        args = [python, "-I", "-S", "-c", _LAUNCHER, *map(str, (w, flags, uid_base, *limits, timeout_s))]
        with open(r, "rb") as status, subprocess.Popen(args, cwd=work, env={}, stdin=subprocess.DEVNULL,
                                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                       pass_fds=(w,), start_new_session=True) as proc:
            os.close(w)
            stuck, pipes = True, (proc.stdout, proc.stderr, status)
            try:  # the launcher enforces timeout_s; the backstop (+10 s) only catches a launcher that hangs
                # (the status, "returncode timed_out", kept whole: a max_output of 0 or 2 lost or broke it)
                (out, err, st), cut, stuck = _read_all(pipes, (max_output, max_output, 64),
                                                       time.monotonic() + timeout_s + 10)
            finally:
                if stuck:  # or the trainer was interrupted: kill the group, and as root all of the uid
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    if uid_base:
                        uid = uid_base + proc.pid
                        subprocess.run(["/bin/sh", "-c", "kill -9 -1"], user=uid, group=uid, extra_groups=[],
                                       env={})
    rc, timed_out = map(int, st.split()) if st else (proc.returncode, stuck)
    text = [b.decode("utf-8", "replace")[:max_output] for b in (out, err)]
    return SandboxResult(text[0], text[1], rc, bool(timed_out) or stuck, cut)


def use(mode: str) -> tuple[str, int, int]:
    """Makes `mode` (--sandbox) the one run_python uses in this process, if sandbox_plan(mode)
    finds it works here: train.validate calls it at start-up, in the trainer and in each worker."""
    global _mode
    _mode = mode  # first: a mode refused here leaves no weaker one of an earlier call in use (fail closed)
    return sandbox_plan(mode)


@functools.cache
def sandbox_plan(mode: str) -> tuple[str, int, int]:
    """(interpreter, unshare flags, uid base or 0), found once per mode. Strict needs namespaces, else
    SandboxUnavailable ("weak" falls back to rlimits): pid (the run sees and signals only its own
    processes, which all die with its first), network (none), mount (a root of its own: the system's
    directories read-only, its own /proc, a minimal /dev, a private scratch), ipc, and user (allowing
    no nested one). As root each run also gets an unused uid, so RLIMIT_NPROC binds and root's files
    stay unreadable."""
    root = os.geteuid() == 0
    uid_base = SANDBOX_UID_BASE if root else 0
    # As root the code runs under another uid, so the interpreter must be readable by others (a pyenv
    # Python under /root is not, but for the prefix the mount namespace shows): else the system's python3.
    system = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    pythons = dict.fromkeys(p for p in (sys.executable, system) if p)
    full, why = _NEWPID | _NEWNET | _NEWNS | _NEWIPC | (0 if root else _NEWUSER), ""
    for flags in (full, 0) if mode == "weak" else (full,):
        for python in pythons:  # importing json, not loaded at start-up, proves the uid can read the stdlib
            r = run_python("import json\nprint(json.dumps(6 * 7))", timeout_s=30.0, cpu_s=10, fsize_mb=1,
                           files=64, nproc=32, max_output=999, plan=(python, flags, uid_base))
            if r.stdout == "42\n" and r.returncode == 0 and not r.timed_out:  # the launcher's, too
                kind = ("isolated (namespaces, system directories read-only, private scratch" if flags
                        else "WEAK mode (--sandbox weak: rlimits only")
                sys.stderr.write(f"sandbox: {kind}{', a uid per run' * root}): {python if flags else why}\n")
                return python, flags, uid_base
            if flags:  # why the strict mode failed, which the weak one's log line tells
                why = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1][-200:]
    raise SandboxUnavailable(
        f"sandbox: cannot isolate model code here ({why}). Allow unprivileged user namespaces (sysctl "
        "user.max_user_namespaces=10000, and on Ubuntu kernel.apparmor_restrict_unprivileged_userns=0), "
        "or run as root where unshare works, and keep a world-readable python3 for root (apt install "
        "python3); or pass --sandbox weak to accept rlimits only (the code can then use the network and "
        "write your files)")


def _read_all(files, caps: tuple[int, ...], deadline: float) -> tuple[list[bytes], bool, bool]:
    """Reads the pipes to their ends, keeping at most caps[i] bytes of the i-th (the rest is dropped):
    (what was kept, whether anything was dropped, whether the deadline hit)."""
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
                keep = max(0, caps[key.data] - len(out[key.data]))
                out[key.data] += chunk[:keep]
                cut |= len(chunk) > keep
    return out, cut, False


# ---------------------------------------------------------------- SQL tool on read-only SQLite
# Runs as a child process: one SQLite call can run for minutes without a progress callback
# (printf('%.*c', 999999999, x)), and sorts and DISTINCT tables grow without bound, so the wall
# clock is a kill and memory an rlimit. Temp tables stay in memory (under RLIMIT_AS), never on disk.
_SQL_CHILD = r"""
import json, resource, sqlite3, sys
path, (max_rows, max_bytes, mem) = sys.argv[1], map(int, sys.argv[2:])
query = sys.stdin.buffer.read().decode()
for r, v in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_FSIZE, 0), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(r, (v, v))
ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
def authorize(action, _, name, *__):  # fts3_tokenizer(x, pointer) takes any address for a tokenizer's code
    ok = action in ALLOWED and not (action == sqlite3.SQLITE_FUNCTION and name.lower() == "fts3_tokenizer")
    return sqlite3.SQLITE_OK if ok else sqlite3.SQLITE_DENY
try:
    con = sqlite3.connect(path, uri=True)
    con.execute("PRAGMA temp_store = MEMORY")
    con.set_authorizer(authorize)
    con.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 1_000_000)  # no string or blob over 1 MB
    cur, rows, size = con.execute(query), [], 0
    while len(rows) <= max_rows and (row := cur.fetchone()) is not None:
        rows.append([{"blob": v.hex()} if isinstance(v, bytes) else v for v in row])
        if (size := size + len(json.dumps(rows[-1]))) > max_bytes:  # the bytes the caller will read
            raise sqlite3.DataError(f"result over {max_bytes} bytes: select fewer or shorter rows")
    out = {"columns": [d[0] for d in cur.description or []], "rows": rows}
except (sqlite3.Error, MemoryError) as e:
    out = {"error": type(e).__name__, "message": str(e) or "out of memory"}
sys.stdout.write(json.dumps(out))
"""


def run_sql(path: str, query: str, *, max_rows: int = 1000, max_bytes: int = 8 << 20, mem_mb: int = 256,
            timeout_s: float = 2.0) -> tuple[list[str], list[tuple], bool]:
    """(column names, at most max_rows rows, whether more exist) of one query on a read-only
    connection whose authorizer allows only reading (no ATTACH, PRAGMA, writes or DDL), in a child
    process killed after `timeout_s`, with mem_mb of address space, strings and blobs of 1 MB and
    max_bytes of results. Raises sqlite3.Error ("not authorized", "interrupted", syntax, memory)."""
    args = [sys.executable, "-I", "-S", "-c", _SQL_CHILD, Path(path).resolve().as_uri() + "?mode=ro",
            *map(str, (max_rows, max_bytes, mem_mb << 20))]
    try:  # the query on stdin: in argv a NUL byte or 128 KiB of text fails to start the process
        r = subprocess.run(args, input=query.encode("utf-8", "replace"), capture_output=True,
                           timeout=timeout_s + 0.5, env={}, start_new_session=True)  # Ctrl-C: the run's
        out = json.loads(r.stdout, object_hook=lambda d: bytes.fromhex(d["blob"]) if "blob" in d else d)
    except subprocess.TimeoutExpired:  # run() has killed it
        raise sqlite3.OperationalError(f"interrupted: the query ran over {timeout_s} s") from None
    except ValueError:  # no JSON: the child died
        raise sqlite3.OperationalError(f"query process died ({r.returncode}): {r.stderr[-200:]!r}") from None
    if "error" in out:
        raise getattr(sqlite3, out["error"], sqlite3.OperationalError)(out["message"])
    rows = [tuple(r) for r in out["rows"]]
    return out["columns"], rows[:max_rows], len(rows) > max_rows
