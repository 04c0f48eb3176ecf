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
request may be as large as 2^32 blocks (256 GiB). A `substream` (one per worker thread, say) gets a key of its
own, derived from this one and a counter never reused, so it cannot repeat this stream's blocks or another
substream's, whatever ids they are given.

`test_seed` makes the key a hash of the seed: the draws are then reproducible for tests, and the guarantee
holds only against someone who does not know the seed.

The Gaussian sampler's finite tail (no draw beyond `Z_MAX` std) leaves a little mass where a neighbouring
dataset's output has no support: `tail_mass` bounds it per release, and the accountants add it to δ.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import math
import os
import threading
from collections.abc import Callable

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from scipy import stats

from ..logs import get_logger
from . import device_chacha

logger = get_logger(__name__)

KEY_BYTES = 32  # 256-bit key
_MAX_REQUEST_BYTES = (1 << 32) * 64  # the 32-bit block counter of one nonce
_MASK_53 = (1 << 53) - 1
_MASK_63 = (1 << 63) - 1
_MASK_24 = (1 << 24) - 1
# `uniform`'s values are (k + _HALF)·_ULP_53, k < 2⁵³ (exact in float64). A Gaussian pair's radius uniform is
# (k + _HALF)·_ULP_63, k < 2⁶³ (exact where it matters, near 0; rounded to float64 elsewhere): ten more bits than a
# float64 mantissa push the largest radius from 8.65 to 9.42 std and its tail mass from 2⁻⁵⁴ to 2⁻⁶⁴.
_HALF, _ULP_53, _ULP_63 = 0.5, 2.0**-53, 2.0**-63
# Bytes per pair of Gaussians: 8 for the radius uniform (63 bits used), 4 for the angle (24 bits used).
PAIR_BYTES = 12
# Pairs per chunk of the Gaussian sampler: the fastest on a 2-core CPU; with the device keystream, whose kernels cost
# per call rather than per byte, larger.
HOST_CHUNK_PAIRS, DEVICE_CHUNK_PAIRS = 1 << 18, 1 << 22

#: A pair's largest radius in standard deviations, √(−2 ln u) at the smallest radius uniform u = 2⁻⁶⁴: ≈ 9.419.
#: No draw exceeds it: every pair lies in a disc of this radius around its mean.
Z_MAX = math.sqrt(-2.0 * math.log(_HALF * _ULP_63))
#: The Gaussian's mass beyond that radius, per pair: e^(−Z_MAX²/2) = 2⁻⁶⁴, what the sampler never draws.
DISC_MISS = _HALF * _ULP_63
#: The most coordinates one release (one `GaussianNoise.add_`) may noise: `tail_mass` assumes it by default.
MAX_RELEASE_COORDINATES = 1 << 32
# d/da of the mass a pair shifted by a std puts outside the disc, at a = 0: the disc's boundary density times 2.
_CRESCENT_SLOPE = Z_MAX * DISC_MISS / math.pi


@functools.lru_cache(maxsize=8)
def _zeros(size: int) -> bytes:
    return bytes(size)


def _test_key(test_seed: int) -> bytes:
    return hashlib.sha256(b"hf_private insecure test seed\0" + str(int(test_seed)).encode()).digest()


# Insecure test mode: every stream of a run's randomness gets a key of its own from the one test seed, so no two
# streams replay each other. The offsets are arbitrary; they are kept as they were when they were gathered here, so
# the pinned numbers of tests/project/test_pinned_numbers.py still hold.
TEST_STREAMS = {
    "training noise": 0,
    "training sampling": 7919,
    "forward noise": 104729,
    "method noise": 15485863,
    "method sampling": 32460762,
    "rgp carriers": 49979687,
    "user cap": 67867967,
    "clip count": 86028121,
    "band partitions": 122949823,
}


