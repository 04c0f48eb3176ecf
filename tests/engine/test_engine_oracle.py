"""The engine's per-example norms and clipped sums equal an fp64 per-example autograd loop (≤1e-6 relative)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from hf_private import BitFitConfig
from hf_private.engine import PerExampleGradientEngine, UnsupportedLayerError, terms
from hf_private.integrations.losses import default_per_example_loss
from tests.support import tiny

BATCH, SEQ = 5, 12
CLIP = 0.05  # any clip will do where only the choice of norm path is checked


def _batch(causal: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(4, len(tiny.VOCAB), (BATCH, SEQ), generator=gen)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, 8:] = 0
    ids[1, 8:] = 0
    labels = ids.masked_fill(mask == 0, -100) if causal else torch.randint(0, 2, (BATCH,), generator=gen)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _loss(model, batch) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return default_per_example_loss(model, model(**inputs), batch["labels"]).sum()


def _oracle(model, batch):
    """Per-example gradients by one backward per example; the clip is set below every norm."""
    params = [p for p in model.parameters() if p.requires_grad]
    norms, grads = [], []
    for b in range(BATCH):
        model.zero_grad()
        _loss(model, {k: v[b : b + 1] for k, v in batch.items()}).backward()
        grads.append([p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params])
        norms.append(torch.sqrt(sum(g.pow(2).sum() for g in grads[-1])))
    model.zero_grad()
    norms = torch.stack(norms)
    clip = 0.5 * norms.min().item()  # every example is clipped: the sums test the clip factors too
    sums = [sum(min(1.0, clip / (n.item() + 1e-6)) * g[i] for n, g in zip(norms, grads)) for i in range(len(params))]
    return norms, sums, params, clip


def _lora(model, task):
    return get_peft_model(model, LoraConfig(task_type=task, r=4, lora_alpha=8, lora_dropout=0.0))


def _bitfit(**kw):
    def prepare(model):
        BitFitConfig(noise_multiplier=1.0, **kw).build_method().prepare_model(model)
        return model

    return prepare


MODELS = {  # name: (factory, causal LM?, how to select what trains)
    "bert": (tiny.bert, False, None),
    "roberta": (tiny.roberta, False, None),
    "gpt2-tied": (tiny.gpt2, True, None),
    "llama": (tiny.llama, True, None),
    "llama-tied": (lambda: tiny.llama(tie_word_embeddings=True), True, None),
    "bert-lora": (tiny.bert, False, lambda m: _lora(m, "SEQ_CLS")),
    "roberta-lora": (tiny.roberta, False, lambda m: _lora(m, "SEQ_CLS")),
    "gpt2-lora": (tiny.gpt2, True, lambda m: _lora(m, "CAUSAL_LM")),
    "llama-lora": (tiny.llama, True, lambda m: _lora(m, "CAUSAL_LM")),
    "roberta-bitfit": (tiny.roberta, False, _bitfit()),
    "roberta-bitfit-paper": (tiny.roberta, False, _bitfit(train_head=False)),
    "bert-bitfit-norms": (tiny.bert, False, _bitfit(train_norm_weights=True)),
    "gpt2-bitfit": (tiny.gpt2, True, _bitfit()),
    "llama-norm-gains": (tiny.llama, True, _bitfit(train_norm_weights=True)),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_engine_matches_fp64_per_example_loop(name):
    factory, causal, prepare = MODELS[name]
    model = factory().double()
    if prepare:
        model = prepare(model)
    model.train()
    check_engine_against_oracle(model, causal)


def check_engine_against_oracle(model, causal: bool) -> None:
    """Two chunks (autograd's self-check, then ghost differentiation): norms and clipped sums ≤ 1e-6 from the fp64
    per-example loop, autograd's gradients dropped, the trainable flags restored."""
    batch = _batch(causal)
    ref_norms, ref_sums, params, clip = _oracle(model, batch)

    engine = PerExampleGradientEngine(model, clip)
    engine.attach()
    ref = torch.cat([s.flatten() for s in ref_sums])
    # First chunk: autograd's gradients on, checked by the engine; second: ghost differentiation (flags off).
    for verified in (False, True):
        assert engine.verified is verified
        with engine.recording(BATCH):
            _loss(model, batch).backward()
        norms = engine.finish_backward()
        assert ((norms - ref_norms).abs().max() / ref_norms.max()).item() <= 1e-6
        sums = engine.pop_clipped_sums()
        ours = torch.cat([sums[p].flatten() for p in params])
        assert ((ours - ref).norm() / ref.norm()).item() <= 1e-6
        assert all(p.grad is None for p in params), "autograd's un-clipped gradient must be dropped"
        assert all(p.requires_grad for p in params), "trainable flags must be restored after the chunk"
    engine.detach()


@pytest.mark.parametrize("name", ["bert", "gpt2-tied", "llama"])
def test_halved_gram_blocks_match_the_per_example_loop(name, monkeypatch):
    monkeypatch.setattr(terms, "_HALVED_GRAM_MIN_POSITIONS", 2)  # the long-sequence path at the tests' T
    test_engine_matches_fp64_per_example_loop(name)


def test_lora_uses_both_ghost_and_instantiated_norms(monkeypatch):
    """LoRA factors (r·d small) instantiate; square hidden×hidden weights use the ghost norm at T=12."""
    model = _lora(tiny.roberta().double(), "SEQ_CLS")
    model.train()
    seen = []
    original = terms.ghost_norm_is_cheaper

    def spy(*shape):
        seen.append(original(*shape))
        return seen[-1]

    monkeypatch.setattr(terms, "ghost_norm_is_cheaper", spy)
    engine = PerExampleGradientEngine(model, CLIP)
    engine.attach()
    with engine.recording(BATCH):
        _loss(model, _batch(False)).backward()
    engine.finish_backward()
    assert True in seen and False in seen


def test_clip_factors_do_not_depend_on_module_registration_order():
    """A head registered before the body (fastDP's silent failure): norms still cover every tensor."""

    class HeadFirst(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(8, 2)
            self.body = torch.nn.Linear(4, 8)
            self.norm = torch.nn.LayerNorm(8)

        def forward(self, x):
            return self.head(self.norm(self.body(x)))

    torch.manual_seed(0)
    model = HeadFirst().double()
    x = torch.randn(6, 3, 4, dtype=torch.float64)
    engine = PerExampleGradientEngine(model, 1e-3)
    engine.attach()
    with engine.recording(6):
        model(x).pow(2).sum().backward()
    norms = engine.finish_backward()
    expected = []
    for b in range(6):
        model.zero_grad()
        model(x[b : b + 1]).pow(2).sum().backward()
        expected.append(torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters())))
    assert torch.allclose(norms, torch.stack(expected), rtol=1e-10)


