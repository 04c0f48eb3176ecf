"""DP-FROST's partition-wise gradient magnitudes (PGMs): `PartitionMagnitudeReducer` against Def. 8 and Lemma 3.

methods_spec §2.2 (Def. 8, Lemma 3) and §8.4 (Tier 0 sensitivity on the PGM vector). The reference is an fp64
per-example loop (one backward per example) that computes Def. 8 literally: g_{∪S}(x) as one flat vector,
normalised per partition (MGN, MGNA) and made absolute (MGNA), clipped in the α-norm at c or c̄, summed over the
examples, projected onto each partition, α-norm (divided by |P_i|^{1/α} for MG).
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from hf_private.engine import PerExampleGradientEngine
from hf_private.engine.terms import IndexTerm, OuterTerm, SampleTerm, clipped_abs_sum, instantiate
from hf_private.methods.frost.reducer import PartitionMagnitudeReducer
from tests.engine.test_engine_oracle import BATCH, _batch, _loss
from tests.support import tiny
from tests.support.helpers import trainable_partitions

VARIANTS = list(itertools.product(["mg", "mgn", "mgna"], [1, 2]))
TOLERANCE = 1e-9  # relative, fp64 (the per-example loss itself is formed in fp32: see losses.py)


# ---------------------------------------------------------------- a tiny regression model, its data and x*
def _model():
    """Tiny BERT with a regression head (labels can be extreme, flipped or NaN), fp64, built from config."""
    return tiny.bert(num_labels=1).double().train()


def _data() -> dict[str, torch.Tensor]:
    return {**_batch(False), "labels": torch.linspace(-1.0, 1.0, BATCH, dtype=torch.float64)}


def _adversaries(model) -> dict[str, dict[str, torch.Tensor]]:
    """x*: one example each, gradients of very different size and direction (methods_spec §8.3 item 1)."""
    data = _data()
    first = {k: v[:1] for k, v in data.items()}
    label = lambda y: torch.tensor([y], dtype=torch.float64)  # noqa: E731
    gen = torch.Generator().manual_seed(5)
    # full length (max positions), only token rows no data example uses
    long_ids = torch.randint(len(tiny.VOCAB), tiny.VOCAB_SIZE, (1, tiny.SEQ_LEN + 4), generator=gen)
    with torch.no_grad():
        embeds = 1e3 * model.bert.embeddings.word_embeddings(first["input_ids"])
    return {
        "copy": {**first, "labels": data["labels"][:1]},  # a duplicate of a data example
        "label+1e6": {**first, "labels": label(1e6)},
        "label-1e6": {**first, "labels": label(-1e6)},  # the same input, gradient flipped
        "flipped": {**{k: v[3:4] for k, v in data.items()}, "labels": -data["labels"][3:4]},
        "long-rare": {"input_ids": long_ids, "attention_mask": torch.ones_like(long_ids), "labels": label(-1e3)},
        "cls-only": {
            "input_ids": first["input_ids"][:, :1],
            "attention_mask": first["attention_mask"][:, :1],
            "labels": label(1e6),
        },
        "scaled-embeddings": {"inputs_embeds": embeds, "attention_mask": first["attention_mask"], "labels": label(1e3)},
    }


def _rows(batch) -> list[dict[str, torch.Tensor]]:
    return [{k: v[b : b + 1] for k, v in batch.items()} for b in range(len(batch["labels"]))]


@functools.cache
def _reference_gradients() -> tuple[list[dict[str, torch.Tensor]], dict[str, dict[str, torch.Tensor]]]:
    """Per-example fp64 gradients by name, one backward per example: (data examples, {x* name: gradient})."""
    model = _model()

    def grad(example):
        model.zero_grad()
        _loss(model, example).backward()
        return {
            n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            for n, p in model.named_parameters()
        }

    return [grad(x) for x in _rows(_data())], {k: grad(x) for k, x in _adversaries(model).items()}


def _partitions(model, subset: bool):
    """All of S (every module with its own parameters), or a later PSEL round: every third one already selected."""
    partitions = trainable_partitions(model)
    return [g for i, g in enumerate(partitions) if i % 3] if subset else partitions


def _names(model, partitions) -> list[list[str]]:
    name = {p: n for n, p in model.named_parameters()}
    return [[name[p] for p in group] for group in partitions]


# ---------------------------------------------------------------- Def. 8, literally
def pgm_reference(grads, partitions, clip, order, variant, clip_order=None):
    """(per-example clipped norms, μ) of Def. 8 from per-example gradients; `clip_order` ≠ α only for a mutant."""
    clip_order = order if clip_order is None else clip_order
    sizes = [sum(grads[0][n].numel() for n in group) for group in partitions]
    c_bar = clip / (sum(sizes) / len(sizes)) ** (1 / order)
    kappa = clip if variant == "mg" else c_bar
    total, norms = torch.zeros(sum(sizes), dtype=torch.float64), []
    for example in grads:
        pieces = [torch.cat([example[n].flatten() for n in group]) for group in partitions]
        if variant != "mg":
            pieces = [g / size ** (1 / order) for g, size in zip(pieces, sizes)]  # ĝ
        v = torch.cat(pieces)  # g_{∪S}(x) or ĝ(x)
        if variant == "mgna":
            v = v.abs()
        norm = torch.linalg.vector_norm(v, ord=clip_order)
        norms.append(norm)
        if torch.isfinite(norm):  # a non-finite example contributes nothing
            total += torch.clamp(kappa / norm, max=1.0) * v  # C_κ(v) = min(1, κ/‖v‖)·v
    mu, start = [], 0
    for size in sizes:
        piece = torch.linalg.vector_norm(total[start : start + size], ord=order)  # ‖[Σ_x C(v(x))]_{P_i}‖_α
        mu.append(piece / size ** (1 / order) if variant == "mg" else piece)
        start += size
    return torch.stack(norms), torch.stack(mu)


def _kappa_per_clip(reducer: PartitionMagnitudeReducer) -> float:
    return reducer.bound / reducer.clip


def _engine_mu(engine, model, chunks) -> tuple[torch.Tensor, torch.Tensor]:
    """μ through the engine: every chunk recorded into the current reducer (one logical batch), then popped."""
    norms = []
    for chunk in chunks:
        with engine.recording(len(chunk["labels"])):
            _loss(model, chunk).backward()
        norms.append(engine.finish_backward())
    return torch.cat(norms), engine.reducer.pop_magnitudes()


def _relative_error(ours, want) -> float:
    return ((ours - want).norm() / want.norm()).item()


# ---------------------------------------------------------------- (1) the reducer computes Def. 8
@pytest.mark.parametrize("variant,order", VARIANTS)
def test_reducer_matches_def8_fp64_per_example_loop(variant, order):
    """Through the engine (two chunks, full S and a later round's subset) μ equals Def. 8 computed literally."""
    model = _model()
    data_grads, _ = _reference_gradients()
    data = _data()
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    for subset in (False, True):
        partitions = _partitions(model, subset)
        names = _names(model, partitions)
        reducer = PartitionMagnitudeReducer(partitions, 1.0, order=order, variant=variant)
        ref_norms, _ = pgm_reference(data_grads, names, 1.0, order, variant)
        clip = ref_norms.median().item() / _kappa_per_clip(reducer)  # some examples clipped, some not
        ref_norms, ref = pgm_reference(data_grads, names, clip, order, variant)
        assert (ref_norms > ref_norms.median()).any() and (ref_norms < ref_norms.median()).any()
        engine.reducer = PartitionMagnitudeReducer(partitions, clip, order=order, variant=variant)
        norms, ours = _engine_mu(
            engine, model, [{k: v[:3] for k, v in data.items()}, {k: v[3:] for k, v in data.items()}]
        )
        assert ours.dtype == torch.float64 and ours.shape == (len(partitions),)
        assert ((norms - ref_norms).abs().max() / ref_norms.max()).item() <= TOLERANCE
        assert _relative_error(ours, ref) <= TOLERANCE, (variant, order, subset)
        assert not engine.reducer.pending() and (engine.reducer.pop_magnitudes() == 0).all()
    engine.detach()


@pytest.mark.parametrize("variant,order", VARIANTS)
def test_fp32_model_gives_float64_magnitudes_close_to_fp64(variant, order):
    """On an fp32 model μ is still returned in float64 and agrees with the fp64 model's μ to fp32 precision."""
    results = []
    for dtype in (torch.float64, torch.float32):
        model = tiny.bert(num_labels=1).to(dtype).train()
        data = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in _data().items()}
        engine = PerExampleGradientEngine(model, 1.0)
        engine.attach()
        engine.reducer = PartitionMagnitudeReducer(_partitions(model, subset=True), 1e-3, order=order, variant=variant)
        results.append(_engine_mu(engine, model, [data])[1])
        engine.detach()
    assert results[1].dtype == torch.float64
    assert _relative_error(results[1], results[0]) <= 1e-4


