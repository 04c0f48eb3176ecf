"""Banded-inverse matrix factorization (BISR) noise: w_t = Σ_{j<b} d_j z_{t−j}, its two memory layouts, its accounting.

The factorization and its sensitivity are in `banded_inverse` (kept free of imports so that `events` can use it).
Here: the run-time noise and the ledger event.

What is proven, and what is claimed: the release is the Gaussian mechanism C x + z (post-processed), each example in
one of b partitions, so taking part only in steps p, p + b, p + 2b, …; its sensitivity is computed exactly for those
patterns (`banded_inverse.sensitivity`) and the run is accounted as ONE Gaussian mechanism at noise multiplier
σ / sensitivity, with no amplification by sampling (dp_accounting: `GaussianDpEvent(σ / sensitivity)`). Poisson
sampling within the partition is used but not credited. With b = 1 the noise is DP-SGD's (C = I) and so is the
sampler, so the event is DP-SGD's Poisson-subsampled Gaussian, whose amplification is proven.

Memory layouts (same values, bit for bit): z_t is drawn from the run's ChaCha20 stream at requests reserved for the
step (`SecretRandom.reserve_requests`), chunk by chunk exactly as `GaussianSampler` draws DP-SGD's noise, so
"store" keeps the last b − 1 draws (b − 1 fp32 copies of the trainable size, like BandMF), while "regenerate" keeps
only their request numbers and re-reads z_{t−j} from the stream each step (`SecretRandom.fill_at_`): DP-SGD's memory
plus two chunk buffers, at the cost of b draws a step. "auto" stores while the history fits in `STORE_LIMIT_BYTES`
(256 MiB: LoRA-sized releases; full fine-tuning of a BERT-base with b ≥ 2 regenerates). The history, stored or
regenerated, is saved in the checkpoint (it is as secret as the noise): a resumed run has a fresh key and cannot
regenerate the old draws.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from .banded_inverse import bisr_coefficients, sensitivity
from .events import BAND_INV_MF, MechanismGroup
from .rng import MAX_RELEASE_COORDINATES, PAIR_BYTES, BoxMuller, SecretRandom

BAND_INV_MF_MECHANISM = "band-inv-mf"
LAYOUTS = ("auto", "store", "regenerate")
#: "auto" keeps the last b − 1 draws while they take at most this many bytes, and regenerates them above it.
STORE_LIMIT_BYTES = 256 << 20


def band_inv_mf_event(
    name: str,
    noise_multiplier: float,
    sample_rate: float,
    bands: int,
    steps: int = 1,
    max_grad_norm: float | None = None,
) -> MechanismGroup:
    """`steps` banded-inverse steps at per-step noise multiplier σ: the ledger's typed event (`events.BAND_INV_MF`,
    accounted as one Gaussian at σ / sensitivity); with b = 1, DP-SGD's Poisson-subsampled Gaussian at `sample_rate`."""
    if bands == 1:
        return MechanismGroup(name, noise_multiplier, sample_rate, steps, max_grad_norm)
    return MechanismGroup(name, noise_multiplier, sample_rate, steps, max_grad_norm, BAND_INV_MF, bands=bands)


def card_release(entry: dict[str, Any]) -> dict[str, Any]:
    """A banded-inverse ledger entry as the card's mechanisms table lists it: what it is accounted as, one Gaussian
    release (`steps` 1, `sample_rate` 1) at σ / sensitivity, with the per-step σ, b and the training steps beside it,
    so that dp_accounting's `GaussianDpEvent(noise_multiplier)` recomputes ε from the entry alone."""
    steps, bands = int(entry["steps"]), int(entry["bands"])
    scale = sensitivity(bands, steps)
    return {
        **entry,
        "noise_multiplier": float(entry["noise_multiplier"]) / scale if steps else float(entry["noise_multiplier"]),
        "sample_rate": 1.0,
        "steps": 1 if steps else 0,
        "training_steps": steps,
        "per_step_noise_multiplier": float(entry["noise_multiplier"]),
        "sample_rate_per_partition": float(entry["sample_rate"]),
        "sensitivity": scale,
        "accounted_as": "gaussian",
    }


def card_line(facts: dict[str, Any]) -> str:
    """The card's one line on the noise, from `run.band_mf.BandMF.report()` of a banded-inverse run."""
    return (
        f"banded-inverse MF (BISR, Kalinin et al. 2026): each step's noise a fixed combination of its own and the "
        f"previous {facts['bands'] - 1} steps' independent draws (coefficients of (1 − x)^(1/2)), the data split "
        f"into {facts['bands']} secret partitions, step t Poisson-sampling partition t mod {facts['bands']} at "
        f"q̂ = {facts['sample_rate']:.4g}; NOT amplified by that sampling: accounted as one Gaussian mechanism at "
        f"σ / sensitivity, sensitivity {facts['sensitivity']:.4g} over the planned steps (the mechanisms table)"
    )


