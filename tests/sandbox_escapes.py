"""The sandbox escape suite, standard library only, so that it runs as any uid with the system's
python3 (tests/test_sandbox.py runs it as root and as an unprivileged user; bench/attacks.py
prints it). `python3 sandbox_escapes.py SANDBOX_DIR WORK_DIR` prints {attack: [contained, observed]}
as JSON; WORK_DIR stands for the caller's project, run directory and home, owned by the caller."""
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path


MINIMAL_DEV = "fd full null random shm stderr stdin stdout urandom zero"  # and no disk, kvm, kmsg, tty...
# The host's directories the code may see (all read-only), and the one its interpreter lives under
SYSTEM = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp", "usr"}
ADD_KEY, KEYCTL = {"x86_64": (248, 250), "aarch64": (217, 219)}.get(os.uname().machine, (-1, -1))


def _survivors(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:  # it exited while we looked
            pass
    return found


def _interrupted(run_python) -> tuple[bool, str]:
    """Ctrl-C reaches the caller while the run's code sleeps: run_python kills what the run started
    (its process group, and as root every process of its uid, which setuid freed from dying with it)."""
    marker = f"{random.randint(10_000, 99_999)}.{random.randint(1, 999_999)}"

    def ctrl_c_once_it_runs():
        end = time.monotonic() + 10
        while not _survivors(marker) and time.monotonic() < end:
            time.sleep(0.01)
        if _survivors(marker):
            os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=ctrl_c_once_it_runs)
    thread.start()
    code = f"import os\nos.execv('/bin/sleep', ['/bin/sleep', '{marker}'])"
    try:
        seen = f"not interrupted: exit {run_python(code, timeout_s=5.0).returncode}"
    except KeyboardInterrupt:
        seen = "interrupted"
    thread.join()
    end = time.monotonic() + 2  # SIGKILL is sent; gone within moments
    while _survivors(marker) and time.monotonic() < end:
        time.sleep(0.01)
    left = _survivors(marker)
    for pid in left:  # (a failure) not left behind by this script
        os.kill(pid, 9)
    return seen == "interrupted" and not left, f"{seen}; survivors {left}"