def test_constructor_sensitivity_and_normalized_clip():
    """c̄ = c / mean|P|^{1/α}; sensitivity c / min|P|^{1/α} for MG and c̄ otherwise; bad arguments are refused."""
    a, b = torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(9))  # |P| = 16 + 9, 36
    c = torch.nn.Parameter(torch.zeros(36))
    partitions = [[a, b], [c]]
    for order in (1, 2):
        for variant in ("mg", "mgn", "mgna"):
            reducer = PartitionMagnitudeReducer(partitions, 3.0, order=order, variant=variant)
            assert reducer.clip == 3.0
            assert reducer.normalized_clip == pytest.approx(3.0 / 30.5 ** (1 / order), rel=1e-15)
            expected = 3.0 / 25 ** (1 / order) if variant == "mg" else 3.0 / 30.5 ** (1 / order)
            assert reducer.sensitivity == pytest.approx(expected, rel=1e-15)
            assert reducer.pop_magnitudes().tolist() == [0.0, 0.0] and not reducer.pending()
    assert PartitionMagnitudeReducer(partitions, 1.0).variant == "mgna"
    with pytest.raises(ValueError, match="variant"):
        PartitionMagnitudeReducer(partitions, 1.0, variant="l2")
    with pytest.raises(ValueError, match="order"):
        PartitionMagnitudeReducer(partitions, 1.0, order=3)
    with pytest.raises(ValueError, match="positive"):
        PartitionMagnitudeReducer(partitions, 0.0)
    with pytest.raises(ValueError, match="disjoint"):
        PartitionMagnitudeReducer([[a], [a, c]], 1.0)
    with pytest.raises(TypeError):
        PartitionMagnitudeReducer(partitions, 1.0, normalize=True)  # replaced by `variant`