class BandedInverseNoise:
    """Adds w_t = Σ_{j<b} d_j z_{t−j} (BISR's d) to the clipped sums, z drawn from `random` at reserved requests;
    `layout` "store", "regenerate" or "auto" (module docstring). `pairs_per_chunk` must be the DP-SGD sampler's."""

    def __init__(
        self,
        random: SecretRandom,
        bands: int,
        pairs_per_chunk: int,
        device: torch.device | str = "cpu",
        layout: str = "auto",
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}.")
        self.random, self.bands, self.layout = random, int(bands), layout
        self.coefficients = [float(d) for d in bisr_coefficients(self.bands)]
        self.pairs, self.device = int(pairs_per_chunk), torch.device(device)
        self.step = 0
        self.sizes: tuple[int, ...] | None = None
        # w_{t−j}'s draws, oldest first: a flat fp32 tensor (stored, or loaded from a checkpoint) or (request, std)
        self._history: deque[torch.Tensor | tuple[int, float]] = deque(maxlen=max(self.bands - 1, 0))
        self._box_muller = BoxMuller(self.pairs, self.device)
        self._raw = bytearray(PAIR_BYTES * self.pairs)  # one request's keystream, reused by every draw
        self._raw_tensor = torch.frombuffer(self._raw, dtype=torch.uint8)
        self._values = torch.empty(2 * self.pairs, dtype=torch.float32, device=self.device)
        self._sum = torch.empty(2 * self.pairs, dtype=torch.float32, device=self.device)

    def _chunks(self) -> list[tuple[int, int, int, int]]:
        """(tensor, start in it, length, start in the flat release) per chunk, in the order DP-SGD draws them."""
        chunks, offset = [], 0
        for i, size in enumerate(self.sizes or ()):
            for start in range(0, size, 2 * self.pairs):
                length = min(2 * self.pairs, size - start)
                chunks.append((i, start, length, offset + start))
            offset += size
        return chunks

    def _draw(self, request: int, length: int, std: float) -> torch.Tensor:
        """The `length` values `GaussianSampler` draws from one request (its `_chunk`), into the reused buffer."""
        pairs = (length + 1) // 2
        self.random.fill_at_(memoryview(self._raw)[: PAIR_BYTES * pairs], request, 0)
        raw_tensor = self._raw_tensor[: PAIR_BYTES * pairs].to(self.device)
        values = self._values[: 2 * pairs]
        self._box_muller.normals_(raw_tensor[: 8 * pairs], raw_tensor[8 * pairs :], std, values[:pairs], values[pairs:])
        return values[:length]

    def _resolve_layout(self, total: int) -> str:
        if self.layout != "auto":
            return self.layout
        return "store" if history_bytes(self.bands, [total]) <= STORE_LIMIT_BYTES else "regenerate"

    def add_(self, totals: list[torch.Tensor], std: float) -> None:
        """totals += w_t for this step (one release of contiguous fp32 tensors, the same sizes every step)."""
        sizes = tuple(t.numel() for t in totals)
        if sum(sizes) > MAX_RELEASE_COORDINATES:
            raise ValueError(f"This release would noise {sum(sizes)} coordinates, more than {MAX_RELEASE_COORDINATES}.")
        if self.sizes is None:
            self.sizes, self.layout = sizes, self._resolve_layout(sum(sizes))
        elif sizes != self.sizes:
            raise ValueError("The banded-inverse noise needs the same trainable tensors every step.")
        chunks = self._chunks()
        first = self.random.reserve_requests(len(chunks))
        current = torch.empty(sum(sizes), dtype=torch.float32, device=self.device) if self.layout == "store" else None
        for m, (i, start, length, offset) in enumerate(chunks):
            z = self._draw(first + m, length, std)
            if current is not None:
                current[offset : offset + length].copy_(z)
            w = torch.mul(z, self.coefficients[0], out=self._sum[:length])
            for j, past in enumerate(reversed(self._history), start=1):
                if isinstance(past, torch.Tensor):  # read in place: no copy
                    z = past[offset : offset + length]
                else:
                    z = self._draw(past[0] + m, length, past[1])
                w.add_(z, alpha=self.coefficients[j])
            totals[i].view(-1)[start : start + length].add_(w)
        if self.bands > 1:
            self._history.append(current if current is not None else (first, float(std)))
        self.step += 1

    def state_dict(self) -> dict[str, Any]:
        """The last b − 1 draws as CPU tensors (regenerated ones re-read now: a resumed run has another key)."""
        history = []
        for past in self._history:
            if isinstance(past, torch.Tensor):
                history.append(past.cpu())
                continue
            flat = torch.empty(sum(self.sizes or ()), dtype=torch.float32)
            for m, (_, _, length, offset) in enumerate(self._chunks()):
                flat[offset : offset + length] = self._draw(past[0] + m, length, past[1]).cpu()
            history.append(flat)
        return {"bands": self.bands, "step": self.step, "sizes": self.sizes, "history": history}

    @staticmethod
    def check_state(state: dict[str, Any], bands: int) -> None:
        """Refuse a checkpoint's noise made with another b (its draws would not match the filter)."""
        if state["bands"] != bands:
            raise ValueError(
                f"The checkpoint's banded-inverse noise was made with bands={state['bands']}, this run has "
                f"bands={bands}: resume with the bands it was started with."
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a checkpoint's sequence (`check_state` first)."""
        self.check_state(state, self.bands)
        self.step, self.sizes = int(state["step"]), None if state["sizes"] is None else tuple(state["sizes"])
        if self.sizes is not None:
            self.layout = self._resolve_layout(sum(self.sizes))
        self._history.clear()
        for flat in state["history"]:
            self._history.append(flat.to(self.device))


def history_bytes(bands: int, sizes: Sequence[int]) -> int:
    """Bytes the "store" layout keeps: b − 1 fp32 copies of the release."""
    return max(int(bands) - 1, 0) * 4 * sum(sizes)
