"""Invariant 8 at user level: a privacy unit is a run of consecutive examples whose number varies from unit to unit.

`engine.recording(units, rows_per_example=[rows of unit 0, rows of unit 1, ...])` groups each unit's rows into one
term (`terms.group_rows(term, sizes)`), so the norm and the clip cover the unit's whole gradient. Checked here against
a brute-force reference (each unit's examples forwarded and backwarded alone with autograd, their gradients summed,
normed and clipped) on BERT, GPT-2 with tied embeddings, Llama (RMSNorm, rotary), a PEFT LoRA model, an embedding-only
GPT-2 and a multiple-choice model (a unit of examples of several rows each); the grouping algebra term by term; that
clipping a unit's examples apart is caught (a different sum, a unit moving it by more than C); that rows which do not
add up are refused; and the independence probe with units recomputed alone.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import DataCollatorForMultipleChoice

from hf_private.engine import FlatL2ClipReducer, PerExampleGradientEngine, independence, terms
from hf_private.engine.independence import check_example_independence, example_alone, probe_example_independence
from hf_private.integrations.losses import default_per_example_loss
from tests.support import tiny

UNITS = [1, 3, 2, 1]  # examples per unit: 7 examples, 4 units
LENGTHS = [12, 5, 9, 12, 3, 7, 10]  # attended tokens of each example (right padding up to SEQ)
SEQ = 12
CHOICES = 3
RTOL = 1e-5  # fp32


def _loss(model, batch) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return default_per_example_loss(model, model(**inputs), batch["labels"]).sum()


def _batch(causal: bool, seq: int = SEQ, lengths=LENGTHS, vocab: int = len(tiny.VOCAB), seed: int = 1) -> dict:
    """Right-padded examples of the given lengths (capped at `seq`); ids from a small vocabulary, so that a unit's
    examples share embedding rows."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (len(lengths), seq), generator=gen)
    mask = (torch.arange(seq).unsqueeze(0) < torch.tensor(lengths).clamp(max=seq).unsqueeze(1)).long()
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100) if causal else torch.randint(0, 2, (len(lengths),), generator=gen)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _mc_batch(count: int) -> dict:
    data = tiny.multiple_choice_dataset(count, choices=CHOICES, seed=5)
    return dict(DataCollatorForMultipleChoice(tiny.tokenizer())([data[i] for i in range(count)]))


def _lora(model, task):
    return get_peft_model(model, LoraConfig(task_type=task, r=4, lora_alpha=8, lora_dropout=0.0))


def _embeddings_only(model):
    """GPT-2 with only wte (tied to the LM head: an embedding term and a head term) and wpe (positions broadcast
    over the rows) trainable."""
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith(("wte.weight", "wpe.weight")))
    return model


# A multiple-choice gradient is Σ_c (p_c - y_c)·h_c with Σ_c (p_c - y_c) = 0 over choice rows that differ by one
# token: it cancels, and fp32 rounding alone moves it by ~1e-3 relative (both here and in autograd), so that case runs
# in fp64 (as tests/engine/test_example_independence.py's multiple-choice oracle does).
FP64 = {"roberta-multiple-choice"}
MODELS = {  # name: (factory, batch kind, what trains)
    "bert": (tiny.bert, "cls", None),
    "gpt2-tied": (tiny.gpt2, "lm", None),
    "llama": (tiny.llama, "lm", None),
    "llama-lora": (tiny.llama, "lm", lambda m: _lora(m, "CAUSAL_LM")),
    "gpt2-embeddings": (tiny.gpt2, "lm-small-vocab", _embeddings_only),
    "roberta-multiple-choice": (tiny.roberta_multiple_choice, "mc", None),
}


def _case(name: str):
    factory, kind, prepare = MODELS[name]
    model = factory().to(torch.float64 if name in FP64 else torch.float32)
    if prepare:
        model = prepare(model)
    if kind == "mc":
        return model.train(), _mc_batch(sum(UNITS)), CHOICES
    return model.train(), _batch(kind != "cls", vocab=10 if kind == "lm-small-vocab" else len(tiny.VOCAB)), 1


