"""The card is publishable as written: a Hub base is metadata, a local base path never appears, the metadata parses
offline (license, base_model, model-index, tags), the body names versions and which checkpoint was released."""

from __future__ import annotations

import logging
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.repocard_data import eval_results_to_model_index, model_index_to_eval_results
from peft import LoraConfig, get_peft_model
from transformers import DataCollatorWithPadding, RobertaForSequenceClassification

from hf_private import BitFitConfig, DPConfig, DPFPConfig, PrivateTrainer
from hf_private.audit import AuditResult
from hf_private.release.adapters import is_hub_model_id
from hf_private.release.model_card import (
    BASE_PLACEHOLDER,
    FRAMEWORKS,
    REPO_PLACEHOLDER,
    build_model_card,
    load_snippet,
    privacy_metadata,
)
from tests.support import tiny
from tests.support.helpers import make_trainer, training_args

REPORT = {
    "guarantee": "formal",
    "epsilon": 3.0,
    "delta": 1e-5,
    "accountant": "prv",
    "dataset_size": 1000,
    "mechanisms": [
        {"name": "dp-sgd", "noise_multiplier": 1.0, "sample_rate": 0.01, "steps": 100, "max_grad_norm": 1.0}
    ],
}
# Where from_pretrained("org/name") leaves a model on the training machine: a path, never a Hub id.
FAKE_CACHE = "/root/.cache/huggingface/hub/models--acme--secret-base/snapshots/3f2c9a1e0b7d"
FORMATS = ("full", "peft", "private_adapter")


def _card(base_model, *, fmt="private_adapter", **kw):
    kw.setdefault("model_title", "m")
    snippet = load_snippet(fmt, "RobertaForSequenceClassification", base_model, "me/repo", 2)
    card = build_model_card(
        privacy=privacy_metadata(REPORT, "dp-sgd"),
        base_model=base_model,
        training={},
        eval_results=kw.pop("eval_results", {}),
        load_snippet=snippet,
        model_class="RobertaForSequenceClassification",
        adapter_format=fmt,
        **kw,
    )
    return ModelCard(str(card))  # parse what would be written, as the Hub does


def _public_statement(text: str) -> str:
    return text.split("**What is public, and not protected:**")[1].split("**")[0]


@pytest.mark.parametrize("name", ["roberta-base", "FacebookAI/roberta-base", "meta-llama/Llama-3.2-1B"])
def test_hub_id_is_metadata_link_and_snippet(name):
    assert is_hub_model_id(name)
    card = _card(name)
    assert card.data.base_model == name and f"(https://huggingface.co/{name})" in card.text
    assert f'from_pretrained("{name}", num_labels=2)' in card.text and BASE_PLACEHOLDER not in card.text
    assert f"the pre-trained weights ({name})" in _public_statement(card.text)


