"""Amplified BandMF in a run: the plan's stages, the partitioned sampler, the correlated noise and their checkpoint.

`privacy.band_mf` holds the mechanism (strategy, streaming noise, accounting) and `data.sampling` the b-min-sep
sampler; this is the run's side of them (as `adaptive_clip.py` is adaptive clipping's). The training stage becomes a
`band_mf` stage at the per-partition rate q̂ = b·B/N (so the plan calibrates σ and stops the budget on ⌈n/b⌉ releases);
the strategy is optimised for the plan's n steps and b; the optimizer correlates its noise through `BandedNoise`; the
sampler draws partition t mod b, t the ledger's training steps. The partition assignment is drawn once from its own
secret stream, and with the noise history is saved in every checkpoint (`BAND_MF_STATE_NAME`, never pushed: both are
as secret as the noise), so a resumed run continues the same noise sequence and the same partitions.

The banded-inverse mechanism (`noise_mechanism="band-inv-mf"`, `privacy.band_inv_mf`) shares all of this but the
strategy and the accounting: its stage is a `banded_inverse` one (one un-amplified Gaussian), and its noise
(`BandedInverseNoise`) draws from the optimizer's own secret stream, so it is built when the optimizer is attached.
`bands="auto"` (either mechanism) is resolved here, before the plan, by `privacy.band_auto.choose_bands`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..data.sampling import PartitionedPoissonBatchSampler, band_partitions
from ..optimizer import NoisyOptimizer
from ..privacy import band_mf, banded_inverse
from ..privacy.band_auto import choose_bands
from ..privacy.band_inv_mf import BAND_INV_MF_MECHANISM, BandedInverseNoise
from ..privacy.band_mf import AUTO_BANDS, BAND_MF_MECHANISM, BandedNoise, check_band_mf_run, check_bands, strategy
from ..privacy.banded_inverse import bisr_coefficients, sensitivity
from ..privacy.plan import PrivacyPlan, Stage, steps_per_epoch
from ..privacy.rng import SecretRandom
from ..release.artifacts import BAND_MF_STATE_NAME

CORRELATED = (BAND_MF_MECHANISM, BAND_INV_MF_MECHANISM)  # the noise mechanisms this module runs


def resolve_bands(
    config: Any, schedule: dict[str, float], delta: float, expected_batch_size: int, dataset_size: int
) -> tuple[int, list[dict[str, float]] | None]:
    """b, and the table of candidates when `bands="auto"` chose it for the plan's steps (from `schedule`)."""
    if config.bands != AUTO_BANDS:
        return int(config.bands), None
    if "steps" in schedule:
        steps = int(schedule["steps"])
    else:
        steps = math.ceil(schedule["epochs"] * steps_per_epoch(expected_batch_size / dataset_size))
    bands, table = choose_bands(
        config.target_epsilon,
        delta,
        steps,
        expected_batch_size,
        dataset_size,
        accountant=config.accountant,
        mechanism=config.noise_mechanism,
    )
    return bands, [row._asdict() for row in table]


def band_mf_stages(
    stages: Sequence[Stage], bands: int, expected_batch_size: int, dataset_size: int, mechanism: str = BAND_MF_MECHANISM
) -> list[Stage]:
    """The method's stages with its one training stage made BandMF (or banded-inverse) at q̂ = b·B/N."""
    if len(stages) != 1 or not stages[0].training:
        raise ValueError(
            f"noise_mechanism={mechanism!r} covers one training release over one trainable set; this "
            f"method plans {[s.name for s in stages]}."
        )
    rate = check_band_mf_run(bands, None, expected_batch_size, dataset_size)
    inverse = mechanism == BAND_INV_MF_MECHANISM
    return [dataclasses.replace(stages[0], name=mechanism, sample_rate=rate, bands=bands, banded_inverse=inverse)]