@pytest.mark.parametrize("kind", ["sample", "sample-vector", "index", "outer", "index+outer", "index+sample"])
def test_clipped_abs_sum_equals_weighted_abs_of_each_example(kind):
    """terms.clipped_abs_sum = Σ_b f_b·abs(g_b) per coordinate, also when instantiated in many small blocks."""
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    batch, tokens, rows, width = 7, 5, 6, 4
    index = IndexTerm(
        index=torch.randint(0, rows, (batch, tokens), generator=gen), right=rand(batch, tokens, width), num_rows=rows
    )
    outer = OuterTerm(left=rand(batch, tokens, rows), right=rand(batch, tokens, width))
    sample = SampleTerm(rand(batch, rows, width))
    terms = {
        "sample": [sample],
        "sample-vector": [SampleTerm(rand(batch, rows))],
        "index": [index],
        "outer": [outer],
        "index+outer": [index, outer],
        "index+sample": [index, sample],
    }[kind]
    factors = torch.rand(batch, generator=gen, dtype=torch.float64)
    dense = sum(instantiate(t) for t in terms)
    want = torch.einsum("b,b...->...", factors, dense.abs())
    for block in (1 << 25, 30):  # 30 values: one example per block
        out = clipped_abs_sum(terms, factors, want.shape, torch.float64, block_elements=block)
        assert torch.allclose(out, want, rtol=1e-12, atol=0)
        again = clipped_abs_sum(terms, factors, want.shape, torch.float64, out=out.clone(), block_elements=block)
        assert torch.allclose(again, 2 * want, rtol=1e-12, atol=0)  # accumulates into `out`


