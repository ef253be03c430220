"""The sandbox for model-written code, attacked with real processes: each test runs hostile
code through sandbox.run_python and then inspects the host (its /proc, files, sockets)."""
import contextlib
import errno
import functools
import os
import random
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

import sandbox
from envs import PythonToolEnv
from sandbox import SANDBOX_UID_BASE, SandboxUnavailable, run_python, sandbox_plan
from tasks import Problem

PYTHON, FLAGS, UID_BASE = sandbox_plan("strict")
# Without a pid namespace or a uid of its own, code that signals "its parent" would hit pytest.
contained = pytest.mark.skipif(not (FLAGS & sandbox._NEWPID or UID_BASE),
                               reason="needs a pid namespace or root (a throwaway uid per run)")


def survivors(marker: str, sandbox_uids: bool = True) -> list[int]:
    """Live host processes whose command line holds `marker`, or (sandbox_uids) run under a sandbox uid."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            status = (d / "status").read_text()
            cmdline = (d / "cmdline").read_bytes()
        except (OSError, ValueError):  # not a process, or it exited while we looked
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields["State"].strip().startswith("Z"):  # dead, only waiting to be reaped
            continue
        if marker.encode() in cmdline or (sandbox_uids and int(fields["Uid"].split()[0]) >= SANDBOX_UID_BASE):
            found.append(int(d.name))
    return found


def test_exit_code_output_and_traceback_come_back_without_launcher_frames():
    r = run_python("import sys\nprint('hi')\nsys.exit(3)")
    assert (r.stdout, r.stderr, r.returncode, r.timed_out, r.truncated) == ("hi\n", "", 3, False, False)
    r = run_python("x = 1\n1 / 0")
    assert r.returncode == 1 and r.stderr.endswith("ZeroDivisionError: division by zero\n")
    assert 'File "main.py", line 2' in r.stderr and "<string>" not in r.stderr


def test_infinite_loop_is_killed_at_the_wall_clock_timeout_and_scores_0():
    env = PythonToolEnv()
    env.timeout_s = 1.0
    env.reset(Problem("What is 6 * 7?", "42", "k"))
    start = time.monotonic()
    obs, reward, done, _ = env.step("```python\nwhile True:\n    pass\n```")
    assert time.monotonic() - start < env.timeout_s + 5.0  # slack for a loaded CI machine; unkilled: forever
    assert reward == 0.0 and not done and obs[0]["content"] == "(timed out and was killed)"


def test_fork_bomb_hits_the_process_limit_and_leaves_no_process_behind():
    counted = run_python("import os, signal\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
                         "            signal.pause()\n        n += 1\nexcept OSError as e:\n    print(n, e.errno)",
                         nproc=16)
    n, err = map(int, counted.stdout.split())
    assert n < 16 and err == errno.EAGAIN  # at most 16 processes under the run's limit, itself included
    bomb = run_python("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
                      timeout_s=2.0, nproc=16)
    assert bomb.timed_out and bomb.returncode == -signal.SIGKILL
    assert survivors("sandbox setup failed") == []  # that string is in every launcher's command line


def test_10gb_allocation_fails_inside_the_address_space_limit():
    r = run_python("x = bytearray(10 * 2**30)\nprint('allocated')", mem_mb=512)
    assert r.stdout == "" and r.stderr.endswith("MemoryError\n") and r.returncode == 1


def test_1gb_file_write_stops_at_the_file_size_limit():
    r = run_python("import os\nfd = os.open('big', os.O_WRONLY | os.O_CREAT)\nn = 0\ntry:\n    for _ in range(1024):\n"
                   "        n += os.write(fd, b'x' * 2**20)\nexcept OSError as e:\n    print(n, e.errno)", fsize_mb=16)
    # SIGXFSZ kills a plain process; pid 1 of a namespace ignores it, and the write fails instead: past the
    # file size limit, or when the 16 MB scratch (which also holds main.py) is full
    n, err = map(int, r.stdout.split() or (0, 0))
    assert r.returncode == -signal.SIGXFSZ or (err, n) in ((errno.EFBIG, 16 << 20), (errno.ENOSPC, (16 << 20) - 4096))


def test_cpu_limit_kills_a_busy_loop_before_the_wall_clock():
    r = run_python("while True:\n    pass", cpu_s=1, timeout_s=30.0)
    assert r.returncode == -signal.SIGKILL and not r.timed_out


@pytest.mark.skipif(not FLAGS & sandbox._NEWNET, reason="no network namespace on this machine")
def test_socket_connection_to_localhost_fails_and_reaches_no_listener():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))  # a real listener on the host's loopback
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        r = run_python(f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                       "    print('connected')\nexcept OSError as e:\n    print('failed', e.errno)")
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected
    assert r.stdout.startswith("failed")


def test_parent_environment_secret_is_invisible(monkeypatch):
    secret = f"sk-{random.getrandbits(64):x}"
    monkeypatch.setenv("NANORL_TEST_SECRET", secret)
    r = run_python(f"import os\nprint(sorted(os.environ))\nfor pid in (os.getppid(), {os.getpid()}):\n    try:\n"
                   "        print(open(f'/proc/{pid}/environ').read())\n    except OSError as e:\n"
                   "        print(type(e).__name__)")
    assert r.stdout.splitlines()[0] in ("[]", "['LC_CTYPE']")  # Python itself may set LC_CTYPE (PEP 538)
    if FLAGS & sandbox._NEWPID or UID_BASE:  # otherwise the code runs as us and may read our /proc/<pid>/environ
        assert secret not in r.stdout + r.stderr


@contained
def test_model_code_cannot_kill_the_trainer():
    r = run_python(f"import os, signal\nfor pid in (os.getppid(), {os.getpid()}, -1):\n    try:\n"
                   "        os.kill(pid, signal.SIGKILL)\n        print(pid, 'sent')\n    except OSError as e:\n"
                   "        print(pid, type(e).__name__)")
    lines = r.stdout.splitlines()
    assert lines[1] in (f"{os.getpid()} ProcessLookupError", f"{os.getpid()} PermissionError")
    assert len(lines) == 3 and not r.timed_out  # and this test process is still here to check


def detach(marker: str) -> str:
    """Code that leaves a grandchild running `sleep <marker>` in a session of its own, waits
    until that really runs, and exits."""
    return f"""
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/bin/sleep", ["/bin/sleep", "{marker}"])
    os._exit(0)
