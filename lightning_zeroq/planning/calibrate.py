"""The rates a plan's step time is figured from, measured on this machine in a few seconds
(``zeroq-plan --calibrate``, ``offload="auto"``): one repeated block's forward and backward on the
device at the planned micro-batch, the device's memory bandwidth (its optimizer step), the host's AdamW
step (the kernel the engine uses), pinned copies between host and device, and the disk under
``nvme_path``.

Each measurement is the median of a few repetitions after a warm-up: the steady state, not the first
call's allocations and kernel choices, and a typical repetition rather than the luckiest: the plan's
steps are typical steps (on one H200's host the fastest of three AdamW steps over 64M elements ran at
5.7e9 elements/s, the host step over the 953M of a training step at about 5.1e9).
"""

from __future__ import annotations

import copy
import os
import statistics
import tempfile
import time
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from lightning_zeroq.nulls import nothing
from lightning_zeroq.ops.host_adam import host_adam

REPEATS = 5


def _typical(run: Callable[[], Any], sync: Callable[[], None], repeats: int = REPEATS) -> float:
    """Seconds ``run`` takes: the median of ``repeats`` calls after a first, untimed one."""
    run()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync(device: torch.device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else nothing


def block_seconds(block: nn.Module, call: Any, device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """One copy of ``block`` (its parameters on the meta device or anywhere) on ``device`` in ``dtype``,
    random weights, called as ``call`` (``(args, kwargs)`` of meta tensors) took: the forward, and the
    forward and backward, in seconds."""
    real = copy.deepcopy(block).to_empty(device=device)
    with torch.no_grad():
        for p in real.parameters():
            p.data = p.data.to(dtype).normal_(0, 0.02)

    def make(t: Any) -> Any:
        if not isinstance(t, Tensor):
            return t
        if t.is_floating_point():
            return torch.randn(t.shape, dtype=t.dtype, device=device, requires_grad=t.requires_grad)
        return torch.zeros(t.shape, dtype=t.dtype, device=device)

    args, kwargs = tree_map(make, call)
    first = next((a for a in args if isinstance(a, Tensor) and a.is_floating_point()), None)
    if first is not None:
        first.requires_grad_(True)

    def forward() -> Any:
        with torch.no_grad():
            real(*args, **kwargs)

    def both() -> None:
        out = real(*args, **kwargs)
        out = out[0] if isinstance(out, (tuple, list)) else out
        out.float().sum().backward()
        real.zero_grad(set_to_none=True)

    sync = _sync(device)
    return _typical(forward, sync), _typical(both, sync)


def host_step_rate(elements: int = 1 << 26) -> float:
    """AdamW elements a second on the host, through the engine's kernel (torch's fused CPU AdamW where
    the kernel is not available)."""
    p, g, m, v = (torch.rand(elements) for _ in range(4))
    kernel = host_adam()

    def run() -> None:
        if kernel is not None:
            kernel.step(
                p, g, m, v, step=1.0, decoupled=True, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01
            )
        else:
            torch._fused_adamw_(
                [p],
                [g],
                [m],
                [v],
                [],
                [torch.tensor(1.0)],
                amsgrad=False,
                beta1=0.9,
                beta2=0.999,
                lr=1e-4,
                weight_decay=0.01,
                eps=1e-8,
                maximize=False,
            )

    return elements / _typical(run, nothing)


def copy_rate(device: torch.device, nbytes: int = 1 << 28) -> Optional[float]:
    """Bytes a second from pinned host memory to ``device`` and back (the mean of both directions);
    None off a GPU."""
    if device.type != "cuda":
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    sync = _sync(device)
    up = _typical(lambda: dev.copy_(host, non_blocking=True), sync)
    down = _typical(lambda: host.copy_(dev, non_blocking=True), sync)
    return 2 * nbytes / (up + down)


def disk_rate(path: str, nbytes: int = 1 << 28) -> float:
    """Bytes a second written (synced) and read back under ``path`` (the mean of both)."""
    data = os.urandom(1 << 20) * (nbytes >> 20)
    with tempfile.NamedTemporaryFile(dir=path) as f:
        start = time.perf_counter()
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        wrote = time.perf_counter() - start
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        f.seek(0)
        start = time.perf_counter()
        while f.read(1 << 24):
            pass
        read = time.perf_counter() - start
    return 2 * nbytes / (wrote + read)


def device_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes a second a copy within the device reads and writes together."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    return 2 * nbytes / _typical(lambda: b.copy_(a), _sync(device))


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int = 4096) -> float:
    """Achieved FLOP/s of an ``n``-square matrix product."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return 2 * n**3 / _typical(lambda: a @ b, _sync(device))


def rates(
    device: torch.device,
    dtype: torch.dtype,
    *,
    block: Optional[nn.Module] = None,
    call: Any = None,
    nvme_path: Optional[str] = None,
) -> dict[str, Any]:
    """The rates measured here, as ``estimate.Machine`` fields: the device's (on a GPU), the host step's,
    the disk's under ``nvme_path``, and ``block`` timed at ``call`` where given."""
    measured: dict[str, Any] = {"host_step_elements_per_s": host_step_rate()}
    if device.type == "cuda":
        measured["matmul_flops"] = matmul_rate(device, dtype)
        measured["pcie_bytes_per_s"] = copy_rate(device)
        measured["device_bytes_per_s"] = device_bandwidth(device)
        if block is not None and call is not None:
            measured["block_seconds"] = block_seconds(block, call, device, dtype)
    if nvme_path:
        measured["nvme_bytes_per_s"] = disk_rate(nvme_path)
    return measured