@pytest.mark.parametrize("fmt", FORMATS)
def test_local_base_path_never_reaches_the_card(tmp_path, monkeypatch, fmt):
    """Fails before issue 18: the card printed "local directory `<path>`", `./not-here` passed as a Hub id, and the
    load snippet carried the path."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-model").mkdir()  # shaped like a Hub id, but a directory here
    for local in (
        str(tmp_path / "my-model"),
        "my-model",
        "./my-model",
        "./not-here",
        "~/models/mine",
        "../x/y",
        FAKE_CACHE,
        "models--acme--base",
        "C:\\models\\base",
    ):
        assert not is_hub_model_id(local), local
        card = _card(local, fmt=fmt)
        assert card.data.base_model is None and "huggingface.co" not in card.text
        assert local not in str(card) and "snapshots" not in str(card) and str(tmp_path) not in str(card), local
        assert "local pre-trained model whose path is withheld" in card.text
        assert "a local model; its path is withheld" in _public_statement(card.text)
        if fmt != "full":  # the base must be supplied: a marked placeholder the reader has to replace
            assert f'from_pretrained("{BASE_PLACEHOLDER}", num_labels=2)' in card.text
            assert f"# REPLACE {BASE_PLACEHOLDER}: training started from a local model" in card.text


def test_model_built_from_config_claims_no_pretrained_weights():
    """Fails before issue 18: "What is public" listed "the pre-trained weights" for a model built from config."""
    card = _card(None)
    assert card.data.base_model is None
    assert "initialised from its configuration with random weights" in card.text
    public = _public_statement(card.text)
    assert "pre-trained weights" not in public.replace("no pre-trained weights", "") and "random weights" in public
    assert f"# REPLACE {BASE_PLACEHOLDER}: training started from a configuration with random weights" in card.text


def test_title_is_the_given_name_or_base_and_method():
    """Fails before issue 18 (build_model_card had no default title: `model_title=None` rendered "# None")."""
    assert _card("roberta-base", model_title=None).text.splitlines()[1] == (
        "# roberta-base fine-tuned with dp-sgd (differential privacy)"
    )
    assert (
        "# RobertaForSequenceClassification fine-tuned with dp-sgd from a local base model"
        in _card(FAKE_CACHE, model_title=None).text
    )
    assert "# RobertaForSequenceClassification trained from random initialisation" in _card(None, model_title=None).text
    assert _card("roberta-base", model_title="tiny-dp").text.splitlines()[1] == "# tiny-dp"


def test_metadata_parses_offline_and_model_index_round_trips():
    """Fails before issue 18: no `license=`, model-index or framework versions in build_model_card."""
    results = {"eval_accuracy": 0.8125, "eval_loss": 0.4321}
    card = _card(
        "FacebookAI/roberta-base",
        fmt="peft",
        license="apache-2.0",
        eval_results=results,
        task_type="text-classification",
        library_name="peft",
        tags=["glue"],
    )
    data = card.data.to_dict()
    assert data["license"] == "apache-2.0" and data["base_model"] == "FacebookAI/roberta-base"
    assert data["base_model_relation"] == "adapter" and data["library_name"] == "peft"
    assert {"differential-privacy", "hf_private", "dp-sgd", "glue"} <= set(data["tags"])
    name, parsed = model_index_to_eval_results(data["model-index"])
    assert name == "m" and {r.metric_name: r.metric_value for r in parsed} == results
    assert {(r.task_type, r.dataset_split, r.metric_type) for r in parsed} == {
        ("text-classification", "held-out", "accuracy"),
        ("text-classification", "held-out", "loss"),
    }
    assert eval_results_to_model_index(name, parsed) == data["model-index"]
    assert ModelCardData(**data).to_dict() == data  # the metadata rebuilds itself, as the Hub's parser does
    assert "`apache-2.0`, as given by whoever trained this model" in card.text
    for framework in FRAMEWORKS:
        assert f"\n- {framework} " in card.text.split("## Framework versions")[1]

    unlicensed = _card("roberta-base").data.to_dict()
    assert unlicensed["license"] == "unknown" and "model-index" not in unlicensed  # no held-out results, no index


@pytest.mark.parametrize("user_level", [False, True], ids=["example", "user"])
def test_the_mechanism_table_prints_c_to_four_digits_and_the_metadata_keeps_it_exact(user_level):
    """Issue 45: the card printed C = 4.081756591796875; the table reads 4.082, the `privacy:` block keeps the value
    that recomputes ε."""
    c = 4.081756591796875
    mechanism = {**REPORT["mechanisms"][0], "max_grad_norm": c}
    extra = {"unit": "user", "user_sampling": "example", "max_examples_per_user": 4} if user_level else {}
    if user_level:
        mechanism["examples_per_user"] = 4
    report = {**REPORT, "mechanisms": [mechanism], **extra}
    card = ModelCard(
        str(
            build_model_card(
                privacy=privacy_metadata(report, "dp-sgd"),
                base_model="roberta-base",
                model_title="m",
                training={},
                eval_results={},
                load_snippet="",
            )
        )
    )
    row = next(line for line in card.text.splitlines() if line.startswith("| dp-sgd |"))
    assert [cell.strip() for cell in row.strip("|").split("|")][4] == f"{c:.4g}" == "4.082"
    assert repr(c) not in card.text
    assert card.data.to_dict()["privacy"]["mechanisms"][0]["max_grad_norm"] == c


def test_load_snippet_names_no_output_folder():
    snippet = load_snippet("full", "BertModel", None, None)
    assert f'from_pretrained("{REPO_PLACEHOLDER}")' in snippet and f"# REPLACE {REPO_PLACEHOLDER}" in snippet


# ---------------------------------------------------------------- a trained model's README, read back field by field
def _local_base(tmp_path: Path) -> str:
    """tiny.roberta() saved where the training machine's Hub cache would hold it, then loaded from that path."""
    path = tmp_path / FAKE_CACHE.lstrip("/")
    tiny.roberta().save_pretrained(path)
    return str(path)


