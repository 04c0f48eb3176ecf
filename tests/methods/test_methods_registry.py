"""Methods register themselves under one canonical name; configs round-trip like PEFT configs; a new method needs
only its own folder to train, be saved and be offered by the recipe."""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
import pkgutil
import pydoc
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from peft import PeftModel
from torch import nn
from transformers import BertModel, BertPreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutput

import hf_private.methods
from hf_private import BitFitConfig, DPConfig, DPLoRAConfig, PrivateTrainer, registered_methods
from hf_private.engine.terms import zero_rows
from hf_private.methods import DPMethod, RecipeDefaults, method_class, register_dp_method
from hf_private.methods.base import _METHODS, CONFIG_NAME, FIELDS_HEADING, FORMAT_VERSION, MethodConfig
from hf_private.privacy import Stage
from tests.support import tiny
from tests.support.helpers import eval_logits, make_trainer, training_args


def test_each_method_has_one_canonical_name():
    assert {"dp-sgd", "dp-lora", "dp-bitfit"} <= set(registered_methods())
    for name in registered_methods():
        method = method_class(name)
        assert method.config_class.method == name
        assert method.config_class(noise_multiplier=1.0).build_method().name == name


def test_config_file_carries_format_version_and_drops_unknown_keys(tmp_path, caplog):
    config = BitFitConfig(target_epsilon=3.0, full_finetune_epochs=1.0)
    config.save_pretrained(tmp_path)
    data = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert data["method"] == "dp-bitfit" and data["format_version"] == FORMAT_VERSION
    data["added_by_a_newer_version"] = 7
    (tmp_path / CONFIG_NAME).write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="transformers.hf_private"):
        assert MethodConfig.from_pretrained(tmp_path) == config
    assert "added_by_a_newer_version" in caplog.text


@pytest.mark.parametrize("name", registered_methods())
def test_help_shows_every_fields_meaning(name):
    config_class = method_class(name).config_class
    doc = pydoc.render_doc(config_class, renderer=pydoc.plaintext)
    for f in fields(config_class):
        assert f"{f.name} (" in doc and f.metadata["help"] in doc, f"help({config_class.__name__}) hides {f.name}"


def test_a_new_methods_config_is_documented_once_and_an_undocumented_field_refused(head_only_method):
    register_dp_method(head_only_method)(method_class(head_only_method.method))  # registering again adds nothing
    doc = pydoc.render_doc(head_only_method, renderer=pydoc.plaintext)
    assert doc.count(FIELDS_HEADING) == 1 and "head_name (str, default 'classifier')" in doc

    @dataclass
    class Undocumented(MethodConfig):
        method: ClassVar[str] = "test-undocumented"
        knob: int = 1

    with pytest.raises(ValueError, match=r"Undocumented.knob has no help text: declare it with field\("):
        register_dp_method(Undocumented)(type("UndocumentedMethod", (DPMethod,), {}))
    assert "test-undocumented" not in registered_methods()


def test_registering_a_name_twice_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        register_dp_method(DPConfig)(type("AnotherDPSGD", (DPMethod,), {}))


def test_dp_lora_wraps_the_model_with_peft_and_trains(tmp_path):
    dp = DPLoRAConfig(noise_multiplier=1.0, lora_r=2, lora_target_modules="query,value", noise_seed=0)
    trainer = make_trainer(tmp_path, model=tiny.bert(), dp=dp, max_steps=2)
    assert isinstance(trainer.model, PeftModel) and trainer.adapter_format == "peft"
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "classifier" in n for n in trainable)
    trainer.train()
    assert trainer.ledger.total_steps == 2 and trainer.privacy_report()["method"] == "dp-lora"

    trainer.save_model()  # a standard PEFT adapter, its new head included: stock PEFT loads it onto the public base
    batch = _padding()([{k: v for k, v in r.items() if k != "label"} for r in tiny.sentiment_dataset(4, seed=7)])
    trained = eval_logits(trainer.model, batch)
    assert not torch.equal(eval_logits(tiny.bert(), batch), trained), "training changed nothing"
    assert torch.equal(eval_logits(PeftModel.from_pretrained(tiny.bert(), tmp_path), batch), trained)