for _ in range(200):
    if any(b"{marker}" in open(f"/proc/{{p}}/cmdline", "rb").read() for p in os.listdir("/proc") if p.isdigit()):
        print("detached child running")
        break
    time.sleep(0.01)
"""


@contained
def test_detached_child_does_not_outlive_the_run():
    marker = f"{random.randint(10_000, 99_999)}.{random.randint(1, 999_999)}"  # a unique `sleep` argument
    r = run_python(detach(marker))
    assert r.stdout == "detached child running\n" and not r.timed_out and survivors(marker) == []


def until(check, seconds: float = 10.0):
    """check()'s first truthy value, polled every 10 ms; its last value once `seconds` have passed."""
    end = time.monotonic() + seconds
    while not (out := check()) and time.monotonic() < end:
        time.sleep(0.01)
    return out


@pytest.mark.parametrize("interrupted", [False, True], ids=["backstop", "ctrl-c"])
def test_a_run_stuck_past_the_backstop_or_interrupted_leaves_no_process_behind(monkeypatch, interrupted):
    """The launcher enforces timeout_s; should it hang, run_python's own deadline (or a Ctrl-C in the
    trainer) kills the launcher's group, and as root every process of the run's uid, which setuid has
    freed from dying with the launcher."""
    # a unique `sleep` argument, and 20 s: were the run not stopped, it would end well before its timeout_s
    marker = f"20.{random.randint(100_000, 999_999)}"
    read_all = sandbox._read_all

    def stuck(files, caps, deadline):  # once the code runs, the backstop passes or Ctrl-C lands
        assert until(lambda: survivors(marker, sandbox_uids=False)), "the code never started"
        if interrupted:
            raise KeyboardInterrupt
        return read_all(files, caps, time.monotonic() + 0.1)

    monkeypatch.setattr(sandbox, "_read_all", stuck)
    code = f"import os\nos.execv('/bin/sleep', ['/bin/sleep', '{marker}'])"
    try:
        if interrupted:
            with pytest.raises(KeyboardInterrupt):
                run_python(code, timeout_s=30.0)
        else:  # no status from the launcher: its own exit, SIGKILL, stands for the run's
            r = run_python(code, timeout_s=30.0)
            assert r == sandbox.SandboxResult("", "", -signal.SIGKILL, True, False)
        assert until(lambda: not survivors(marker)) and survivors(marker) == []
    finally:
        for pid in survivors(marker):  # only if it failed: leave no `sleep` running for hours
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_huge_output_is_truncated_while_reading():
    before = peak_rss_mb(reset=True)
    r = run_python("print('x' * 10**8)", max_output=1000)
    assert r.truncated and r.stdout == "x" * 1000 and r.returncode == 0
    assert peak_rss_mb() - before < 50  # the 100 MB never came into this process, only the 1,000 bytes kept


