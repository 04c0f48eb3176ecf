"""The numbers of every method, pinned: σ, ε, steps and (under a test seed) the released updates.

A restructuring must not change what a run releases. Each row trains a tiny model for a few steps under an insecure
test seed (so noise and sampling replay) and compares with `pinned_numbers.json`, written by the code before the
restructuring (`python -m tests.project.test_pinned_numbers --write` rewrites it: only for a change that is meant to
change the
numbers).

What is pinned, and how exactly:

* mechanisms, steps and the count of trained tensors: exactly;
* the calibrated σ of each stage and the ledger's ε: to a relative 1e-9. Their last bits come from the accountants'
  numerics (PRV's FFTs, root finding in scipy and dp-accounting), which move with the numeric packages a fresh install
  resolves (a fresh machine moved σ by about 2e-13 relative); any meaningful change to a plan moves them by far more;
* the released updates (each trained tensor after training minus before it, where it existed before): two figures a
  tensor (its norm and its projection on a fixed direction), to 1e-4 of the tensor's update norm, or to ten times the
  drift measured when the file was written, if that is more. Matrix products sum in an order that depends on the
  CPU's vector unit, the thread count and the torch build; the file records, per tensor, how far the figures moved
  between one thread and two (`update_drift`): at most 3.4e-6 of the update, except where the exact gradient is zero
  and the update is the arithmetic's residue (DP-FP paper mode's attention key biases, which moved by 0.29 and 0.57
  of their norm). A change in what is clipped, sampled or noised moves the figures by order 1;
* a SHA-256 of every trained tensor, bit for bit, where the platform is the one that wrote the file (the same torch,
  numeric packages and CPU capability; rows train on one thread everywhere): there the arithmetic is entirely
  determined, and nothing may move at all.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

from hf_private import BitFitConfig, DPConfig, DPFPConfig, DPLoRAConfig, FrostConfig, SparseLowRankConfig
from tests.support import tiny
from tests.support.helpers import make_trainer

PINNED = Path(__file__).parents[1] / "support" / "pinned_numbers.json"
SEED = 20261125
SHARED = dict(max_grad_norm=0.5, noise_seed=SEED)
# row → (config, tiny model factory); target_epsilon rows pin the calibration too
ROWS = {
    "dp-sgd": (DPConfig(target_epsilon=3.0, **SHARED), tiny.bert),
    "dp-lora": (DPLoRAConfig(noise_multiplier=0.8, lora_r=2, lora_target_modules="query,value", **SHARED), tiny.bert),
    "dp-bitfit": (BitFitConfig(target_epsilon=5.0, **SHARED), tiny.roberta),
    "dp-bitfit/x": (BitFitConfig(target_epsilon=5.0, full_finetune_epochs=1.0, **SHARED), tiny.roberta),
    "dp-frost": (FrostConfig(target_epsilon=4.0, unfreeze_ratio=0.3, selection_sample_rate=0.25, **SHARED), tiny.bert),
    "sparse-lowrank": (SparseLowRankConfig(noise_multiplier=0.8, rank=4, sparsity=0.25, **SHARED), tiny.bert),
    "sparse-lowrank/rgp": (
        SparseLowRankConfig(noise_multiplier=0.8, variant="rgp", rank=2, sparsity=0.25, **SHARED),
        tiny.bert,
    ),
    "dp-fp": (DPFPConfig(target_epsilon=4.0, **SHARED), tiny.bert),
    "dp-fp/paper": (DPFPConfig(noise_multiplier=0.8, mode="paper", **SHARED), tiny.bert),
}
CALIBRATION_RTOL = 1e-9
UPDATE_TOLERANCE = 1e-4  # of each tensor's update norm
DRIFT_MARGIN = 10  # times the drift of a tensor's figures between one thread and two, measured by --write


def platform() -> dict[str, str]:
    """What decides the released updates' last bits: the packages doing the arithmetic and the CPU's vector unit."""
    packages = ("torch", "transformers", "peft", "numpy", "scipy", "dp-accounting")
    return {**{name: version(name) for name in packages}, "cpu": torch.backends.cpu.get_cpu_capability()}


def update_figures(update: torch.Tensor) -> list[float]:
    """The update's norm and its projection on a fixed unit direction (the same for every run of a shape)."""
    update = update.detach().to(torch.float64).flatten()
    direction = torch.randn(
        update.numel(), generator=torch.Generator().manual_seed(update.numel()), dtype=torch.float64
    )
    return [update.norm().item(), (update @ direction / direction.norm()).item()]


