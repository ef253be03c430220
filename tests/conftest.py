import runpy
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
# pyproject's addopts run the suite on 2 xdist workers, a file to a worker at a time (module fixtures are
# shared), the files with the most tests first. Those that run sandboxed code share a worker: test_sandbox
# counts every process of a sandbox uid on the machine.
SANDBOXED = {"test_sandbox.py", "test_envs.py", "test_errors.py", "test_inbox.py"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadFileScheduling

    class Files(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return "sandboxed" if Path(file).name in SANDBOXED else file
    return Files(config, log) if config.getvalue("dist") == "loadfile" else None


def free_url() -> str:
    """A loopback port free now, for a server that must listen where its clients were told to look."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from a second thread, and on a shared 2-core machine a busy
    neighbour makes torch's spinning OpenMP threads 10-50x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def hub_out_of_reach(monkeypatch):
    """A hub out of reach, for real: the hub client's endpoint is a port of this machine where nothing
    listens (a connection is refused), with no proxy that could reach it instead. Yields the endpoint."""
    from huggingface_hub import constants

    endpoint = free_url()
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    yield endpoint


@pytest.fixture
def script(monkeypatch, capsys):
    """A script (bench/<name>.py) run as __main__ in this process (runpy), its command line in sys.argv:
    its exit status and what it wrote, as its own process gives them (a SystemExit's message: stderr,
    status 1). Each process of its own imported torch again (seconds); test_bench's
    test_memory_when_every_setting_fails_names_the_first_error_in_one_line keeps a real process's CLI."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the scripts put the checkout (and tests/) first

    def run(*argv: str) -> subprocess.CompletedProcess:
        monkeypatch.setattr(sys, "argv", list(argv))
        capsys.readouterr()
        try:
            runpy.run_path(str(ROOT / argv[0]), run_name="__main__")
            status = 0
        except SystemExit as e:
            status = e.code
        out, err = capsys.readouterr()
        if isinstance(status, str):  # sys.exit("message"), as the interpreter ends on it
            status, err = 1, err + status + "\n"
        return subprocess.CompletedProcess(argv, status or 0, out, err)
    return run
