"""White-box gradient (Dirac) canaries: drawn secretly, inserted through the engine as a unit's gradient, read from the
released noisy gradients; and the audit's power with them for every method whose input embedding does not train.

Every sound audit here is paired with broken runs (bugs injected by monkeypatching, as in test_audit.py) that the
same audit, with the default number of canaries, must refute.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import DataCollatorWithPadding

from hf_private import BitFitConfig, DPConfig, DPFPConfig, DPLoRAConfig, FrostConfig, SparseLowRankConfig
from hf_private.audit import AuditResult
from hf_private.audit.canaries import add_canary_tokens
from hf_private.audit.gradient_canaries import (
    INSERTED_NORM,
    GradientCanaries,
    GradientCanaryInserter,
    draw_gradient_canaries,
)
from hf_private.cli.audit import run_audit
from hf_private.engine import PerExampleGradientEngine, trainable_parameters
from hf_private.integrations.losses import default_per_example_loss
from tests.audit.test_audit import AUDIT_ARGS, BUGS, CLAIMED_EPSILON, CLIP, DELTA, assert_power
from tests.support import tiny
from tests.support.helpers import training_args

DEFAULT_CANARIES = 1000  # run_audit's default m
# The methods whose input embedding is not always trained. Each needs at least m coordinates it always trains (a
# canary's own): BiTFiT's biases are widened, and DP-FP's and DP-FROST's heads given 32 outputs (32 × 32 weights), to
# hold 1000.
METHODS = {
    "dp-lora": (DPLoRAConfig, {}),
    "bitfit": (BitFitConfig, dict(hidden_size=64)),
    "sparse-lowrank-lora": (functools.partial(SparseLowRankConfig, variant="lora"), {}),
    "sparse-lowrank-rgp": (functools.partial(SparseLowRankConfig, variant="rgp"), {}),
    "dp-fp-head": (functools.partial(DPFPConfig, mode="sound"), dict(num_labels=32)),
    # DP-FROST trains the embedding only when a selection picks it: its canaries live in the head it always trains
    "dp-frost": (FrostConfig, dict(num_labels=32)),
}


# ---------------------------------------------------------------- drawing the canaries
def _named(*shapes) -> list[tuple[str, torch.nn.Parameter]]:
    return [(f"p{i}", torch.nn.Parameter(torch.zeros(shape))) for i, shape in enumerate(shapes)]


def test_canaries_take_distinct_coordinates_over_every_trainable_tensor_with_random_signs():
    params = _named((10, 20), (30,), (5, 4))
    canaries = draw_gradient_canaries(params, 200, first_token=7, generator=torch.Generator().manual_seed(0))
    sizes = [200, 30, 20]
    global_index = canaries.flat_index + torch.tensor([0, 200, 230])[canaries.parameter]
    assert canaries.count == 200 and global_index.unique().numel() == 200  # a coordinate of its own each
    assert all(0 <= int(f) < sizes[int(p)] for p, f in zip(canaries.parameter, canaries.flat_index))
    assert set(canaries.parameter.tolist()) == {0, 1, 2} and set(canaries.sign.tolist()) == {-1.0, 1.0}
    again = draw_gradient_canaries(params, 200, 7, torch.Generator().manual_seed(0))
    other = draw_gradient_canaries(params, 200, 7, torch.Generator().manual_seed(1))
    assert torch.equal(again.flat_index, canaries.flat_index)  # the auditor's seed alone decides them
    assert not torch.equal(other.flat_index, canaries.flat_index)


def test_drawing_refuses_more_canaries_than_trainable_coordinates():
    with pytest.raises(ValueError, match="trains 12 coordinates"):
        draw_gradient_canaries(_named((3, 4)), 13, 0, torch.Generator().manual_seed(0))


# ---------------------------------------------------------------- insertion through the engine
def _sums(engine, model, batch, labels) -> dict[str, torch.Tensor]:
    engine.reset()
    with engine.recording(labels.shape[0]):
        default_per_example_loss(model, model(**batch), labels).sum().backward()
    engine.finish_backward()
    names = {id(p): n for n, p in engine.parameters}
    return {names[id(p)]: s.clone() for p, s in engine.pop_clipped_sums().items()}


@pytest.mark.parametrize("clip", [CLIP, 100.0], ids=["clipped", "within-clip"])
def test_a_sampled_canary_adds_its_inserted_gradient_clipped_and_nothing_of_its_own(clip):
    """A chunk of three examples and one canary: the clipped sums are the three examples' plus the canary's inserted
    gradient, 10·C clipped to C (or, with a clip of 100, all of it), at its coordinate; its own gradient is gone."""
    model = tiny.bert()
    (first,) = add_canary_tokens(model, 1, torch.Generator().manual_seed(0))
    engine = PerExampleGradientEngine(model, clip)
    engine.attach()
    params = trainable_parameters(model)
    canary = GradientCanaries(
        first, tuple(n for n, _ in params), torch.tensor([5]), torch.tensor([17]), torch.tensor([-1.0])
    )
    model.train()
    collate = DataCollatorWithPadding(tiny.tokenizer())
    rows = [dict(r) for r in tiny.sentiment_dataset(3, seed=2)]
    canary_row = {"input_ids": [first] * 6, "attention_mask": [1] * 6, "token_type_ids": [0] * 6, "label": 1}
    data = collate(rows)
    with_canary = collate([*rows, canary_row])
    labels, labels_with_canary = data.pop("labels"), with_canary.pop("labels")
    expected = _sums(engine, model, data, labels)
    GradientCanaryInserter(model, canary, lambda: clip).attach_engine(engine)
    got = _sums(engine, model, with_canary, labels_with_canary)
    name = params[5][0]
    inserted = torch.zeros_like(expected[name]).view(-1)
    inserted[17] = -min(INSERTED_NORM * clip, clip)
    expected[name] = expected[name] + inserted.view(expected[name].shape)
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-7 * clip)


def test_the_canary_inserter_refuses_rows_it_cannot_attribute():
    model = tiny.bert()
    first, second = add_canary_tokens(model, 2, torch.Generator().manual_seed(0))
    canaries = GradientCanaries(first, ("x",), torch.tensor([0, 0]), torch.tensor([0, 1]), torch.ones(2))
    inserter = GradientCanaryInserter(model, canaries, lambda: 1.0)
    model.train()
    with pytest.raises(ValueError, match="two gradient canaries"):
        model(input_ids=torch.tensor([[first, second]]))
    model.eval()
    model(input_ids=torch.tensor([[first, second]]))  # scoring and probes are not training forwards
    assert inserter._rows == []


# ---------------------------------------------------------------- the audit with them, and its power
def _method_audit(output_dir, method: str) -> AuditResult:
    config_cls, model_kwargs = METHODS[method]
    dp = config_cls(target_epsilon=CLAIMED_EPSILON, target_delta=DELTA, max_grad_norm=CLIP, noise_seed=1000)
    tok = tiny.tokenizer()
    return run_audit(
        functools.partial(tiny.bert, **model_kwargs),
        tiny.sentiment_dataset(400, seed=1),
        dp,
        training_args(output_dir, **AUDIT_ARGS),
        canaries=DEFAULT_CANARIES,
        seed=0,
        data_collator=DataCollatorWithPadding(tok),
        processing_class=tok,
    )


@pytest.mark.parametrize("bug", [None, *sorted(BUGS)], ids=["sound", *sorted(BUGS)])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_gradient_canaries_audit_every_method_whose_embedding_does_not_train(tmp_path, monkeypatch, method, bug):
    if bug is not None:
        BUGS[bug](monkeypatch)
    result = _method_audit(tmp_path, method)
    assert [b.score for b in result.bounds] == ["white-box-gradient", "black-box"]
    white = result.bounds[0]
    assert white.guesses == DEFAULT_CANARIES // 5 and 0.4 * DEFAULT_CANARIES < white.included < 0.6 * DEFAULT_CANARIES
    assert_power(result, white, bug)


def test_a_dp_sgd_run_can_be_audited_with_gradient_canaries_too(tmp_path, monkeypatch):
    """Asked for by name, gradient canaries audit full fine-tuning (the inserted gradient meets the embedding's
    index terms in the norm) and refute it unnoised."""
    dp = DPConfig(target_epsilon=CLAIMED_EPSILON, target_delta=DELTA, max_grad_norm=CLIP, noise_seed=1000)
    tok = tiny.tokenizer()

    def audit(path):
        return run_audit(
            tiny.bert,
            tiny.sentiment_dataset(400, seed=1),
            dp,
            training_args(path, **AUDIT_ARGS),
            canaries=DEFAULT_CANARIES,
            seed=0,
            scores=("white-box-gradient",),
            data_collator=DataCollatorWithPadding(tok),
            processing_class=tok,
        )

    sound = audit(tmp_path / "sound")
    assert [b.score for b in sound.bounds] == ["white-box-gradient"] and not sound.refutes_claim
    assert sound.bounds[0].confidence == 0.95
    BUGS["noise-not-added"](monkeypatch)
    assert audit(tmp_path / "broken").refutes_claim


def test_gradient_canaries_audit_a_user_level_run(tmp_path, monkeypatch):
    """At user level every gradient canary is a user of its own, one example in a unit of the user's rows: DP-LoRA
    under ULS (100 users of 4 examples) is not refuted, and refuted unnoised."""
    dp = DPLoRAConfig(
        target_epsilon=CLAIMED_EPSILON,
        target_delta=DELTA,
        max_grad_norm=CLIP,
        noise_seed=1000,
        privacy_unit="user",
        user_column="user_id",
        examples_per_user=4,
    )
    tok = tiny.tokenizer()
    data = tiny.sentiment_dataset(400, seed=1)
    data = data.add_column("user_id", [i // 4 for i in range(len(data))])

    def audit(path):
        return run_audit(
            tiny.bert,
            data,
            dp,
            training_args(path, **AUDIT_ARGS),
            canaries=DEFAULT_CANARIES,
            seed=0,
            data_collator=DataCollatorWithPadding(tok),
            processing_class=tok,
        )

    sound = audit(tmp_path / "sound")
    assert sound.bounds[0].score == "white-box-gradient"
    assert_power(sound, sound.bounds[0], None)
    BUGS["noise-not-added"](monkeypatch)
    broken = audit(tmp_path / "broken")
    assert_power(broken, broken.bounds[0], "noise-not-added")
