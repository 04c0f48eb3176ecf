"""A launch that ends with fewer processes than asked says so (`accelerate launch --cpu --num_processes 2`)."""

from __future__ import annotations

import logging

import pytest

from hf_private.trainer import preflight
from hf_private.trainer.preflight import check_process_count
from tests.support.helpers import make_trainer

LAUNCH_VARIABLES = (
    "WORLD_SIZE",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "MV2_COMM_WORLD_SIZE",
    "MASTER_ADDR",
    "ACCELERATE_MIXED_PRECISION",
)


@pytest.fixture
def clean_launch_environment(monkeypatch):
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == preflight.logger.name]


def test_accelerate_simple_launcher_asked_for_two_processes_is_named(tmp_path, clean_launch_environment, caplog):
    # What `accelerate launch --cpu --num_processes 2` leaves in the one process it starts (accelerate 1.x).
    clean_launch_environment.setenv("ACCELERATE_MIXED_PRECISION", "no")
    clean_launch_environment.setenv("MASTER_ADDR", "127.0.0.1")
    with caplog.at_level(logging.WARNING, logger="transformers.hf_private"):
        make_trainer(tmp_path)
    [message] = _warnings(caplog)
    assert "asked for more than one process" in message and "this run has 1" in message
    assert "accelerate launch --multi_gpu --num_processes N" in message


def test_world_size_below_the_launchers_is_named_with_both_counts(clean_launch_environment, caplog):
    clean_launch_environment.setenv("WORLD_SIZE", "4")
    with caplog.at_level(logging.WARNING, logger="transformers.hf_private"):
        check_process_count(2)
        check_process_count(4)
    [message] = _warnings(caplog)
    assert "asked for 4 processes, but this run has 2" in message


def test_a_plain_single_process_run_is_not_warned(tmp_path, clean_launch_environment, caplog):
    clean_launch_environment.setenv("ACCELERATE_MIXED_PRECISION", "no")  # `accelerate launch script.py`
    with caplog.at_level(logging.WARNING, logger="transformers.hf_private"):
        make_trainer(tmp_path)
    assert _warnings(caplog) == []