def test_output_of_exactly_max_output_is_whole_and_one_more_byte_in_a_later_write_is_reported_cut():
    r = run_python("print('x' * 999)", max_output=1000)  # 1,000 bytes with the newline: nothing dropped
    assert (r.stdout, r.truncated) == ("x" * 999 + "\n", False)
    r = run_python("import time\nprint('x' * 1000, end='', flush=True)\ntime.sleep(0.1)\nprint('y', end='')",
                   max_output=1000)  # the dropped byte comes alone, in a read of its own
    assert (r.stdout, r.truncated) == ("x" * 1000, True)


def test_a_run_with_max_output_0_still_reports_its_exit_code_and_timeout():
    """The launcher's status ("returncode timed_out") came back through the same capped reader: with
    max_output=0 a sys.exit(3) read as exit 0 and a timed-out run as a finished one; 2 raised ValueError."""
    r = run_python("import sys\nprint('hi')\nsys.exit(3)", max_output=0)
    assert r == sandbox.SandboxResult("", "", 3, False, True)  # "hi" was dropped
    r = run_python("while True:\n    pass", timeout_s=0.5, max_output=2)
    assert r == sandbox.SandboxResult("", "", -signal.SIGKILL, True, False)


def test_the_default_limits_are_the_documented_ones_as_the_code_sees_them():
    """5 s of wall clock, 5 s of CPU, 512 MB of address space, files of 16 MB on a scratch of 16 MB and
    256 inodes, 64 open files, 8 processes, and 4,000 characters of each stream."""
    r = run_python("import os, resource as r, sys, time\nstart = time.monotonic()\n"
                   "print([r.getrlimit(k) for k in (r.RLIMIT_CPU, r.RLIMIT_AS, r.RLIMIT_FSIZE, "
                   "r.RLIMIT_NOFILE, r.RLIMIT_NPROC)])\ns = os.statvfs('/tmp')\n"
                   "print(s.f_blocks * s.f_frsize, s.f_files)\nprint('x' * 5000, flush=True)\n"
                   "while True:  # how long the code has run, on stderr\n    time.sleep(0.1)\n"
                   "    print(time.monotonic() - start, file=sys.stderr, flush=True)")
    mb = lambda n: (n << 20, n << 20)
    head = f"[(5, 5), {mb(512)}, {mb(16)}, (64, 64), (8, 8)]\n{16 << 20} 256\n"
    assert r.stdout == head + "x" * (4000 - len(head)) and r.truncated
    assert r.timed_out and r.returncode == -signal.SIGKILL
    assert 3.5 <= float(r.stderr.split()[-1]) < 5.0  # 5 s from the launcher's start, before the code's


def test_a_launcher_slow_to_start_still_gets_its_whole_timeout(tmp_path):
    """run_python's own deadline is a backstop 10 s past timeout_s, for a launcher that hangs: one that
    takes a while to start (a loaded machine) is not killed for it."""
    slow = tmp_path / "python3"
    slow.write_text(f"#!/bin/sh\nsleep 1\nexec {PYTHON} \"$@\"\n")
    slow.chmod(0o755)
    r = run_python("print(42)", timeout_s=0.5, plan=(str(slow), FLAGS, UID_BASE))
    assert (r.stdout, r.returncode, r.timed_out) == ("42\n", 0, False)


