"""The secret random stream behind noise and sampling: strength of the key, quality of the draws.

The key-strength check is a predicate run on two generators: ours, and the torch generator the library used
before (seeded with 64 OS bits, of which mt19937 keeps 32). The predicate must reject the old one, or it
proves nothing.
"""

from __future__ import annotations

import logging
import pickle
import struct

import pytest
import torch
from scipy import stats

from hf_private.privacy import GaussianNoise, SecretRandom
from hf_private.privacy.rng import KEY_BYTES

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
    state = [0x61707865, 0x3320646E, 0x79622D32, 0x6B206574, *struct.unpack("<8I", key), counter,
             *struct.unpack("<3I", nonce)]
    x = list(state)
    for _ in range(10):
        for a, b, c, d in ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15),
                           (0, 5, 10, 15), (1, 6, 11, 12), (2, 7, 8, 13), (3, 4, 9, 14)):
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
    noise = GaussianNoise("cpu", test_seed=99)
    parts = [torch.zeros(count // 4), torch.zeros(count - count // 4)]  # two tensors, one not a chunk multiple
    noise.add_(parts, std)
    return torch.cat(parts).double()


def _gaussian_verdict(values: torch.Tensor, std: float) -> dict[str, bool]:
    n = values.numel()
    z = (values / std).numpy()
    variance = float((values**2).mean())
    tail = float((values.abs() > 4 * std).double().mean())
    tail_expected = 2 * stats.norm.sf(4)
    return {
        "ks": stats.kstest(z, "norm").pvalue > ALPHA,
        "variance": abs(variance / std**2 - 1) < 6 * (2 / n) ** 0.5,
        "mean": abs(float(values.mean()) / std) < 6 / n**0.5,
        "tail": abs(tail - tail_expected) < 6 * (tail_expected / n) ** 0.5,
        "pairs uncorrelated": abs(stats.pearsonr(z[0 : 1 << 16], z[1 << 16 : 1 << 17])[0]) < 6 / (1 << 16) ** 0.5,
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
