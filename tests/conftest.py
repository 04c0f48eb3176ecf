"""Shared test set-up: offline Hub, small thread count, tiny models built from configs."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers.utils import logging as transformers_logging  # noqa: E402

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    # `pytest -n N`: the workers share the machine's cores, and torch's threads would otherwise each take all of them
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture
def single_thread():
    """One torch thread for tests of tiny models (more threads only synchronise on a shared machine); restored after,
    since the thread count changes float summation order and tests/project/test_pinned_numbers.py pins
    results bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _hf_private_logs_reach_caplog():
    """hf_private logs under transformers' library logger, which does not propagate; caplog listens at the root."""
    transformers_logging.enable_propagation()
    yield
