"""Long context with activation checkpointing: private against non-private training, both checkpointed, in one process.

    python -m benchmarks.long_context --vocab 32000 --seq-lens 2048 4096 --modes full lora

A Llama-shaped model (12 layers × 768 by default) built from config. Arms, in alternating rounds on the same batch:
non-private with checkpointing (the reference), hf_private with checkpointing, and hf_private without it (what
checkpointing saves and costs the private run). Every token of a chunk is real (no padding), so the step-time ratio
is the ratio per real token. Peak memory is measured for each arm alone in a fresh interpreter (VmHWM on the CPU,
the allocator's peak on a GPU); results are written after every configuration.

On the CPU each arm's peak is measured twice, each in a fresh interpreter: under glibc's default heap (what a user
sees, but it depends on where the allocator places blocks: freed arena pages stay resident, and which ones a step
touches again differs between two runs of one arm by up to a hundred MiB at 2 layers), and with every block of 64 KiB
or more mapped on its own from the interpreter's start (`mallopt(M_MMAP_THRESHOLD)`), so that the high-water mark
follows the live tensors.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import multiprocessing
import os
import statistics
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.memory import peak_bytes, reset_peak
from benchmarks.speed import HfPrivate, NonPrivate, _release_memory, make_chunks

logger = logging.getLogger("benchmarks.long_context")

#: label → (arm class, checkpointing on)
ARMS = {
    "non-private+ckpt": (NonPrivate, True),
    "hf_private+ckpt": (HfPrivate, True),
    "hf_private": (HfPrivate, False),
}
REFERENCE = "non-private+ckpt"
#: the CPU heaps an arm's peak is measured under, each in a fresh interpreter
HEAPS = ("default", "mapped")


def build(shape: dict, mode: str, checkpointing: bool, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The same weights every time (seeded init); LoRA r=8 on the attention and MLP projections for `lora`."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["heads"],
        max_position_embeddings=max(shape["seq_len"], 2048),
    )
    model = LlamaForCausalLM(config).to(dtype)
    if mode == "lora":
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(
            model, LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets)
        )
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.to(device).train()


_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter; setting it also turns off the threshold's dynamic growth
_MAPPED_BLOCK = 64 * 2**10


def _map_large_blocks() -> bool:
    """From now on give every block of 64 KiB or more its own mapping, returned to the system when freed."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, _MAPPED_BLOCK))
    except (OSError, AttributeError):
        return False


def _measured_step(arm, chunks, device) -> int:
    _release_memory()
    reset_peak(device)
    arm.step(chunks)
    return peak_bytes(device)


def _peak_worker(label, shape, mode, batch_size, dtype_name, device_name, mapped, queue) -> None:
    """One arm's peak over one step after a warm-up, in this fresh interpreter. `mapped`: large blocks mapped from
    the start, before anything is allocated (set later, heap pages that earlier steps freed stay resident and count)."""
    if mapped and not _map_large_blocks():
        queue.put(None)
        return
    device, dtype = torch.device(device_name), getattr(torch, dtype_name)
    arm_cls, checkpointing = ARMS[label]
    model = build(shape, mode, checkpointing, dtype, device)
    chunks = make_chunks(model, batch_size, shape["seq_len"], 1, device)
    arm = arm_cls(model, batch_size)
    arm.step(chunks)  # warm-up: optimizer state allocated
    queue.put(_measured_step(arm, chunks, device))


def _peak_in_fresh_process(*args) -> int | None:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_peak_worker, args=(*args, queue))
    process.start()
    peak = queue.get()
    process.join()
    return peak


def peak_in_fresh_process(label, shape, mode, batch_size, dtype, device, heaps=HEAPS) -> dict[str, int]:
    """The arm's peak under glibc's default heap (`peak_bytes`) and, on the CPU, in another fresh interpreter with
    large blocks mapped (`peak_bytes_mapped`: what the live tensors cost), each if `heaps` names it."""
    args = (label, shape, mode, batch_size, str(dtype).removeprefix("torch."), str(device))
    peaks = {}
    if "default" in heaps or device.type != "cpu":
        peaks["peak_bytes"] = _peak_in_fresh_process(*args, False)
    mapped = _peak_in_fresh_process(*args, True) if device.type == "cpu" and "mapped" in heaps else None
    if mapped is not None:
        peaks["peak_bytes_mapped"] = mapped
    return peaks


