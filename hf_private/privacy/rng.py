"""The secret random generator behind DP noise and Poisson sampling."""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)


def make_secret_generator(device: torch.device | str = "cpu", test_seed: int | None = None) -> torch.Generator:
    """A `torch.Generator` on `device` seeded with 64 bits from `os.urandom`.

    Why not `args.seed`: it is public (written to training_args.bin and usually to the card), and
    anyone who knows the seed can replay the Gaussian noise and subtract it, or replay the Poisson
    sampling, which voids the guarantee. `torch.manual_seed` does not reach this generator either.
    The seed is never saved into checkpoints: a resumed run draws a fresh secret seed, which is
    sound because the noise of each step only needs to be fresh and independent. (torch's generators
    are not cryptographic; what they produce is never published except inside noisy sums.)

    `test_seed` makes the draws reproducible for tests only; the guarantee then holds only against
    someone who does not know that seed.
    """
    generator = torch.Generator(device=device)
    if test_seed is None:
        generator.manual_seed(int.from_bytes(os.urandom(8), "little"))
    else:
        logger.warning(
            "Insecure test mode: DP randomness seeded with test_seed=%d. The noise and sampling are reproducible, "
            "and the privacy guarantee is void against anyone who knows the seed. Never use it for a real run.",
            test_seed,
        )
        generator.manual_seed(int(test_seed))
    return generator
