"""The secret random stream behind noise and sampling: strength of the key, quality of the draws.

The key-strength check is a predicate run on two generators: ours, and the torch generator the library used
before (seeded with 64 OS bits, of which mt19937 keeps 32). The predicate must reject the old one, or it
proves nothing.
"""

from __future__ import annotations

import logging
import math
import pickle
import struct

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from hf_private.privacy import GaussianNoise, GaussianSampler, SecretRandom
from hf_private.privacy.rng import KEY_BYTES, MAX_RELEASE_COORDINATES, Z_MAX, tail_mass

# ---------------------------------------------------------------- ChaCha20 as RFC 8439 specifies it
_MASK32 = 0xFFFFFFFF


def _quarter_round(x: list[int], a: int, b: int, c: int, d: int) -> None:
    def rotl(v: int, n: int) -> int:
        return ((v << n) & _MASK32) | (v >> (32 - n))

    x[a] = (x[a] + x[b]) & _MASK32
    x[d] = rotl(x[d] ^ x[a], 16)
    x[c] = (x[c] + x[d]) & _MASK32
    x[b] = rotl(x[b] ^ x[c], 12)
    x[a] = (x[a] + x[b]) & _MASK32
    x[d] = rotl(x[d] ^ x[a], 8)
    x[c] = (x[c] + x[d]) & _MASK32
    x[b] = rotl(x[b] ^ x[c], 7)


def _chacha20_block(key: bytes, counter: int, nonce: bytes) -> bytes:
    """RFC 8439 §2.3, written from the specification: the reference the library's stream must equal."""
    state = [
        0x61707865,
        0x3320646E,
        0x79622D32,
        0x6B206574,
        *struct.unpack("<8I", key),
        counter,
        *struct.unpack("<3I", nonce),
    ]
    x = list(state)
    for _ in range(10):
        for a, b, c, d in (
            (0, 4, 8, 12),
            (1, 5, 9, 13),
            (2, 6, 10, 14),
            (3, 7, 11, 15),
            (0, 5, 10, 15),
            (1, 6, 11, 12),
            (2, 7, 8, 13),
            (3, 4, 9, 14),
        ):
            _quarter_round(x, a, b, c, d)
    return struct.pack("<16I", *[(x[i] + state[i]) & _MASK32 for i in range(16)])


def test_reference_block_matches_rfc8439_vector():
    block = _chacha20_block(bytes(range(32)), 1, bytes.fromhex("000000090000004a00000000"))
    assert block[:16].hex() == "10f1e7e4d13b5915500fdd1fa32071c4"  # RFC 8439 §2.3.2


def test_stream_is_chacha20_with_one_nonce_per_request():
    key = bytes(range(100, 132))
    random = SecretRandom(key=key, stream=7)
    for request in range(3):
        drawn = random.random_bytes(130)  # three blocks: the block counter runs within a request
        nonce = request.to_bytes(8, "little") + (7).to_bytes(4, "little")
        expected = b"".join(_chacha20_block(key, counter, nonce) for counter in range(3))[:130]
        assert drawn == expected


# ---------------------------------------------------------------- key strength
def _differs_in_high_key_bits(draw_with_key) -> bool:
    """Two 256-bit keys that agree on their low 64 bits: their draws must differ."""
    low = bytes(range(8))
    first = draw_with_key(low + bytes(KEY_BYTES - 8))
    second = draw_with_key(low + bytes(KEY_BYTES - 9) + b"\x01")
    return not torch.equal(first, second)


def _ours(key: bytes) -> torch.Tensor:
    return SecretRandom(key=key).normal(64)


def test_keys_differing_only_in_high_bits_draw_differently():
    assert _differs_in_high_key_bits(_ours)
    assert _differs_in_high_key_bits(lambda key: SecretRandom(key=key).uniform(64))


