"""Warnings once per run, from the main process only."""

from __future__ import annotations

import logging

from transformers.utils import logging as transformers_logging

from hf_private import DPConfig
from hf_private.logs import get_logger
from hf_private.privacy import rng
from tests.support.helpers import make_trainer


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


def _plans(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith("Private training plan")]


def test_the_plan_shows_once_at_transformers_default_verbosity_from_the_main_process(tmp_path, monkeypatch, caplog):
    """Issue 45: the plan was INFO, so a user's own script never showed it."""
    before = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_warning()  # transformers' default
    try:
        with caplog.at_level(logging.WARNING, logger="transformers.hf_private"):
            make_trainer(tmp_path, dp=DPConfig(target_epsilon=3.0, max_grad_norm=1.0))
        plans = _plans(caplog)
        assert len(plans) == 1 and get_logger("hf_private.run.privacy_run").isEnabledFor(plans[0].levelno)
        for field in (
            "N=96 examples",
            "q=",
            "expected logical batch 8 examples",
            "steps",
            "σ=",
            "C=1,",
            "δ=",
            "target ε=3",
        ):
            assert field in plans[0].getMessage()
        caplog.clear()
        monkeypatch.setenv("RANK", "1")  # what every other process of a multi-process run sees
        with caplog.at_level(logging.WARNING, logger="transformers.hf_private"):
            make_trainer(tmp_path, dp=DPConfig(target_epsilon=3.0, max_grad_norm=1.0))
        assert not _plans(caplog)
    finally:
        transformers_logging.set_verbosity(before)
