"""DP-FP's behaviour (methods_spec §5; its soundness, §6.1).

Both modes clip each example's representation at the noise point to `representation_clip` C and add N(0, σ_r²C²) in
the forward pass, in training only (`forward_noise.ClippedNoisyOutput`, the secret noise source), with σ_r from the
paper's calibration (Eq. 11 from the GDP-CLT μ of the target, `clt.clt_noise_multiplier`).

* "sound": everything below the noise point is frozen (the pooler included), the head above it trains with DP-SGD
  (per-example clip C and noise from the plan), so ε is the ledger's formal guarantee and covers the labels; the
  representation noise is then a regulariser on top of it.
* "paper": the whole model trains with the plain optimizer (no per-example clip, no gradient noise) on the noisy
  representation, as published. The gradient of every parameter below the noise reads the raw input and the label,
  so the released model has no finite guarantee: each step is a ledger event without one, the report and the card
  carry no ε, only, under "not a guarantee", the paper's CLT figure (`clt_approximation`) and the accountant's
  figure for the representation releases alone (`representation_releases_alone`), each labelled as what it is.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from ...engine import PerExampleGradientEngine
from ...logs import get_logger
from ...models.peft import is_peft_model
from ...privacy import GaussianNoise, MechanismGroup
from ...privacy.accountants import epsilon_bound
from ...privacy.plan import PrivacyPlan, Stage
from ..base import DPMethod, RecipeDefaults, register_dp_method
from ..shared import head_parameter_names, train_only
from .clt import clt_epsilon, clt_noise_multiplier
from .config import DPFPConfig
from .forward_noise import ClippedNoisyOutput

logger = get_logger(__name__)

PAPER_MODE_REASON = (
    "DP-FP in paper mode trains the encoder below the noise on raw inputs with a plain optimizer and uses the labels "
    "in the clear, so the released model has no finite differential privacy guarantee (methods_spec §6.1: a canary "
    "token's embedding changes if and only if the canary was sampled)."
)
# §5.3: B = 32 split in M = 32 micro-batches, 3 epochs, lr 5e-6, AdamW, max length 128, C = 1.
_PAPER = "DP-FP §5.3 (methods_spec): B = 32 in M = 32 micro-batches (one step each), 3 epochs, lr 5e-6, max length 128"
_PAPER_TASKS = ("sst2", "qnli", "qqp", "mnli")
_INPUT = "input:"


@register_dp_method(DPFPConfig)
class DPFPMethod(DPMethod):
    config: DPFPConfig

    def __init__(self, config: DPFPConfig) -> None:
        super().__init__(config)
        self.noise_point = ""
        self.representation_noise_multiplier: float | None = None
        self._plan: PrivacyPlan | None = None
        self._epsilons: tuple[float, float, str] | None = None

    # ------------------------------------------------------------------ model and plan
    def wrap_model(self, model: nn.Module) -> nn.Module:
        if is_peft_model(model):
            raise ValueError("DPFPConfig adds noise inside a plain transformers model; pass the base model.")
        return model

    def prepare_model(self, model: nn.Module) -> None:
        self.noise_point = self.config.noise_point or default_noise_point(model)
        module_name = self.noise_point.removeprefix(_INPUT)
        try:
            model.get_submodule(module_name)
        except AttributeError:
            raise ValueError(
                f"noise_point {self.noise_point!r}: {type(model).__name__} has no module {module_name!r}."
            ) from None
        if self.config.mode == "paper":
            model.requires_grad_(True)
            logger.warning("DP-FP paper mode: %s", PAPER_MODE_REASON)
            return
        head = head_above(model, self.noise_point)
        if not head:
            raise ValueError(
                f"No parameter of {type(model).__name__} lies above the noise point {self.noise_point!r}: "
                "sound DP-FP trains the head above it. Name another noise_point."
            )
        train_only(model, head)

    def stages(self) -> list[Stage]:
        if self.config.mode == "paper":
            return [
                Stage(
                    self.name,
                    no_guarantee=PAPER_MODE_REASON,
                    sensitivity="none on the gradients; representations clipped to C and noised",
                )
            ]
        return [Stage(self.name, sensitivity="flat L2 clip C over the head above the noise point")]

    def attach_engine(self, engine: PerExampleGradientEngine) -> None:
        if self.config.mode == "paper":
            engine.max_grad_norm = math.inf  # the plain optimizer: no per-example clip

    def attach_forward_mechanisms(
        self, model: nn.Module, noise: GaussianNoise, plan: PrivacyPlan
    ) -> list[RemovableHandle]:
        self._plan = plan
        steps = plan[self.name].steps
        if self.config.target_epsilon is not None:
            sigma = clt_noise_multiplier(self.config.target_epsilon, plan.delta, plan.sample_rate, steps)
        elif self.config.noise_multiplier is not None:
            sigma = self.config.noise_multiplier
        else:  # unreachable: MethodConfig holds exactly one of target_epsilon and noise_multiplier
            raise ValueError("DP-FP's representation noise needs target_epsilon or noise_multiplier.")
        self.representation_noise_multiplier = sigma
        mechanism = ClippedNoisyOutput(self.config.representation_clip, sigma, noise)
        module = model.get_submodule(self.noise_point.removeprefix(_INPUT))
        attach = mechanism.attach_to_input if self.noise_point.startswith(_INPUT) else mechanism.attach
        logger.info(
            "DP-FP: representation at %s clipped to %g with noise σ_r=%.4g (the paper's Eq. 11 calibration).",
            self.noise_point,
            self.config.representation_clip,
            sigma,
        )
        return [attach(module)]

    # ------------------------------------------------------------------ report
    def representation_epsilons(self) -> tuple[float, float, str]:
        """(the paper's CLT figure, the exact ε, the accountant that gave it: PRV, or RDP where PRV cannot run) of
        the representation releases alone, as planned."""
        if self._epsilons is None:
            plan, sigma = self._plan, self.representation_noise_multiplier
            if plan is None or sigma is None:
                raise RuntimeError(
                    "The representation releases are planned by attach_forward_mechanisms(): call it "
                    "before asking for their ε."
                )
            steps = plan[self.name].steps
            release = MechanismGroup("dp-fp-representations", sigma, plan.sample_rate, steps)
            self._epsilons = (
                clt_epsilon(sigma, plan.sample_rate, steps, plan.delta),
                *epsilon_bound([release], plan.delta, "prv"),
            )
        return self._epsilons

    def report(self) -> dict[str, Any]:
        return {
            "mode": self.config.mode,
            "noise_point": self.noise_point,
            "representation_clip": self.config.representation_clip,
            "representation_noise_multiplier": self.representation_noise_multiplier,
        }

    def figures_without_guarantee(self) -> dict[str, dict[str, Any]]:
        if self.config.mode != "paper" or self._plan is None:
            return {}
        clt, exact, accountant = self.representation_epsilons()
        return {
            "clt_approximation": {
                "value": clt,
                "what": "The paper's Gaussian-DP central-limit figure for the planned representation releases: an "
                "approximation (it under-states their privacy loss 2-3×), not a bound, and not about this "
                "model, whose encoder was trained on raw inputs.",
            },
            "representation_releases_alone": {
                "value": exact,
                "what": f"The {accountant} accountant's upper bound for the representation releases alone, as "
                "planned: one part of the algorithm, not this model, whose encoder and labels were used "
                "without noise.",
            },
        }

    def citations(self) -> tuple[str, ...]:
        return (
            *super().citations(),
            "DP-FP: differentially private forward propagation (seed 004; methods_spec §5, its soundness §6.1).",
        )

    @classmethod
    def recipe_defaults(cls, task: str) -> RecipeDefaults:
        return RecipeDefaults(1, 3, 5e-6, 1.0, 128, _PAPER, from_paper=task in _PAPER_TASKS)


def default_noise_point(model: nn.Module) -> str:
    """The paper's representation: BERT's pooler output; RoBERTa's after classifier dense + tanh."""
    if getattr(getattr(model, "bert", None), "pooler", None) is not None:
        return "bert.pooler"
    if hasattr(getattr(model, "classifier", None), "out_proj"):
        return f"{_INPUT}classifier.out_proj"
    raise ValueError(
        f"DP-FP's noise point (the pooled representation before the classifier) is not defined for "
        f"{type(model).__name__}: name the module with DPFPConfig(noise_point='<module>' or 'input:<module>')."
    )


def head_above(model: nn.Module, noise_point: str) -> set[str]:
    """The task head's parameters after the noise point (registration order, as a head's forward uses them)."""
    head = [name for name, _ in model.named_parameters() if name in head_parameter_names(model)]
    module = noise_point.removeprefix(_INPUT)
    inside = [i for i, name in enumerate(head) if name.startswith(f"{module}.")]
    if noise_point.startswith(_INPUT):
        return set(head[inside[0] :]) if inside else set()
    return set(head[inside[-1] + 1 :]) if inside else set(head)
