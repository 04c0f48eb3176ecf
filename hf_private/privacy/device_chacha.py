"""ChaCha20's block function (RFC 8439 §2.3) in torch integer ops, so the keystream is made where the noise is used.

On an accelerator a keystream made on the CPU has to be drawn there (one core, the GIL held) and copied every step:
12 bytes per pair of Gaussians, 0.66 GB for a 110M-parameter model and 2.1 GB for a 355M one, a bottleneck for
full fine-tuning however far ahead it is drawn. Here every 64-byte block is computed from the key, the nonce and its
own counter by elementwise tensor ops on the device itself; on CUDA `torch.compile` fuses them into one kernel.

The words are held in int64 and masked to 32 bits after each addition: no signed 32-bit overflow, whose wrapping
torch does not promise on every device. The key, nonce and first counter are tensors (never Python numbers), so a
compiled kernel takes them as arguments and never holds the key as a constant of its generated code.

Before a device's block function is used it must reproduce RFC 8439's §2.4.2 keystream there (`block_function`), so
a miscompiled or mis-executed kernel is never trusted with the noise.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..logs import get_logger

logger = get_logger(__name__)

BLOCK_BYTES = 64
_MASK = 0xFFFFFFFF
_SIGMA = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)  # "expand 32-byte k"
_COLUMNS = ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15))
_DIAGONALS = ((0, 5, 10, 15), (1, 6, 11, 12), (2, 7, 8, 13), (3, 4, 9, 14))

# RFC 8439 §2.4.2: key 00..1f, nonce 00:00:00:00:00:00:00:4a:00:00:00:00, initial counter 1; the keystream is the
# plaintext XOR the ciphertext (two blocks: a size of 1 would be a special case to a compiler).
_KNOWN_KEY = bytes(range(32))
_KNOWN_NONCE = bytes.fromhex("000000000000004a00000000")
_KNOWN_PLAINTEXT = (
    b"Ladies and Gentlemen of the class of '99: If I could offer you only one tip for the future, "
    b"sunscreen would be it."
)
_KNOWN_CIPHERTEXT = bytes.fromhex(
    "6e2e359a2568f98041ba0728dd0d6981e97e7aec1d4360c20a27afccfd9fae0bf91b65c5524733ab8f593dabcd62b357"
    "1639d624e65152ab8f530c359f0861d807ca0dbf500d6a6156a38e088a22b65e52bc514d16ccf806818ce91ab7793736"
    "5af90bbf74a35be6b40b8eedf2785e42874d"
)

BlockFunction = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def words(data: bytes, device: torch.device | str = "cpu") -> torch.Tensor:
    """Little-endian 32-bit words of `data` as an int64 tensor."""
    return torch.tensor(
        [int.from_bytes(data[i : i + 4], "little") for i in range(0, len(data), 4)], dtype=torch.int64, device=device
    )


def _rotate_left(x: torch.Tensor, bits: int) -> torch.Tensor:
    return ((x << bits) & _MASK) | (x >> (32 - bits))


def _quarter_round(state: list[torch.Tensor], a: int, b: int, c: int, d: int) -> None:
    state[a] = (state[a] + state[b]) & _MASK
    state[d] = _rotate_left(state[d] ^ state[a], 16)
    state[c] = (state[c] + state[d]) & _MASK
    state[b] = _rotate_left(state[b] ^ state[c], 12)
    state[a] = (state[a] + state[b]) & _MASK
    state[d] = _rotate_left(state[d] ^ state[a], 8)
    state[c] = (state[c] + state[d]) & _MASK
    state[b] = _rotate_left(state[b] ^ state[c], 7)


def block_words(key: torch.Tensor, nonce: torch.Tensor, first_block: torch.Tensor, blocks: int) -> torch.Tensor:
    """The keystream words of blocks first_block, …, first_block + blocks − 1 of (key, nonce): [blocks, 16] int64 in
    [0, 2³²), on the device of `key`. key: 8 words; nonce: 3 words; first_block: a 0-d tensor."""
    counters = torch.arange(blocks, dtype=torch.int64, device=key.device) + first_block
    zeros = torch.zeros_like(counters)
    initial = (
        [zeros + constant for constant in _SIGMA]
        + [zeros + key[i] for i in range(8)]
        + [counters]
        + [zeros + nonce[i] for i in range(3)]
    )
    state = list(initial)
    for _ in range(10):  # 20 rounds: a column round and a diagonal round each time
        for quarter in _COLUMNS:
            _quarter_round(state, *quarter)
        for quarter in _DIAGONALS:
            _quarter_round(state, *quarter)
    return torch.stack([(word + start) & _MASK for word, start in zip(state, initial)], dim=1)


def keystream(
    function: BlockFunction, key: torch.Tensor, nonce: torch.Tensor, size: int, first_block: int = 0
) -> torch.Tensor:
    """`size` keystream bytes of (key, nonce) from block `first_block`, serialized as RFC 8439 §2.3 says (each word
    little-endian, in order): a flat uint8 tensor on the device of `key`."""
    first = torch.tensor(first_block, dtype=torch.int64, device=key.device)
    unsigned = function(key, nonce, first, -(-size // BLOCK_BYTES))
    signed = unsigned - ((unsigned >> 31) << 32)  # the same 32 bits, as a value int32 holds
    return signed.to(torch.int32).reshape(-1).view(torch.uint8)[:size]


def _reproduces_rfc8439(function: BlockFunction, device: torch.device) -> bool:
    got = keystream(function, words(_KNOWN_KEY, device), words(_KNOWN_NONCE, device), len(_KNOWN_PLAINTEXT), 1)
    expected = bytes(p ^ c for p, c in zip(_KNOWN_PLAINTEXT, _KNOWN_CIPHERTEXT))
    return got.cpu().numpy().tobytes() == expected


@functools.cache
def block_function(device: torch.device, *, compile: bool) -> BlockFunction | None:
    """The block function to run on `device`, checked there against RFC 8439 §2.4.2 (compiling it first, once per
    process, if `compile`); None if it fails to build, to run or to match, with a warning saying why."""
    function: BlockFunction = torch.compile(block_words, dynamic=True, fullgraph=True) if compile else block_words
    what = "compiled" if compile else "op-by-op"
    if compile:
        logger.info(
            "Compiling the ChaCha20 keystream kernel for %s (once per process; torch.compile caches it).", device
        )
    try:
        matches = _reproduces_rfc8439(function, device)
    except Exception as error:  # any failure to build or run it means: do not use it
        logger.warning(
            "The %s ChaCha20 keystream cannot run on %s (%s: %s).", what, device, type(error).__name__, error
        )
        return None
    if not matches:
        logger.warning(
            "The %s ChaCha20 keystream on %s does not reproduce RFC 8439's test vector: not used.", what, device
        )
        return None
    return function