class _MeanPooledScorer(BertPreTrainedModel):
    """A custom head whose class name PEFT has no task type for."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=False)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        states = self.bert(input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1)
        logits = self.classifier((states * mask).sum(1) / mask.sum(1))
        return SequenceClassifierOutput(logits=logits)


def test_dp_lora_trains_the_new_head_of_a_custom_model(tmp_path):
    """Without a recognised class name PEFT would freeze the random head; its modules outside the backbone train."""
    model = _MeanPooledScorer(tiny.bert().config)
    head_before = model.classifier.weight.detach().clone()
    dp = DPLoRAConfig(noise_multiplier=1.0, lora_r=2, lora_target_modules="query,value", noise_seed=0)
    trainer = make_trainer(tmp_path, model=model, dp=dp, max_steps=2)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any("classifier" in n for n in trainable) and all("lora_" in n or "classifier" in n for n in trainable)
    trainer.train()
    head = trainer.model.base_model.model.classifier.modules_to_save["default"].weight
    assert not torch.equal(head.detach(), head_before)


# ---------------------------------------------------------------- a method from its own folder only
@dataclass
class _HeadOnlyConfig(MethodConfig):
    method: ClassVar[str] = "test-head-only"
    head_name: str = field(default="classifier", metadata={"help": "Prefix of the parameters that train."})


class _HeadOnlyMethod(DPMethod):
    def prepare_model(self, model: nn.Module) -> None:
        for name, param in model.named_parameters():
            param.requires_grad_(name.startswith(self.config.head_name))

    @classmethod
    def recipe_defaults(cls, task: str) -> RecipeDefaults:
        return RecipeDefaults(64, 1, 1e-2, 1.0, 32, "a test", method_fields={"head_name": "classifier"})


@pytest.fixture
def head_only_method():
    register_dp_method(_HeadOnlyConfig)(_HeadOnlyMethod)
    yield _HeadOnlyConfig
    del _METHODS[_HeadOnlyConfig.method]


def test_a_new_method_trains_saves_and_reloads_its_config(tmp_path, head_only_method):
    trainer = PrivateTrainer(
        tiny.bert(),
        training_args(tmp_path, max_steps=1),
        train_dataset=tiny.sentiment_dataset(32),
        dp_config=head_only_method(noise_multiplier=1.0, noise_seed=0),
    )
    trainer.data_collator = _padding()
    trainer.train()
    trainer.save_model()
    assert {n for n, p in trainer.model.named_parameters() if p.requires_grad} == {
        "classifier.weight",
        "classifier.bias",
    }
    assert MethodConfig.from_pretrained(tmp_path) == trainer.dp_config
    assert trainer.privacy_report()["mechanisms"][0]["name"] == "test-head-only"


def test_the_recipe_offers_a_new_method_and_its_flags(tmp_path, head_only_method):
    sys.path.insert(0, str(Path(__file__).parents[2] / "recipes"))
    import glue

    recipe, args, _ = glue.parse_args(
        ["--method", "test-head-only", "--head_name", "bert.pooler", "--output_dir", str(tmp_path), "--use_cpu", "true"]
    )
    assert recipe.method_fields == {"head_name": "bert.pooler"}
    assert isinstance(glue._dp_config(recipe, 1.0), head_only_method)


# ---------------------------------------------------------------- the package finds method folders itself
METHODS_DIR = Path(hf_private.methods.__file__).parent
_TOY_FOLDER = """
from dataclasses import dataclass
from typing import ClassVar

from ..base import DPMethod, MethodConfig, register_dp_method


@dataclass
class ToyFolderConfig(MethodConfig):
    method: ClassVar[str] = "test-toy-folder"


@register_dp_method(ToyFolderConfig)
class ToyFolderMethod(DPMethod):
    pass
"""


def test_a_method_folder_is_found_and_its_config_is_public_with_no_other_edit(tmp_path, monkeypatch):
    (tmp_path / "toy_folder").mkdir()
    (tmp_path / "toy_folder" / "__init__.py").write_text(_TOY_FOLDER)
    monkeypatch.setattr(hf_private.methods, "__path__", [*hf_private.methods.__path__, str(tmp_path)])
    try:
        assert "hf_private.methods.toy_folder" in hf_private.methods.import_method_folders()
        config_class = method_class("test-toy-folder").config_class
        assert hf_private.methods.ToyFolderConfig is config_class and "ToyFolderConfig" in dir(hf_private.methods)
        assert config_class(noise_multiplier=1.0).build_method().name == "test-toy-folder"
    finally:
        _METHODS.pop("test-toy-folder", None)
        sys.modules.pop("hf_private.methods.toy_folder", None)


def test_every_method_folder_registers_a_method_whose_config_is_public():
    folders = {module.name for module in pkgutil.iter_modules([str(METHODS_DIR)]) if module.ispkg}
    owners = {}
    for name in registered_methods():
        module = method_class(name).__module__.split(".")
        if module[:2] == ["hf_private", "methods"]:
            owners[name] = module[2]
            config_class = method_class(name).config_class
            assert getattr(hf_private.methods, config_class.__name__) is config_class
            assert config_class.__name__ in hf_private.methods.__all__
    assert set(owners.values()) == folders and len(owners) == len(folders)
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchConfig'"):
        hf_private.methods.NoSuchConfig  # noqa: B018


def _imported_modules(path: Path, package: str) -> set[str]:
    """Absolute names of the modules a file imports (`from .. import x` counts as importing `<package>..x`)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = (
                importlib.util.resolve_name("." * node.level + (node.module or ""), package)
                if node.level
                else (node.module)
            )
            names |= {base, *(f"{base}.{alias.name}" for alias in node.names)}
    return names


