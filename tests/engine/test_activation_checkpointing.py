"""Activation checkpointing: per-example norms and clipped sums stay exact, and the engine keeps no checkpointed input.

A layer's saved input goes through autograd's saved-tensor hooks (`core._Stash`): inside a non-reentrant checkpointed
segment it is dropped after the forward and recomputed when its backward reads it; a reentrant segment runs its
forward without gradients and records everything in the recompute.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from hf_private.engine import PerExampleGradientEngine
from tests.engine.test_engine_oracle import BATCH, MODELS, _batch, _loss, check_engine_against_oracle
from tests.support import tiny

CHECKPOINTED = ["bert", "gpt2-tied", "llama", "llama-lora", "bert-lora", "llama-norm-gains"]


def _checkpointed(name: str, reentrant: bool):
    factory, causal, prepare = MODELS[name]
    model = factory().double()
    if prepare:
        model = prepare(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    return model, causal


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("name", CHECKPOINTED)
def test_checkpointed_model_matches_the_fp64_per_example_loop(name, reentrant):
    check_engine_against_oracle(*_checkpointed(name, reentrant))


def _inner_inputs(model) -> list[weakref.ref]:
    """Weak references to the storage of every attention projection's input, taken in the forward (the storage: the
    engine keeps a detached view of it, a different tensor object)."""
    seen: list[weakref.ref] = []
    for name, module in model.named_modules():
        if name.endswith(("q_proj", "v_proj")):
            module.register_forward_hook(lambda m, args, out: seen.append(weakref.ref(args[0].untyped_storage())))
    return seen


@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointed", "not-checkpointed"])
def test_the_engine_keeps_no_input_of_a_checkpointed_layer_after_the_forward(checkpointing):
    """Non-reentrant checkpointing frees a segment's inner activations after the forward; the engine's stash must
    not keep them (it would hold every layer's inputs, the memory checkpointing saves). Without checkpointing the
    stash does keep them, which shows the test can fail."""
    model = tiny.llama()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    engine = PerExampleGradientEngine(model, 1.0)
    engine.attach()
    engine.verified = True  # ghost differentiation: autograd itself saves no layer input for a weight gradient
    seen = _inner_inputs(model)
    batch = _batch(True)
    with engine.recording(BATCH):
        loss = _loss(model, batch)
        gc.collect()
        alive = sum(ref() is not None for ref in seen)
        loss.backward()
    engine.finish_backward()
    assert len(seen) >= 2 * model.config.num_hidden_layers
    if checkpointing:
        assert alive == 0, f"{alive} checkpointed layer inputs still held after the forward"
    else:
        assert alive == len(seen)


def test_an_input_modified_in_place_after_the_forward_is_refused():
    layer = torch.nn.Linear(3, 2)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), layer)
    engine = PerExampleGradientEngine(layer, 1.0)
    engine.attach()
    x = torch.randn(4, 3)
    with engine.recording(4):
        hidden = model[0](x)
        out = layer(hidden)
        with torch.no_grad():
            hidden.mul_(2.0)
        with pytest.raises(RuntimeError, match=r"input of <root> \(Linear\) was modified in place"):
            out.pow(2).sum().backward()
    engine.discard_chunk()