class _FirstEvaluationIsBest:
    """compute_metrics whose `marker` is best at the first evaluation, so the best checkpoint is step 1 of 3."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, prediction) -> dict[str, float]:
        self.calls += 1
        return {"marker": 1.0 if self.calls == 1 else 0.0}


def test_trained_card_reads_back_every_field_and_names_no_local_path(tmp_path):
    """Fails before issue 18: the README named the fake cache path and the output folder, had no license, no
    framework versions, no model-index, and did not say the weights were step 1's while ε covers all 3 steps."""
    base_path = _local_base(tmp_path)
    model = RobertaForSequenceClassification.from_pretrained(base_path)
    assert model.config._name_or_path == base_path
    output_dir = tmp_path / "private-run-folder"
    tok = tiny.tokenizer()
    trainer = PrivateTrainer(
        model=model,
        train_dataset=tiny.sentiment_dataset(96),
        eval_dataset=tiny.sentiment_dataset(32, seed=4),
        args=training_args(
            output_dir,
            max_steps=3,
            eval_strategy="steps",
            eval_steps=1,
            save_strategy="steps",
            save_steps=1,
            load_best_model_at_end=True,
            metric_for_best_model="marker",
            greater_is_better=True,
        ),
        data_collator=DataCollatorWithPadding(tok),
        processing_class=tok,
        dp_config=BitFitConfig(noise_multiplier=1.0),
        compute_metrics=_FirstEvaluationIsBest(),
    )
    trainer.train()
    assert trainer.state.best_global_step == 1 and trainer.state.global_step == 3
    released = trainer.evaluate()  # the released (best) weights, measured after the reload
    report = trainer.privacy_report()
    trainer.save_model()
    readme = output_dir / "README.md"

    def check(card: ModelCard, license: str) -> None:
        raw = readme.read_text(encoding="utf-8")
        for secret in (
            str(tmp_path),
            base_path,
            FAKE_CACHE,
            "models--acme--secret-base",
            "snapshots",
            "private-run-folder",
        ):
            assert secret not in raw, secret
        data = card.data.to_dict()
        assert data["license"] == license and "base_model" not in data
        assert data["library_name"] == "transformers" and {"differential-privacy", "dp-bitfit"} <= set(data["tags"])
        privacy = data["privacy"]
        assert (privacy["epsilon"], privacy["delta"]) == (report["epsilon"], report["delta"])
        assert privacy["accountant"] == report["accountant"] and privacy["guarantee"] == "formal"
        assert privacy["unit"] == "example" and sum(m["steps"] for m in privacy["mechanisms"]) == 3
        assert privacy["sampler_tail_delta"] == report["sampler_tail_delta"] > 0
        _, results = model_index_to_eval_results(data["model-index"])
        assert {r.metric_name: r.metric_value for r in results} == {
            k: round(v, 4) for k, v in released.items() if k in ("eval_loss", "eval_marker")
        }
        assert {r.task_type for r in results} == {"text-classification"}
        text = card.text
        assert f"(ε = {report['epsilon']:.3g}, δ = {report['delta']:.3g})-differential" in text
        assert f"`{report['accountant']}` accountant" in text
        assert "local pre-trained model whose path is withheld" in text
        assert f'from_pretrained("{BASE_PLACEHOLDER}", num_labels=2)' in text
        assert "these are the weights of step 1, the best checkpoint by\n`eval_marker` (1 on held-out data)" in text
        assert "ε covers all 3 steps\ntaken" in text and "- steps taken: 3 (all counted in ε)" in text
        assert (
            f"- noise sampler's tail in δ: δ = {report['delta']:.3g} includes {report['sampler_tail_delta']:.2g} "
            "for the noise sampler's finite tail"
        ) in text
        versions = text.split("## Framework versions")[1]
        for framework in FRAMEWORKS:
            assert f"- {framework} {metadata.version(framework)}\n" in versions

    check(ModelCard.load(readme), "unknown")
    assert "# RobertaForSequenceClassification fine-tuned with dp-bitfit from a local base model" in readme.read_text()
    trainer.create_model_card(license="apache-2.0", model_name="tiny-dp-bitfit")
    card = ModelCard.load(readme)
    check(card, "apache-2.0")
    assert card.data.model_name == "tiny-dp-bitfit" and "\n# tiny-dp-bitfit\n" in card.content
    _assert_no_released_file_names(output_dir, base_path)