def test_mutation_torch_generator_fails_the_key_strength_check():
    assert not _differs_in_high_key_bits(
        lambda key: torch.randn(64, generator=torch.Generator().manual_seed(int.from_bytes(key[:8], "little")))
    ), "torch's mt19937 should ignore seed bits above 32; if this changed, revisit the check"
    high_bits_only = [torch.randn(8, generator=torch.Generator().manual_seed(5 + (k << 32))) for k in range(3)]
    assert all(torch.equal(high_bits_only[0], other) for other in high_bits_only[1:])


def test_key_comes_from_os_entropy_not_torch_or_args_seed():
    torch.manual_seed(0)
    state = torch.get_rng_state()
    first = SecretRandom().normal(32)
    torch.manual_seed(0)
    second = SecretRandom().normal(32)
    assert not torch.equal(first, second), "two fresh streams after the same torch.manual_seed drew alike"
    torch.manual_seed(0)
    SecretRandom().uniform(1000)
    GaussianNoise("cpu").add_([torch.zeros(1000)], 1.0)
    assert torch.equal(torch.get_rng_state(), state), "drawing secret noise consumed torch's global generator"


def test_key_is_never_pickled_or_shown():
    random = SecretRandom()
    with pytest.raises(TypeError, match="secret key"):
        pickle.dumps(random)
    assert random._key.hex() not in repr(random)


def test_requests_and_streams_never_repeat():
    random = SecretRandom(key=bytes(32))
    assert random.random_bytes(64) != random.random_bytes(64)
    assert SecretRandom(key=bytes(32)).random_bytes(64) != random.substream(1).random_bytes(64)


def _blocks(random: SecretRandom, requests: int = 4) -> set[bytes]:
    """The 64-byte keystream blocks of a few requests of three blocks each."""
    drawn = [random.random_bytes(3 * 64) for _ in range(requests)]
    return {data[i : i + 64] for data in drawn for i in range(0, len(data), 64)}


def test_substreams_never_reuse_keystream():
    parent = SecretRandom(key=bytes(range(32)), stream=5)
    streams = [parent, parent.substream(5), parent.substream(1), parent.substream(1), parent.substream(0)]
    streams.append(streams[2].substream(1))  # a grandchild, under the child's own id
    seen: set[bytes] = set()
    for random in streams:
        blocks = _blocks(random)
        assert len(blocks) == 12 and not blocks & seen, f"{random} repeats keystream"
        seen |= blocks


def test_substreams_of_a_test_seed_are_reproducible_and_insecure():
    def children(seed: int) -> list[bytes]:
        parent = SecretRandom(test_seed=seed)
        return [parent.substream(stream).random_bytes(64) for stream in (1, 1, 2)]

    assert children(7) == children(7) and children(7) != children(8)
    assert SecretRandom(test_seed=7).substream(1).insecure and not SecretRandom().substream(1).insecure
    child = SecretRandom().substream(3)
    assert child._key.hex() not in repr(child)
    with pytest.raises(TypeError, match="secret key"):
        pickle.dumps(child)
    with pytest.raises(ValueError, match="32-bit"):
        child.substream(1 << 32)


def test_test_seed_is_reproducible_and_warns(caplog):
    from hf_private.privacy.rng import _warn_test_seed

    _warn_test_seed.cache_clear()  # it warns once per process: an earlier test may have warned already
    with caplog.at_level(logging.WARNING, logger="transformers.hf_private.privacy.rng"):
        first = SecretRandom(test_seed=1234).normal(16)
        second = SecretRandom(test_seed=1234).normal(16)
    assert torch.equal(first, second)
    assert not torch.equal(first, SecretRandom(test_seed=1235).normal(16))
    assert "reproducible" in caplog.text and "void" in caplog.text


# ---------------------------------------------------------------- quality of the draws
ALPHA = 1e-6  # fixed keys make these deterministic; the level only guards against a wrong transform


