"""The card names its base model honestly: a Hub id as metadata and link, a local directory as a path."""

from __future__ import annotations

import pytest
from huggingface_hub import ModelCard

from hf_private.model_card import build_model_card, is_hub_model_id, privacy_metadata

REPORT = {"guarantee": "formal", "epsilon": 3.0, "delta": 1e-5, "accountant": "prv", "dataset_size": 1000,
          "mechanisms": [{"name": "dp-sgd", "noise_multiplier": 1.0, "sample_rate": 0.01, "steps": 100,
                          "max_grad_norm": 1.0}]}


def _card(base_model):
    card = build_model_card(privacy=privacy_metadata(REPORT, "dp-sgd"), base_model=base_model, model_title="m",
                            training={}, eval_results={}, load_snippet="")
    return ModelCard(str(card))  # parse what would be written, as the Hub does


@pytest.mark.parametrize("name", ["roberta-base", "FacebookAI/roberta-base", "meta-llama/Llama-3.2-1B"])
def test_hub_id_is_metadata_and_link(name):
    assert is_hub_model_id(name)
    card = _card(name)
    assert card.data.base_model == name and f"(https://huggingface.co/{name})" in card.text


def test_local_directory_is_named_as_a_path_not_a_hub_link(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-model").mkdir()  # shaped like a Hub id, but a directory here
    for local in (str(tmp_path / "my-model"), "my-model", "./my-model", "../x/y"):
        assert not is_hub_model_id(local)
        card = _card(local)
        assert card.data.base_model is None and "huggingface.co" not in card.text
        assert f"local directory `{local}`" in card.text


def test_model_built_from_config_has_no_base_model():
    card = _card(None)
    assert card.data.base_model is None and "built from its configuration" in card.text
