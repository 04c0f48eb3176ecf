"""DP-FROST's behaviour (methods_spec §2.6-2.8): before training step k·⌊U/K⌋, select partitions by PSEL, each round a
noisy release of partition-wise gradient magnitudes on a Poisson sample; then DP-SGD on the selected partitions.

Privacy: every selection round is one release of the "dp-frost-selection" stage, an SGM at q_ps whose sensitivity is
the magnitude reducer's Lemma 3 bound on the *remaining* partitions, noised with the plan's σ_ps through `MethodRun`
(which records it in the ledger). PGM-EST, σ_v, the threshold and the budget arithmetic use only those releases and
public partition sizes, so the selected set is post-processing. DP-SGD then clips in L2 over the selected partitions
(and the head) and noises all of them, as any DP-SGD stage.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torch import nn

from ...logs import get_logger
from ...models.peft import is_peft_model
from ...privacy.plan import Stage
from ..base import DPMethod, MethodRun, RecipeDefaults, register_dp_method
from ..shared import head_parameter_names, train_only
from .config import FrostConfig
from .partitions import Partition, model_partitions
from .reducer import PartitionMagnitudeReducer
from .selection import estimate_pgms, pgm_std, select_round

logger = get_logger(__name__)

SELECTION_STAGE = "dp-frost-selection"
# §2.9: SST-2 B = 1024 and 3 epochs; the other tasks keep B/N at SST-2's (≈ 0.0152), with Li et al.'s epochs.
_PAPER_SCHEDULE = {"sst2": (1024, 3), "qnli": (1593, 6), "qqp": (5532, 18), "mnli": (5971, 18)}
_PAPER = (
    "DP-FROST §2.9 (methods_spec): B and epochs as the paper, C = 0.1 (Li et al. 2022), AdamW; lr and γ from "
    "the paper's grids (it does not report the tuned values)"
)


@register_dp_method(FrostConfig)
class FrostMethod(DPMethod):
    config: FrostConfig

    def __init__(self, config: FrostConfig) -> None:
        super().__init__(config)
        self.partitions: list[Partition] = []
        self.head: set[str] = set()  # parameter names of the always-trained head
        self.selections: list[dict[str, Any]] = []  # one per selection made: step, partitions, rounds

    # ------------------------------------------------------------------ model and plan
    def wrap_model(self, model: nn.Module) -> nn.Module:
        if is_peft_model(model):
            raise ValueError(
                "FrostConfig selects whole weight matrices of a plain transformers model; pass the base "
                "model, not a PeftModel (use DPLoRAConfig for DP-LoRA)."
            )
        return model

    def prepare_model(self, model: nn.Module) -> None:
        """Every tensor trainable, so the optimizer holds every tensor a selection may choose; `before_step` narrows
        the set to the selection before the first training step."""
        self.partitions = model_partitions(model)
        self.head = head_parameter_names(model) if self.config.always_train_head else set()
        if self.config.always_train_head and not self.head:
            logger.info("%s has no new task head: DP-FROST trains only the selected partitions.", type(model).__name__)
        if not self.candidates:
            raise ValueError(f"{type(model).__name__} has no partition outside its task head to select.")
        model.requires_grad_(True)

    @property
    def candidates(self) -> list[int]:
        """Indices of the partitions PSEL may select (all but the always-trained head)."""
        return [i for i, p in enumerate(self.partitions) if not set(p.parameter_names) <= self.head]

    def stages(self) -> list[Stage]:
        config = self.config
        selection = Stage(
            SELECTION_STAGE,
            sample_rate=config.selection_sample_rate,
            steps=config.num_selections * config.rounds_per_selection,
            training=False,
            sensitivity=f"Lemma 3: DP-{config.variant.upper()} magnitudes clipped in the L{config.norm_order} norm, "
            "recomputed on the remaining partitions every round",
        )
        share = config.sgd_budget_ratio if config.target_epsilon is not None else None
        training = Stage(
            self.name, epsilon_share=share, sensitivity="flat L2 clip C over the selected partitions (and the head)"
        )
        return [selection, training]

    # ------------------------------------------------------------------ selection
    def selection_step(self, k: int, planned_steps: int) -> int:
        """The training step before which selection k (0-based) runs: k·⌊U/K⌋ (the paper's Table 4)."""
        return k * (planned_steps // self.config.num_selections)

    def before_step(self, run: MethodRun, step: int) -> None:
        recorded = run.releases(SELECTION_STAGE)
        expected = sum(len(s["rounds"]) for s in self.selections)
        if recorded != expected:
            raise RuntimeError(
                f"The ledger holds {recorded} selection rounds but the method state {expected}: the checkpoint's "
                "dp_method_state.json and privacy_ledger.json do not belong together."
            )
        planned = run.plan.planned_steps
        due = sum(1 for k in range(self.config.num_selections) if self.selection_step(k, planned) <= step)
        while len(self.selections) < due:
            self.selections.append(self._select(run, step))
        if self.selections:
            self._train_selected(run.model)

    def _select(self, run: MethodRun, step: int) -> dict[str, Any]:
        """PSEL (Algorithm 4): T rounds of noisy magnitudes on the remaining partitions, PGM-EST, gap-tested picks."""
        config = self.config
        sizes = np.array([p.size for p in self.partitions], dtype=np.float64)
        total = int(sizes.sum())  # |Θ|, the head included (methods_spec §2.13)
        rounds = config.rounds_per_selection
        sigma = run.plan[SELECTION_STAGE].noise_multiplier
        if sigma is None:  # unreachable: a selection runs only in a planned round, and a stage with steps has its σ
            raise RuntimeError(f"Stage {SELECTION_STAGE!r} has no σ: it was planned with no selection rounds.")
        remaining = list(self.candidates)
        selected: list[int] = []
        observations, deltas, log = [], [], []
        for t in range(1, rounds + 1):
            if not remaining:
                break  # everything is selected: no further release (spending less than planned)
            candidates = len(remaining)
            reducer = self._measure(run, remaining)
            noisy = run.release(SELECTION_STAGE, reducer.pop_magnitudes(), reducer.sensitivity)
            observation = np.full(len(self.partitions), np.nan)
            observation[remaining] = noisy.double().cpu().numpy()
            observations.append(observation)
            deltas.append(reducer.sensitivity)
            v, lambdas = estimate_pgms(observations, deltas, config.selection_sample_rate, config.mle_iterations)
            sigma_v = pgm_std(sigma, lambdas, deltas)
            new = select_round(
                v,
                remaining,
                selected,
                sizes,
                total,
                t,
                rounds,
                config.unfreeze_ratio,
                config.gap_coefficient,
                sigma_v,
                config.skip_oversized,
            )
            selected += new
            remaining = [i for i in remaining if i not in set(new)]
            log.append(
                {
                    "round": t,
                    "candidates": candidates,
                    "sensitivity": reducer.sensitivity,
                    "pgm_std": sigma_v,
                    "selected": [self.partitions[i].name for i in new],
                }
            )
            logger.info(
                "DP-FROST selection %d, round %d/%d: %d candidates, Δ=%.4g, σ_v=%.4g, %d selected.",
                len(self.selections) + 1,
                t,
                rounds,
                candidates,
                reducer.sensitivity,
                sigma_v,
                len(new),
            )
        names = [self.partitions[i].name for i in selected]
        fraction = float(sizes[selected].sum() / total) if selected else 0.0
        logger.info(
            "DP-FROST selected %d partitions (%.3f%% of the parameters) before step %d: %s",
            len(names),
            100 * fraction,
            step,
            ", ".join(names) or "none",
        )
        if not selected:
            logger.warning(
                "DP-FROST selected no partition: only the head trains. A larger unfreeze_ratio, "
                "skip_oversized=True or a larger budget may help."
            )
        return {"step": step, "partitions": names, "fraction": fraction, "rounds": log}

    def _measure(self, run: MethodRun, remaining: list[int]) -> PartitionMagnitudeReducer:
        """Σ_x of the clipped per-example magnitudes of the remaining partitions on one Poisson sample (no noise)."""
        model = run.model
        params = dict(model.named_parameters())
        groups = [[params[n] for n in self.partitions[i].parameter_names] for i in remaining]
        model.requires_grad_(False)
        for group in groups:
            for param in group:
                param.requires_grad_(True)
        reducer = PartitionMagnitudeReducer(
            groups, self.config.initial_clip_norm, order=self.config.norm_order, variant=self.config.variant
        )
        engine = run.new_engine(reducer)
        try:
            run.accumulate(engine, run.poisson_sample(SELECTION_STAGE))
        finally:
            engine.detach()
        return reducer

    def _train_selected(self, model: nn.Module) -> None:
        train_only(model, self.trained_parameter_names(model))

    # ------------------------------------------------------------------ what trains, state, report
    def trained_parameter_names(self, model: nn.Module) -> set[str]:
        """The head (if always trained) and the latest selection; nothing else before the first selection."""
        names = set(self.head)
        if self.selections:
            by_name = {p.name: p for p in self.partitions}
            for partition in self.selections[-1]["partitions"]:
                names.update(by_name[partition].parameter_names)
        return names

    def state_dict(self) -> dict[str, Any]:
        return {"selections": self.selections}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        selections = state.get("selections", [])
        known = {p.name for p in self.partitions}
        unknown = sorted({name for s in selections for name in s["partitions"]} - known)
        if unknown:
            raise ValueError(f"The checkpoint's DP-FROST selection names partitions this model lacks: {unknown}.")
        self.selections = list(selections)

    def report(self) -> dict[str, Any]:
        config = self.config
        details: dict[str, Any] = {
            "selection": f"DP-{config.variant.upper()}, α={config.norm_order}, {config.rounds_per_selection} "
            f"round(s) at q={config.selection_sample_rate:g} per selection, {config.num_selections} "
            f"selection(s), γ={config.unfreeze_ratio:g}, ν={config.gap_coefficient:g}",
        }
        if self.selections:
            latest = self.selections[-1]
            details["selected_partitions"] = latest["partitions"]
            details["selected_fraction"] = round(latest["fraction"], 6)
            details["selections"] = self.selections
        return details

    def citations(self) -> tuple[str, ...]:
        return (
            *super().citations(),
            "DP-FROST: *Differentially Private Fine-tuning of Pre-trained Models with Freezing Model Parameters* "
            "(seed 000; methods_spec §2).",
        )

    @classmethod
    def recipe_defaults(cls, task: str) -> RecipeDefaults:
        batch, epochs = _PAPER_SCHEDULE.get(task, _PAPER_SCHEDULE["sst2"])
        return RecipeDefaults(
            batch,
            epochs,
            1e-3,
            0.1,
            256,
            _PAPER,
            from_paper=task in _PAPER_SCHEDULE,
            method_fields={"unfreeze_ratio": 0.25**2},
        )