# ---------------------------------------------------------------- (2) Lemma 3 through the engine
def _sensitivity_setup(model, variant, order):
    """The reducer for all of S with c set so that every data example is clipped (κ = ½ of the smallest norm)."""
    partitions = _partitions(model, subset=False)
    data_grads, _ = _reference_gradients()
    unit = PartitionMagnitudeReducer(partitions, 1.0, order=order, variant=variant)
    ref_norms, _ = pgm_reference(data_grads, _names(model, partitions), 1.0, order, variant)
    clip = 0.5 * ref_norms.min().item() / _kappa_per_clip(unit)
    return partitions, clip


@pytest.mark.parametrize("variant,order", VARIANTS)
def test_lemma3_sensitivity_holds_for_adversarial_examples(variant, order):
    """‖μ(D ∪ {x*}) − μ(D)‖₂ ≤ Δ (Lemma 3) for every adversarial x*, and matches Def. 8; MGNA α=1 gets within 2×."""
    model = _model()
    data = _data()
    partitions, clip = _sensitivity_setup(model, variant, order)
    names = _names(model, partitions)
    data_grads, adversary_grads = _reference_gradients()
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    engine.reducer = reducer = PartitionMagnitudeReducer(partitions, clip, order=order, variant=variant)
    _, mu_data = _engine_mu(engine, model, [data])
    ratios = {}
    for name, extra in _adversaries(model).items():
        norms, mu = _engine_mu(engine, model, [data, extra])  # D, then x* as a second chunk of the same batch
        _, ref = pgm_reference([*data_grads, adversary_grads[name]], names, clip, order, variant)
        assert _relative_error(mu, ref) <= TOLERANCE, name
        assert torch.isfinite(norms).all()
        ratios[name] = ((mu - mu_data).norm() / reducer.sensitivity).item()
    engine.detach()
    assert max(ratios.values()) <= 1 + 1e-9, ratios
    assert min(ratios.values()) >= 0.0
    if (variant, order) == ("mgna", 1):  # Δμ = C(abs ĝ(x*)) exactly: its L1 norm is c̄, its L2 norm near it
        assert max(ratios.values()) > 0.5, ratios


# ---------------------------------------------------------------- (3) the sensitivity check has power
@pytest.mark.parametrize("variant", ["mg", "mgn", "mgna"])
def test_sensitivity_check_fails_for_l2_clipping_where_alpha_is_1(variant):
    """A mutant clipping in L2 where α = 1 exceeds Lemma 3's bound for some x* (the check above can fail)."""
    model = _model()
    partitions, clip = _sensitivity_setup(model, variant, 1)
    names = _names(model, partitions)
    sensitivity = PartitionMagnitudeReducer(partitions, clip, order=1, variant=variant).sensitivity
    data_grads, adversary_grads = _reference_gradients()

    def worst(clip_order):
        _, base = pgm_reference(data_grads, names, clip, 1, variant, clip_order=clip_order)
        return (
            max(
                (pgm_reference([*data_grads, g], names, clip, 1, variant, clip_order=clip_order)[1] - base).norm()
                for g in adversary_grads.values()
            )
            / sensitivity
        )

    assert worst(1) <= 1 + 1e-9  # the correct clip
    assert worst(2) > 1.5  # the mutant: ‖C₂(v)‖₁ can be up to √d·κ (measured: 2.2 MG, 3.0 MGN, 3.5 MGNA)


# ---------------------------------------------------------------- (4) non-finite examples
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_non_finite_example_contributes_zero_for_every_variant(poison):
    """An example with a NaN or infinite label leaves μ exactly as without it, for every variant and α."""
    model = _model()
    data = _data()
    poisoned = {**data, "labels": data["labels"].clone()}
    poisoned["labels"][0] = poison
    clean = {k: v[1:] for k, v in data.items()}
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    partitions = _partitions(model, subset=False)
    for variant, order in VARIANTS:
        clip = 1e-3 if variant == "mg" else 1e-3 * 100 ** (1 / order)  # some examples clipped
        engine.reducer = PartitionMagnitudeReducer(partitions, clip, order=order, variant=variant)
        norms, with_poison = _engine_mu(engine, model, [poisoned])
        _, without = _engine_mu(engine, model, [clean])
        assert not torch.isfinite(norms[0]) and torch.isfinite(norms[1:]).all()
        assert torch.isfinite(with_poison).all() and (without > 0).all()
        assert torch.allclose(with_poison, without, rtol=1e-12, atol=0), (variant, order)
    engine.detach()