def test_writes_land_in_a_private_scratch_that_vanishes():
    leak = f"/tmp/nanorl-leak-{random.getrandbits(32):x}"
    r = run_python(f"import os\nopen('here.txt', 'w').write('x')\nopen('{leak}', 'w').write('x')\nprint(os.getcwd())")
    assert r.stdout == "/tmp\n" and not os.path.exists(leak) and not os.path.exists("/tmp/here.txt")


def test_a_scratch_directory_that_will_not_delete_costs_the_call_nothing(monkeypatch, tmp_path):
    """Without a mount namespace the code works in that directory, and a process of its that the SIGKILL has
    not ended yet may still write there while it is removed (ENOTEMPTY): no reason to lose the result."""
    def refuse(path, onerror=None, onexc=None):  # as rmtree reports what it could not remove (3.11, 3.12):
        try:  # from inside its except, where the handler's bare `raise` re-raises it
            raise OSError(errno.ENOTEMPTY, "Directory not empty", path)
        except OSError as e:
            onexc(os.rmdir, path, e) if onexc else onerror(os.rmdir, path, sys.exc_info())
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for owner, name in ((tempfile, "_rmtree"), (tempfile._shutil, "rmtree")):  # what its cleanup calls:
        if hasattr(owner, name):  # Python 3.11.2's tempfile bound rmtree at import, as _rmtree; 3.11.7's not
            monkeypatch.setattr(owner, name, refuse)
    r = run_python("print(6 * 7)")
    assert (r.stdout, r.returncode, r.timed_out) == ("42\n", 0, False)
    assert [p.name[:15] for p in tmp_path.iterdir()] == ["nanorl-sandbox-"]  # left, not lost in a raise


@pytest.mark.skipif(not UID_BASE, reason="a uid per run needs root")
def test_each_run_gets_its_own_unprivileged_uid_and_no_groups():
    ids = [run_python("import os\nprint(os.getuid(), os.getgid(), os.getgroups())").stdout for _ in range(2)]
    (uid1, gid1, groups1), (uid2, *_) = (line.split(" ", 2) for line in ids)
    assert int(uid1) >= SANDBOX_UID_BASE and uid1 == gid1 and groups1 == "[]\n" and uid1 != uid2
    # root's home is hidden (an empty tmpfs), and without the mount namespace the uid alone keeps it unread
    assert run_python("print(open('/root/.bashrc').read())").stderr.endswith("No such file or directory: "
                                                                           "'/root/.bashrc'\n")
    assert run_python("print(open('/root/.bashrc').read())", plan=(PYTHON, 0, UID_BASE)).stderr.endswith(
        "Permission denied: '/root/.bashrc'\n")


@pytest.mark.skipif(not UID_BASE, reason="a uid per run needs root")
def test_root_without_namespaces_still_reaps_detached_children_and_spares_the_trainer():
    """What holds where unshare is refused (e.g. Docker's default seccomp) but setuid works."""
    marker = f"{random.randint(10_000, 99_999)}.{random.randint(1, 999_999)}"
    no_namespaces = (PYTHON, 0, UID_BASE)
    r = run_python(detach(marker), nproc=32, plan=no_namespaces)
    assert r.stdout == "detached child running\n" and not r.timed_out and survivors(marker) == []
    r = run_python(f"import os, signal\nfor pid in (os.getppid(), {os.getpid()}, -1):\n"
                   "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError as e:\n"
                   "        print(type(e).__name__)", nproc=32, plan=no_namespaces)
    assert r.stdout == "PermissionError\nPermissionError\n" and r.returncode == 0  # kill(-1) reaches only its uid


def escape_suite_as(user: str, *flags: str) -> dict:
    """Runs tests/sandbox_escapes.py as `user` with the system's python3, from a world-readable copy
    of sandbox.py, against a work directory in the user's home (the project, run dir and home it
    attacks must lie outside /tmp, which the sandbox replaces)."""
    import json
    import pwd
    import shutil
    import subprocess

    if subprocess.run(["id", user], capture_output=True).returncode:
        subprocess.run(["useradd", "-m", user], check=True)
    pw = pwd.getpwnam(user)
    code = Path(tempfile.mkdtemp())
    work = Path(tempfile.mkdtemp(dir=pw.pw_dir))
    try:
        for f in (Path(sandbox.__file__), Path(__file__).with_name("sandbox_escapes.py")):
            shutil.copy(f, code)
        os.chmod(code, 0o755)
        os.chown(work, pw.pw_uid, pw.pw_gid)
        r = subprocess.run(["setpriv", "--reuid", user, "--regid", user, "--clear-groups", "/usr/bin/python3",
                            str(code / "sandbox_escapes.py"), str(code), str(work), *flags],
                           capture_output=True, text=True, timeout=300, cwd=code, env={"PATH": os.environ["PATH"]})
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)
    finally:
        shutil.rmtree(code)
        shutil.rmtree(work)