def _examples(batch: dict, start: int, stop: int) -> dict:
    return {k: v[start:stop] for k, v in batch.items()}


def _unit_reference(model, batch, units, clip_quantile: float = 0.5):
    """Brute force: each example forwarded and backwarded alone, the gradients of a unit's examples summed, then the
    unit's norm and clip. The clip sits at a quantile of the unit norms, so that some units are clipped and some not."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads, start = [], 0
    for count in units:
        unit = [torch.zeros_like(p) for p in params]
        for b in range(start, start + count):
            model.zero_grad()
            _loss(model, _examples(batch, b, b + 1)).backward()
            unit = [u + (p.grad if p.grad is not None else 0) for u, p in zip(unit, params)]
        grads.append(unit)
        start += count
    model.zero_grad()
    norms = torch.stack([torch.sqrt(sum(g.double().pow(2).sum() for g in unit)) for unit in grads]).to(params[0].dtype)
    clip = float(norms.quantile(clip_quantile))
    sums = [
        sum(min(1.0, clip / (n.item() + 1e-6)) * unit[i] for n, unit in zip(norms, grads)) for i in range(len(params))
    ]
    return norms, torch.cat([s.flatten() for s in sums]), params, clip


class _TermTypes(FlatL2ClipReducer):
    """The flat clip, remembering which kind of (grouped) term each parameter handed it."""

    def __init__(self, max_grad_norm: float) -> None:
        super().__init__(max_grad_norm)
        self.seen: dict[torch.nn.Parameter, list[str]] = {}

    def reduce(self, chunk):
        self.seen = {p: [type(t).__name__ for t in ts] for p, ts in chunk.terms.items()}
        return super().reduce(chunk)


def _engine_chunk(engine, model, batch, units, rows_per_example=1):
    with engine.recording(len(units), [count * rows_per_example for count in units]):
        _loss(model, batch).backward()
    norms = engine.finish_backward()
    sums = engine.pop_clipped_sums()
    return norms, sums


def _errors(norms, sums, params, ref_norms, ref_sums):
    ours = torch.cat([sums[p].flatten() if p in sums else torch.zeros_like(p).flatten() for p in params])
    norm_error = ((norms - ref_norms).abs() / ref_norms).max().item()
    sum_error = ((ours - ref_sums).norm() / ref_sums.norm()).item()
    return norm_error, sum_error


# ---------------------------------------------------------------- the engine against the brute-force reference
@pytest.mark.parametrize("name", list(MODELS))
def test_unit_norms_and_clipped_sums_match_a_brute_force_reference(name):
    model, batch, rows = _case(name)
    ref_norms, ref_sums, params, clip = _unit_reference(model, batch, UNITS)
    engine = PerExampleGradientEngine(model, clip)
    engine.attach()
    for verified in (False, True):  # the self-checked first chunk, then a ghost-differentiated one
        assert engine.verified is verified
        norms, sums = _engine_chunk(engine, model, batch, UNITS, rows)
        norm_error, sum_error = _errors(norms, sums, params, ref_norms, ref_sums)
        print(
            f"{name} units {UNITS}: norms {norm_error:.1e}, clipped sums {sum_error:.1e} (clip {clip:.3g}, "
            f"{int((ref_norms > clip).sum())} of {len(UNITS)} units clipped)"
        )
        tolerance = 1e-9 if name in FP64 else RTOL
        assert norm_error <= tolerance and sum_error <= tolerance
        assert all(p.grad is None and p.requires_grad for p in params)
    engine.detach()


@pytest.mark.parametrize("seq, longest_unit_instantiates", [(4, False), (12, True)])
def test_ghost_and_instantiated_unit_terms_both_match(seq, longest_unit_instantiates):
    """A unit's weight term is re-decided at its padded length (3 examples × T): Llama's 32×32 q/o projections keep
    the ghost norm at 3·4 = 12 positions (32·32 > 12·64) and are instantiated at 3·12 = 36; both match the
    reference, in the same chunk as terms of the other kind."""
    model = tiny.llama().train()
    batch = _batch(True, seq=seq, lengths=[min(n, seq) for n in LENGTHS])
    ref_norms, ref_sums, params, clip = _unit_reference(model, batch, UNITS)
    engine = PerExampleGradientEngine(model, clip, reducer=_TermTypes(clip))
    engine.attach()
    norms, sums = _engine_chunk(engine, model, batch, UNITS)
    seen = engine.reducer.seen
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    kinds = {kind for ts in seen.values() for kind in ts}
    print(f"T={seq}: q_proj grouped as {seen[q_proj]}; kinds in the chunk {sorted(kinds)}")
    assert terms.ghost_norm_is_cheaper(seq, 32, 32), "an example's own rows keep the ghost norm at either length"
    assert seen[q_proj] == (["SampleTerm"] if longest_unit_instantiates else ["OuterTerm"])
    if not longest_unit_instantiates:  # 32×16 k/v projections are instantiated even at 12 positions
        assert {"OuterTerm", "SampleTerm", "IndexTerm"} <= kinds
    norm_error, sum_error = _errors(norms, sums, params, ref_norms, ref_sums)
    assert norm_error <= RTOL and sum_error <= RTOL


def test_equal_sizes_give_the_fixed_path_bit_for_bit():
    """A sequence of equal sizes is the int path (one reshape), and one row per unit groups nothing."""
    model = tiny.gpt2().train()
    batch = _batch(True, lengths=LENGTHS[:6])
    results = []
    for rows in (2, [2, 2, 2]):
        engine = PerExampleGradientEngine(model, 0.05)
        engine.verified = True
        engine.attach()
        results.append(_chunk_with(engine, model, batch, 3, rows))
        engine.detach()
    (norms_int, sums_int), (norms_seq, sums_seq) = results
    assert torch.equal(norms_int, norms_seq)
    assert all(torch.equal(sums_int[p], sums_seq[p]) for p in sums_int)


def _chunk_with(engine, model, batch, units, rows_per_example):
    with engine.recording(units, rows_per_example):
        _loss(model, batch).backward()
    return engine.finish_backward(), engine.pop_clipped_sums()


# ---------------------------------------------------------------- group_rows, term by term
def _random_terms(rows: int, seq: int = 5):
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    index = torch.randint(0, 6, (rows, seq), generator=gen)
    return {  # three terms of one 6×4 parameter, of every kind
        "outer": terms.OuterTerm(left=rand(rows, seq, 6), right=rand(rows, seq, 4)),
        "index": terms.IndexTerm(index=index, right=rand(rows, seq, 4), num_rows=6),
        "sample": terms.SampleTerm(rand(rows, 6, 4)),
    }


def test_group_rows_of_every_term_kind_is_the_sum_of_each_units_rows():
    sizes = [1, 4, 2, 1, 3]
    owner = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    raw = _random_terms(sum(sizes))
    grouped = {k: terms.group_rows(t, sizes) for k, t in raw.items()}
    dense = {
        k: torch.zeros(len(sizes), 6, 4, dtype=torch.float64).index_add_(0, owner, terms.instantiate(t))
        for k, t in raw.items()
    }
    factors = torch.rand(len(sizes), dtype=torch.float64)
    for k, term in grouped.items():
        assert term.batch_size == len(sizes)
        torch.testing.assert_close(terms.instantiate(term).reshape(len(sizes), 6, 4), dense[k], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(terms.squared_norm(term), dense[k].flatten(1).pow(2).sum(1), rtol=1e-12, atol=0)
        torch.testing.assert_close(
            terms.clipped_sum(term, factors, torch.Size([6, 4])),
            torch.einsum("u,upd->pd", factors, dense[k]),
            rtol=1e-12,
            atol=1e-12,
        )
    # The cross terms of a shared parameter (tied embeddings) and the L1 norm of their sum.
    total = sum(dense.values())
    torch.testing.assert_close(
        terms.combined_squared_norm(list(grouped.values()), torch.float64),
        total.flatten(1).pow(2).sum(1),
        rtol=1e-12,
        atol=0,
    )
    torch.testing.assert_close(
        terms.combined_l1_norm(list(grouped.values()), torch.float64), total.flatten(1).abs().sum(1), rtol=1e-12, atol=0
    )
    # A long unit keeps the ghost norm only while it is cheaper: 6·4 > T·10 fails at 4·5 positions.
    assert isinstance(grouped["outer"], terms.SampleTerm)
    assert isinstance(
        terms.group_rows(
            terms.OuterTerm(raw["outer"].left[:, :1], raw["outer"].right[:, :1]), [1, 1, 2, 1, 1, 1, 1, 1, 1, 1]
        ),
        terms.OuterTerm,
    )


def test_group_rows_with_equal_sizes_is_the_int_path_bit_for_bit():
    raw = _random_terms(6)
    for term in raw.values():
        by_int, by_sizes = terms.group_rows(term, 2), terms.group_rows(term, (2, 2, 2))
        assert type(by_int) is type(by_sizes)
        assert all(
            torch.equal(a, b) if torch.is_tensor(a) else a == b
            for a, b in zip(vars(by_int).values(), vars(by_sizes).values())
        )


def test_group_rows_refuses_sizes_that_do_not_cover_the_rows():
    term = _random_terms(7)["sample"]
    with pytest.raises(ValueError, match=r"7 rows cannot be grouped into 3 units of 6 rows in all \(\[1, 3, 2\]\)"):
        terms.group_rows(term, [1, 3, 2])
    with pytest.raises(ValueError, match="at least one row"):
        terms.group_rows(term, [1, 0, 6])


# ---------------------------------------------------------------- mutations: clipping a unit's examples apart
def test_clipping_a_units_examples_apart_is_caught():
    """All sizes 1 (each example its own unit) is per-example clipping: a different clipped sum from the reference,
    and a unit of 3 copies of one example moves the sum by 3·C instead of at most C."""
    model = tiny.bert().train()
    batch = _batch(False)
    _, ref_sums, params, clip = _unit_reference(model, batch, UNITS, clip_quantile=0.0)
    engine = PerExampleGradientEngine(model, clip)
    engine.attach()
    norms, sums = _engine_chunk(engine, model, batch, [1] * sum(UNITS))
    assert norms.shape == (sum(UNITS),)
    _, wrong_error = _errors(torch.ones(1), sums, params, torch.ones(1), ref_sums)
    print(f"examples clipped apart: clipped sum off by {wrong_error:.2f} (relative)")
    assert wrong_error > 0.1

    # Sensitivity: add a user of three copies of one example (example 4) to the chunk [1, 2, 1] (examples 0-3).
    base = _examples(batch, 0, 4)
    user = {k: torch.cat([v[:4], v[4:5].expand(3, *v.shape[1:])]) for k, v in batch.items()}
    example_norms, _ = _engine_chunk(engine, model, user, [1] * 7)
    engine.max_grad_norm = clip = 0.5 * float(example_norms[4])  # each copy alone is clipped: 3 copies, 3·C

    def clipped(data, units):
        return torch.cat([s.flatten() for s in _engine_chunk(engine, model, data, units)[1].values()])

    without = clipped(base, [1, 2, 1])
    right = (clipped(user, [1, 2, 1, 3]) - without).norm().item()
    apart = (clipped(user, [1, 2, 1, 1, 1, 1]) - without).norm().item()
    print(f"a user of 3 examples moves the sum by {right / clip:.4f}·C grouped, {apart / clip:.4f}·C clipped apart")
    assert 0.9 * clip <= right <= clip * (1 + 1e-5)
    assert apart > 2.9 * clip


def test_a_chunk_whose_rows_do_not_add_up_is_refused():
    # Llama: no position embedding broadcast over the rows (BERT's would be expanded to the 8 declared rows and fail
    # in the forward already, with a shape error)
    model = tiny.llama().train()
    batch = _batch(True)  # 7 rows
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    with engine.recording(4, [1, 3, 2, 2]):
        _loss(model, batch).backward()
    with pytest.raises(
        ValueError,
        match=r"computed gradients for 7 rows, but the chunk holds 4 units of "
        r"\[1, 3, 2, 2\] rows \(8 rows in all\).*per-row clipping",
    ):
        engine.finish_backward()
    assert not engine._calls and all(p.grad is None for p in model.parameters())
    assert not engine.clipped_sums


@pytest.mark.parametrize(
    "units, rows, error, message",
    [
        (3, [1, 3, 2, 1], ValueError, "4 unit sizes for a chunk of 3 units"),
        (3, [1, 0, 2], ValueError, "at least one row"),
        (2, [1.5, 2], TypeError, "must be ints"),
        (2, "12", TypeError, "int or a sequence"),
        (2, 0, ValueError, "rows_per_example >= 1"),
    ],
)
def test_recording_validates_unit_sizes(units, rows, error, message):
    engine = PerExampleGradientEngine(torch.nn.Linear(4, 2), 1.0)
    with pytest.raises(error, match=message), engine.recording(units, rows):
        pass
    assert engine._chunk is None and engine._rows is None


def test_unit_sizes_may_be_a_tensor():
    model = torch.nn.Linear(4, 2)
    engine = PerExampleGradientEngine(model, 1e9)
    engine.attach()
    x = torch.randn(7, 4)
    with engine.recording(4, torch.tensor(UNITS)):
        model(x).pow(2).sum().backward()
    norms = engine.finish_backward()
    starts = [0, 1, 4, 6]
    expected = []
    for start, count in zip(starts, UNITS):
        model.zero_grad()
        model(x[start : start + count]).pow(2).sum().backward()
        expected.append(torch.sqrt(model.weight.grad.pow(2).sum() + model.bias.grad.pow(2).sum()))
    torch.testing.assert_close(norms, torch.stack(expected), rtol=RTOL, atol=0)


# ---------------------------------------------------------------- the independence probe with units
def test_probe_recomputes_units_alone_and_accepts_a_correct_model(monkeypatch):
    recorded = []
    norms = independence._norms

    def spy(engine, model, inputs, summed_loss, chunk):
        recorded.append(
            (chunk[0], list(chunk[1]) if not isinstance(chunk[1], int) else chunk[1], inputs["input_ids"].shape)
        )
        return norms(engine, model, inputs, summed_loss, chunk)

    monkeypatch.setattr(independence, "_norms", spy)
    model = tiny.gpt2().train()
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    batch = _batch(True)
    check_example_independence(engine, model, batch, _loss, sum(UNITS), examples_per_unit=UNITS)
    print("probe chunks (units, rows, input shape):", recorded)
    assert recorded[0][:2] == (4, UNITS)
    # Units of the first, the shortest (example 4: unit 2) and the longest (example 0: unit 0) example, and the
    # largest unit (1): each alone, padding columns removed.
    assert recorded[1:] == [(1, 1, torch.Size([1, 12])), (1, 2, torch.Size([2, 7])), (1, 3, torch.Size([3, 12]))]
    assert model.training and all(p.grad is None for p in model.parameters())


def test_probe_with_units_of_multiple_choice_examples():
    """fp64: in fp32 the cancelling choice rows (see FP64) make the norm of unit 0 (one example) 0.0018185 in its chunk,
    where it is grouped with padding and instantiated, and 0.0018409 alone, where the 64×32 weights keep the ghost
    norm (fp64: 0.0018209 both): 1.2%, above the probe's fp32 tolerance."""
    model = tiny.roberta_multiple_choice().double().train()
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    check_example_independence(
        engine, model, _mc_batch(sum(UNITS)), _loss, sum(UNITS), CHOICES, examples_per_unit=UNITS
    )