def run_row(name: str, output_dir, threads: int = 1) -> dict:
    """One row's numbers, trained on one thread (two for --write's drift): the thread count orders the float sums, so
    the hash must not depend on how many cores the machine has or how many test workers share them."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _train_row(name, output_dir)
    finally:
        torch.set_num_threads(before)


def _train_row(name: str, output_dir) -> dict:
    config, factory = ROWS[name]
    torch.manual_seed(0)
    model = factory()
    before = {tensor_name: param.detach().clone() for tensor_name, param in model.named_parameters()}
    trainer = make_trainer(
        output_dir,
        model=model,
        dataset=tiny.sentiment_dataset(64, seed=1),
        dp=config,
        num_train_epochs=2,
        learning_rate=5e-2,
    )
    sigmas = [stage.noise_multiplier for stage in trainer.plan.planned]
    trainer.train()
    digest = hashlib.sha256()
    updates = {}
    for tensor_name, param in sorted(trainer.model.named_parameters()):
        if tensor_name in trainer.trained_parameter_names:
            digest.update(tensor_name.encode())
            digest.update(param.detach().to(torch.float64).numpy().tobytes())
            start = before.get(tensor_name)  # a tensor the method added (LoRA's) is pinned as trained
            updates[tensor_name] = update_figures(param if start is None else param.detach() - start)
    return {
        "sigmas": [None if s is None else float(s).hex() for s in sigmas],
        "epsilon": float(trainer.ledger.epsilon()).hex(),
        "steps": trainer.training_steps(),
        "mechanisms": [[group.name, group.steps] for group in trainer.ledger.mechanisms],
        "trained_tensors": len(trainer.trained_parameter_names),
        "updates": updates,
        "updates_sha256": digest.hexdigest(),
    }


def differences(got: dict, pinned: dict, same_platform: bool) -> list[str]:
    """Every pinned figure `got` misses, by the rules of the module docstring (empty when all hold)."""
    found = [
        f"{key}: {got[key]} != {pinned[key]}"
        for key in ("steps", "mechanisms", "trained_tensors")
        if got[key] != pinned[key]
    ]
    numbers = [("epsilon", got["epsilon"], pinned["epsilon"])]
    numbers += [(f"sigmas[{i}]", a, b) for i, (a, b) in enumerate(zip(got["sigmas"], pinned["sigmas"]))]
    if len(got["sigmas"]) != len(pinned["sigmas"]):
        found.append(f"sigmas: {got['sigmas']} != {pinned['sigmas']}")
    for key, a, b in numbers:
        if (a is None) != (b is None) or (a is not None and not _close(float.fromhex(a), float.fromhex(b))):
            found.append(f"{key}: {a} != {b}")
    if sorted(got["updates"]) != sorted(pinned["updates"]):
        found.append(f"trained tensors: {sorted(got['updates'])} != {sorted(pinned['updates'])}")
    for tensor_name in sorted(set(got["updates"]) & set(pinned["updates"])):
        norm, projection = got["updates"][tensor_name]
        pinned_norm, pinned_projection = pinned["updates"][tensor_name]
        allowed = max(UPDATE_TOLERANCE * pinned_norm, DRIFT_MARGIN * pinned["update_drift"][tensor_name])
        if abs(norm - pinned_norm) > allowed or abs(projection - pinned_projection) > allowed:
            found.append(
                f"update of {tensor_name}: (norm, projection) = ({norm:.9g}, {projection:.9g}), pinned "
                f"({pinned_norm:.9g}, {pinned_projection:.9g}), allowed ±{allowed:.3g}"
            )
    if same_platform and got["updates_sha256"] != pinned["updates_sha256"]:
        found.append(f"updates_sha256 on the pinning platform: {got['updates_sha256']} != {pinned['updates_sha256']}")
    return found


def _close(a: float, b: float) -> bool:
    return a == b or math.isclose(a, b, rel_tol=CALIBRATION_RTOL)


@pytest.mark.parametrize("name", sorted(ROWS))
def test_numbers_are_the_pinned_ones(tmp_path, name):
    pinned = json.loads(PINNED.read_text())
    got = run_row(name, tmp_path)
    assert differences(got, pinned["rows"][name], pinned["platform"] == platform()) == []


def test_the_comparison_tolerates_arithmetic_drift_and_nothing_more():
    """The rules themselves: last-bit drift passes, a changed σ, ε, update or step count does not, and the hash is
    compared bit for bit only on the pinning platform."""
    pinned = json.loads(PINNED.read_text())["rows"]["dp-sgd"]

    def moved(**changes) -> dict:
        return {**json.loads(json.dumps(pinned)), **changes}

    sigma = float.fromhex(pinned["sigmas"][0])
    name, (norm, projection) = next(iter(pinned["updates"].items()))
    drift = moved(
        sigmas=[(sigma * (1 + 2e-13)).hex()],
        updates_sha256="0" * 64,
        updates={**pinned["updates"], name: [norm * (1 + 4e-7), projection + 4e-7 * norm]},
    )
    assert differences(drift, pinned, same_platform=False) == []
    assert len(differences(drift, pinned, same_platform=True)) == 1  # the hash alone
    assert differences(moved(sigmas=[(sigma * 1.001).hex()]), pinned, False)
    assert differences(moved(epsilon=(float.fromhex(pinned["epsilon"]) * 1.0001).hex()), pinned, False)
    assert differences(moved(steps=pinned["steps"] + 1), pinned, False)
    assert differences(moved(updates={**pinned["updates"], name: [norm * 1.01, projection]}), pinned, False)
    assert differences(moved(updates={**pinned["updates"], name: [norm, projection + 0.01 * norm]}), pinned, False)
    residue = moved(update_drift={**pinned["update_drift"], name: 0.05 * norm})  # a tensor the arithmetic moves

    def scaled(factor: float) -> dict:
        return {**residue, "updates": {**pinned["updates"], name: [norm * factor, projection]}}

    assert differences(scaled(1.3), residue, False) == [] and differences(scaled(1.6), residue, False)


def test_the_measured_drift_widens_the_tolerance_only_where_the_gradient_is_exactly_zero():
    """Where the recorded drift (one thread against two) exceeds 1e-4 of a tensor's norm, its figure is the
    arithmetic's residue and not a pinned number: that must stay the exception the docstring names."""
    rows = json.loads(PINNED.read_text())["rows"]
    widened = {
        (name, tensor)
        for name, row in rows.items()
        for tensor, (norm, _) in row["updates"].items()
        if DRIFT_MARGIN * row["update_drift"][tensor] > UPDATE_TOLERANCE * norm
    }
    assert widened == {("dp-fp/paper", f"bert.encoder.layer.{i}.attention.self.key.bias") for i in (0, 1)}


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        rows = {name: run_row(name, Path(directory) / name) for name in sorted(ROWS)}
        for name, row in rows.items():
            other = run_row(name, Path(directory) / f"{name}-2", threads=2)["updates"]
            row["update_drift"] = {
                tensor: max(abs(a - b) for a, b in zip(figures, other[tensor]))
                for tensor, figures in row["updates"].items()
            }
    PINNED.write_text(json.dumps({"platform": platform(), "rows": rows}, indent=1, sort_keys=True) + "\n")
    print(json.dumps(rows, indent=1))
