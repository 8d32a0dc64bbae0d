"""Generic NVMe swap space: named fixed-size regions in per-rank files, moved to and from host tensors
with asynchronous ``O_DIRECT`` I/O. It knows nothing about ZeRO; ``lightning_zeroq.zero.offload``
builds the optimizer-state and parameter placements on it.

Modules, from the bottom up: ``buffers`` (aligned host memory), ``regions`` (what a region is, the
checks of arguments), ``io`` (chunked transfers, the ``O_DIRECT`` probe), ``cleanup`` (signal
handlers), ``directory`` (the private, locked directory and leftovers of killed runs) and
``swapper`` (:class:`NvmeSwapper`, which puts them together)."""

from lightning_zeroq.swap.buffers import aligned_empty
from lightning_zeroq.swap.io import SwapHandle
from lightning_zeroq.swap.swapper import NvmeSwapper, free_bytes

__all__ = ["NvmeSwapper", "SwapHandle", "aligned_empty", "free_bytes"]