def _assert_no_released_file_names(output_dir: Path, base_path: str) -> None:
    """Every file a push would upload (the output directory's top level; checkpoints stay local)."""
    released = [p for p in output_dir.iterdir() if p.is_file()]
    assert released
    for path in released:
        assert base_path.encode() not in path.read_bytes(), path.name


def test_lora_adapter_files_name_no_local_base_path(tmp_path):
    """Fails before issue 18: PEFT's adapter_config.json carried the local base path (base_model_name_or_path)."""
    base_path = _local_base(tmp_path)
    model = get_peft_model(
        RobertaForSequenceClassification.from_pretrained(base_path),
        LoraConfig(r=2, target_modules=["query", "value"], modules_to_save=["classifier"]),
    )
    output_dir = tmp_path / "lora-run"
    tok = tiny.tokenizer()
    trainer = PrivateTrainer(
        model=model,
        train_dataset=tiny.sentiment_dataset(64),
        args=training_args(output_dir, max_steps=1),
        data_collator=DataCollatorWithPadding(tok),
        processing_class=tok,
        dp_config=DPConfig(noise_multiplier=1.0),
    )
    trainer.train()
    trainer.save_model()
    assert trainer.adapter_format == "peft"
    _assert_no_released_file_names(output_dir, base_path)


def test_results_of_weights_not_released_are_not_published(tmp_path):
    """Fails before issue 18: the last in-training evaluation (step 3's weights) was published for step 1's."""
    tok = tiny.tokenizer()
    trainer = PrivateTrainer(
        model=tiny.roberta(),
        train_dataset=tiny.sentiment_dataset(96),
        eval_dataset=tiny.sentiment_dataset(32, seed=4),
        args=training_args(
            tmp_path,
            max_steps=3,
            eval_strategy="steps",
            eval_steps=1,
            save_strategy="steps",
            save_steps=1,
            load_best_model_at_end=True,
            metric_for_best_model="marker",
            greater_is_better=True,
        ),
        data_collator=DataCollatorWithPadding(tok),
        processing_class=tok,
        dp_config=BitFitConfig(noise_multiplier=1.0),
        compute_metrics=_FirstEvaluationIsBest(),
    )
    trainer.train()
    trainer.save_model()
    card = ModelCard.load(tmp_path / "README.md")
    assert "model-index" not in card.data.to_dict() and "| eval_marker |" not in card.text
    assert "measured the weights of a later step, not the released weights of step 1" in card.text


