"""Multi-process launches in tests: each on a port of its own, so that launches in parallel test workers
(`pytest -n`) never meet on one rendezvous."""

from __future__ import annotations

import socket
import sys


def free_port() -> int:
    """A TCP port free on this machine now (the OS picks it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


ACCELERATE = (sys.executable, "-m", "accelerate.commands.launch")


def accelerate_launch(
    script: str, *script_args: str, processes: int = 2, launcher: tuple[str, ...] = ACCELERATE
) -> list[str]:
    """`accelerate launch` of `script` as data-parallel CPU processes (set ACCELERATE_USE_CPU=1 in the environment),
    rendezvousing on a free port rather than accelerate's fixed default; `launcher` starts accelerate (its module under
    this Python, or the CLI as a user types it)."""
    return [
        *launcher,
        "--multi_gpu",
        "--num_processes",
        str(processes),
        "--num_machines",
        "1",
        "--main_process_port",
        str(free_port()),
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        script,
        *script_args,
    ]


def torchrun(script: str, *script_args: str, processes: int = 2) -> list[str]:
    """`torchrun` of `script` on this machine, rendezvousing on a free port."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={processes}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        script,
        *script_args,
    ]
