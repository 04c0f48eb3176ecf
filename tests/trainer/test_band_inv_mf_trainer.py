"""DPConfig(noise_mechanism="band-inv-mf") and bands="auto" through PrivateTrainer (issue 50, part 1): b = 1 is DP-SGD
bit for bit, the card's ε is one un-amplified Gaussian recomputable from its entry, the two memory layouts train to the
same weights, resume, refusals by name; "auto" picks the least-error b and the card says so."""

from __future__ import annotations

import logging

import pytest
import torch
import yaml
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant

from hf_private import DPConfig
from hf_private.methods.frost import FrostConfig
from hf_private.privacy import band_auto, band_inv_mf
from hf_private.privacy.band_mf import prefix_loss, step_noise_factor, strategy
from hf_private.privacy.banded_inverse import bisr_coefficients, sensitivity
from hf_private.privacy.calibration import calibrate_noise_multiplier
from hf_private.release.artifacts import BAND_MF_STATE_NAME
from tests.support import tiny
from tests.support.helpers import KillAtStep, make_trainer

HF_LOGGER = "transformers.hf_private"
DATA = dict(dataset=tiny.sentiment_dataset(64), per_device_train_batch_size=8)  # B = 8 of N = 64: q = 1/8


def inverse(bands: int = 4, **overrides) -> DPConfig:
    return DPConfig(**{"target_epsilon": 8.0, "noise_mechanism": "band-inv-mf", "bands": bands, **overrides})


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_one_band_is_dp_sgd_bit_for_bit(tmp_path):
    weights = []
    for name, dp in (
        ("dp-sgd", DPConfig(noise_multiplier=1.0, noise_seed=3)),
        ("band-inv-mf", inverse(1, target_epsilon=None, noise_multiplier=1.0, noise_seed=3)),
    ):
        trainer = make_trainer(tmp_path / name, dp=dp, max_steps=3, **DATA)
        trainer.train()
        weights.append(_weights(trainer))
    assert all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0])
    assert any(not torch.equal(weights[0][n], tiny.bert().state_dict()[n]) for n in weights[0])  # it trained


def test_four_bands_train_and_the_card_epsilon_is_one_gaussian(tmp_path):
    trainer = make_trainer(tmp_path, dp=inverse(4), max_steps=6, save_strategy="steps", save_steps=6, **DATA)
    trainer.train()
    report = trainer.privacy_report()
    (entry,) = report["mechanisms"]
    assert entry["mechanism"] == "band_inv_mf" and entry["bands"] == 4 and entry["steps"] == 6
    bisr = [1, -1 / 2, -1 / 8, -1 / 16]  # the step's noise: these times the last 4 draws
    assert report["band_mf"]["step_noise_factor"] == pytest.approx(sum(d * d for d in bisr) ** 0.5)
    assert trainer.privacy_run.optimizer.banded_noise is trainer.privacy_run.band_mf.noise
    assert trainer.privacy_run.band_mf.noise.step == 6 and trainer.privacy_run.band_mf.noise.layout == "store"
    card_text = (tmp_path / "checkpoint-6" / "README.md").read_text()
    assert "banded-inverse MF" in card_text and "NOT amplified" in card_text  # the noise line
    assert "its guarantee is not amplified by the sampling" in card_text  # what is protected
    card = yaml.safe_load(card_text.split("---")[1])["privacy"]
    (released,) = card["mechanisms"]
    assert (released["sample_rate"], released["steps"], released["accounted_as"]) == (1.0, 1, "gaussian")
    assert released["noise_multiplier"] == pytest.approx(entry["noise_multiplier"] / sensitivity(4, 6))
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dp_event.GaussianDpEvent(released["noise_multiplier"]))  # from the card's entry alone
    independent = accountant.get_epsilon(card["delta"] - card["sampler_tail_delta"])
    assert card["epsilon"] == pytest.approx(independent, rel=0.02) and card["epsilon"] <= 8.0
    state = torch.load(tmp_path / "checkpoint-6" / BAND_MF_STATE_NAME, weights_only=True)
    assert state["mechanism"] == "band-inv-mf" and len(state["noise"]["history"]) == 3


