"""The engine's pluggable parts: reducers, term transforms (masks before the norm), and the optimizer's named step.

Every oracle is an fp64 per-example autograd loop (one backward per example), as in test_engine_oracle.py.
"""

from __future__ import annotations

import pytest
import torch

from hf_private.engine import FlatL2ClipReducer, PerExampleGradientEngine, terms
from hf_private.engine.terms import IndexTerm, OuterTerm, SampleTerm, instantiate, zero_columns, zero_rows
from hf_private.methods.frost.reducer import PartitionMagnitudeReducer
from hf_private.optimizer import NoisyOptimizer
from hf_private.privacy import GaussianNoise
from tests.engine.test_engine_oracle import BATCH, _batch, _lora, _loss
from tests.support import tiny
from tests.support.helpers import trainable_partitions


def _bert_lora():
    """PEFT's zero-initialised lora_B would make every lora_A gradient zero: give it values, as after some training."""
    model = _lora(tiny.bert().double(), "SEQ_CLS")
    gen = torch.Generator().manual_seed(2)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.copy_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


MODELS = {  # name: (factory, causal LM?)
    "bert": (lambda: tiny.bert().double(), False),
    "bert-lora": (_bert_lora, False),
    "gpt2-tied": (lambda: tiny.gpt2().double(), True),  # wte is an embedding lookup and the LM head: dense L1 path
}


def _per_example_grads(model, batch, params, transform=None) -> list[list[torch.Tensor]]:
    """grads[b][i]: example b's gradient of params[i], by one backward per example (then `transform(i, g)`)."""
    grads = []
    for b in range(BATCH):
        model.zero_grad()
        _loss(model, {k: v[b : b + 1] for k, v in batch.items()}).backward()
        grads.append([p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params])
        if transform is not None:
            grads[-1] = [transform(i, g) for i, g in enumerate(grads[-1])]
    model.zero_grad()
    return grads


def _model(name):
    factory, causal = MODELS[name]
    model = factory()
    model.train()
    return model, _batch(causal)


def _two_chunks(engine, model, batch):
    """The verifying chunk (autograd's gradients on), then a ghost-differentiated one: yield after each."""
    for _ in range(2):
        with engine.recording(BATCH):
            _loss(model, batch).backward()
        yield engine.finish_backward()


# ---------------------------------------------------------------- per-partition magnitudes (DP-FROST's selection)
def _magnitude_oracle(grads, partitions, params, order, variant, clip):
    """Def. 8 partition by partition: (each example's α-norm before its clip, μ)."""
    position = {p: i for i, p in enumerate(params)}
    sizes = torch.tensor([sum(p.numel() for p in group) for group in partitions], dtype=torch.float64)
    scale = torch.ones_like(sizes) if variant == "mg" else sizes ** (1 / order)  # ĝ_{P_i} = g_{P_i} / |P_i|^{1/α}
    bound = clip if variant == "mg" else clip / sizes.mean().item() ** (1 / order)
    norms, sums = [], [0.0] * len(partitions)
    for example in grads:
        pieces = [torch.cat([example[position[p]].flatten() for p in group]) / s for group, s in zip(partitions, scale)]
        pieces = [g.abs() for g in pieces] if variant == "mgna" else pieces
        norm = torch.linalg.vector_norm(torch.cat(pieces), ord=order)
        norms.append(norm)
        sums = [total + min(1.0, bound / norm.item()) * g for total, g in zip(sums, pieces)]
    mu = torch.stack([torch.linalg.vector_norm(total, ord=order) for total in sums])
    return torch.stack(norms), mu / sizes ** (1 / order) if variant == "mg" else mu


@pytest.mark.parametrize("order", [1, 2])
@pytest.mark.parametrize("name", list(MODELS))
def test_partition_magnitudes_match_fp64_per_example_loop(name, order):
    """Every PGM variant on a later round's partitions (tied and LoRA models too) equals Def. 8 per partition."""
    model, batch = _model(name)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = _per_example_grads(model, batch, params)
    partitions = trainable_partitions(model)
    assert sum(len(g) for g in partitions) == len(params), "every trainable tensor in exactly one partition"
    # A later PSEL round: a third of the partitions already selected, so outside both the norm and the sum.
    remaining = [g for i, g in enumerate(partitions) if i % 3]
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    for variant in ("mg", "mgn", "mgna"):
        ref_norms, _ = _magnitude_oracle(grads, remaining, params, order, variant, 1.0)
        unit = PartitionMagnitudeReducer(remaining, 1.0, order=order, variant=variant)
        clip = 0.5 * ref_norms.min().item() / unit.bound  # every example is clipped: the sum tests the clip factors
        _, ref = _magnitude_oracle(grads, remaining, params, order, variant, clip)
        engine.reducer = PartitionMagnitudeReducer(remaining, clip, order=order, variant=variant)
        for norms in _two_chunks(engine, model, batch):
            assert ((norms - ref_norms).abs().max() / ref_norms.max()).item() <= 1e-6
            ours = engine.reducer.pop_magnitudes()
            assert ours.shape == (len(remaining),) and ours.dtype == torch.float64
            assert ((ours - ref).norm() / ref.norm()).item() <= 1e-6, variant
            assert all(p.grad is None for p in params)
    engine.detach()