as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to act as another user, too)")


@as_root
def test_escape_suite_is_contained_as_root():
    from sandbox_escapes import escapes

    work = Path(tempfile.mkdtemp(dir=Path.home()))
    try:
        failed = {k: v for k, v in escapes(run_python, work).items() if not v[0]}
    finally:
        import shutil

        shutil.rmtree(work)
    assert failed == {}


@as_root
def test_escape_suite_is_contained_as_an_ordinary_user():
    failed = {k: v for k, v in escape_suite_as("nanorl-tester").items() if not v[0]}
    assert failed == {}


@as_root
def test_without_user_namespaces_an_ordinary_user_is_refused_in_one_line_unless_weak():
    refused = escape_suite_as("nanorl-tester", "--plan", "--no-userns")
    assert refused.startswith("sandbox: cannot isolate model code here (sandbox setup failed: unshare:")
    assert "--sandbox weak" in refused and "\n" not in refused
    assert escape_suite_as("nanorl-tester", "--plan", "--no-userns", "--weak")[1:] == [0, 0]


@as_root
def test_the_weak_mode_of_an_ordinary_user_lets_the_code_start_its_own_processes_up_to_the_limit():
    """RLIMIT_NPROC counts all the user's threads on the machine (here 10 other processes; the trainer alone
    has more than 8), so in the weak mode every fork of the code failed; the run's come on top of them now."""
    said, forked = escape_suite_as("nanorl-tester", "--no-userns", "--weak", "--fork")
    # nproc 8, the code's own process one of them (7), as under a uid of its own; 8 if a process counted
    # at the start (the previous run's launcher, exiting) was gone by the last fork
    assert said == "hi" and int(forked) in (7, 8)


@as_root
def test_root_where_unshare_is_denied_is_refused_unless_weak_which_keeps_the_uid_per_run():
    refused = escape_suite_as("root", "--plan", "--no-unshare")  # a seccomp filter, as Docker's default profile
    assert refused.startswith("sandbox: cannot isolate model code here (sandbox setup failed: unshare: Operation")
    assert escape_suite_as("root", "--plan", "--no-unshare", "--weak")[1:] == [0, SANDBOX_UID_BASE]


def test_the_sandbox_flag_reaches_run_python_in_the_trainer_and_in_workers(monkeypatch, capsys, tmp_path):
    """--sandbox is validated, recorded in config.yaml, and is the mode run_python asks for after
    start-up, in a sync trainer and in a rollout worker alike (both go through train.validate)."""
    import train
    import utils

    assert "unknown --sandbox 'lax'" in _one_line_error(capsys, ["--sandbox", "lax"])
    cfg = train.parse(["--task", "python_tool", "--sandbox", "weak"])
    (tmp_path / "config.yaml").write_text(utils.dump_config(cfg))
    assert "sandbox: weak" in (tmp_path / "config.yaml").read_text().splitlines()
    asked = []
    monkeypatch.setattr(sandbox, "sandbox_plan", lambda mode: asked.append(mode) or (PYTHON, FLAGS, UID_BASE))
    monkeypatch.setattr(sandbox, "_mode", "strict")
    for role in ({}, {"role": "rollout", "trainer_url": "http://127.0.0.1:9"}):
        train.validate(train.Config(task="python_tool", sandbox="weak", **role))
        assert run_python("print(6 * 7)").stdout == "42\n"
    assert asked == ["weak", "weak"] * 2


