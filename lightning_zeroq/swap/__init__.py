"""Generic NVMe swap space: named fixed-size regions in per-rank files, moved to and from host tensors
with asynchronous ``O_DIRECT`` I/O. It knows nothing about ZeRO; ``lightning_zeroq.zero.offload``
builds the optimizer-state and parameter placements on it."""

from lightning_zeroq.swap.nvme import NvmeSwapper, SwapHandle, aligned_empty, free_bytes

__all__ = ["NvmeSwapper", "SwapHandle", "aligned_empty", "free_bytes"]