# ---------------------------------------------------------------- the recipe's last line names what it wrote
@pytest.mark.parametrize(
    "fmt, written", [("peft", "PEFT adapter"), ("private_adapter", "Private adapter"), ("full", "Full model")]
)
def test_recipe_result_line_names_what_was_written(caplog, fmt, written):
    """Fails before issue 18: the line always began "Adapter, privacy ledger and card"."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
    import glue

    recipe = glue.RecipeArguments()
    report = {
        "epsilon": 1.0,
        "delta": 1e-5,
        "accountant": "prv",
        "steps": 3,
        "noise_multiplier": 1.0,
        "guarantee": "formal",
    }
    result = {"metrics": {}, "seconds": 1.0, "output_dir": "out"}
    with caplog.at_level(logging.INFO, logger="recipes"):
        glue._log_result(result, report, recipe, False, fmt)
    assert f"s. {written}" in caplog.text and "privacy ledger and card in out." in caplog.text


# ---------------------------------------------------------------- a run without a guarantee promises nothing
_NO_GUARANTEE_RUNS = {
    "dp-fp paper mode": lambda: DPFPConfig(mode="paper", target_epsilon=3.0, max_grad_norm=1.0),
    "test seed": lambda: DPConfig(target_epsilon=3.0, max_grad_norm=1.0, noise_seed=0),
}
# Sentences and labels that promise protection or present a number as ε.
_PROMISES = (
    "What is protected:",
    "and not protected",
    "satisfies",
    "counted in ε",
    "ε covers",
    "composed into the ε",
    "with **differential privacy**",
    "(differential privacy)",
    "trained with differential privacy",
)
_EPSILON_NUMBER = re.compile(r"(ε|epsilon)\s*[:=≤≥]?\s*[0-9]", re.IGNORECASE)


def _epsilon_keys(value, path=()) -> list[tuple]:
    """Every key containing 'epsilon' in a nested dict/list (target_epsilon, a setting, aside)."""
    if isinstance(value, dict):
        return [
            found
            for key, item in value.items()
            for found in ([(*path, key)] if "epsilon" in str(key) and key != "target_epsilon" else [])
            + _epsilon_keys(item, (*path, key))
        ]
    if isinstance(value, list):
        return [found for i, item in enumerate(value) for found in _epsilon_keys(item, (*path, i))]
    return []


@pytest.mark.parametrize("run", sorted(_NO_GUARANTEE_RUNS))
def test_a_run_without_a_guarantee_promises_nothing(tmp_path, caplog, run):
    """Invariant 10: card, report, logs and audit record have no protection sentence and no number labelled ε."""
    trainer = make_trainer(tmp_path, dp=_NO_GUARANTEE_RUNS[run](), max_steps=3)
    with caplog.at_level(logging.INFO):
        trainer.train()
        trainer.save_model()
    report = trainer.privacy_report()
    assert report["guarantee"] == "none" and not _epsilon_keys(report), _epsilon_keys(report)
    assert report["not_a_guarantee"] and all(f["what"] for f in report["not_a_guarantee"].values())
    assert not any("epsilon" in entry for entry in trainer.state.log_history)
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("transformers.hf_private")]
    assert logged and not [m for m in logged if _EPSILON_NUMBER.search(m)], logged

    card = ModelCard.load(tmp_path / "README.md")
    privacy = card.data.to_dict()["privacy"]
    assert not _epsilon_keys(privacy) and "differential-privacy" not in card.data.tags
    body = card.text
    assert "No formal differential privacy guarantee holds for this model" in body
    assert "### Figures that are not a guarantee" in body
    assert not [p for p in _PROMISES if p in body], [p for p in _PROMISES if p in body]
    outside_figures = body.split("### Figures that are not a guarantee")[0] + body.split("**What is public")[1]
    assert not _EPSILON_NUMBER.search(outside_figures)

    result = AuditResult(
        epsilon_lower_bound=0.5,
        confidence=0.95,
        claimed_epsilon=1.0,
        claim=next(iter(report["not_a_guarantee"])),
        delta=1e-5,
        method=report["method"],
        canaries=10,
        included=5,
        k_plus=1,
        k_minus=1,
        bounds=(),
        date="today",
        audit_data="public",
        mechanisms=(),
        accountant="prv",
        guarantee=report["guarantee"],
        dataset_fingerprint=None,
    )
    for record in (result.to_dict(), result.card_entry()):
        assert "claimed_epsilon" not in record and record["tested_figure"]["name"] == result.claim