def test_partition_magnitude_reducer_releases_nothing_to_the_optimizer():
    model, batch = _model("bert")
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    engine.reducer = PartitionMagnitudeReducer(trainable_partitions(model), 1e-3)
    next(_two_chunks(engine, model, batch))
    with pytest.raises(TypeError, match="no clipped gradient"):
        engine.pop_clipped_sums()
    with pytest.raises(RuntimeError, match="not yet released"):
        engine.reducer = FlatL2ClipReducer(1.0)  # the magnitudes of a half-finished round would be lost
    assert engine.reducer.pop_magnitudes().abs().sum() > 0
    engine.reducer = FlatL2ClipReducer(1.0)
    assert engine.pop_clipped_sums() == {}
    frozen = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    with pytest.raises(ValueError, match="does not train"):
        engine.reducer = PartitionMagnitudeReducer([[frozen]], 1.0)


def test_partition_magnitudes_drop_a_non_finite_example():
    model = tiny.bert(num_labels=1).double().train()  # a regression head: a float label can be NaN
    batch = {**_batch(False), "labels": torch.linspace(-1.0, 1.0, BATCH, dtype=torch.float64)}
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    engine.reducer = PartitionMagnitudeReducer(trainable_partitions(model), 1e-3)
    results = []
    for poisoned in (False, True):
        labels = batch["labels"].clone()
        if poisoned:
            labels[0] = float("nan")
        inputs = {**batch, "labels": labels} if poisoned else {k: v[1:] for k, v in batch.items()}
        with engine.recording(labels.shape[0] if poisoned else BATCH - 1):
            _loss(model, inputs).backward()
        norms = engine.finish_backward()
        results.append(engine.reducer.pop_magnitudes())
    assert not torch.isfinite(norms[0]) and torch.isfinite(results[1]).all()
    assert torch.allclose(results[1], results[0], rtol=1e-9)


# ---------------------------------------------------------------- masks before the norm
def _masks(model, name):
    """parameter → (rows, columns) to zero: every term kind is reached (checked by the test)."""
    masks = {}
    for pname, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name == "bert" and pname.endswith(
            ("word_embeddings.weight", "layer.0.attention.self.query.weight", "layer.1.intermediate.dense.weight")
        ):
            masks[p] = (torch.tensor([0, 3, 5, 17]), torch.arange(p.shape[1]) % 4 == 1)
        elif name == "bert" and pname.endswith("layer.0.output.LayerNorm.weight"):
            masks[p] = (torch.arange(0, 32, 3), None)
        elif name == "bert-lora" and "lora_B" in pname:  # rows of ∂L (PEFT lora_B: out × r)
            masks[p] = (torch.arange(p.shape[0]) % 3 == 0, None)
        elif name == "bert-lora" and "lora_A" in pname:  # columns of ∂R (PEFT lora_A: r × in)
            masks[p] = (None, torch.arange(1, p.shape[1], 4))
    return masks


def _apply_mask(g, rows, columns):
    g = g.clone()
    if rows is not None:
        g[rows] = 0
    if columns is not None:
        g[:, columns] = 0
    return g


@pytest.mark.parametrize("name", ["bert", "bert-lora"])
def test_masked_terms_match_masked_fp64_per_example_loop(name):
    model, batch = _model(name)
    params = [p for p in model.parameters() if p.requires_grad]
    masks = _masks(model, name)
    mask_of = [masks.get(p) for p in params]
    grads = _per_example_grads(
        model, batch, params, lambda i, g: g if mask_of[i] is None else _apply_mask(g, *mask_of[i])
    )
    ref_norms = torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in example)) for example in grads])
    clip = 0.5 * ref_norms.min().item()
    ref = [
        sum(min(1.0, clip / (n.item() + 1e-6)) * example[i] for n, example in zip(ref_norms, grads))
        for i in range(len(params))
    ]

    engine = PerExampleGradientEngine(model, clip)
    engine.attach()
    kinds = set()

    def transform(rows, columns):
        def apply(term):
            kinds.add(type(term))
            term = term if rows is None else zero_rows(term, rows)
            return term if columns is None else zero_columns(term, columns)

        return apply

    for p, (rows, columns) in masks.items():
        engine.add_term_transform(p, transform(rows, columns))
    assert kinds == set() and masks
    for norms in _two_chunks(engine, model, batch):
        assert ((norms - ref_norms).abs().max() / ref_norms.max()).item() <= 1e-6
        sums = engine.pop_clipped_sums()
        ours, want = torch.cat([sums[p].flatten() for p in params]), torch.cat([r.flatten() for r in ref])
        assert ((ours - want).norm() / want.norm()).item() <= 1e-6
        for p, (rows, columns) in masks.items():
            masked = _apply_mask(torch.ones_like(p), rows, columns) == 0
            assert masked.any() and (sums[p][masked] == 0).all(), "masked coordinates must be exactly zero"
            assert (sums[p][~masked] != 0).any()
    expected = {IndexTerm, OuterTerm} if name == "bert" else {SampleTerm}
    assert expected <= kinds
    engine.detach()


