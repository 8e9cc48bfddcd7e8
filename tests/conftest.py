"""Shared test set-up: the test process itself computes with one thread, like every rank does.

Single-device references are then computed the same way as on the ranks (one thread), and the
test process does not compete with the ranks it spawns for the machine's cores.
"""
import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
