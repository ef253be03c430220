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
