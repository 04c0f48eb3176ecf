"""Gaussian noise for every trainable coordinate, drawn from the secret ChaCha20 stream.

Drawing σC·N(0, 1) for every coordinate is the one cost of DP-SGD that does not shrink with the batch. The
draws are made in chunks into small reused buffers (`GaussianSampler`); torch's own intra-op threads share each
chunk's arithmetic. (Separate worker threads with their own substreams were slower on a 2-core CPU: the chunk
kernels already use both.)

On CUDA the keystream itself is made on the device, by ChaCha20 compiled into one kernel there (`device_chacha`,
checked against RFC 8439 before use): nothing crosses the bus, and the CPU's one-core keystream is not the limit.

Drawing ahead (on an accelerator by default): once a release's sizes and std are known (`prepare`, at the start of a
logical batch), a background thread draws its values into one fp32 buffer — the memory of one fp32 copy of the
noised coordinates — while forward and backward run, and `add_` adds them. The values are those the synchronous path
would add, from the same requests in the same order (`add_` waits for the thread before drawing anything else), so
test-seed replay does not depend on timing. Each draw is used at most once: a draw is spent when added or discarded
(sizes or std that differ from the release), and `add_` refuses a spent draw or one not newer than the last it used.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from .rng import MAX_RELEASE_COORDINATES, GaussianSampler, SecretRandom
from .sharded_noise import ShardedGaussianSampler, TensorShard


def _check_coordinates(coordinates: int) -> None:
    """The δ the ledger sets aside for the sampler's finite tail (`rng.tail_mass`) assumes no release noises more."""
    if coordinates > MAX_RELEASE_COORDINATES:
        raise ValueError(
            f"This release would noise {coordinates} coordinates, more than the {MAX_RELEASE_COORDINATES} the "
            "privacy accounting of the noise sampler's finite tail assumes (rng.tail_mass): train fewer "
            "parameters at once (e.g. LoRA or BiTFiT)."
        )


class _Draw:
    """One release's noise, drawn in a background thread into `values`; spent once taken or discarded.

    On CUDA the thread works on a side stream that first waits for everything queued on the caller's stream before
    `prepare` (e.g. the last add from the same buffer), and synchronises it before finishing: once `wait` returns,
    the values are on the device and no work of the draw is still queued.
    """

    def __init__(
        self, generation: int, key: tuple[tuple[int, ...], float], values: torch.Tensor, sampler: GaussianSampler
    ) -> None:
        self.generation, self.key, self.values = generation, key, values
        self.spent = False
        self._error: BaseException | None = None
        # On CUDA: the side stream, and the event it waits for (everything queued on the caller's stream so far).
        self._side: tuple[torch.cuda.Stream, torch.cuda.Event] | None = None
        if values.device.type == "cuda":
            side = torch.cuda.Stream(values.device)
            after = torch.cuda.Event()
            after.record()
            self._side = side, after
        # Not a daemon: interpreter exit waits for at most one draw rather than killing it inside torch.
        self._thread = threading.Thread(target=self._run, args=(sampler,), name="hf_private noise", daemon=False)
        self._thread.start()

    def _run(self, sampler: GaussianSampler) -> None:
        try:
            if self._side is None:
                self._draw(sampler)
                return
            side, after = self._side
            with torch.cuda.stream(side):
                side.wait_event(after)
                self._draw(sampler)
            side.synchronize()
        except BaseException as error:  # raised again in the caller's thread by `wait`
            self._error = error

    def _draw(self, sampler: GaussianSampler) -> None:
        sizes, std = self.key
        for part in self.values.split(sizes):
            sampler.draw_(part, std)  # chunked per tensor, as the synchronous path's add_

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise RuntimeError("Drawing the noise ahead failed.") from self._error

    def take(self) -> torch.Tensor:
        """The values, once: a second take raises, whatever the caller."""
        self.wait()
        if self.spent:
            raise RuntimeError(f"Noise draw {self.generation} was already used or discarded: noise is never reused.")
        self.spent = True
        return self.values