def _keyring(run_python, token: str) -> tuple[bool, str]:
    """The caller's session keyring holds a key (a token, as a login's or a service's might); the code
    searches its session, user and user-session keyrings for it and tries to add keys of its own."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    key = libc.syscall(ADD_KEY, b"user", b"nanorl-escape", token.encode(), len(token), -3)
    r = run_python(f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nbuf = ctypes.create_string_buffer(99)\n"
                   f"for ring in (-3, -4, -5):\n"
                   f"    k = libc.syscall({KEYCTL}, 10, ring, b'user', b'nanorl-escape', 0)\n"
                   f"    print(k, libc.syscall({KEYCTL}, 11, k, buf, 99), buf.value.decode())\n"
                   f"print('added', libc.syscall({ADD_KEY}, b'user', b'mine', b'x', 1, -3))")
    if key > 0:
        libc.syscall(KEYCTL, 21, key)  # KEYCTL_INVALIDATE
    return token not in r.stdout and "added -1" in r.stdout, (r.stdout.strip() or r.stderr)[-80:]


def escapes(run_python, work: Path) -> dict[str, tuple[bool, str]]:
    """Runs each attack through `run_python` and checks the host afterwards: (contained, what was seen)."""
    project, run_dir, home = work / "project", work / "runs" / "r1", work / "home"
    for d in (project, run_dir, home):
        d.mkdir(parents=True, exist_ok=True)
    (project / "train.py").write_text("print('train')\n")
    (run_dir / "meta.json").write_text("{}")
    out = {}
    for name, path in (("append to the project's train.py", project / "train.py"),
                       ("rewrite the run's meta.json", run_dir / "meta.json"), ("create ~/.bashrc", home / ".bashrc")):
        before = path.read_bytes() if path.exists() else None
        r = run_python(f"open({str(path)!r}, 'a').write('import os; os.system(\"id\")')")
        after = path.read_bytes() if path.exists() else None
        out[name] = (before == after, (r.stderr.strip().splitlines() or ["no error"])[-1][:80])

    # The caller's processes, standing in for the trainer: one holds the token in its environment
    token = f"tok-{random.getrandbits(64):x}"
    os.environ["NANORL_TOKEN"] = token
    victim = subprocess.Popen(["/bin/sleep", "60"], env={"NANORL_TOKEN": token})
    r = run_python(f"import os\nprint(dict(os.environ))\nfor p in [{victim.pid}, os.getppid()] + os.listdir('/proc'):\n"
                   "    try:\n        print(open(f'/proc/{p}/environ').read())\n    except (OSError, ValueError):\n"
                   "        pass")
    out["read NANORL_TOKEN from the environment or /proc"] = (token not in r.stdout + r.stderr, r.stdout[:40])

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        r = run_python(f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {server.getsockname()[1]}), "
                       "timeout=2)\n    print('connected')\nexcept OSError as e:\n    print(e)")
        try:
            server.accept()
            reached = True
        except BlockingIOError:
            reached = False
    out["connect to the trainer's port on 127.0.0.1"] = (not reached, r.stdout.strip()[:80])

    free = shutil.disk_usage(work).free, shutil.disk_usage("/tmp").free
    r = run_python("import os\nn = 0\ntry:\n    for i in range(128):\n        with open(f'f{i}', 'wb') as f:\n"
                   "            for _ in range(16):\n                n += f.write(b'x' * 2**20)\nexcept OSError as e:\n"
                   "    print(n, e.strerror)", timeout_s=20.0)
    grew = max(a - b for a, b in zip(free, (shutil.disk_usage(work).free, shutil.disk_usage("/tmp").free)))
    written = int(r.stdout.split()[0]) if r.stdout else -1  # -1: killed (by the CPU limit) before a write failed
    out["fill the disk: 128 files of 16 MB"] = (0 <= written <= 16 << 20 and grew < 64 << 20,
                                                f"{written >> 20} MB written: {r.stdout.strip()[-40:]}" if r.stdout
                                                else f"no write failed; exit {r.returncode}")
    r = run_python("n = 0\ntry:\n    while n < 100_000:\n        open(f'e{n}', 'w').close()\n        n += 1\n"
                   "except OSError as e:\n    print(n, e.strerror)", timeout_s=20.0)
    out["fill the disk: 100,000 empty files"] = (r.stdout[:1].isdigit() and int(r.stdout.split()[0]) < 100_000,
                                                  r.stdout.strip()[:60] or f"no create failed; exit {r.returncode}")

    marker = f"{random.randint(10_000, 99_999)}.{random.randint(1, 999_999)}"
    r = run_python(f"import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                   f"        os.execv('/bin/sleep', ['/bin/sleep', '{marker}'])\n    os._exit(0)\ntime.sleep(0.5)\n"
                   "print('forked')")
    out["double-forked setsid survivor"] = (_survivors(marker) == [], f"{r.stdout.strip()}; survivors "
                                                                      f"{_survivors(marker)}")
    for pid in _survivors(marker):  # (weak mode) not left behind by this script
        os.kill(pid, 9)
    out["outlive the trainer's Ctrl-C"] = _interrupted(run_python)
    r = run_python("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                   "print(libc.unshare(0x10000000), ctypes.get_errno())")  # CLONE_NEWUSER
    out["create a nested user namespace"] = (r.stdout.split()[:1] == ["-1"], r.stdout.strip() or r.stderr[-80:])
    r = run_python("import os\nprint(len(open('/dev/urandom', 'rb').read(16)), open('/dev/null', 'w').write('x'))\n"
                   "print(' '.join(sorted(os.listdir('/dev'))))")
    seen = r.stdout.splitlines() + [r.stderr.strip()[-80:]]
    out["see the host's devices in /dev"] = (seen[:2] == ["16 1", MINIMAL_DEV], f"{seen[0]}; /dev: {seen[1][:60]}")
    # Memory past the 512 MB limit (RLIMIT_AS) that no mapping holds: SysV shm segments filled and detached
    # (3 GB held), then memfds (64 fds of 16 MB a process); each must stop at the limit or fail at once
    r = run_python("import ctypes, mmap, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                   "libc.shmat.restype = ctypes.c_void_p\nheld = 0\nfor i in range(16):\n"
                   "    sid = libc.shmget(0, 64 << 20, 0o1600)\n    if sid < 0:\n        break\n"
                   "    addr = libc.shmat(sid, None, 0)\n    ctypes.memset(addr, 1, 64 << 20)\n"
                   "    libc.shmdt(ctypes.c_void_p(addr))\n    held += 64\nfds = []\ntry:\n"
                   "    for i in range(40):\n        fds.append(os.memfd_create('m'))\n"
                   "        os.write(fds[-1], b'x' * (15 << 20))\n        held += 15\nexcept OSError:\n"
                   "    pass\nprint(held)", timeout_s=30.0, cpu_s=30)
    held = int(r.stdout) if r.stdout.strip().isdigit() else -1
    out["hold memory past the limit in SysV shm or memfds"] = (0 <= held <= 512, f"{held} MB; {r.stderr[-60:]}")
    # memfd_secret: memory that no mapping, and so no RLIMIT_AS, counts (40 fds of 15 MB, each filled
    # through windows of 3 MB that RLIMIT_MEMLOCK allows)
    r = run_python("import ctypes, mmap, os\nlibc = ctypes.CDLL(None, use_errno=True)\nheld = 0\n"
                   "for i in range(40):\n    fd = libc.syscall(447, 0)\n    if fd < 0:\n        break\n"
                   "    os.ftruncate(fd, 15 << 20)\n    for at in range(0, 15 << 20, 3 << 20):\n"
                   "        with mmap.mmap(fd, 3 << 20, offset=at) as m:\n            m.write(b'x' * (3 << 20))\n"
                   "    held += 15\nprint(held)", timeout_s=30.0, cpu_s=30)
    held = int(r.stdout) if r.stdout.strip().isdigit() else -1
    out["hold memory past the limit in secret memfds"] = (0 <= held <= 512, f"{held} MB; {r.stderr[-60:]}")
    r = run_python("import os, sys\nprint(' '.join(sorted(os.listdir('/'))))\nprint(sys.base_prefix.split('/')[1])")
    seen = (r.stdout.splitlines() + ["", ""])[:2]
    out["see the host's directories (the project, runs, caches)"] = (
        bool(seen[0]) and set(seen[0].split()) <= SYSTEM | {seen[1]}, seen[0][:80] or r.stderr[-80:])
    r = run_python("import socket\ntry:\n    socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM).bind((-1, 47123))\n"
                   "    print('bound')\nexcept OSError as e:\n    print(e.strerror)")
    out["open a vsock socket (the hypervisor's, which no namespace confines)"] = (
        r.stdout.strip() not in ("bound", ""), r.stdout.strip() or r.stderr[-80:])
    r = run_python("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                   "params = ctypes.create_string_buffer(120)\n"
                   "print(libc.syscall(425, 4, params))")  # io_uring_setup: its ops would open sockets unfiltered
    out["set up io_uring"] = (r.stdout.strip() == "-1", r.stdout.strip() or r.stderr[-80:])
    out["read a key from the caller's keyrings, or add one"] = _keyring(run_python, token)
    secret = work / "secret.txt"  # in the caller's home: 0600, as ~/.ssh/id_* or a hub token
    secret.write_text(token)
    secret.chmod(0o600)
    r = run_python(f"print(open({str(secret)!r}).read())")
    out["read a private file in the caller's home"] = (token not in r.stdout, (r.stdout + r.stderr)[-80:])
    r = run_python(f"import os, signal\ntry:\n    os.kill({victim.pid}, signal.SIGKILL)\n    print('sent')\n"
                   "except OSError as e:\n    print(e.strerror)")
    time.sleep(0.2)
    out["SIGKILL a process of the caller"] = (victim.poll() is None, r.stdout.strip())
    victim.kill()
    victim.wait()
    return out


def forbid_user_namespaces():
    """Makes this process a machine without unprivileged user namespaces: it enters one of its own
    (mapping only its uid) and sets that namespace's limit on nested ones to 0."""
    import ctypes

    ids = os.getuid(), os.getgid()
    if ctypes.CDLL(None, use_errno=True).unshare(0x10000000) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER)")
    for name, text in (("self/setgroups", "deny"), ("self/uid_map", f"{ids[0]} {ids[0]} 1"),
                       ("self/gid_map", f"{ids[1]} {ids[1]} 1"), ("sys/user/max_user_namespaces", "0")):
        with open(f"/proc/{name}", "w") as f:
            f.write(text)


