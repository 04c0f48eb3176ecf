"""bf16 autocast (TrainingArguments(bf16=True), as Trainer runs it on CPU): every per-example term path works.

Under autocast a layer's output gradient is bf16 while the input it saved may be fp32 (a matmul after a norm
layer). The engine's per-example norms must still track an fp64 per-example loop with the same weights, and each
example's clipped contribution must stay within C, whether the weight terms are kept factored (ghost norm) or
instantiated, whichever layer type produced them, and whether backward runs outside autocast (as Trainer and
accelerate run it) or inside.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding

from hf_private import DPConfig, PrivateTrainer
from hf_private.engine import PerExampleGradientEngine, independence, terms
from hf_private.engine.independence import RTOL_LOW_PRECISION
from hf_private.integrations.losses import default_per_example_loss
from tests.support import tiny
from tests.support.families import FAMILY
from tests.support.helpers import snapshot, training_args

BATCH = 5
SEQ = tiny.SEQ_LEN  # 16 at hidden 32: the engine's own rule instantiates square weights and keeps wider ones factored
NORM_RTOL = 0.02  # per-example norm under bf16 autocast vs the fp64 loop
CLIP_SLACK = 1e-4  # fp32 rounding of the clipped sums and of the norm they are divided by


class RMSNormNet(nn.Module):
    """A Llama-style block on torch's own `nn.RMSNorm` (eps=None: the compute type's epsilon), fed by a bf16 matmul.

    The projection is initialised at HF's `initializer_range`, so the normalised activations are small and the
    epsilon matters.
    """

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(tiny.VOCAB_SIZE, 32)
        self.proj = nn.Linear(32, 32)
        self.norm = nn.RMSNorm(32)
        self.head = nn.Linear(32, 2)
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)

    def forward(self, input_ids, attention_mask):
        hidden = self.norm(self.proj(self.embed(input_ids)))
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return SimpleNamespace(logits=self.head((hidden * mask).sum(1) / mask.sum(1)))


def _lora(model, task):
    return get_peft_model(model, LoraConfig(task_type=task, r=4, lora_alpha=8, lora_dropout=0.0))


CHOICES = 3
CASES = {  # name: (factory, task, what each covers)
    "bert": (tiny.bert, "cls"),  # nn.Linear, nn.Embedding (word, position, token type), nn.LayerNorm
    "gpt2-tied": (tiny.gpt2, "lm"),  # GPT-2 Conv1D, LayerNorm, an embedding tied to the LM head (cross terms)
    "llama": (tiny.llama, "lm"),  # nn.Linear, LlamaRMSNorm (fp32 statistics inside the module's own forward)
    "llama-lora": (lambda: _lora(tiny.llama(), "CAUSAL_LM"), "lm"),  # PEFT LoRA factors only
    "bert-lora": (lambda: _lora(tiny.bert(), "SEQ_CLS"), "cls"),  # LoRA + the trainable classifier head
    "torch-rmsnorm": (RMSNormNet, "cls"),  # nn.RMSNorm with a bf16 input
    "roberta-multiple-choice": (tiny.roberta_multiple_choice, "mc"),  # rows grouped per example (group_rows)
    "qwen3": (FAMILY["Qwen3"].build, "lm"),  # q/k norms: the norm rule matched by probe, fp32 statistics
    "gemma3": (FAMILY["Gemma 3"].build, "lm"),  # x̂·(1 + w) norms and the √d-scaled embedding, both matched
}


def _batch(task: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    shape = (BATCH, CHOICES, SEQ) if task == "mc" else (BATCH, SEQ)
    ids = torch.randint(4, len(tiny.VOCAB), shape, generator=gen)
    mask = torch.ones(shape, dtype=torch.long)
    mask[1, ..., 10:] = 0
    ids[1, ..., 10:] = 0
    if task == "lm":
        labels = ids.masked_fill(mask == 0, -100)
    else:
        labels = torch.randint(0, CHOICES if task == "mc" else 2, (BATCH,), generator=gen)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _losses(model, batch) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return default_per_example_loss(model, model(**inputs), batch["labels"])


def _fp64_norms(model, batch) -> torch.Tensor:
    """Per-example gradient norms by one fp64 backward per example, without autocast."""
    model = copy.deepcopy(model).double()
    params = [p for p in model.parameters() if p.requires_grad]
    norms = []
    for b in range(BATCH):
        model.zero_grad()
        _losses(model, {k: v[b : b + 1] for k, v in batch.items()}).sum().backward()
        norms.append(torch.sqrt(sum(p.grad.pow(2).sum() for p in params if p.grad is not None)))
    return torch.stack(norms)


def _bf16_chunk(engine, model, batch, weights, backward_inside_autocast, first_chunk):
    """One chunk through the engine, forward under bf16 autocast; `weights` scales each example's loss."""
    engine.verified = not first_chunk  # the first chunk runs autograd's gradients too and checks the engine's sums
    rows = batch["input_ids"].shape[1] if batch["input_ids"].dim() == 3 else 1
    with engine.recording(BATCH, rows):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = (_losses(model, batch) * weights).sum()
            if backward_inside_autocast:
                loss.backward()
        if not backward_inside_autocast:
            loss.backward()
    norms = engine.finish_backward()
    assert engine.verified, "the first chunk's self-check did not pass"
    return norms, engine.pop_clipped_sums()


@pytest.fixture
def forced_path(request, monkeypatch):
    """Send every weight term down one path, whatever the engine's size rule (ghost_norm_is_cheaper) would pick."""
    ghost = request.param == "ghost"
    calls = []

    def decide(*shape):
        calls.append(shape)
        return ghost

    monkeypatch.setattr(terms, "ghost_norm_is_cheaper", decide)
    return calls


