"""Gaussian noise for every trainable coordinate, drawn from secret generators.

Drawing σC·N(0, 1) for every coordinate is the one cost of DP-SGD that does not shrink with the batch: about
a quarter of a second per 100M parameters per generator on a CPU. The draws are split over several
independent secret generators working in parallel threads, each in chunks into a small reused scratch buffer
that is then added in place, so a step allocates nothing parameter-sized for the noise.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from .rng import make_secret_generator

_CHUNK = 1 << 22  # draw at most 4M values (16 MB) at a time: the scratch buffer stays small


class GaussianNoise:
    def __init__(self, device: torch.device | str, test_seed: int | None = None, workers: int | None = None) -> None:
        device = torch.device(device)
        if workers is None:
            workers = max(1, min(4, torch.get_num_threads())) if device.type == "cpu" else 1
        self.device = device
        self.generators = [
            make_secret_generator(device, None if test_seed is None else test_seed + 1_000_003 * i)
            for i in range(workers)
        ]
        self._scratch: list[torch.Tensor | None] = [None] * workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="dp-noise") if workers > 1 else None

    def add_(self, tensors: list[torch.Tensor], std: float) -> None:
        """tensors[i] += N(0, std²) elementwise, drawn in fp32, in place."""
        shares: list[list[torch.Tensor]] = [[] for _ in self.generators]
        loads = [0] * len(self.generators)
        for tensor in sorted(tensors, key=torch.Tensor.numel, reverse=True):  # balance the work by size
            worker = loads.index(min(loads))
            shares[worker].append(tensor)
            loads[worker] += tensor.numel()
        if self._pool is None:
            self._draw(0, shares[0], std)
        else:
            for future in [self._pool.submit(self._draw, w, share, std) for w, share in enumerate(shares)]:
                future.result()

    def _draw(self, worker: int, tensors: list[torch.Tensor], std: float) -> None:
        if not tensors:
            return
        size = min(_CHUNK, max(t.numel() for t in tensors))
        scratch = self._scratch[worker]
        if scratch is None or scratch.numel() < size:
            scratch = self._scratch[worker] = torch.empty(size, dtype=torch.float32, device=self.device)
        for tensor in tensors:
            flat = tensor.view(-1)  # the optimizer's own fresh (contiguous) buffers
            for start in range(0, flat.numel(), _CHUNK):
                part = flat[start : start + _CHUNK]
                noise = scratch[: part.numel()].normal_(0.0, std, generator=self.generators[worker])
                part.add_(noise.to(part.device))