def test_parameter_used_outside_its_module_is_refused():
    class Functional(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used = torch.nn.Linear(4, 4)
            self.bypassed = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x) @ self.bypassed.weight  # bypassed's forward never runs: no hook sees it

    model = Functional()
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    with engine.recording(3):
        model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(UnsupportedLayerError, match="bypassed.weight"):
        engine.finish_backward()


def test_parameter_partly_used_outside_its_module_fails_the_self_check():
    class PartlyHidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(x) + x @ self.proj.weight  # the second use is invisible to hooks

    model = PartlyHidden()
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    with engine.recording(3):
        model(torch.randn(3, 4)).pow(2).sum().backward()
    with pytest.raises(UnsupportedLayerError, match="proj.weight"):
        engine.finish_backward()


def test_conv_biases_match_the_per_example_loop():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.GELU(), torch.nn.Conv1d(3, 2, 1)).double()
    net = lambda x: model[2](model[1](model[0](x)).flatten(2))  # noqa: E731
    model[0].weight.requires_grad_(False)
    model[2].weight.requires_grad_(False)
    x = torch.randn(4, 2, 6, 6, dtype=torch.float64)
    engine = PerExampleGradientEngine(model, 1e-3)
    engine.attach()
    with engine.recording(4):
        net(x).pow(2).sum().backward()
    norms = engine.finish_backward()
    expected = []
    for b in range(4):
        model.zero_grad()
        net(x[b : b + 1]).pow(2).sum().backward()
        expected.append(torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters() if p.requires_grad)))
    assert torch.allclose(norms, torch.stack(expected), rtol=1e-10)


@pytest.mark.parametrize("name", ["bert", "gpt2-tied", "bert-lora", "roberta-bitfit"])
def test_bf16_autocast_keeps_the_clip_and_tracks_the_fp64_loop(name):
    """Under bf16 autocast the terms are bf16; the norms must still track the exact ones and, above all,
    each example's clipped contribution must stay within C (the sensitivity the noise is calibrated to)."""
    factory, causal, prepare = MODELS[name]
    model = factory()
    if prepare:
        model = prepare(model)
    model.train()
    batch = _batch(causal)
    ref_norms, _, params, clip = _oracle(model.double(), batch)
    model.float()

    engine = PerExampleGradientEngine(model, clip)
    engine.attach()
    sums_by_batch = []
    for kept in (range(BATCH), range(1, BATCH)):  # neighbouring batches: with and without example 0
        sub = {k: v[list(kept)] for k, v in batch.items()}
        for _ in range(2):  # the verifying chunk, then the ghost-differentiated one
            with torch.autocast("cpu", dtype=torch.bfloat16), engine.recording(len(kept)):
                _loss(model, sub).backward()
            norms = engine.finish_backward()
            sums = engine.pop_clipped_sums()
        if len(kept) == BATCH:
            assert ((norms.double() - ref_norms).abs() / ref_norms).max().item() <= 0.02  # measured ≤ 0.0044
        sums_by_batch.append(torch.cat([sums[p].double().flatten() for p in params]))
    engine.detach()
    assert (sums_by_batch[0] - sums_by_batch[1]).norm().item() <= clip * 1.001
