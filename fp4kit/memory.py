"""Keep freed tensor memory from staying resident: glibc malloc settings, no-ops with any other C library.

glibc serves an allocation of at least its mmap threshold with a mapping of its own, returned to the OS on free, and
anything smaller from its heaps, which keep freed memory resident and give back only their free top. The threshold
starts at 128 KiB, but every free of a mapped block raises it to that block's size (up to 32 MiB). After the first
large tensor is freed, buffers of a few MB (an expert's weights, a batch's activations) come from the heaps, and small
long-lived allocations made between them (a statistic, a dict) split the freed space, so the heaps grow from one
expert to the next: a layer's calibration pass kept 0.2-0.5 GB of freed memory on top of the layer itself, more
in some runs than in others (the spread in docs/BENCHMARKS.md, "Calibration"). Fixing the threshold at 128 KiB
(setting it turns the raising off) gives every buffer from 128 KiB up back to the OS when it is freed.
"""

from __future__ import annotations

import ctypes
import functools
import os

M_MMAP_THRESHOLD = -3  # mallopt parameter number, glibc malloc.h
MMAP_THRESHOLD = 128 * 1024  # glibc's own initial value, kept fixed


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc, else None."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        return ctypes.CDLL(None)
    except (AttributeError, ValueError, OSError):  # no confstr (Windows), not glibc (musl, macOS), no dlopen
        return None


def return_large_frees_to_os() -> bool:
    """Fix glibc's mmap threshold for the rest of the process, so that freed buffers of 128 KiB and more leave the
    resident set at once. Process-wide and idempotent; True when applied, False where the C library is not glibc."""
    libc = _glibc()
    mallopt = getattr(libc, "mallopt", None)
    return bool(mallopt and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def trim_freed_memory() -> None:
    """Give the heaps' free pages back to the OS (glibc ``malloc_trim``), e.g. after dropping a decoder layer."""
    trim = getattr(_glibc(), "malloc_trim", None)
    if trim is not None:
        trim(0)
