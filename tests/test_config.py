"""DPConfig behaves like a PEFT config: validated dataclass, dict and directory round-trips."""

import pytest

from hf_private import DPConfig
from hf_private.methods.dpsgd.config import CONFIG_NAME


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


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="Unknown DP method"):
        DPConfig.from_dict({"method": "dp-magic", "target_epsilon": 1.0})


def test_every_field_documents_itself():
    import dataclasses

    assert all(f.metadata.get("help") for f in dataclasses.fields(DPConfig))


@pytest.mark.parametrize("size, expected", [(10, 0.05), (1000, 0.0005)])
def test_default_delta_is_half_of_one_over_n(size, expected):
    assert DPConfig(target_epsilon=1.0).resolve_delta(size) == pytest.approx(expected)