def _noise(count: int, std: float) -> torch.Tensor:
    noise = GaussianNoise("cpu", test_seed=99, ahead=True)
    parts = [torch.zeros(count // 4), torch.zeros(count - count // 4)]  # two tensors, one not a chunk multiple
    noise.prepare([part.numel() for part in parts], std)  # drawn ahead, as training noise is (test_noise_ahead.py)
    noise.add_(parts, std)
    return torch.cat(parts).double()


def _gaussian_verdict(values: torch.Tensor, std: float) -> dict[str, bool]:
    n = values.numel()
    z = (values / std).numpy()
    pairs = GaussianSampler(SecretRandom(key=bytes(KEY_BYTES))).pairs
    variance = float((values**2).mean())
    tail = float((values.abs() > 4 * std).double().mean())
    tail_expected = 2 * stats.norm.sf(4)
    return {
        "ks": stats.kstest(z, "norm").pvalue > ALPHA,
        "variance": abs(variance / std**2 - 1) < 6 * (2 / n) ** 0.5,
        "mean": abs(float(values.mean()) / std) < 6 / n**0.5,
        "tail": abs(tail - tail_expected) < 6 * (tail_expected / n) ** 0.5,
        # a chunk's values are its pairs' cosines, then their sines: the two halves of the first chunk
        "pairs uncorrelated": abs(stats.pearsonr(z[:pairs], z[pairs : 2 * pairs])[0]) < 6 / pairs**0.5,
    }


def test_gaussian_draws_pass_normality_variance_and_tail_checks():
    std = 0.7
    verdict = _gaussian_verdict(_noise(1 << 21, std), std)
    assert all(verdict.values()), verdict


def test_mutation_wrong_noise_fails_the_normality_checks():
    std = 0.7
    good = _noise(1 << 21, std)
    assert not all(_gaussian_verdict(good * 1.01, std).values())  # 1% too much noise: variance
    uniform = (torch.rand(1 << 21, dtype=torch.float64) - 0.5) * std * 12**0.5  # right variance, wrong shape
    assert not _gaussian_verdict(uniform, std)["ks"]
    truncated = good.clamp(-3 * std, 3 * std)
    assert not all(_gaussian_verdict(truncated, std).values())


def test_uniforms_are_float64_inside_the_unit_interval_on_a_fine_grid():
    u = SecretRandom(key=bytes(range(32))).uniform(1 << 20)
    assert u.dtype == torch.float64 and 0 < u.min() and u.max() < 1
    assert stats.kstest(u.numpy(), "uniform").pvalue > ALPHA
    off_float32_grid = ((u * 2**24) % 1 != 0).double().mean()
    assert off_float32_grid > 0.99, "uniforms on a 2^-24 grid over-include at small q"


# ---------------------------------------------------------------- the finite tail
class _ConstantBytes:
    """A stand-in stream whose every byte is `value`: it pins the radius and angle bits of every pair."""

    def __init__(self, value: int) -> None:
        self.value = value

    def fill_(self, buffer: memoryview) -> None:
        buffer[:] = bytes([self.value]) * buffer.nbytes


def test_z_max_is_the_largest_draw_the_bit_layout_allows():
    # The radius uniform is (k + ½)·2⁻⁶³ for the 63 low bits k: k = 0 gives the smallest, 2⁻⁶⁴, the largest radius.
    assert Z_MAX == math.sqrt(-2 * math.log(2.0**-64))
    extremes = torch.zeros(8)
    GaussianSampler(_ConstantBytes(0), pairs_per_chunk=4).add_(extremes, 1.0)  # angle 0: cos = 1, sin = 0
    assert extremes[0].item() == torch.tensor(Z_MAX, dtype=torch.float32).item()
    assert abs(extremes[0].item() - Z_MAX) <= 2**-24 * Z_MAX  # float32 rounding only
    smallest = torch.zeros(8)
    GaussianSampler(_ConstantBytes(0xFF), pairs_per_chunk=4).add_(smallest, 1.0)  # k = 2⁶³ − 1
    assert smallest.abs().max() < 1e-7


def _outside_disc(shift: float) -> float:
    """P(‖Z + a‖ > Z_MAX, ‖Z‖ ≤ Z_MAX) for a standard 2-D Gaussian Z, a = `shift`: the mass a pair shifted by
    `shift` std puts where the unshifted pair cannot be, by polar integration (independent of the library)."""

    def excess(theta: float) -> float:  # e^((Z_MAX² − ρ₀²)/2) − 1 where ρ₀ is the radius that just gets out
        u = math.cos(theta)
        rho = -shift * u + math.sqrt(Z_MAX**2 - shift**2 * (1 - u * u))
        return math.expm1((Z_MAX**2 - rho**2) / 2) if rho < Z_MAX else 0.0

    inside = integrate.quad(excess, 0, math.pi, epsabs=0, epsrel=1e-10, limit=400)[0]
    return 2.0**-64 / math.pi * inside


def test_tail_mass_counts_the_disc_not_the_one_coordinate_figure():
    # The review's figure for the 53-bit radius (Z_MAX 8.65), P(N(0,1) > Z_MAX − 1/σ): 1.4e-11 at σ = 0.5.
    assert stats.norm.sf(math.sqrt(-2 * math.log(2.0**-54)) - 1 / 0.5) == pytest.approx(1.4e-11, rel=0.1)
    # With 63 radius bits the one-coordinate figure is ~240× smaller...
    assert stats.norm.sf(Z_MAX - 1 / 0.5) == pytest.approx(5.9e-14, rel=0.1)
    # ...and a pair's support is a disc, which a shift leaves 1.7-2.7 times more often than that figure says.
    for sigma, one_pair in ((0.5, 1.30e-13), (0.7, 1.75e-15), (0.4, 4.46e-12), (0.3, 9.85e-10)):
        exact = _outside_disc(1 / sigma)
        assert exact == pytest.approx(one_pair, rel=5e-3) and exact > 1.6 * stats.norm.sf(Z_MAX - 1 / sigma)
        assert exact <= tail_mass(sigma, coordinates=1) <= exact * (1 + 1e-3) + 1.7e-19 / sigma
    assert tail_mass(0.5) == pytest.approx(1.51e-13, rel=0.01)  # with 2³² coordinates: + 1.07e-14/σ spread thin
    assert tail_mass(0.7) == pytest.approx(1.70e-14, rel=0.01)


def test_tail_mass_bounds_a_shift_spread_over_many_pairs():
    slope = Z_MAX * 2.0**-64 / math.pi  # d/da of the mass outside at a = 0
    assert _outside_disc(1e-6) == pytest.approx(slope * 1e-6, rel=1e-4)
    # The bound's lemma: (f(a) − c·a)/a² is non-decreasing, so the shares of a shift cost at most f(1/σ) + c·√m/σ.
    shifts = np.linspace(0.01, 8.0, 400)
    excess = [(_outside_disc(a) - slope * a) / a**2 for a in shifts]
    assert all(later >= earlier for earlier, later in zip(excess, excess[1:]))
    for sigma in (0.4, 0.7, 1.5):
        for pairs in (1, 2, 10, 10**4, 10**8, MAX_RELEASE_COORDINATES):
            spread = pairs * _outside_disc(1 / sigma / math.sqrt(pairs))  # equal shares: Σ a_j² = 1/σ²
            assert spread <= tail_mass(sigma, coordinates=pairs)
    assert 2**16 * slope / 0.7 > 0.5 * _outside_disc(1 / 0.7)  # at 2³² coordinates the thin spread matters


def test_a_release_larger_than_the_tail_accounting_assumes_is_refused():
    with pytest.raises(ValueError, match="LoRA or BiTFiT"):
        GaussianNoise("cpu").add_(
            [torch.empty(MAX_RELEASE_COORDINATES, device="meta"), torch.empty(1, device="meta")], 1.0
        )