class GaussianNoise:
    def __init__(self, device: torch.device | str, test_seed: int | None = None, *, ahead: bool | None = None) -> None:
        """`ahead`: whether `prepare` draws ahead; by default on an accelerator only. On a CPU the step's own kernels
        already use every core: on 2 cores a draw in a background thread took twice as long (0.65 s against 0.31 s
        for 110M values) and a step that drew ahead was slower. Without it no parameter-sized buffer is kept."""
        self.device = torch.device(device)
        self.random = SecretRandom(test_seed)
        self.sampler = GaussianSampler(self.random, device=self.device)
        self.ahead = self.device.type != "cpu" if ahead is None else ahead
        self._next: _Draw | None = None  # the draw for the next release, running or done, unused
        self._generations = 0  # draws started
        self._used = 0  # the generation of the last draw added
        self._values: torch.Tensor | None = None  # the buffer draws go into
        self._sharded: ShardedGaussianSampler | None = None  # built at the first sharded release

    def prepare(self, sizes: Sequence[int], std: float) -> None:
        """Start drawing N(0, std²) for the next release of tensors of these sizes (numels), in a background thread.

        Nothing new if the pending draw is for the same sizes and std; a pending draw for others is discarded.
        """
        if not self.ahead:  # every training step calls this: nothing to build on a CPU
            return
        key = (tuple(int(size) for size in sizes), float(std))
        if self._next is not None and self._next.key == key:
            return
        self._discard(self._next)
        self._next = None
        _check_coordinates(sum(key[0]))
        values = self._buffer(sum(key[0]))
        self._generations += 1
        self._next = _Draw(self._generations, key, values, self.sampler)

    def add_(self, tensors: list[torch.Tensor], std: float) -> None:
        """tensors[i] += N(0, std²) elementwise, drawn in fp32, in place: one release (at most
        `MAX_RELEASE_COORDINATES` coordinates). The tensors must be contiguous."""
        sizes = [tensor.numel() for tensor in tensors]
        _check_coordinates(sum(sizes))
        draw, self._next = self._next, None
        if draw is not None and draw.key == (tuple(sizes), float(std)):
            values = draw.take()
            if draw.generation <= self._used:
                raise RuntimeError(f"Noise draw {draw.generation} is not newer than the last one used ({self._used}).")
            self._used = draw.generation
            for tensor, part in zip(tensors, values.split(sizes)):
                tensor.view(-1).add_(part)
            return
        self._discard(draw)  # its requests come first, as drawn: replay does not depend on the thread's timing
        for tensor in tensors:
            self.sampler.add_(tensor, std)  # the optimizer's own fresh (contiguous) buffers

    def add_shards_(self, shards: Sequence[TensorShard], std: float) -> None:
        """One release split across processes (FSDP2): each shard gets the values `add_` would add to its coordinates
        of the whole tensor, from the same requests (`sharded_noise`). Every process calls it with its own shards of
        the same tensors, in the same order, so every coordinate is noised exactly once, by its owner."""
        _check_coordinates(sum(shard.numel for shard in shards))
        if self._next is not None:  # its requests were taken on this process only: the counters would drift apart
            raise RuntimeError(
                "A noise draw was prepared ahead for a whole-tensor release, but this release is sharded: sharded "
                "releases do not draw ahead (call prepare only where add_ follows)."
            )
        if self._sharded is None:
            self._sharded = ShardedGaussianSampler(self.random, self.sampler.pairs, self.device)
        self._sharded.add_(shards, std)

    @staticmethod
    def _discard(draw: _Draw | None) -> None:
        """Spend a draw unused, after its thread ends (the sampler is then free)."""
        if draw is not None:
            draw.wait()
            draw.spent = True

    def _buffer(self, size: int) -> torch.Tensor:
        """The fp32 buffer draws go into, reused while the size stays (a spent draw's values are overwritten)."""
        if self._values is None or self._values.numel() != size:
            self._values = torch.empty(size, dtype=torch.float32, device=self.device)
        return self._values