@pytest.mark.parametrize("backward", ["outside-autocast", "inside-autocast"])
@pytest.mark.parametrize("forced_path", ["ghost", "instantiated"], indirect=True)
@pytest.mark.parametrize("name", list(CASES))
def test_bf16_norms_track_fp64_and_each_example_stays_within_the_clip(name, forced_path, backward):
    factory, task = CASES[name]
    model = factory()
    model.train()
    batch = _batch(task)
    ref_norms = _fp64_norms(model, batch)
    clip = 0.5 * ref_norms.min().item()  # every example is clipped: its contribution is then exactly C
    params = [p for p in model.parameters() if p.requires_grad]

    engine = PerExampleGradientEngine(model, clip)
    engine.attach()
    inside = backward == "inside-autocast"
    for first_chunk in (True, False):  # the self-checked chunk, then a ghost-differentiated one
        norms, sums = _bf16_chunk(engine, model, batch, torch.ones(BATCH), inside, first_chunk)
        assert forced_path, "no weight term was formed: the forced path was not exercised"
        assert norms.dtype in (torch.float32, torch.float64), "norms must be accumulated in float32 or better"
        error = ((norms.double() - ref_norms) / ref_norms).abs().max().item()
        assert error <= NORM_RTOL, f"per-example norms off the fp64 loop by {error:.2%}"
        assert set(sums) == set(params)
        assert all(sums[p].dtype == torch.promote_types(p.dtype, torch.float32) for p in params)
        assert all(bool(torch.isfinite(s).all()) for s in sums.values())
    full = torch.cat([sums[p].double().flatten() for p in params])
    for b in range(BATCH):  # example b's contribution: the sums with and without its loss (same chunk shape)
        weights = torch.ones(BATCH)
        weights[b] = 0.0
        _, without = _bf16_chunk(engine, model, batch, weights, inside, first_chunk=False)
        contribution = (full - torch.cat([without[p].double().flatten() for p in params])).norm().item()
        assert contribution <= clip * (1 + CLIP_SLACK), f"example {b} contributes {contribution / clip:.6f}·C"
        assert contribution >= clip * (1 - 1e-3), f"example {b} was clipped to {contribution / clip:.6f}·C, not C"
    engine.detach()


def test_the_natural_size_rule_takes_both_paths_at_the_test_length():
    """At T=16 and hidden 32 the engine itself instantiates square weights and keeps wider ones factored, which is
    where the bf16 crash was: the end-to-end tests below run both paths without forcing."""
    assert not terms.ghost_norm_is_cheaper(SEQ, 32, 32)  # attention projections, GPT-2 c_proj: instantiated
    assert terms.ghost_norm_is_cheaper(SEQ, 64, 32)  # BERT/Llama MLP, tied LM head (vocab 64): ghost norm


# ---------------------------------------------------------------- end to end
def _trainer_case(name):
    tok = tiny.tokenizer()
    lm_collator = DataCollatorForLanguageModeling(tok, mlm=False, pad_to_multiple_of=SEQ)
    if name == "bert":
        return (
            tiny.bert(),
            tiny.sentiment_dataset(48),
            DataCollatorWithPadding(tok, padding="max_length", max_length=SEQ),
        )
    if name == "gpt2":
        return tiny.gpt2(), tiny.lm_dataset(48), lm_collator
    return _lora(tiny.llama(), "CAUSAL_LM"), tiny.lm_dataset(48), lm_collator


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama-lora"])
def test_private_trainer_trains_with_bf16_on_cpu(tmp_path, monkeypatch, name):
    model, dataset, collator = _trainer_case(name)
    decisions = []
    rule = terms.ghost_norm_is_cheaper
    monkeypatch.setattr(terms, "ghost_norm_is_cheaper", lambda *shape: decisions.append(rule(*shape)) or decisions[-1])
    probes = []
    probe = independence.check_example_independence

    def recorded_probe(*args, **kwargs):
        probes.append(kwargs.get("rtol"))
        return probe(*args, **kwargs)

    monkeypatch.setattr(independence, "check_example_independence", recorded_probe)
    trainer = PrivateTrainer(
        model=model,
        args=training_args(tmp_path, bf16=True, max_steps=3, per_device_train_batch_size=8),
        train_dataset=dataset,
        data_collator=collator,
        processing_class=tiny.tokenizer(),
        dp_config=DPConfig(noise_multiplier=1.0, max_grad_norm=1.0, noise_seed=0),
    )
    output_dtypes = set()
    handles = [
        m.register_forward_hook(lambda m, a, out: output_dtypes.add(out.dtype) if m.training else None)
        for m in model.modules()
        if isinstance(m, nn.Linear) and m.weight.requires_grad
    ]
    before = snapshot(model)
    trainer.train()
    for handle in handles:
        handle.remove()

    assert output_dtypes == {torch.bfloat16}, "the training forward did not run under bf16 autocast"
    assert True in decisions or name == "llama-lora", "the ghost-norm path was not exercised"
    assert False in decisions, "the instantiated path was not exercised"
    assert trainer.ledger.total_steps == 3
    assert trainer.engine.verified, "the first chunk's self-check did not run or did not pass"
    # once: on the first real chunk and on a chunk spread over the training set's lengths, at the bf16 tolerance
    assert probes == [RTOL_LOW_PRECISION] * 2, "the independence probe did not run once, at the bf16 tolerance"
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    for n, p in model.named_parameters():
        assert bool(torch.isfinite(p).all()), f"{n} is not finite"
        changed = not torch.equal(before[f"param:{n}"], p)
        assert changed == p.requires_grad, f"{n}: changed={changed}, trainable={p.requires_grad}"