def _chunk_normalised_loss(model, batch) -> torch.Tensor:
    """Each example's loss divided by the chunk's number of examples: every unit's gradient depends on its chunk."""
    return _loss(model, batch) / batch["input_ids"].shape[0]


def test_probe_catches_a_loss_normalised_by_the_chunk():
    model = tiny.bert().train()
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    batch = _batch(False)
    with pytest.raises(
        ValueError,
        match=r"Unit 0 \(1 example\) of a probed chunk has gradient norm .* among its 3 "
        r"chunk-mate units but .* alone: its gradient depends on the other units",
    ):
        check_example_independence(engine, model, batch, _chunk_normalised_loss, sum(UNITS), examples_per_unit=UNITS)
    # Through the trainer's entry point: a chunk tuple with examples_per_unit as its 4th element.
    with pytest.raises(ValueError, match="depends on the other units.*num_items_in_batch"):
        probe_example_independence(engine, model, [(batch, sum(UNITS), 1, UNITS)], _chunk_normalised_loss, False)
    probe_example_independence(engine, model, [(batch, sum(UNITS), 1, UNITS), (batch, sum(UNITS), 1)], _loss, False)
    assert not engine.clipped_sums and all(p.grad is None for p in model.parameters())


def test_probe_refuses_units_that_do_not_cover_the_examples():
    model = tiny.bert().train()
    engine = PerExampleGradientEngine(model, 1.0)
    with pytest.raises(
        ValueError,
        match=r"examples_per_unit \[1, 3, 2\] counts 6 examples, but the probed chunk "
        r"holds 7",
    ):
        check_example_independence(engine, model, _batch(False), _loss, 7, examples_per_unit=[1, 3, 2])


