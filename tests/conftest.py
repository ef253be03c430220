import runpy
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


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

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
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