def test_store_and_regenerate_train_the_same_weights(tmp_path, monkeypatch):
    weights = []
    for limit in (band_inv_mf.STORE_LIMIT_BYTES, 0):
        monkeypatch.setattr(band_inv_mf, "STORE_LIMIT_BYTES", limit)
        trainer = make_trainer(tmp_path / str(limit), dp=inverse(3, noise_seed=5), max_steps=5, **DATA)
        trainer.train()
        weights.append((trainer.privacy_run.band_mf.noise.layout, _weights(trainer)))
    assert [layout for layout, _ in weights] == ["store", "regenerate"]
    assert all(torch.equal(weights[0][1][n], weights[1][1][n]) for n in weights[0][1])


def test_resume_continues_the_history_and_refuses_another_b_or_mechanism(tmp_path):
    dp = inverse(3, noise_seed=0)
    args = dict(max_steps=6, save_strategy="steps", save_steps=3, **DATA)
    interrupted = make_trainer(tmp_path, dp=dp, **args)
    interrupted.add_callback(KillAtStep(at_step=4))
    with pytest.raises(KeyboardInterrupt):
        interrupted.train()
    resumed = make_trainer(tmp_path, dp=dp, **args)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert resumed.privacy_run.band_mf.noise.step == 6 and resumed.ledger.total_steps == 6
    with pytest.raises(ValueError, match="bands=3, this run has bands=2"):
        make_trainer(tmp_path, dp=inverse(2, noise_seed=0), **args).train(resume_from_checkpoint=True)
    band_mf = DPConfig(target_epsilon=8.0, noise_mechanism="band-mf", bands=3, noise_seed=0)
    with pytest.raises(ValueError, match="noise_mechanism='band-inv-mf', this run has 'band-mf'"):
        make_trainer(tmp_path, dp=band_mf, **args).train(resume_from_checkpoint=True)


def test_refusals_name_what_to_change():
    with pytest.raises(ValueError, match="noise_mechanism='band-inv-mf' is not supported by method 'dp-frost'"):
        FrostConfig(target_epsilon=4.0, noise_mechanism="band-inv-mf", bands=2)
    with pytest.raises(ValueError, match="'band-inv-mf' is not supported with privacy_unit='user'"):
        inverse(2, privacy_unit="user", user_column="user")
    with pytest.raises(ValueError, match="'band-inv-mf' is not supported with max_grad_norm='adaptive'"):
        inverse(2, max_grad_norm="adaptive", initial_max_grad_norm=1.0)
    with pytest.raises(ValueError, match="bands='auto' picks b for noise_mechanism='band-mf' or 'band-inv-mf'"):
        DPConfig(target_epsilon=8.0, bands="auto")
    with pytest.raises(ValueError, match="bands='auto'.*target_epsilon"):
        DPConfig(noise_multiplier=1.0, noise_mechanism="band-mf", bands="auto")
    with pytest.raises(ValueError, match="bands='auto'.*target_epsilon"):
        inverse("auto", target_epsilon=None, noise_multiplier=1.0)


# ---------------------------------------------------------------------------------------------- bands="auto"
def test_auto_keeps_one_band_when_a_second_partition_would_exceed_the_rate():
    assert band_auto.candidate_bands(steps=100, expected_batch_size=40, dataset_size=64) == [1]  # 2·40 > 64
    assert band_auto.choose_bands(4.0, 1e-5, 100, 40, 64)[0] == 1
    assert band_auto.candidate_bands(steps=1, expected_batch_size=8, dataset_size=64) == [1]


def test_auto_picks_the_minimiser_of_the_error_table():
    steps, batch, size = 40, 8, 256
    chosen, table = band_auto.choose_bands(4.0, 1e-5, steps, batch, size, accountant="rdp")
    assert [row.bands for row in table] == [1, 2, 4, 8, 16, 32]
    errors = {}
    for b in (1, 2, 4, 8, 16, 32):  # brute force: calibrate each b and weigh its strategy's loss
        sigma = calibrate_noise_multiplier(4.0, 1e-5, b * batch / size, steps, accountant="rdp", bands=b)
        errors[b] = sigma**2 * prefix_loss(strategy(steps, b), steps)
    assert chosen == min(errors, key=errors.get)
    assert [row.error for row in table] == pytest.approx([errors[b] for b in errors], rel=1e-9)
    assert errors[chosen] < errors[1]  # correlation pays here