def test_the_sandbox_flag_reaches_run_python_for_an_env_of_ones_own_that_runs_code(monkeypatch):
    """Only --task python_tool applied --sandbox: a code tool env of the user's own ignored --sandbox weak
    (its code refused where namespaces fail, though the run opted in) and its sandbox went unchecked."""
    import envs
    import train

    class Hard(PythonToolEnv):  # python_tool with more time, under a name of its own
        timeout_s = 10.0

    class Shell(envs.TextEnv):  # or any env whose respond() calls run_python
        task = envs.PythonTask

        def respond(self, completion):
            return run_python(completion).stdout, 0.0, False

    monkeypatch.setitem(envs.TEXT_ENVS, "python_hard", Hard)
    monkeypatch.setitem(envs.TEXT_ENVS, "shell", Shell)
    asked = []
    monkeypatch.setattr(sandbox, "sandbox_plan", lambda mode: asked.append(mode) or (PYTHON, FLAGS, UID_BASE))
    for task, mode in (("python_hard", "strict"), ("python_hard", "weak"), ("shell", "weak")):
        monkeypatch.setattr(sandbox, "_mode", "strict")
        train.validate(train.Config(task=task, sandbox=mode))
        assert sandbox._mode == mode
    assert asked == ["strict", "weak", "weak"]


def test_where_the_strict_sandbox_fails_the_refusal_names_the_reason_and_weak_logs_it(monkeypatch, capsys):
    # As a kernel without IPC namespaces: unshare(2) refuses the flag with EINVAL (0x1 is no namespace flag)
    monkeypatch.setattr(sandbox, "_NEWIPC", 0x1)
    uncached = functools.cache(sandbox.sandbox_plan.__wrapped__)  # a fresh cache, this test's alone
    monkeypatch.setattr(sandbox, "sandbox_plan", uncached)
    monkeypatch.setattr(sandbox, "_mode", "weak")  # an earlier use("weak") in this process (a test's, a
    err = _one_line_error(capsys, ["--task", "python_tool"])  # library user's) stayed in use: fail open
    assert err.startswith("error: sandbox: cannot isolate model code here (sandbox setup failed: unshare: "
                          "Invalid argument). Allow unprivileged user namespaces")
    assert "--sandbox weak" in err and sandbox._mode == "strict"
    assert sandbox.sandbox_plan("weak")[1:] == (0, UID_BASE)
    assert capsys.readouterr().err.endswith(": sandbox setup failed: unshare: Invalid argument\n")


def test_a_launcher_that_fails_after_the_code_ran_is_no_sandbox(monkeypatch, tmp_path):
    """A python3 without os.pidfd_open (3.8, as root's system Python on Ubuntu 20.04) ran the check's code,
    which printed 42, then failed to enforce the wall clock: the check passed, and every run outlived its
    timeout. A plan now needs the launcher's own success too."""
    fake = tmp_path / "python3"  # runs `-I -S -c LAUNCHER args` as the real one would, without pidfd_open
    fake.write_text(f"#!{PYTHON} -I\nimport os, sys, time\nsys.argv = sys.argv[4:]\n"
                    "def pidfd_open(pid):  # after the code's print: the launcher fails once it has run\n"
                    "    time.sleep(2)\n    raise AttributeError(\"module 'os' has no attribute 'pidfd_open'\")\n"
                    "os.pidfd_open = pidfd_open\nexec(sys.argv[0])\n")
    fake.chmod(0o755)
    r = run_python("print(42)", plan=(str(fake), FLAGS, 0))
    assert r.stdout == "42\n" and r.returncode == 1 and "pidfd_open" in r.stderr  # what the check saw
    monkeypatch.setattr(sandbox.sys, "executable", str(fake))
    monkeypatch.setattr(sandbox.shutil, "which", lambda *a, **k: None)
    with pytest.raises(SandboxUnavailable, match=r"cannot isolate model code here \(AttributeError: .*pidfd_open"):
        sandbox.sandbox_plan.__wrapped__("strict")


def test_sql_cannot_register_a_pointer_as_an_fts3_tokenizer():
    """fts3_tokenizer('simple') gave libsqlite's address and fts3_tokenizer(name, blob) took any pointer: the
    first steps of a known SQLite code-execution technique, in a child with the trainer's rights."""
    from envs import sql_database

    for query in ("SELECT hex(fts3_tokenizer('simple'))", "SELECT FTS3_TOKENIZER('x', x'4141414141414141')"):
        with pytest.raises(sqlite3.DatabaseError, match="not authorized"):
            sandbox.run_sql(sql_database("shop"), query)
    assert sandbox.run_sql(sql_database("shop"), "SELECT lower('A'), count(*) > 0 FROM customers")[1] == [("a", 1)]