def bench(shape: dict, mode: str, batch_size: int, rounds: int, dtype, device, labels=tuple(ARMS), heaps=HEAPS) -> dict:
    arms = {}
    chunks = None
    for label in labels:
        arm_cls, checkpointing = ARMS[label]
        model = build(shape, mode, checkpointing, dtype, device)
        chunks = chunks or make_chunks(model, batch_size, shape["seq_len"], 1, device)
        arms[label] = arm_cls(model, batch_size)
        arms[label].step(chunks)  # warm-up
    times: dict[str, list[float]] = {label: [] for label in arms}
    for _ in range(rounds):
        for label, arm in arms.items():
            start = time.perf_counter()
            arm.step(chunks)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[label].append(time.perf_counter() - start)
    arms.clear()
    _release_memory()
    peaks = {label: peak_in_fresh_process(label, shape, mode, batch_size, dtype, device, heaps) for label in labels}
    tokens = batch_size * shape["seq_len"]
    reference = statistics.median(times[REFERENCE])
    return {
        **shape,
        "mode": mode,
        "batch_size": batch_size,
        "dtype": str(dtype),
        "reference": REFERENCE,
        "arms": {
            label: {
                "median_step_s": statistics.median(times[label]),
                "step_s": times[label],
                "s_per_1k_tokens": 1e3 * statistics.median(times[label]) / tokens,
                "time_ratio": statistics.median(times[label]) / reference,
                **peaks[label],
                **{
                    key.replace("peak_bytes", "memory_ratio"): value / peaks[REFERENCE][key]
                    for key, value in peaks[label].items()
                },
            }
            for label in labels
        },
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[2048, 4096])
    parser.add_argument("--modes", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    parser.add_argument("--batch-size", type=int, default=1, help="examples per chunk (one chunk a step)")
    parser.add_argument("--rounds", type=int, default=2, help="timed steps per arm, in alternating rounds")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help=f"the arms to run ({REFERENCE} always runs)"
    )
    parser.add_argument(
        "--heaps", nargs="+", default=list(HEAPS), choices=list(HEAPS), help="the CPU heaps each peak is measured under"
    )
    parser.add_argument("--out", default="benchmarks/results/long_context.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    results = []
    for seq_len in args.seq_lens:
        for mode in args.modes:
            shape = dict(
                layers=args.layers,
                hidden=args.hidden,
                intermediate=args.intermediate,
                heads=args.heads,
                vocab=args.vocab,
                seq_len=seq_len,
            )
            logger.info("benchmarking %s T=%d vocab=%d", mode, seq_len, args.vocab)
            labels = [REFERENCE, *(label for label in args.arms if label != REFERENCE)]
            results.append(bench(shape, mode, args.batch_size, args.rounds, dtype, device, labels, args.heaps))
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out, "w") as f:  # after every configuration: a crash loses one
                json.dump({"device": str(device), "threads": torch.get_num_threads(), "results": results}, f, indent=2)
            for label, arm in results[-1]["arms"].items():
                memory = [
                    f"{arm[ratio]:5.2f}x memory{how} ({arm[peak] / 2**20:.0f} MiB)"
                    for ratio, peak, how in (
                        ("memory_ratio", "peak_bytes", ""),
                        ("memory_ratio_mapped", "peak_bytes_mapped", " with large blocks mapped"),
                    )
                    if peak in arm
                ]
                print(
                    f"{mode:<5} T={seq_len:<5} V={args.vocab:<7} {label:<17} {arm['time_ratio']:5.2f}x time "
                    f"({arm['median_step_s']:.2f} s), " + ", ".join(memory),
                    flush=True,
                )
    return results


if __name__ == "__main__":
    main()