def test_stream_seed(test_seed: int | None, stream: str) -> int | None:
    """The test seed of one stream (`TEST_STREAMS`) of a run keyed by `test_seed`; None (a secret key) when None."""
    return None if test_seed is None else test_seed + TEST_STREAMS[stream]


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
        self._children = 0
        self._lock = threading.Lock()
        self._device_keys: dict[torch.device, torch.Tensor] = {}
        self.insecure = test_seed is not None

    def __repr__(self) -> str:  # never show the key
        return f"SecretRandom(stream={self._stream}, requests={self._requests}, insecure={self.insecure})"

    def __getstate__(self):
        raise TypeError("SecretRandom holds a secret key and must not be pickled or saved.")

    def substream(self, stream: int) -> SecretRandom:
        """An independent stream with its own key, e.g. one per worker thread; `stream` is only its label.

        The child key is HMAC-SHA256(this key, child index ‖ stream), the index counting this object's substreams
        under its lock: two calls, even with the same id or this stream's own id, never get the same key, so no
        child repeats a keystream block of this stream or of another child. In test-seed mode the children are
        reproducible for the same sequence of calls, and as insecure as their parent.
        """
        if not 0 <= stream < 1 << 32:
            raise ValueError(f"stream must be a 32-bit id, got {stream}.")
        with self._lock:
            index = self._children
            self._children += 1
        label = b"hf_private substream\0" + index.to_bytes(8, "little") + stream.to_bytes(4, "little")
        child = SecretRandom(stream=stream, key=hmac.digest(self._key, label, "sha256"))
        child.insecure = self.insecure
        return child

    def _nonce(self, size: int) -> bytes:
        """The 96-bit nonce of a new request of `size` bytes: never given twice."""
        if size > _MAX_REQUEST_BYTES:
            raise ValueError(f"One request may draw at most {_MAX_REQUEST_BYTES} bytes, got {size}.")
        with self._lock:
            request = self._requests
            self._requests += 1
        return self._nonce_of(request)

    def _nonce_of(self, request: int) -> bytes:
        return request.to_bytes(8, "little") + self._stream.to_bytes(4, "little")

    def reserve_requests(self, count: int) -> int:
        """Take `count` consecutive request numbers at once and return the first; `fill_at_` reads their keystream.

        For a release split across processes (FSDP2 shards): every process reserves the requests of the whole
        release, as one process drawing it all would, so the request counters stay in step and each coordinate's
        noise comes from the same request and bytes whatever the number of processes.
        """
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}.")
        with self._lock:
            first = self._requests
            self._requests += count
        return first

    def fill_at_(self, buffer: bytearray | memoryview, request: int, offset: int) -> None:
        """Overwrite `buffer` with the keystream of a reserved `request` from byte `offset` on (ChaCha20's block
        counter seeked to offset // 64): the bytes a `fill_` of that request would put there.

        Only requests already taken (`reserve_requests`) can be read: a fresh nonce is only ever given by the
        counter. The caller reads each byte range of a request at most once (each coordinate has one owner).
        """
        size = memoryview(buffer).nbytes
        if not 0 <= request < self._requests:
            raise ValueError(f"Request {request} was not reserved (this stream has taken {self._requests}).")
        if offset < 0 or offset + size > _MAX_REQUEST_BYTES:
            raise ValueError(f"Bytes [{offset}, {offset + size}) lie outside one request's {_MAX_REQUEST_BYTES}.")
        block, skip = divmod(offset, 64)
        counter = block.to_bytes(4, "little")
        encryptor = Cipher(algorithms.ChaCha20(self._key, counter + self._nonce_of(request)), mode=None).encryptor()
        if skip == 0:  # straight into the buffer, as `fill_` does (regenerated noise reads whole requests)
            encryptor.update_into(_zeros(size), buffer)
            return
        memoryview(buffer).cast("B")[:] = encryptor.update(bytes(skip + size))[skip:]

    def fill_(self, buffer: bytearray | memoryview) -> None:
        """Overwrite `buffer` with fresh keystream bytes (one request, one nonce)."""
        size = memoryview(buffer).nbytes
        # cryptography's 16-byte ChaCha20 nonce: 4-byte little-endian block counter, then the 96-bit nonce.
        encryptor = Cipher(algorithms.ChaCha20(self._key, b"\0\0\0\0" + self._nonce(size)), mode=None).encryptor()
        encryptor.update_into(_zeros(size), buffer)  # keystream XOR zeros = keystream

    def device_keystream(self, size: int, function: device_chacha.BlockFunction, device: torch.device) -> torch.Tensor:
        """`size` fresh keystream bytes (one request, one nonce) made on `device` by `function` (see
        `device_chacha.block_function`): the bytes `fill_` gives for the same request, as a uint8 tensor there.

        The key goes to the device as an argument of the block function, kept here (one copy per device) and never
        elsewhere.
        """
        nonce = device_chacha.words(self._nonce(size), device)
        key = self._device_keys.get(device)
        if key is None:
            key = self._device_keys[device] = device_chacha.words(self._key, device)
        return device_chacha.keystream(function, key, nonce, size)

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
        return bits.bitwise_and(_MASK_53).double().add_(_HALF).mul_(_ULP_53)

    def normal(self, count: int, std: float = 1.0) -> torch.Tensor:
        """`count` float32 draws of N(0, std²) (a fresh tensor; `GaussianSampler` reuses buffers for bulk noise)."""
        sampler = GaussianSampler(self, max(1, math.ceil(count / 2)))
        out = torch.empty(count, dtype=torch.float32)
        sampler.add_(out.zero_(), std)
        return out