def _one_line_error(capsys, argv) -> str:
    import train

    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


# ---------------------------------------------------------------- SQL: limits a query cannot call its way out of
SORT_BLOBS = ("WITH RECURSIVE r(i, b) AS (SELECT 1, zeroblob(900000) UNION ALL SELECT i + 1, zeroblob(900000) FROM r "
              "LIMIT 3000) SELECT i, length(b) FROM r ORDER BY b DESC LIMIT 1 OFFSET 2999")  # a 2.7 GB sort
# (the offset makes SQLite hold every row: for LIMIT 1 alone it keeps only the best row so far)


def peak_rss_mb(reset: bool = False) -> int:
    if reset:  # "5" resets the peak (VmHWM) to the current RSS
        Path("/proc/self/clear_refs").write_text("5")
    return int(Path("/proc/self/status").read_text().split("VmHWM:")[1].split()[0]) >> 10


def test_sql_one_function_call_cannot_outrun_the_wall_clock():
    from envs import sql_database

    start = time.monotonic()
    with pytest.raises(sqlite3.OperationalError, match="interrupted"):  # ran 25 s in one printf call in-process
        sandbox.run_sql(sql_database("shop"), "SELECT length(printf('%.*c', 999999999, name)) FROM customers",
                        timeout_s=1.0)
    # timeout_s and 0.5 s more for the query process to start; slack for a loaded CI machine; unbounded: 25 s
    assert 1.0 + 0.5 <= time.monotonic() - start < 1.0 + 5.0


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["oom-killer", "ctrl-c"])
def test_sql_a_killed_query_process_raises_operational_error_naming_its_death(sig):
    """As the OOM killer would: the child dies without a word, and the caller gets an sqlite3.Error; one
    that says something on the way (the traceback of a Ctrl-C) has its last words in the message."""
    from envs import sql_database

    def kill_the_query_child():  # once it has the database open: past Python's start, its handlers set
        for f in until(lambda: [f for f in Path("/proc").glob("[0-9]*/cmdline") if child(f) and opened(f)]):
            os.kill(int(f.parent.name), sig)

    def opened(f: Path) -> bool:
        with contextlib.suppress(OSError):
            return any(os.readlink(fd) == str(Path(path).resolve()) for fd in (f.parent / "fd").iterdir())
        return False

    def child(f: Path) -> bool:  # ours (not another test run's): our child, running _SQL_CHILD
        with contextlib.suppress(OSError):
            ppid = int((f.parent / "stat").read_text().rsplit(")", 1)[1].split()[1])
            return ppid == os.getpid() and sandbox._SQL_CHILD.encode() in f.read_bytes()
        return False

    path, killer = sql_database("shop"), threading.Thread(target=kill_the_query_child)
    killer.start()
    try:
        with pytest.raises(sqlite3.OperationalError) as e:  # the query runs on and on: it dies first
            sandbox.run_sql(path, "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
                                  "SELECT x FROM c WHERE x % 1000000 = 0", timeout_s=30.0)
    finally:
        killer.join()
    if sig == signal.SIGKILL:
        assert str(e.value) == f"query process died ({-signal.SIGKILL}): b''"
    else:  # KeyboardInterrupt between two of the query's rows: Python prints it, then dies of the signal
        died = rf"query process died \({-signal.SIGINT}\): "
        assert re.fullmatch(died + r"b'Traceback \(most recent call last\):\\n.*\\nKeyboardInterrupt\\n'",
                            str(e.value)), str(e.value)


CTRL_C_MID_QUERY = """
import os, signal, sys, threading
sys.path.insert(0, sys.argv[1])
import sandbox
from envs import sql_database
signal.signal(signal.SIGINT, lambda *_: print("the run saw it", flush=True))  # train.py's first Ctrl-C: go on
path = sql_database("shop")
threading.Timer(0.2, os.killpg, (0, signal.SIGINT)).start()  # the terminal's Ctrl-C: its whole process group
query = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 10000000) SELECT count(*) FROM c"
print(sandbox.run_sql(path, query, timeout_s=60.0))  # about 2 s here
"""


