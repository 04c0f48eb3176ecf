"""The device keystream: ChaCha20 in tensor ops, checked against RFC 8439 and against the host (OpenSSL) stream.

No accelerator here: the block function runs op by op on the CPU, the path an accelerator takes with its ops fused
by `torch.compile` (which `block_function` checks against RFC 8439 on the device before any use).
"""

from __future__ import annotations

import logging

import pytest
import torch

from hf_private.privacy import GaussianNoise, device_chacha
from hf_private.privacy.rng import GaussianSampler, SecretRandom
from tests.privacy.test_secret_random import _chacha20_block

CPU = torch.device("cpu")


def _block(key: bytes, nonce: bytes, counter: int, blocks: int = 1) -> bytes:
    function = device_chacha.block_words
    stream = device_chacha.keystream(
        function, device_chacha.words(key), device_chacha.words(nonce), 64 * blocks, counter
    )
    return stream.numpy().tobytes()


def test_the_block_function_gives_rfc8439s_test_vectors():
    # §2.3.2: the block function's serialized output for key 00..1f, nonce 00:00:00:09:00:00:00:4a:00:00:00:00,
    # block count 1.
    assert _block(bytes(range(32)), bytes.fromhex("000000090000004a00000000"), 1).hex() == (
        "10f1e7e4d13b5915500fdd1fa32071c4c7d1f4c733c068030422aa9ac3d46c4e"
        "d2826446079faa0914c2d705d98b02a2b5129cd1de164eb9cbd083e8a2503c4e"
    )
    # Appendix A.1, test vector #1: all-zero key and nonce, block count 0.
    assert _block(bytes(32), bytes(12), 0).hex() == (
        "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
        "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586"
    )
    # §2.4.2 (the sunscreen text, two blocks from count 1): the check every device's block function must pass.
    assert device_chacha.block_function(CPU, compile=False) is device_chacha.block_words


def test_the_block_function_equals_the_specification_over_many_blocks_and_counters():
    key, nonce = bytes(range(100, 132)), bytes(range(12))
    got = _block(key, nonce, 2**32 - 3, blocks=3)  # the highest block counters a request may reach
    assert got == b"".join(_chacha20_block(key, counter, nonce) for counter in range(2**32 - 3, 2**32))


def test_the_device_keystream_is_the_host_stream_request_for_request():
    key = bytes(range(7, 39))
    host, device = SecretRandom(key=key, stream=3), SecretRandom(key=key, stream=3)
    for size in (1, 63, 64, 65, 130, 12_007):
        expected = host.random_bytes(size)
        got = device.device_keystream(size, device_chacha.block_words, CPU)
        assert got.dtype == torch.uint8 and got.numel() == size
        assert got.numpy().tobytes() == expected
    assert device._requests == host._requests == 6  # each request took a nonce of its own, as fill_ does


def test_host_and_device_requests_share_one_counter():
    random = SecretRandom(key=bytes(32))
    drawn = [
        random.random_bytes(64),
        random.device_keystream(64, device_chacha.block_words, CPU).numpy().tobytes(),
        random.random_bytes(64),
    ]
    reference = SecretRandom(key=bytes(32))
    assert drawn == [reference.random_bytes(64) for _ in range(3)] and len(set(drawn)) == 3


def _device_blocks(random: SecretRandom, requests: int = 6) -> list[bytes]:
    """The 64-byte keystream blocks of device requests of three blocks each, a host request between every two."""
    blocks = []
    for _ in range(requests):
        drawn = random.device_keystream(3 * 64, device_chacha.block_words, CPU).numpy().tobytes()
        drawn += random.random_bytes(3 * 64)
        blocks += [drawn[i : i + 64] for i in range(0, len(drawn), 64)]
    return blocks


def test_two_device_requests_never_share_a_nonce_or_keystream():
    parent = SecretRandom(key=bytes(range(32)), stream=2)
    blocks = _device_blocks(parent) + _device_blocks(parent.substream(2))
    assert len(set(blocks)) == len(blocks) == 2 * 6 * 6


def test_mutation_a_nonce_reused_across_device_requests_repeats_keystream(monkeypatch):
    monkeypatch.setattr(SecretRandom, "_nonce", lambda self, size: bytes(12))
    blocks = _device_blocks(SecretRandom(key=bytes(range(32))))
    assert len(set(blocks)) == 3  # every request, device or host, gives the same three blocks


@pytest.mark.parametrize("size", [1, 3, 1000, 200_001])
def test_noise_from_the_device_keystream_equals_the_host_noise_bit_for_bit(size):
    host, device = torch.zeros(size), torch.zeros(size)
    pairs = 1 << 16  # the same chunks, so the same requests
    GaussianSampler(SecretRandom(test_seed=5), pairs, keystream="host").add_(host, 0.7)
    sampler = GaussianSampler(SecretRandom(test_seed=5), pairs, keystream="device")
    sampler.add_(device, 0.7)
    assert sampler.keystream == "device" and torch.equal(host, device) and host.abs().max() > 0


def test_a_device_takes_the_device_keystream_only_where_asked_or_on_cuda():
    assert GaussianSampler(SecretRandom(test_seed=1)).keystream == "host"  # a CPU: OpenSSL's is far faster
    assert GaussianSampler(SecretRandom(test_seed=1), device="meta").keystream == "host"
    assert GaussianSampler(SecretRandom(test_seed=1), keystream="device").pairs == 1 << 22
    with pytest.raises(ValueError, match="keystream must be"):
        GaussianSampler(SecretRandom(test_seed=1), keystream="gpu")


@pytest.fixture
def fresh_block_functions():
    device_chacha.block_function.cache_clear()
    yield
    device_chacha.block_function.cache_clear()


def test_mutation_a_block_function_off_the_test_vector_is_never_used(monkeypatch, caplog, fresh_block_functions):
    rotate = device_chacha._rotate_left  # a broken cipher: the first rotation of every quarter round by 15, not 16
    monkeypatch.setattr(device_chacha, "_rotate_left", lambda x, bits: rotate(x, 15 if bits == 16 else bits))
    with caplog.at_level(logging.WARNING, logger="hf_private"):
        assert device_chacha.block_function(CPU, compile=False) is None
    assert "does not reproduce RFC 8439" in caplog.text
    with pytest.raises(RuntimeError, match="device keystream cannot be used"):
        GaussianSampler(SecretRandom(test_seed=1), keystream="device")


def test_a_compiler_that_fails_leaves_the_device_keystream_unused(monkeypatch, caplog, fresh_block_functions):
    def failing_compile(function, **options):
        def run(*args):
            raise RuntimeError("no compiler toolchain")

        return run

    monkeypatch.setattr(torch, "compile", failing_compile)
    with caplog.at_level(logging.WARNING, logger="hf_private"):
        assert device_chacha.block_function(CPU, compile=True) is None
    assert "cannot run on cpu (RuntimeError: no compiler toolchain)" in caplog.text


def test_noise_drawn_ahead_from_the_device_keystream_equals_the_host_noise():
    # The accelerator's path as a whole: drawn ahead in a background thread, from the device keystream.
    sizes, std = [1000, 3, 600_001], 0.7
    released = []
    for keystream in ("host", "device"):
        noise = GaussianNoise("cpu", test_seed=21, ahead=True)
        noise.sampler = GaussianSampler(noise.random, 1 << 18, keystream=keystream)
        tensors = [torch.zeros(size) for size in sizes]
        noise.prepare(sizes, std)
        noise.add_(tensors, std)
        assert noise._used == 1  # the draw made ahead was the one added
        released.append(torch.cat(tensors))
    assert torch.equal(*released) and released[0].std() > 0.5