@pytest.mark.parametrize("kind", ["outer", "index", "sample", "sample-vector"])
def test_zero_rows_and_columns_equal_masking_each_example(kind):
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    if kind == "outer":
        term = OuterTerm(left=rand(3, 4, 6), right=rand(3, 4, 5))
    elif kind == "index":
        term = IndexTerm(index=torch.randint(0, 6, (3, 4), generator=gen), right=rand(3, 4, 5), num_rows=6)
    else:
        term = SampleTerm(rand(3, 6, 5) if kind == "sample" else rand(3, 6))
    dense = instantiate(term)
    rows, columns = torch.tensor([1, 4]), torch.tensor([True, False, False, True, False])
    expected = dense.clone()
    expected[:, rows] = 0
    assert torch.equal(instantiate(zero_rows(term, rows)), expected)
    if kind == "sample-vector":
        with pytest.raises(ValueError, match="two dimensions"):
            zero_columns(term, columns)
        return
    expected[:, :, columns] = 0
    assert torch.equal(instantiate(zero_columns(zero_rows(term, rows), columns)), expected)
    assert torch.allclose(
        terms.squared_norm(zero_columns(zero_rows(term, rows), columns)), expected.flatten(1).pow(2).sum(1), rtol=1e-12
    )


@pytest.mark.parametrize("positions", [8, 64, 65])  # one Gram; halved blocks; halved blocks of odd length
def test_ghost_norms_from_gram_blocks_equal_the_instantiated_norms(positions):
    gen = torch.Generator().manual_seed(positions)
    term = OuterTerm(
        left=torch.randn(3, positions, 6, generator=gen, dtype=torch.float64),
        right=torch.randn(3, positions, 5, generator=gen, dtype=torch.float64),
    )
    assert len(terms.gram_blocks(term.left)) == (1 if positions < 64 else 3)
    assert torch.allclose(terms.squared_norm(term), instantiate(term).flatten(1).pow(2).sum(1), rtol=1e-12)