def test_a_ctrl_c_at_the_terminal_leaves_a_running_query_to_finish():
    """Ctrl-C signals the terminal's whole process group. The run finishes its step on the first one, but
    the SQL child was in that group and died of it: the step's tool replies read "query process died (1):
    ...KeyboardInterrupt", and a right answer scored 0. The child now has a session of its own."""
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-c", CTRL_C_MID_QUERY, str(root)], start_new_session=True,
                       capture_output=True, text=True, timeout=300)
    assert r.stdout.splitlines() == ["the run saw it", "(['count(*)'], [(10000000,)], False)"], r.stderr[-500:]


def test_sql_by_default_returns_1000_rows_and_8_mb_and_says_when_more_exist():
    from envs import sql_database

    path = sql_database("shop")
    count = "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r LIMIT {})"
    thousand = [(i,) for i in range(1, 1001)]
    assert sandbox.run_sql(path, count.format(1000) + " SELECT i FROM r") == (["i"], thousand, False)
    assert sandbox.run_sql(path, count.format(1001) + " SELECT i FROM r") == (["i"], thousand, True)
    # the size of a row is its JSON as sent, ["x...x"]: 4 bytes more than its string. 8 strings of 999,999
    # (SQLite's longest here) and one of 388,580 make 8 * 1,000,003 + 388,584 = 8,388,608 bytes: 8 MB exactly
    last = count.format(9) + " SELECT printf('%.*c', CASE WHEN i < 9 THEN 999999 ELSE {} END, 'x') FROM r"
    _, rows, more = sandbox.run_sql(path, last.format(388_580))
    assert [len(row[0]) for row in rows] == [999_999] * 8 + [388_580] and not more
    with pytest.raises(sqlite3.DataError, match="^result over 8388608 bytes: select fewer or shorter rows$"):
        sandbox.run_sql(path, last.format(388_581))


def test_sql_the_8_mb_counts_bytes_sent_so_an_escaped_character_counts_12_not_1():
    """JSON escapes a character outside the BMP as two \\uXXXX: 12 bytes, where repr, the count before,
    saw 1, and a query of emoji sent the caller 91 MB. 100,000 emoji a row: 1,200,004 bytes; 6 rows are
    7,200,024 bytes, 7 are 8,400,028, past 8,388,608."""
    from envs import sql_database

    query = ("WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r LIMIT {}) "
             "SELECT replace(printf('%.*c', 100000, 'x'), 'x', char(128512)) FROM r")
    _, rows, _ = sandbox.run_sql(sql_database("shop"), query.format(6))
    assert [row[0] for row in rows] == ["\U0001F600" * 100_000] * 6
    with pytest.raises(sqlite3.DataError, match="^result over 8388608 bytes"):
        sandbox.run_sql(sql_database("shop"), query.format(7))


def test_sql_by_default_a_query_may_sort_180_mb_but_not_315_mb_in_its_256_mb():
    from envs import sql_database

    sort = SORT_BLOBS.replace("3000", "{0}").replace("2999", "{1}")  # n rows of 900 kB, all held at once
    assert sandbox.run_sql(sql_database("shop"), sort.format(200, 199)) == (["i", "length(b)"],
                                                                            [(200, 900000)], False)
    with pytest.raises(sqlite3.OperationalError, match="^out of memory$"):
        sandbox.run_sql(sql_database("shop"), sort.format(350, 349))


def test_eight_concurrent_runaway_queries_leave_the_callers_memory_flat():
    from concurrent.futures import ThreadPoolExecutor

    from envs import sql_database

    path, errors = sql_database("shop"), []
    before = peak_rss_mb(reset=True)

    def attack(query):
        with pytest.raises(sqlite3.Error) as e:
            sandbox.run_sql(path, query, timeout_s=3.0)
        errors.append(str(e.value))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(attack, [SORT_BLOBS] * 4 + [SORT_BLOBS.replace("UNION ALL", "UNION")] * 4))
    assert len(errors) == 8 and peak_rss_mb() - before < 50, (errors, before, peak_rss_mb())
    with pytest.raises(sqlite3.DataError, match="result over"):  # 1,000 rows of 900 kB: 900 MB of results
        sandbox.run_sql(path, "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r LIMIT 1000) "
                              "SELECT zeroblob(900000) FROM r")
