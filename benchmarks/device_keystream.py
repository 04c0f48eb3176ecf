"""Where the noise's keystream is made: the host (OpenSSL's ChaCha20, one core) against the device's block function.

    python -m benchmarks.device_keystream --device cuda            # compiled, checked against RFC 8439 first
    python -m benchmarks.device_keystream --device cpu --compile   # the same compiled kernel, built for the CPU

For a model's worth of noise (`--values`, 110M: bert-base), the seconds to make its keystream (12 bytes per pair of
values) and to draw the Gaussians from it, on each path, after one warm-up; every path's keystream is checked
byte for byte against the host stream for the same requests (same key), so a speed figure is never for a wrong
stream. Why: issue #36 asks for the noise to be made on an accelerator from the secret key, not copied there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from hf_private.privacy import device_chacha
from hf_private.privacy.rng import DEVICE_CHUNK_PAIRS, HOST_CHUNK_PAIRS, PAIR_BYTES, GaussianSampler, SecretRandom

KEY = bytes(range(32))  # a public benchmark key: these draws protect nothing


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(work, device: torch.device, repeats: int) -> float:
    work()  # warm-up (and, compiled, the first call's build)
    times = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        work()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _check_stream(function: device_chacha.BlockFunction, device: torch.device) -> None:
    size = PAIR_BYTES * 100_003
    host, on_device = SecretRandom(key=KEY), SecretRandom(key=KEY)
    if on_device.device_keystream(size, function, device).cpu().numpy().tobytes() != host.random_bytes(size):
        raise SystemExit("The device keystream differs from the host stream: no timing reported.")


def _device_keystream_seconds(
    function: device_chacha.BlockFunction, device: torch.device, size: int, repeats: int
) -> float:
    random, chunk = SecretRandom(key=KEY), PAIR_BYTES * DEVICE_CHUNK_PAIRS  # the sampler's requests

    def device_keystream():
        for start in range(0, size, chunk):
            random.device_keystream(min(chunk, size - start), function, device)

    return _seconds(device_keystream, device, repeats)


def measure(device: torch.device, values: int, compile: bool, repeats: int) -> dict:
    pairs = (values + 1) // 2
    bytes_needed = PAIR_BYTES * pairs
    host_buffer = bytearray(PAIR_BYTES * HOST_CHUNK_PAIRS)  # the sampler's requests
    host_random = SecretRandom(key=KEY)

    def host_keystream():
        for start in range(0, bytes_needed, len(host_buffer)):
            host_random.fill_(memoryview(host_buffer)[: min(len(host_buffer), bytes_needed - start)])

    result = {
        "device": str(device),
        "values": values,
        "keystream_bytes": bytes_needed,
        "host_keystream_s": _seconds(host_keystream, device, repeats),
    }
    target = torch.zeros(values, device=device)
    host_sampler = GaussianSampler(SecretRandom(key=KEY), device=device, keystream="host")
    result["host_noise_s"] = _seconds(lambda: host_sampler.add_(target, 1.0), device, repeats)
    paths = {"op_by_op": False} | ({"compiled": True} if compile else {})
    for name, compiled in paths.items():
        build = time.perf_counter()
        function = device_chacha.block_function(device, compile=compiled)
        if function is None:
            result[f"{name}_error"] = "did not build, run or reproduce RFC 8439 (see the warning)"
            continue
        result[f"{name}_build_and_check_s"] = time.perf_counter() - build
        _check_stream(function, device)
        result[f"{name}_keystream_s"] = _device_keystream_seconds(function, device, bytes_needed, repeats)
    device_sampler = GaussianSampler(SecretRandom(key=KEY), device=device, keystream="device")
    result[f"device_noise_s ({'compiled' if device.type == 'cuda' else 'op_by_op'})"] = _seconds(
        lambda: device_sampler.add_(target, 1.0), device, repeats
    )
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--values", type=int, default=110_000_000, help="noised coordinates (bert-base: 110M)")
    parser.add_argument("--compile", action="store_true", help="also the compiled kernel (always on CUDA)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/device_keystream_<device>)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    result = measure(device, args.values, args.compile or device.type == "cuda", args.repeats)
    result |= {"torch": torch.__version__, "threads": torch.get_num_threads()}
    out = args.out or f"benchmarks/results/device_keystream_{device.type}.json"
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
