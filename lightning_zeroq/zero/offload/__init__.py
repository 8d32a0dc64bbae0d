"""Offload of optimizer state (and, in stage 3, parameters) to CPU memory and NVMe."""

from lightning_zeroq.zero.offload.nvme import NvmeSwapper, SwapHandle, aligned_empty, free_bytes

__all__ = ["NvmeSwapper", "SwapHandle", "aligned_empty", "free_bytes"]