class BandMF:
    """One run's BandMF (or banded-inverse MF): b, q̂, the strategy and its noise state, and the partition assignment
    once drawn."""

    def __init__(
        self,
        bands: int,
        plan: PrivacyPlan,
        args: Any,
        random: SecretRandom,
        mechanism: str = BAND_MF_MECHANISM,
        auto_table: list[dict[str, float]] | None = None,
    ) -> None:
        """For `plan`, whose training stage `band_mf_stages` made BandMF; `random` draws the partitions;
        `auto_table`: the candidates `bands="auto"` compared, for the card."""
        if getattr(args, "dataloader_num_workers", 0) > 0:
            raise ValueError(
                f"noise_mechanism={mechanism!r} needs dataloader_num_workers=0 (got "
                f"{args.dataloader_num_workers}): its sampler reads the step about to be drawn when the batch is "
                "drawn, and worker processes draw batches ahead of the steps."
            )
        self.bands = check_bands(bands, plan.planned_steps)
        (stage,) = plan.training_stages
        self.sample_rate, self.mechanism, self.auto_table = stage.sample_rate, mechanism, auto_table
        self.planned_steps = plan.planned_steps
        self.noise: BandedNoise | BandedInverseNoise | None = None
        self._loaded: dict[str, Any] | None = None  # a checkpoint's noise state, until the noise is built
        if mechanism == BAND_INV_MF_MECHANISM:
            self.coefficients = [float(d) for d in bisr_coefficients(self.bands)]  # of C⁻¹; b only
        else:
            self.coefficients = [float(c) for c in strategy(plan.planned_steps, bands)]  # (n, b) only: public, cached
            self.noise = BandedNoise(self.coefficients)
        self._random = random
        self.partitions: torch.Tensor | None = None  # drawn at the first sampler, or the checkpoint's

    def attach_optimizer(self, optimizer: NoisyOptimizer) -> None:
        """BandMF's noise; the banded-inverse noise is built on the optimizer's secret stream and sampler chunks."""
        if self.mechanism == BAND_INV_MF_MECHANISM:
            source = optimizer.noise
            self.noise = BandedInverseNoise(source.random, self.bands, source.sampler.pairs, source.device)
            if self._loaded is not None:
                self.noise.load_state_dict(self._loaded)
        optimizer.banded_noise = self.noise

    def assignment(self, num_samples: int, share: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Each example's partition, drawn once (`share`d from the main process) or the checkpoint's."""
        if self.partitions is None:
            self.partitions = share(band_partitions(num_samples, self.bands, self._random))
        elif len(self.partitions) != num_samples:
            raise ValueError(
                f"The checkpoint's BandMF partitions cover {len(self.partitions)} examples, the training set has "
                f"{num_samples}: resume on the training set the run started with."
            )
        return self.partitions

    def sampler(
        self,
        num_samples: int,
        steps_per_epoch: int,
        num_chunks: int,
        random: SecretRandom,
        lengths: torch.Tensor | None,
        step: Callable[[], int],
        share: Callable[[torch.Tensor], torch.Tensor],
        rank: int = 0,
        world_size: int = 1,
    ) -> PartitionedPoissonBatchSampler:
        """The b-min-sep sampler: step t (the ledger's training steps when the batch is drawn) samples partition
        t mod b at q̂."""
        return PartitionedPoissonBatchSampler(
            num_samples,
            self.sample_rate,
            steps_per_epoch,
            num_chunks,
            rank=rank,
            world_size=world_size,
            random=random,
            lengths=lengths,
            partitions=self.assignment(num_samples, share),
            bands=self.bands,
            step=step,
        )

    @property
    def step_noise_factor(self) -> float:
        """The std of one step's noise once the history is full, in units of σ·C (DP-SGD: 1)."""
        if self.mechanism == BAND_INV_MF_MECHANISM:
            return banded_inverse.step_noise_factor(self.bands)
        return band_mf.step_noise_factor(self.coefficients, self.planned_steps)

    def step_noise_line(self, noise_multiplier: float) -> str:
        """What the correlated noise does to each step, for the run's log: Adam-type optimizers see it."""
        factor = self.step_noise_factor
        line = (
            f"Correlated noise ({self.mechanism}, b={self.bands}): once its history is full each step adds noise of "
            f"std {factor:.3g}·σ·C = {factor * noise_multiplier:.4g}·C"
        )
        if self.auto_table is not None:  # b = 1 is DP-SGD at the same target: the comparison a user wants
            independent = next(row["noise_multiplier"] for row in self.auto_table if row["bands"] == 1)
            line += f", {factor * noise_multiplier / independent:.2f}× DP-SGD's {independent:.4g}·C at this target ε"
        return (
            line + ". Adam-type optimizers (AdamW) divide each update by the gradient's running RMS, which this noise "
            "dominates, so their signal steps shrink by the ratio of the per-step noise to DP-SGD's: raise the "
            "learning rate by it (docs: Benchmarks, correlated noise on SST-2)."
        )

    def report(self) -> dict[str, Any]:
        """The card's `privacy.band_mf` block: what anyone needs to recompute ε and the noise's correlation."""
        report: dict[str, Any] = {
            "mechanism": self.mechanism,
            "bands": self.bands,
            "sample_rate": self.sample_rate,
            "step_noise_factor": self.step_noise_factor,
        }
        if self.mechanism == BAND_INV_MF_MECHANISM:
            report["noise_coefficients"] = list(self.coefficients)
            report["sensitivity"] = sensitivity(self.bands, self.planned_steps)
            report["noise_layout"] = getattr(self.noise, "layout", "auto")
        else:
            report["strategy_coefficients"] = list(self.coefficients)
        if self.auto_table is not None:
            report["bands_chosen_by"] = "auto"
            report["auto_candidates"] = self.auto_table
        return report

    # ------------------------------------------------------------------ checkpoints
    def save(self, output_dir: str) -> None:
        noise = self.noise.state_dict() if self.noise is not None else self._loaded
        torch.save(
            {"mechanism": self.mechanism, "noise": noise, "partitions": self.partitions},
            os.path.join(output_dir, BAND_MF_STATE_NAME),
        )

    def load(self, checkpoint: str) -> None:
        """Continue the checkpoint's noise sequence and partitions; refused when missing or made with another b."""
        path = os.path.join(checkpoint, BAND_MF_STATE_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{checkpoint} has no {BAND_MF_STATE_NAME}: a BandMF run continues its noise history and partitions "
                "from it (another partition assignment would break b-min-sep participation). Resume from a "
                f"checkpoint of a noise_mechanism={self.mechanism!r} run, or start afresh."
            )
        state = torch.load(path, weights_only=True)
        if state.get("mechanism", BAND_MF_MECHANISM) != self.mechanism:
            raise ValueError(
                f"The checkpoint's noise was made by noise_mechanism={state.get('mechanism')!r}, this run has "
                f"{self.mechanism!r}: resume with the mechanism it was started with."
            )
        if self.noise is None:  # built with the optimizer, which loads it then: refuse another b now
            BandedInverseNoise.check_state(state["noise"], self.bands)
            self._loaded = state["noise"]
        else:
            self.noise.load_state_dict(state["noise"])
        saved = state["partitions"]
        if saved is None:
            return
        if self.partitions is None:
            self.partitions = saved
        elif len(saved) != len(self.partitions):
            raise ValueError(
                f"The checkpoint's BandMF partitions cover {len(saved)} examples, the training set has "
                f"{len(self.partitions)}: resume on the training set the run started with."
            )
        else:
            self.partitions.copy_(saved)  # in place: a sampler built already reads these
