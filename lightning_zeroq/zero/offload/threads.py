"""The host step's threads: torch's intra-op threads, which ``torchrun`` would leave at one per rank."""

from __future__ import annotations

import logging
import os
import warnings

import torch


_THREADS_SET: list[int] = []


def give_the_host_step_threads(world_size: int) -> None:
    """The host step runs on torch's intra-op threads. torchrun sets ``OMP_NUM_THREADS=1`` for every
    rank it starts unless the user set it (a step with 1 thread against 16: benchmarks/README.md, the
    offload host step's row): under torchrun with that default, use the cores per local rank and say so once;
    elsewhere, one thread is the user's choice, and gets a warning."""
    if torch.get_num_threads() != 1:
        return
    cores = os.cpu_count() or 1
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    threads = max(1, cores // max(1, local_ranks))
    if threads == 1:
        return
    if "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("OMP_NUM_THREADS") == "1":
        torch.set_num_threads(threads)
        if not _THREADS_SET:
            _THREADS_SET.append(threads)
            logging.getLogger("lightning_zeroq").info(
                f"offload_optimizer: torchrun left each rank 1 thread (OMP_NUM_THREADS=1); the host step now uses "
                f"{threads} ({cores} cores / {local_ranks} local ranks). Set OMP_NUM_THREADS to another value to choose."
            )
        return
    warnings.warn(
        "offload_optimizer: the optimizer step runs on the CPU with 1 thread (torch.get_num_threads() == 1). "
        f"Set OMP_NUM_THREADS to the cores per rank, e.g. OMP_NUM_THREADS={threads}, or call torch.set_num_threads().",
        stacklevel=4,
    )