def test_inverse_prefix_loss_is_the_filter_matrix_weighed_by_the_prefix_sums():
    for bands, n in ((1, 5), (3, 7), (8, 5)):  # b > n: the filter is cut at n
        d = bisr_coefficients(min(bands, n))
        filter_matrix = sum(
            torch.diag(torch.full((n - j,), float(d[j]), dtype=torch.float64), -j) for j in range(len(d))
        )
        prefix = torch.tril(torch.ones(n, n, dtype=torch.float64))
        expected = torch.linalg.matrix_norm(prefix @ filter_matrix) ** 2
        assert band_auto.inverse_prefix_loss(bands, n) == pytest.approx(float(expected), rel=1e-12)


def test_inverse_auto_weighs_each_b_by_its_unamplified_sigma_and_keeps_dp_sgd_where_it_wins(caplog):
    steps, batch, size = 40, 8, 256
    chosen = {}
    for epsilon in (8.0, 0.5):
        with caplog.at_level(logging.WARNING, logger=HF_LOGGER):
            chosen[epsilon], table = band_auto.choose_bands(
                epsilon, 1e-5, steps, batch, size, accountant="rdp", mechanism="band-inv-mf"
            )
        assert [row.bands for row in table] == [1, 2, 4, 8, 16, 32]
        dp_sgd = calibrate_noise_multiplier(epsilon, 1e-5, batch / size, steps, accountant="rdp")
        errors = {1: dp_sgd**2 * steps * (steps + 1) / 2}  # b = 1: DP-SGD, amplified; its error ‖A‖_F² σ²
        for b in (2, 4, 8, 16, 32):  # one Gaussian at σ / sensitivity: no amplification
            sigma = calibrate_noise_multiplier(
                epsilon, 1e-5, b * batch / size, steps, accountant="rdp", bands=b, banded_inverse=True
            )
            errors[b] = sigma**2 * band_auto.inverse_prefix_loss(b, steps)
        assert [row.error for row in table] == pytest.approx([errors[b] for b in errors], rel=1e-9)
        assert chosen[epsilon] == min(errors, key=errors.get)
    assert chosen[8.0] > 1 and chosen[0.5] == 1  # at small ε no banded inverse beats amplified DP-SGD ...
    (warning,) = [r.getMessage() for r in caplog.records if "chose b=1" in r.getMessage()]
    assert "(band-inv-mf) chose b=1, which is DP-SGD: at ε=0.5" in warning  # ... and the log says so


def test_inverse_auto_through_the_trainer_records_the_choice(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger=HF_LOGGER):
        trainer = make_trainer(tmp_path, dp=inverse("auto"), max_steps=8, **DATA)  # 8 steps: each example once at b=8
        trainer.train()
    report = trainer.privacy_report()
    facts = report["band_mf"]
    assert facts["bands_chosen_by"] == "auto" and [row["bands"] for row in facts["auto_candidates"]] == [1, 2, 4, 8]
    assert facts["bands"] == min(facts["auto_candidates"], key=lambda row: row["error"])["bands"] == 8
    assert report["mechanisms"][0]["mechanism"] == "band_inv_mf" and report["mechanisms"][0]["bands"] == 8
    assert trainer.privacy_run.band_mf.noise.step == 8
    assert any(r.getMessage().startswith("Correlated noise (band-inv-mf, b=8)") for r in caplog.records)


def test_auto_through_the_trainer_records_the_choice(tmp_path, caplog):
    dp = DPConfig(target_epsilon=8.0, noise_mechanism="band-mf", bands="auto")
    with caplog.at_level(logging.WARNING, logger=HF_LOGGER):
        trainer = make_trainer(tmp_path, dp=dp, max_steps=6, **DATA)
        trainer.train()
    facts = trainer.privacy_report()["band_mf"]
    assert facts["bands_chosen_by"] == "auto" and [row["bands"] for row in facts["auto_candidates"]] == [1, 2, 4]
    best = min(facts["auto_candidates"], key=lambda row: row["error"])["bands"]
    assert facts["bands"] == best == trainer.privacy_report()["mechanisms"][0]["bands"]
    # the per-step noise an Adam-type optimizer sees, on the card and in the log against DP-SGD's at the same target
    assert facts["step_noise_factor"] == pytest.approx(step_noise_factor(strategy(6, best), 6))
    sigma, independent = trainer.privacy_report()["noise_multiplier"], facts["auto_candidates"][0]["noise_multiplier"]
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Correlated noise")]
    assert f"{facts['step_noise_factor'] * sigma:.4g}·C" in line
    assert f"× DP-SGD's {independent:.4g}·C at this target ε" in line
