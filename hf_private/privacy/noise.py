"""Gaussian noise for every trainable coordinate, drawn from the secret ChaCha20 stream.

Drawing σC·N(0, 1) for every coordinate is the one cost of DP-SGD that does not shrink with the batch. The
draws are made in chunks into small reused buffers (`GaussianSampler`) and added in place, so a step allocates
nothing parameter-sized for the noise; torch's own intra-op threads share each chunk's arithmetic. (Separate
worker threads with their own substreams were slower on a 2-core CPU: the chunk kernels already use both.)
"""

from __future__ import annotations

import torch

from .rng import MAX_RELEASE_COORDINATES, GaussianSampler, SecretRandom


class GaussianNoise:
    def __init__(self, device: torch.device | str, test_seed: int | None = None) -> None:
        self.device = torch.device(device)
        self.random = SecretRandom(test_seed)
        self.sampler = GaussianSampler(self.random, device=self.device)

    def add_(self, tensors: list[torch.Tensor], std: float) -> None:
        """tensors[i] += N(0, std²) elementwise, drawn in fp32, in place: one release.

        At most `MAX_RELEASE_COORDINATES` in all: the δ the ledger sets aside for the sampler's finite tail
        (`rng.tail_mass`) assumes no release noises more.
        """
        coordinates = sum(tensor.numel() for tensor in tensors)
        if coordinates > MAX_RELEASE_COORDINATES:
            raise ValueError(
                f"This release would noise {coordinates} coordinates, more than the {MAX_RELEASE_COORDINATES} the "
                "privacy accounting of the noise sampler's finite tail assumes (rng.tail_mass): train fewer "
                "parameters at once (e.g. LoRA or BiTFiT)."
            )
        for tensor in tensors:
            self.sampler.add_(tensor, std)  # the optimizer's own fresh (contiguous) buffers