def test_factor_grams_form_a_shared_input_once_and_never_another_tensors(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    hidden = rand(3, 70, 16)  # the input Q, K and V read: one tensor, three weights' right factor
    outputs = [rand(3, 70, 8) for _ in range(3)]
    formed = []
    gram_blocks = terms.gram_blocks
    monkeypatch.setattr(terms, "gram_blocks", lambda factor: formed.append(factor) or gram_blocks(factor))
    grams = terms.FactorGrams()
    for grad in outputs:
        term = OuterTerm(left=grad, right=hidden)
        expected = instantiate(term).flatten(1).pow(2).sum(1)
        assert torch.allclose(terms.squared_norm(term, grams), expected, rtol=1e-12)
    assert len(formed) == 4, "three output-gradient factors and the shared input once"
    # The same values in another tensor, or other values at the same address (another view): Grams of their own.
    wide = rand(3, 70, 32)
    columns, packed = wide[:, :, :16], wide.as_strided((3, 70, 16), (70 * 16, 16, 1))
    assert columns.data_ptr() == packed.data_ptr() and not torch.equal(columns, packed)
    for other in (hidden.clone(), columns, packed):
        term = OuterTerm(left=outputs[2], right=other)
        assert torch.allclose(terms.squared_norm(term, grams), instantiate(term).flatten(1).pow(2).sum(1), rtol=1e-12)
    assert len(formed) == 4 + 3


def test_factor_grams_cast_a_shared_bf16_input_once_and_compute_in_the_accumulation_dtype(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 66, 16, generator=gen).to(torch.bfloat16)  # as bf16 autocast stores it
    outputs = [torch.randn(2, 66, 8, generator=gen).to(torch.bfloat16) for _ in range(3)]
    formed = []
    gram_blocks = terms.gram_blocks
    monkeypatch.setattr(terms, "gram_blocks", lambda factor: formed.append(factor.dtype) or gram_blocks(factor))
    grams = terms.FactorGrams()
    for grad in outputs:
        term = OuterTerm(left=grad, right=hidden)
        got = terms.combined_squared_norm([term], torch.float32, grams)
        expected = instantiate(terms.cast_term(term, torch.float64)).flatten(1).pow(2).sum(1)
        assert got.dtype == torch.float32 and torch.allclose(got.double(), expected, rtol=1e-5)
    assert formed == [torch.float32] * 4, "cast to fp32 and formed once for the shared input"


def test_term_transform_handle_removes_it():
    model, batch = _model("bert")
    weight = model.classifier.weight
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    handle = engine.add_term_transform(weight, lambda t: zero_rows(t, [0, 1]))
    next(_two_chunks(engine, model, batch))
    assert (engine.pop_clipped_sums()[weight] == 0).all()
    handle.remove()
    next(_two_chunks(engine, model, batch))
    assert (engine.pop_clipped_sums()[weight] != 0).all()
    with pytest.raises(ValueError, match="not one this engine trains"):
        engine.add_term_transform(torch.nn.Parameter(torch.zeros(2)), lambda t: t)


# ---------------------------------------------------------------- the optimizer's named step
def _optimizer(model, engine, *, ledger=None, **kw):
    inner = torch.optim.AdamW([p for _, p in engine.parameters], lr=1e-2, weight_decay=0.0)
    return NoisyOptimizer(
        inner,
        engine,
        noise_multiplier=1.0,
        max_grad_norm=engine.max_grad_norm,
        expected_batch_size=BATCH,
        noise=GaussianNoise("cpu", test_seed=0),
        may_step=lambda: True,
        on_step=(ledger or (lambda: None)),
        **kw,
    )


def _train_step(engine, model, batch, optimizer):
    with engine.recording(BATCH):
        _loss(model, batch).backward()
    engine.finish_backward()
    optimizer.step()


@pytest.mark.parametrize("registered", ["add_gradient_transform", "constructor"])
def test_gradient_transform_keeps_masked_coordinates_bit_identical_under_noise(registered):
    model, batch = _model("bert-lora")
    engine = PerExampleGradientEngine(model, 0.1)
    engine.attach()
    lora_b = next(p for n, p in model.named_parameters() if "lora_B" in n)
    lora_a = next(p for n, p in model.named_parameters() if "lora_A" in n)
    rows = torch.arange(lora_b.shape[0]) % 2 == 0
    lora_a.data.normal_()  # the masked columns must hold values a stray update would change

    def zero_masked(grad):
        grad[rows] = 0

    def zero_columns_(grad):
        return grad.masked_fill(torch.arange(grad.shape[1]) < 5, 0.0)

    transforms = {lora_b: zero_masked, lora_a: zero_columns_}
    if registered == "constructor":
        optimizer = _optimizer(model, engine, gradient_transforms=transforms)
    else:
        optimizer = _optimizer(model, engine)
        for p, fn in transforms.items():
            optimizer.add_gradient_transform(p, fn)
    before_b, before_a = lora_b.detach().clone(), lora_a.detach().clone()
    for _ in range(3):
        _train_step(engine, model, batch, optimizer)
        optimizer.step()  # an empty logical batch: noise only
    assert torch.equal(lora_b[rows], before_b[rows]) and torch.equal(lora_a[:, :5], before_a[:, :5])
    assert (lora_b[~rows] != before_b[~rows]).all() and (lora_a[:, 5:] != before_a[:, 5:]).all()


def test_step_end_hook_runs_once_per_logical_batch_after_the_inner_step_and_the_ledger():
    model, batch = _model("bert-lora")
    engine = PerExampleGradientEngine(model, 0.1)
    engine.attach()
    events = []
    param = next(p for _, p in engine.parameters)
    optimizer = _optimizer(model, engine, ledger=lambda: events.append("ledger"))
    inner_step = optimizer.optimizer.step

    def counted_step(*args, **kwargs):
        events.append("inner")
        return inner_step(*args, **kwargs)

    optimizer.optimizer.step = counted_step
    seen = []
    optimizer.add_step_end_hook(lambda: (events.append("end"), seen.append(param.detach().clone())))
    for step in range(3):
        before = param.detach().clone()
        _train_step(engine, model, batch, optimizer)
        assert events[-3:] == ["inner", "ledger", "end"] and len(events) == 3 * (step + 1)
        assert not torch.equal(seen[-1], before), "the hook sees the weights after the inner step"
    optimizer.may_step = lambda: False  # budget spent: no step, so no step end either
    optimizer.step()
    assert len(events) == 9