class BoxMuller:
    """The arithmetic from keystream bytes to Gaussian pairs, in reused buffers of up to `pairs` pairs.

    Shared by `GaussianSampler` and the sharded sampler (`sharded_noise`), so that a coordinate drawn by a shard's
    owner is bit for bit the value one process drawing the whole tensor gives it: every step is elementwise.
    """

    def __init__(self, pairs: int, device: torch.device) -> None:
        self._bits63 = torch.empty(pairs, dtype=torch.int64, device=device)
        self._bits24 = torch.empty(pairs, dtype=torch.int32, device=device)
        self._radius64 = torch.empty(pairs, dtype=torch.float64, device=device)
        self._radius = torch.empty(pairs, dtype=torch.float32, device=device)
        self._angle = torch.empty(pairs, dtype=torch.float32, device=device)

    def normals_(
        self, radius_bytes: torch.Tensor, angle_bytes: torch.Tensor, std: float, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        """Pair k's two N(0, std²) draws into cos[k] and sin[k], from its 8 radius bytes and 4 angle bytes (uint8)."""
        pairs = cos.numel()
        radius_bits = radius_bytes.view(torch.int64)
        angle_bits = angle_bytes.view(torch.int32)
        bits63, bits24 = self._bits63[:pairs], self._bits24[:pairs]
        radius64, radius, angle = self._radius64[:pairs], self._radius[:pairs], self._angle[:pairs]
        torch.bitwise_and(radius_bits, _MASK_63, out=bits63)
        # −2 ln u in float64 (u's 63 bits matter near 0, where the tail is), then a float32 square root and scale:
        # −2 ln u (0, or 2⁻⁵² to 177.4) needs no float64 range or precision for a float32 root, 3× cheaper.
        radius64.copy_(bits63).add_(_HALF).mul_(_ULP_63).log_().mul_(-2.0)
        radius.copy_(radius64).sqrt_().mul_(std)
        torch.bitwise_and(angle_bits, _MASK_24, out=bits24)
        torch.mul(bits24, 2 * math.pi / (1 << 24), out=angle)  # uniform on a 2^24-point grid
        torch.cos(angle, out=cos).mul_(radius)
        torch.sin(angle, out=sin).mul_(radius)


class GaussianSampler:
    """Box-Muller on keystream bytes into reused buffers: adds N(0, std²) to float32 tensors in chunks.

    Each pair of draws takes 63 bits for the radius and 24 for the angle: r = std·√(−2 ln u₁), the logarithm in
    float64 and the rest in float32, then r·cos θ and r·sin θ in float32. The radius never exceeds `Z_MAX` ≈ 9.419
    std (up to float32 rounding; the Gaussian's mass beyond it is 2⁻⁶⁴ per pair), so a neighbour's output shifted by
    the sensitivity can land where this one's cannot: up to 1.3e-13 per release at σ = 0.5, 4.5e-12 at σ = 0.4,
    9.9e-10 at σ = 0.3 with the shift on one pair, plus up to 1.1e-14/σ with it spread over 2³² coordinates
    (`tail_mass`, which the accountants add to δ). With 53 radius bits, as a float64 mantissa would give, Z_MAX was
    8.65 and these figures 240-1000× larger.
    The work per value is fixed — no rejection loop — so its time does not depend on anything private.
    """

    def __init__(
        self,
        random: SecretRandom,
        pairs_per_chunk: int | None = None,
        device: torch.device | str = "cpu",
        keystream: str | None = None,
    ):
        """`keystream`: where the keystream is made. "host": by `random.fill_` on the CPU, copied to an accelerator;
        "device": by ChaCha20 in tensor ops on the device itself (`device_chacha`), compiled on CUDA. By default
        "device" on CUDA if its compiled kernel reproduces RFC 8439 there, else "host". Either gives the same bytes
        for the same requests. `pairs_per_chunk`: `HOST_CHUNK_PAIRS` or `DEVICE_CHUNK_PAIRS` by default."""
        self.random = random
        self.device = torch.device(device)
        self._block_function = self._device_block_function(keystream)
        self.pairs = pairs_per_chunk or (DEVICE_CHUNK_PAIRS if self._block_function is not None else HOST_CHUNK_PAIRS)
        # With the host keystream on CUDA it goes into two pinned host buffers in turn, each copied to the device
        # asynchronously: the next chunk's keystream is drawn while this one's copy runs, and a buffer is refilled only
        # after its copy has finished (its event). Elsewhere one pageable buffer, copied (on CPU, viewed) synchronously.
        pinned = self.device.type == "cuda" and self._block_function is None
        turns = 2 if pinned else 1
        host_bytes = 0 if self._block_function is not None else PAIR_BYTES * self.pairs
        self._hosts = [torch.empty(host_bytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(turns)]
        self._copied: list[torch.cuda.Event | None] = [None] * turns
        self._turn = 0
        # The device buffer the pinned host buffers are copied into; None where the host buffer is pageable.
        self._raw = torch.empty(PAIR_BYTES * self.pairs, dtype=torch.uint8, device=self.device) if pinned else None
        self._box_muller = BoxMuller(self.pairs, self.device)
        self._values = torch.empty(2 * self.pairs, dtype=torch.float32, device=self.device)

    def _chunk(self, std: float, pairs: int) -> torch.Tensor:
        """2·pairs fresh N(0, std²) values, pairs ≤ self.pairs (a view of a reused buffer).

        Only the keystream for `pairs` is drawn: a small tensor must not pay for a whole chunk.
        """
        raw = self._keystream(PAIR_BYTES * pairs)  # one request: radius bits, angle bits
        values = self._values[: 2 * pairs]
        self._box_muller.normals_(raw[: 8 * pairs], raw[8 * pairs :], std, values[:pairs], values[pairs:])
        return values

    @property
    def keystream(self) -> str:
        """Where this sampler's keystream is made: "host" or "device"."""
        return "host" if self._block_function is None else "device"

    def _device_block_function(self, keystream: str | None) -> device_chacha.BlockFunction | None:
        """The checked block function for the device keystream, or None for the host keystream."""
        if keystream not in (None, "host", "device"):
            raise ValueError(f'keystream must be "host", "device" or None, got {keystream!r}.')
        if keystream == "host" or (keystream is None and self.device.type != "cuda"):
            return None
        function = device_chacha.block_function(self.device, compile=self.device.type == "cuda")
        if function is None and keystream == "device":
            raise RuntimeError(f"The device keystream cannot be used on {self.device} (the warning above says why).")
        if function is None:
            logger.warning("The noise keystream is made on the CPU and copied to %s.", self.device)
        return function

    def _keystream(self, size: int) -> torch.Tensor:
        """`size` fresh keystream bytes (one request) as a uint8 tensor on the device."""
        if self._block_function is not None:
            return self.random.device_keystream(size, self._block_function, self.device)
        if self._raw is None:  # one pageable host buffer
            host = self._hosts[0][:size]
            self.random.fill_(host.numpy().data)
            return host.to(self.device, non_blocking=True)  # a view on CPU; from pageable memory a synchronous copy
        turn, self._turn = self._turn, 1 - self._turn
        previous_copy = self._copied[turn]
        if previous_copy is not None:
            previous_copy.synchronize()  # this buffer's previous copy has left it
        host = self._hosts[turn][:size]
        self.random.fill_(host.numpy().data)
        raw = self._raw[:size]
        raw.copy_(host, non_blocking=True)  # queued on the current stream, before this chunk's transform
        copied = self._copied[turn] = torch.cuda.Event()
        copied.record()
        return raw

    def add_(self, tensor: torch.Tensor, std: float) -> None:
        """tensor += N(0, std²) elementwise, in place; `tensor` must be contiguous."""
        self._apply(tensor, std, torch.Tensor.add_)

    def draw_(self, tensor: torch.Tensor, std: float) -> None:
        """Overwrite `tensor` with N(0, std²) draws: the values `add_` would add with the same requests."""
        self._apply(tensor, std, torch.Tensor.copy_)

    def _apply(self, tensor: torch.Tensor, std: float, combine: Callable[[torch.Tensor, torch.Tensor], object]) -> None:
        flat = tensor.view(-1)
        step = 2 * self.pairs
        for start in range(0, flat.numel(), step):
            part = flat[start : start + step]
            combine(part, self._chunk(std, (part.numel() + 1) // 2)[: part.numel()])


@functools.lru_cache(maxsize=1024)
def tail_mass(noise_multiplier: float, coordinates: int = MAX_RELEASE_COORDINATES) -> float:
    """Per release, a bound on the probability that a neighbouring dataset's output falls where this dataset's has
    no support: what the sampler's finite tail adds to δ. σ = `noise_multiplier`, in units of the sensitivity C.

    Every pair of draws lies in a disc of radius `Z_MAX` around its mean. A neighbour moves the mean by at most C,
    i.e. by shifts a_j (std) on the pairs with Σ a_j² ≤ 1/σ², and puts mass at most Σ_j f(a_j) outside the discs,
    f(a) = P(‖Z + a‖ > Z_MAX) for a standard 2-D Gaussian Z (a non-central χ² tail). Two worst cases, added:

    * the whole shift on one pair: f(1/σ), 1.3e-13 at σ = 0.5, 1.8e-15 at σ = 0.7, 4.5e-12 at σ = 0.4, 9.9e-10
      at σ = 0.3. The one-coordinate figure P(N(0, 1) > Z_MAX − 1/σ) (5.9e-14, 6.7e-16, 2.3e-12, 5.8e-10)
      undercounts it 1.7-2.7×: the disc is smaller than the square |z| ≤ Z_MAX.
    * the shift spread thin over m pairs: each adds a crescent of mass ≈ c·a_j, c = Z_MAX·2⁻⁶⁴/π ≈ 1.6e-19, in
      all up to c·√m/σ with m ≤ `coordinates`: 1.1e-14/σ at 2³² (the most a release may noise, which
      `GaussianNoise` enforces), 1.6e-15/σ at 10⁸.

    Σ_j f(a_j) ≤ f(1/σ) + c·√m/σ because (f(a) − c·a)/a² is non-decreasing (checked numerically in the tests for
    shifts up to 8 std, i.e. σ ≥ 0.125; plans refuse far larger σ long before).

    Why δ covers it (a sketch, not a proof): both datasets' truncated densities are the Gaussian's restricted to
    the discs with one normaliser Z (the discs' mass), so for each sampled batch the two outputs compare as the
    Gaussian's do on the common support, and joint convexity carries that to the Poisson mixture; what falls
    outside has mass at most this bound (Poisson sampling lowers it by q: not claimed). Over k releases the union
    bound adds k times it to δ, and the restriction multiplies the accountant's δ by at most Z^(−k), with
    Z ≥ (1 − 2⁻⁶⁴)^coordinates: `accountants.sampler_tail_delta` takes both out of δ. Floating point is not
    covered: the outputs are float32 values from a 2²⁴-point angle grid, finite sets whose supports differ
    between neighbours (Mironov 2012), as in every DP-SGD library.
    """
    if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
        raise ValueError(f"noise_multiplier must be finite and > 0, got {noise_multiplier}.")
    if int(coordinates) != coordinates or coordinates < 1:
        raise ValueError(f"coordinates must be a positive integer, got {coordinates}.")
    shift = 1.0 / noise_multiplier
    one_pair = float(stats.ncx2.sf(Z_MAX**2, 2, shift**2))
    return min(1.0, one_pair + _CRESCENT_SLOPE * math.sqrt(coordinates) * shift)
