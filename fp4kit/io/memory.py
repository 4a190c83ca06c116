"""Keep freed tensor memory from staying resident: glibc malloc settings, no-ops with any other C library, and
bounds on the caches of compiled CPU GEMM kernels (oneDNN's, ideep's).

glibc serves an allocation of at least its mmap threshold with a mapping of its own, returned to the OS on free, and
anything smaller from its heaps, which keep freed memory resident and give back only their free top. The threshold
starts at 128 KiB, but every free of a mapped block raises it to that block's size (up to 32 MiB). After the first
large tensor is freed, buffers of a few MB (an expert's weights, a batch's activations) come from the heaps, and small
long-lived allocations made between them (a statistic, a dict) split the freed space, so the heaps grow from one
expert to the next: a layer's calibration pass kept 0.2-0.5 GB of freed memory on top of the layer itself, more
in some runs than in others (the spread in docs/BENCHMARKS.md, "Calibration"). Fixing the threshold at 128 KiB
(setting it turns the raising off) gives every buffer from 128 KiB up back to the OS when it is freed, at the price
of a page fault per 4 KiB page of every new buffer: worth it while one decoder layer sets the peak, not in the
weight pass (2-layer bench: +6 s system time of ~60 CPU s for 0.1 GB less than its 0.6 GB peak).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Iterator

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameter numbers, glibc malloc.h
MMAP_THRESHOLD = 128 * 1024  # glibc's own initial value, kept fixed
HEAP_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit, the ceiling of its raising


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc, else None."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        return ctypes.CDLL(None)
    except (AttributeError, ValueError, OSError):  # no confstr (Windows), not glibc (musl, macOS), no dlopen
        return None


@contextlib.contextmanager
def large_frees_returned_to_os() -> Iterator[bool]:
    """Within the block, glibc's mmap threshold stays at 128 KiB, so freed buffers of 128 KiB and more leave the
    resident set at once; yields whether that applies (False where the C library is not glibc). Process-wide. On
    exit, buffers below 32 MiB come from the heaps again, which keep up to 64 MiB of free top: where glibc's own
    raising ends (DEFAULT_MMAP_THRESHOLD_MAX; trim threshold twice the mmap threshold), so what follows runs as it
    would after freeing a 32 MiB block. The raising itself stays off."""
    mallopt = getattr(_glibc(), "mallopt", None)
    applied = bool(mallopt and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    try:
        yield applied
    finally:
        if applied:
            mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)
            mallopt(M_TRIM_THRESHOLD, 2 * HEAP_MMAP_THRESHOLD)


def trim_freed_memory() -> None:
    """Give the heaps' free pages back to the OS (glibc ``malloc_trim``), e.g. after dropping a decoder layer."""
    trim = getattr(_glibc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


# A layer's forward repeats a few GEMM shapes (the projections') from batch to batch and gives each routed expert a
# new one (its token count) in every batch, so most entries of the CPU GEMM kernel caches are never used again. Per
# cache, the entries kept: oneDNN's compiled primitives, and ideep's computations built on them, which PyTorch's CPU
# bf16 GEMMs reuse (rebuilding them costs more than recompiling a primitive, so more of those are kept).
ONEDNN_CACHE_CAPACITIES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": 64, "LRU_CACHE_CAPACITY": 256}


def bound_onednn_kernel_cache() -> dict[str, str]:
    """Cap the CPU GEMM kernel caches at ONEDNN_CACHE_CAPACITIES unless the environment already sets them; returns
    the capacities in force. At the libraries' default of 1024 entries each, a calibration forward fills them with
    kernels for token counts that never recur, about 0.6 MB resident per new shape. Both libraries read the variables
    when they build their first kernel: this works before the process's first bf16 GEMM, not after."""
    return {name: os.environ.setdefault(name, str(n)) for name, n in ONEDNN_CACHE_CAPACITIES.items()}
