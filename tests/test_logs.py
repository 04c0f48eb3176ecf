"""Warnings once per run, from the main process only."""

from __future__ import annotations

import logging

from hf_private import DPConfig
from hf_private.logs import get_logger
from hf_private.privacy import rng
from tests.helpers import make_trainer


def test_a_test_seed_run_warns_of_insecure_randomness_once(tmp_path, caplog):
    rng._warn_test_seed.cache_clear()  # once per process: an earlier test may have warned already
    dp = DPConfig(noise_multiplier=1.0, max_grad_norm=1.0, noise_seed=3)
    with caplog.at_level(logging.WARNING, logger="transformers.hf_private"):
        make_trainer(tmp_path, dp=dp, max_steps=2).train()  # noise, sampler and forward noise each key a generator
    insecure = [r for r in caplog.records if r.getMessage().startswith("Insecure test mode: DP randomness")]
    assert len(insecure) == 1


def test_ranks_other_than_the_main_process_keep_only_errors(monkeypatch, caplog):
    logger = get_logger("hf_private.some_module")
    with caplog.at_level(logging.INFO, logger="transformers.hf_private"):
        monkeypatch.setenv("RANK", "1")
        logger.warning("repeated by every rank")
        logger.error("rank 1 failed")
        monkeypatch.setenv("RANK", "0")
        logger.warning("said by the main process")
    assert [r.getMessage() for r in caplog.records] == ["rank 1 failed", "said by the main process"]
