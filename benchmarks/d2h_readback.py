"""How long a few bytes read back from the device wait behind large device-to-host copies in flight.

The offload step copies every gradient shard to the host (3.8 GB on the 953M model) and reads back a
few flags (the agreement on non-finite gradients) before it may step. If the copies start during the
backward, the read-back may queue behind them on the copy engine. This measures, for several ways of
issuing the copies and the read-back, when the flags are readable on the host, counted from the start
of a "backward" of about 30 ms on the compute stream (one unit reduced, and its copy issued, every
30/units ms), and when every copy has landed. Variants: ``nocopy`` (no copies: the floor),
``pageable`` (``.cpu()`` on the compute stream, as the engine reads back), ``pinned`` (non-blocking
into pinned memory, then an event), ``highprio`` (the read-back on a stream of the highest priority),
``chunk`` (each copy in ``--chunk-mib`` pieces), ``lowprio`` (the copies on a low-priority stream),
``mapped`` (no copy at all: a kernel on the compute stream writes the flags into pinned host memory
through its device address, then an event).

    python benchmarks/d2h_readback.py [--gib 3.5] [--units 8]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def spin(ms: float) -> None:
    """About ``ms`` of work on the current stream (a device-side sleep; cycles at about 1.98 GHz)."""
    torch.cuda._sleep(int(ms * 1.98e6))


def mapped_view(host: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor over the pinned host tensor ``host`` (its device address: the same pointer under
    unified addressing), so a kernel writes the host memory directly over PCIe."""
    from lightning_zeroq.zero.comm import device_alias

    return device_alias(host)


def run(variant: str, grads: list[torch.Tensor], hosts: list[torch.Tensor], chunk: int) -> dict:
    dev = grads[0].device
    compute = torch.cuda.current_stream(dev)
    low = torch.cuda.Stream(dev, priority=0)
    high = torch.cuda.Stream(dev, priority=-1)
    copies = low if "lowprio" in variant else torch.cuda.Stream(dev)
    flags_dev = torch.zeros(16, device=dev)
    flags_host = torch.empty(16).pin_memory()
    flags_mapped = torch.zeros(16, dtype=torch.bool).pin_memory()
    torch.cuda.synchronize()
    t_start = time.perf_counter()
    # the "backward": 8 units reduced one after another, each copied as soon as it is reduced
    per_unit_ms = 30.0 / len(grads)
    for g, h in zip(grads, hosts):
        spin(per_unit_ms)
        if "nocopy" in variant:
            continue
        copies.wait_stream(compute)
        with torch.cuda.stream(copies):
            if "chunk" in variant:
                for s in range(0, g.numel(), chunk):
                    h[s : s + chunk].copy_(g[s : s + chunk], non_blocking=True)
            else:
                h.copy_(g, non_blocking=True)
    flags_dev.add_(1.0)
    if "mapped" in variant:
        torch.gt(flags_dev, 0, out=mapped_view(flags_mapped))
        done = torch.cuda.Event()
        done.record(compute)
        done.synchronize()
        assert bool(flags_mapped.all())
        readable = time.perf_counter()
    elif "pageable" in variant:
        flags_dev.cpu()
        readable = time.perf_counter()
    else:
        stream = high if "highprio" in variant else compute
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            flags_host.copy_(flags_dev, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()
        readable = time.perf_counter()
    torch.cuda.synchronize()
    t_all = time.perf_counter()
    # the "backward" ends about 30 ms after the start: a read-back that waits for nothing else lands then
    return {"variant": variant, "readback_after_start_ms": round((readable - t_start) * 1e3, 1),
            "all_copies_after_start_ms": round((t_all - t_start) * 1e3, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=3.5)
    parser.add_argument("--units", type=int, default=8)
    parser.add_argument("--chunk-mib", type=int, default=32)
    args = parser.parse_args()
    dev = torch.device("cuda", 0)
    numel = int(args.gib * 2**30 / 4 / args.units)
    grads = [torch.randn(numel, device=dev) for _ in range(args.units)]
    hosts = [torch.empty(numel).pin_memory() for _ in range(args.units)]
    chunk = args.chunk_mib * 2**20 // 4
    variants = ["nocopy", "mapped", "pageable", "pinned", "pinned_highprio", "chunk_pinned", "chunk_pinned_highprio",
                "chunk_lowprio_pinned_highprio", "lowprio_pinned_highprio"]
    for _ in range(2):
        for v in variants:
            print(json.dumps(run(v, grads, hosts, chunk)), flush=True)


if __name__ == "__main__":
    main()