def test_no_method_folder_imports_another_and_engine_and_privacy_import_no_method():
    folders = {module.name for module in pkgutil.iter_modules([str(METHODS_DIR)]) if module.ispkg}
    root = METHODS_DIR.parents[1]
    for folder in sorted(folders):
        for path in sorted((METHODS_DIR / folder).rglob("*.py")):
            package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
            others = {
                name.split(".")[2]
                for name in _imported_modules(path, package)
                if name.startswith("hf_private.methods.") and name.count(".") >= 2
            } & (folders - {folder})
            assert not others, f"{path.relative_to(root)} imports the method folder(s) {sorted(others)}"
    for layer in ("engine", "privacy"):
        for path in sorted((root / "hf_private" / layer).rglob("*.py")):
            package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
            assert not {n for n in _imported_modules(path, package) if n.startswith("hf_private.methods")}, path


def _padding():
    from transformers import DataCollatorWithPadding

    return DataCollatorWithPadding(tiny.tokenizer())


# ---------------------------------------------------------------- a method's own releases join the plan and ledger
@dataclass
class _SelectThenTrainConfig(MethodConfig):
    method: ClassVar[str] = "test-select-then-train"


class _SelectThenTrainMethod(DPMethod):
    def stages(self):
        return [Stage("test-selection", sample_rate=0.25, steps=2, training=False, noise_ratio=2.0), Stage(self.name)]


@pytest.fixture
def select_then_train():
    register_dp_method(_SelectThenTrainConfig)(_SelectThenTrainMethod)
    yield _SelectThenTrainConfig
    del _METHODS[_SelectThenTrainConfig.method]


def test_a_method_release_outside_training_is_planned_calibrated_and_ledgered(tmp_path, select_then_train):
    trainer = make_trainer(tmp_path, dp=select_then_train(target_epsilon=3.0), max_steps=4)
    selection, training = trainer.plan["test-selection"], trainer.plan[select_then_train.method]
    assert selection.noise_multiplier == pytest.approx(2 * training.noise_multiplier)  # one scale, two ratios
    assert trainer.plan.epsilon() <= 3.0
    trainer.record_release("test-selection", 2)  # what the method does before training
    trainer.train()
    report = trainer.privacy_report()
    assert [(m["name"], m["steps"]) for m in report["mechanisms"]] == [
        ("test-selection", 2),
        (select_then_train.method, 4),
    ]
    assert trainer.training_steps() == 4 == trainer.state.global_step
    assert report["epsilon"] == pytest.approx(trainer.plan.epsilon(), rel=1e-9) and report["epsilon"] <= 3.0


# ---------------------------------------------------------------- a method's hooks on the engine and the optimizer
@dataclass
class _MaskedRowConfig(MethodConfig):
    method: ClassVar[str] = "test-masked-row"


class _MaskedRowMethod(DPMethod):
    """Row 0 of the classifier never trains: masked before the norm and after the noise (seed 003's pattern)."""

    step_ends = 0

    def attach_engine(self, engine):
        weight = dict(engine.parameters)["classifier.weight"]
        engine.add_term_transform(weight, lambda term: zero_rows(term, [0]))

    def attach_optimizer(self, optimizer):
        weight = next(p for n, p in optimizer.engine.parameters if n == "classifier.weight")

        def mask(grad):
            grad[0] = 0

        optimizer.add_gradient_transform(weight, mask)
        optimizer.add_step_end_hook(self._count)

    def _count(self):
        type(self).step_ends += 1


@pytest.fixture
def masked_row():
    register_dp_method(_MaskedRowConfig)(_MaskedRowMethod)
    _MaskedRowMethod.step_ends = 0
    yield _MaskedRowConfig
    del _METHODS[_MaskedRowConfig.method]


def test_a_method_masks_terms_before_the_norm_and_the_noisy_gradient_and_acts_at_step_end(tmp_path, masked_row):
    trainer = make_trainer(tmp_path, dp=masked_row(noise_multiplier=1.0), max_steps=3, weight_decay=0.0)
    weight = trainer.model.classifier.weight
    before = weight.detach().clone()
    trainer.train()
    assert torch.equal(weight[0], before[0]), "a masked row moved: masked before the norm and after the noise"
    assert not torch.equal(weight[1], before[1])
    assert _MaskedRowMethod.step_ends == 3 == trainer.state.global_step
