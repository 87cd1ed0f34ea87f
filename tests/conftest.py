import pytest
import torch

from specframe.decoder import target_info
from specframe.testing.tiny import tiny_llama


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny models run fastest single-threaded, and a busy second core would otherwise stall every matmul.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def target():
    return tiny_llama(vocab_size=8, seed=0)


@pytest.fixture
def info(target):
    return target_info(target)