def forbid_unshare():
    """Makes unshare(2) fail with EPERM in this process and its children, as Docker's default seccomp
    profile does: a seccomp filter (load the syscall number; unshare, 272 on x86-64: EPERM; else allow)."""
    import ctypes
    import struct

    code = struct.pack("HBBI" * 4, 0x20, 0, 0, 0, 0x15, 0, 1, 272, 0x06, 0, 0, 0x50001, 0x06, 0, 0, 0x7FFF0000)
    buf = ctypes.create_string_buffer(code)
    prog = struct.pack("HxxxxxxQ", 4, ctypes.addressof(buf))
    if ctypes.CDLL(None, use_errno=True).prctl(22, 2, prog) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "seccomp")


if __name__ == "__main__":  # SANDBOX_DIR WORK_DIR [--plan] [--no-userns] [--no-unshare] [--weak]
    sys.path.insert(0, sys.argv[1])
    import sandbox

    if "--no-userns" in sys.argv:
        forbid_user_namespaces()
    if "--no-unshare" in sys.argv:
        forbid_unshare()
    try:
        plan = sandbox.use("weak" if "--weak" in sys.argv else "strict")  # as train's --sandbox does
    except sandbox.SandboxUnavailable as e:
        plan = str(e)
    if "--plan" in sys.argv or isinstance(plan, str):  # only what sandbox_plan decides here
        print(json.dumps(plan))
    elif "--fork" in sys.argv:  # what model code that starts processes gets, and how many a bomb gets
        others = [subprocess.Popen(["/bin/sleep", "30"]) for _ in range(10)]  # the user's other processes
        said = sandbox.run_python("import subprocess\nprint(subprocess.run(['/bin/echo', 'hi'], "
                                  "capture_output=True).stdout.decode().strip())").stdout.strip()
        bomb = sandbox.run_python("import os, time\nn = 0\ntry:\n    while n < 100:\n        if os.fork() == 0:\n"
                                  "            time.sleep(5)\n            os._exit(0)\n        n += 1\n"
                                  "except OSError:\n    pass\nprint(n)", timeout_s=10.0).stdout.strip()
        for p in others:
            p.kill()
        print(json.dumps([said, bomb]))
    else:
        print(json.dumps(escapes(sandbox.run_python, Path(sys.argv[2]))))
