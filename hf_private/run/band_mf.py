"""Amplified BandMF in a run: the plan's stages, the partitioned sampler, the correlated noise and their checkpoint.

`privacy.band_mf` holds the mechanism (strategy, streaming noise, accounting) and `data.sampling` the b-min-sep
sampler; this is the run's side of them (as `adaptive_clip.py` is adaptive clipping's). The training stage becomes a
`band_mf` stage at the per-partition rate q̂ = b·B/N (so the plan calibrates σ and stops the budget on ⌈n/b⌉ releases);
the strategy is optimised for the plan's n steps and b; the optimizer correlates its noise through `BandedNoise`; the
sampler draws partition t mod b, t the ledger's training steps. The partition assignment is drawn once from its own
secret stream, and with the noise history is saved in every checkpoint (`BAND_MF_STATE_NAME`, never pushed: both are
as secret as the noise), so a resumed run continues the same noise sequence and the same partitions.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..data.sampling import PartitionedPoissonBatchSampler, band_partitions
from ..optimizer import NoisyOptimizer
from ..privacy.band_mf import BAND_MF_MECHANISM, BandedNoise, check_band_mf_run, check_bands, strategy
from ..privacy.plan import PrivacyPlan, Stage
from ..privacy.rng import SecretRandom
from ..release.artifacts import BAND_MF_STATE_NAME


def band_mf_stages(stages: Sequence[Stage], bands: int, expected_batch_size: int, dataset_size: int) -> list[Stage]:
    """The method's stages with its one training stage made BandMF at q̂ = b·B/N (`Stage.bands`)."""
    if len(stages) != 1 or not stages[0].training:
        raise ValueError(
            f"noise_mechanism={BAND_MF_MECHANISM!r} covers one training release over one trainable set; this "
            f"method plans {[s.name for s in stages]}."
        )
    rate = check_band_mf_run(bands, None, expected_batch_size, dataset_size)
    return [dataclasses.replace(stages[0], name=BAND_MF_MECHANISM, sample_rate=rate, bands=bands)]


class BandMF:
    """One run's BandMF: b, q̂, the strategy and its noise state, and the partition assignment once drawn."""

    def __init__(self, bands: int, plan: PrivacyPlan, args: Any, random: SecretRandom) -> None:
        """For `plan`, whose training stage `band_mf_stages` made BandMF; `random` draws the partitions."""
        if getattr(args, "dataloader_num_workers", 0) > 0:
            raise ValueError(
                f"noise_mechanism={BAND_MF_MECHANISM!r} needs dataloader_num_workers=0 (got "
                f"{args.dataloader_num_workers}): its sampler reads the step about to be drawn when the batch is "
                "drawn, and worker processes draw batches ahead of the steps."
            )
        self.bands = check_bands(bands, plan.planned_steps)
        (stage,) = plan.training_stages
        self.sample_rate = stage.sample_rate
        self.coefficients = [float(c) for c in strategy(plan.planned_steps, bands)]  # (n, b) only: public, cached
        self.noise = BandedNoise(self.coefficients)
        self._random = random
        self.partitions: torch.Tensor | None = None  # drawn at the first sampler, or the checkpoint's

    def attach_optimizer(self, optimizer: NoisyOptimizer) -> None:
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

    def report(self) -> dict[str, Any]:
        """The card's `privacy.band_mf` block: what anyone needs to recompute ε and the noise's correlation."""
        return {
            "mechanism": BAND_MF_MECHANISM,
            "bands": self.bands,
            "sample_rate": self.sample_rate,
            "strategy_coefficients": list(self.coefficients),
        }

    # ------------------------------------------------------------------ checkpoints
    def save(self, output_dir: str) -> None:
        torch.save(
            {"noise": self.noise.state_dict(), "partitions": self.partitions},
            os.path.join(output_dir, BAND_MF_STATE_NAME),
        )

    def load(self, checkpoint: str) -> None:
        """Continue the checkpoint's noise sequence and partitions; refused when missing or made with another b."""
        path = os.path.join(checkpoint, BAND_MF_STATE_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{checkpoint} has no {BAND_MF_STATE_NAME}: a BandMF run continues its noise history and partitions "
                "from it (another partition assignment would break b-min-sep participation). Resume from a "
                "checkpoint of a noise_mechanism='band-mf' run, or start afresh."
            )
        state = torch.load(path, weights_only=True)
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
