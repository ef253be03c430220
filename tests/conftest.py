import socket

import pytest
import torch


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
