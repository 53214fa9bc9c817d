"""Memory figures a training step reports beside its speed."""

from __future__ import annotations

import os

import torch


def cuda_alloc_retries() -> int:
    """How often torch's CUDA allocator found no free block, emptied its cache and retried:
    each retry waits for the GPU and frees memory it must then allocate again, so a step
    that retries is slow for a reason no profile of its kernels shows (fragmentation, or a
    batch too close to the memory limit). torchtitan's memory monitor reports the same."""
    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))


def resident_memory_gb() -> float:
    """This process's resident memory (RSS) in GB; 0 where /proc cannot tell."""
    try:
        with open("/proc/self/statm") as handle:
            pages = int(handle.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 1e9
    except (OSError, ValueError):
        return 0.0
