"""DPConfig behaves like a PEFT config: validated dataclass, dict and directory round-trips."""

import dataclasses

import pytest

from hf_private import BitFitConfig, DPConfig
from hf_private.methods import MethodConfig, method_class, registered_methods
from hf_private.methods.base import CONFIG_NAME


def test_dict_round_trip_keeps_method_and_fields():
    config = DPConfig(target_epsilon=3.0, max_grad_norm=0.1, accountant="rdp")
    data = config.to_dict()
    assert data["method"] == "dp-sgd" and data["target_epsilon"] == 3.0
    assert DPConfig.from_dict(data) == config


def test_directory_round_trip(tmp_path):
    config = DPConfig(noise_multiplier=0.8, target_delta=1e-6)
    config.save_pretrained(tmp_path)
    assert (tmp_path / CONFIG_NAME).is_file()
    assert DPConfig.from_pretrained(tmp_path) == config


@pytest.mark.parametrize("name", registered_methods())
def test_every_method_config_derives_from_the_base_and_the_base_reads_every_file(tmp_path, name):
    config_class = method_class(name).config_class
    assert config_class.__bases__ == (MethodConfig,)  # no method config derives from another method's
    config = config_class(noise_multiplier=0.9)
    config.save_pretrained(tmp_path)
    assert MethodConfig.from_pretrained(tmp_path) == config == config_class.from_pretrained(tmp_path)


def test_dp_sgd_reads_dp_sgd_files_only(tmp_path):
    BitFitConfig(target_epsilon=2.0).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"'dp-bitfit' \(BitFitConfig\), not a DPConfig: read it with MethodConfig"):
        DPConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a BitFitConfig"):
        BitFitConfig.from_dict(DPConfig(target_epsilon=2.0).to_dict())


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="Unknown DP method"):
        DPConfig.from_dict({"method": "dp-magic", "target_epsilon": 1.0})


def test_every_field_documents_itself():
    assert all(f.metadata.get("help") for f in dataclasses.fields(DPConfig))


@pytest.mark.parametrize("size, expected", [(10, 0.05), (1000, 0.0005)])
def test_default_delta_is_half_of_one_over_n(size, expected):
    assert DPConfig(target_epsilon=1.0).resolve_delta(size) == pytest.approx(expected)
