"""The secret randomness behind every privacy-protecting draw: DP noise, Poisson sampling, future mechanisms.

`SecretRandom` is ChaCha20 (RFC 8439, OpenSSL through the `cryptography` package) keyed with 256 bits from
`os.urandom`. Why not a `torch.Generator`: torch's CPU generator (mt19937) keeps only the low 32 bits of its
seed, so from one released step an attacker can search 2^32 keys against a coordinate that is pure noise,
replay the draw and subtract it, leaving the exact clipped sum. ChaCha20's keystream is indistinguishable
from random to anyone without the key, and the key never leaves this object: it is not derived from
`TrainingArguments.seed` (public), not touched by `torch.manual_seed`, and never written to a checkpoint
(a resumed run draws a fresh key, which is sound: each step's noise only needs to be fresh and independent).

Every request (one call of `uniform`, `normal`, ...) uses its own 96-bit nonce — a 64-bit request counter and
a 32-bit stream id — with the block counter starting at 0, so no keystream block is ever used twice and a
request may be as large as 2^32 blocks (256 GiB). Streams with different ids (one per noise worker thread, one
per rank) are independent under one key.

`test_seed` makes the key a hash of the seed: the draws are then reproducible for tests, and the guarantee
holds only against someone who does not know the seed.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import threading

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from ..logs import get_logger

logger = get_logger(__name__)

KEY_BYTES = 32  # 256-bit key
_MAX_REQUEST_BYTES = (1 << 32) * 64  # the 32-bit block counter of one nonce
_MASK_53 = (1 << 53) - 1
_MASK_24 = (1 << 24) - 1
# Bytes per pair of Gaussians: 8 for the radius uniform (53 bits used), 4 for the angle (24 bits used).
PAIR_BYTES = 12


@functools.lru_cache(maxsize=8)
def _zeros(size: int) -> bytes:
    return bytes(size)


def _test_key(test_seed: int) -> bytes:
    return hashlib.sha256(b"hf_private insecure test seed\0" + str(int(test_seed)).encode()).digest()


@functools.cache
def _warn_test_seed() -> None:
    """Once per process: one test-seed run keys several generators (noise, sampling, forward mechanisms)."""
    logger.warning(
        "Insecure test mode: DP randomness keyed from a test seed (DPConfig.noise_seed). The noise and sampling are "
        "reproducible, and the privacy guarantee is void against anyone who knows the seed. Never use it for a real "
        "run."
    )


class SecretRandom:
    """A cryptographically secure random stream turned into uniforms and Gaussians in torch."""

    def __init__(self, test_seed: int | None = None, stream: int = 0, *, key: bytes | None = None) -> None:
        """`key` is for tests of the generator itself; real runs leave it None (256 bits of OS entropy)."""
        if key is not None and test_seed is not None:
            raise ValueError("Give at most one of key and test_seed.")
        if test_seed is not None:
            _warn_test_seed()
            key = _test_key(test_seed)
        elif key is None:
            key = os.urandom(KEY_BYTES)
        if len(key) != KEY_BYTES:
            raise ValueError(f"The key must be {KEY_BYTES} bytes, got {len(key)}.")
        if not 0 <= stream < 1 << 32:
            raise ValueError(f"stream must be a 32-bit id, got {stream}.")
        self._key = key
        self._stream = stream
        self._requests = 0
        self._lock = threading.Lock()
        self.insecure = test_seed is not None

    def __repr__(self) -> str:  # never show the key
        return f"SecretRandom(stream={self._stream}, requests={self._requests}, insecure={self.insecure})"

    def __getstate__(self):
        raise TypeError("SecretRandom holds a secret key and must not be pickled or saved.")

    def substream(self, stream: int) -> SecretRandom:
        """An independent stream under the same key (different nonces), e.g. one per worker thread."""
        child = SecretRandom.__new__(SecretRandom)
        child._key, child._stream, child._requests = self._key, stream, 0
        child._lock, child.insecure = threading.Lock(), self.insecure
        return child

    def fill_(self, buffer: bytearray | memoryview) -> None:
        """Overwrite `buffer` with fresh keystream bytes (one request, one nonce)."""
        size = memoryview(buffer).nbytes
        if size > _MAX_REQUEST_BYTES:
            raise ValueError(f"One request may draw at most {_MAX_REQUEST_BYTES} bytes, got {size}.")
        with self._lock:
            request = self._requests
            self._requests += 1
        # cryptography's 16-byte ChaCha20 nonce: 4-byte little-endian block counter, then the 96-bit nonce.
        nonce = b"\0\0\0\0" + request.to_bytes(8, "little") + self._stream.to_bytes(4, "little")
        encryptor = Cipher(algorithms.ChaCha20(self._key, nonce), mode=None).encryptor()
        encryptor.update_into(_zeros(size), buffer)  # keystream XOR zeros = keystream

    def random_bytes(self, count: int) -> bytes:
        buffer = bytearray(count)
        self.fill_(buffer)
        return bytes(buffer)

    def uniform(self, count: int) -> torch.Tensor:
        """`count` float64 uniforms on the grid (k + ½)·2⁻⁵³, k < 2⁵³: strictly inside (0, 1), exact in float64.

        Poisson inclusion compares these with q: a float32 grid (2⁻²⁴) would include examples with probability
        slightly above the accounted q.
        """
        buffer = bytearray(8 * count)
        self.fill_(buffer)
        bits = torch.frombuffer(buffer, dtype=torch.int64, count=count) if count else torch.empty(0, dtype=torch.int64)
        return bits.bitwise_and(_MASK_53).double().add_(0.5).mul_(2.0**-53)

    def normal(self, count: int, std: float = 1.0) -> torch.Tensor:
        """`count` float32 draws of N(0, std²) (a fresh tensor; `GaussianSampler` reuses buffers for bulk noise)."""
        sampler = GaussianSampler(self, max(1, math.ceil(count / 2)))
        out = torch.empty(count, dtype=torch.float32)
        sampler.add_(out.zero_(), std)
        return out


class GaussianSampler:
    """Box-Muller on keystream bytes into reused buffers: adds N(0, std²) to float32 tensors in chunks.

    Each pair of draws takes 53 bits for the radius and 24 for the angle: r = std·√(−2 ln u₁) computed in float64
    (the tail is cut only beyond 8.6 std, a mass of 2⁻⁵⁴ per pair), r·cos θ and r·sin θ in float32.
    The work per value is fixed — no rejection loop — so its time does not depend on anything private.
    """

    def __init__(self, random: SecretRandom, pairs_per_chunk: int = 1 << 16, device: torch.device | str = "cpu"):
        self.random = random
        self.pairs = pairs_per_chunk
        self.device = torch.device(device)
        self._bytes = bytearray(PAIR_BYTES * self.pairs)
        self._raw = torch.frombuffer(self._bytes, dtype=torch.uint8)
        on = dict(device=self.device)
        self._bits53 = torch.empty(self.pairs, dtype=torch.int64, **on)
        self._bits24 = torch.empty(self.pairs, dtype=torch.int32, **on)
        self._radius64 = torch.empty(self.pairs, dtype=torch.float64, **on)
        self._radius = torch.empty(self.pairs, dtype=torch.float32, **on)
        self._angle = torch.empty(self.pairs, dtype=torch.float32, **on)
        self._values = torch.empty(2 * self.pairs, dtype=torch.float32, **on)

    def _chunk(self, std: float, pairs: int) -> torch.Tensor:
        """2·pairs fresh N(0, std²) values, pairs ≤ self.pairs (a view of a reused buffer).

        Only the keystream for `pairs` is drawn: a small tensor must not pay for a whole chunk.
        """
        self.random.fill_(memoryview(self._bytes)[: PAIR_BYTES * pairs])  # one request: radius bits, angle bits
        radius_bits = self._raw[: 8 * pairs].view(torch.int64)
        angle_bits = self._raw[8 * pairs : PAIR_BYTES * pairs].view(torch.int32)
        bits53, bits24 = self._bits53[:pairs], self._bits24[:pairs]
        radius64, radius, angle = self._radius64[:pairs], self._radius[:pairs], self._angle[:pairs]
        torch.bitwise_and(radius_bits.to(self.device, non_blocking=True), _MASK_53, out=bits53)
        radius64.copy_(bits53).add_(0.5).mul_(2.0**-53).log_().mul_(-2.0 * std * std).sqrt_()
        radius.copy_(radius64)
        torch.bitwise_and(angle_bits.to(self.device, non_blocking=True), _MASK_24, out=bits24)
        torch.mul(bits24, 2 * math.pi / (1 << 24), out=angle)  # uniform on a 2^24-point grid
        values = self._values[: 2 * pairs]
        torch.cos(angle, out=values[:pairs]).mul_(radius)
        torch.sin(angle, out=values[pairs:]).mul_(radius)
        return values

    def add_(self, tensor: torch.Tensor, std: float) -> None:
        """tensor += N(0, std²) elementwise, in place; `tensor` must be contiguous."""
        flat = tensor.view(-1)
        step = 2 * self.pairs
        for start in range(0, flat.numel(), step):
            part = flat[start : start + step]
            part.add_(self._chunk(std, (part.numel() + 1) // 2)[: part.numel()])