def test_a_unit_alone_is_the_slice_of_its_examples():
    batch = {**_batch(True), "broadcast": torch.arange(SEQ).unsqueeze(0)}
    unit = example_alone(batch, 2, 7, examples_per_unit=UNITS)  # examples 4 and 5: lengths 3 and 7
    assert torch.equal(unit["input_ids"], batch["input_ids"][4:6, :7])
    assert torch.equal(unit["labels"], batch["labels"][4:6, :7])
    assert torch.equal(unit["broadcast"], batch["broadcast"])
    assert torch.equal(example_alone(batch, 2, 7)["input_ids"], batch["input_ids"][2:3, :9])  # one example a unit


@pytest.mark.parametrize("dtype", [None, torch.float64])
def test_an_instantiated_terms_squared_norm_covers_every_block(dtype):
    """The squares are summed block by block (`terms._SQUARE_BLOCK` values at a time): every block counts, the last
    partial one included, and the result keeps a float64 sum's accuracy."""
    torch.manual_seed(0)
    width = 2 * (terms._SQUARE_BLOCK // 3) + 5  # three examples: two whole blocks and a partial third
    grad = torch.randn(3, width) * torch.tensor([[1.0], [3.0], [1e-3]])
    grad[1, -1] = 100.0  # in the partial block
    expected = grad.double().pow(2).sum(1)
    got = terms.squared_norm(terms.SampleTerm(grad.view(3, width, 1)), dtype=dtype)
    assert got.dtype == (dtype or torch.float32)
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=0.0)


def test_an_instantiated_routed_term_is_zero_where_an_example_sent_no_pairs_to_an_expert(monkeypatch):
    """The [B, E, P, D] gradients are written by their GEMMs into an uninitialised buffer: an (example, expert)
    without pairs must still read zero, whatever the allocator hands back (NaN here)."""
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *size, **kw: torch.full(size, float("nan"), **kw))
    torch.manual_seed(0)
    left, right = torch.randn(5, 3), torch.randn(5, 4)
    example = torch.tensor([0, 0, 1, 2, 2])
    expert = torch.tensor([0, 1, 1, 0, 1])  # example 1 sent nothing to expert 0
    term = terms.RoutedOuterTerm(left=left, right=right, example=example, expert=expert, examples=3, experts=2)
    got = terms.instantiate(term)
    expected = torch.zeros(3, 2, 3, 4)
    for k in range(5):
        expected[example[k], expert[k]] += torch.outer(left[k], right[k])
    torch.testing.assert_close(got, expected)
