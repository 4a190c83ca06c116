"""fp4kit.memory: with glibc, a freed buffer of a few MB leaves the resident set at once; elsewhere, nothing happens.

glibc's dynamic mmap threshold (malloc/malloc.c, ``free``: a freed mmapped chunk larger than ``mp_.mmap_threshold``
and at most DEFAULT_MMAP_THRESHOLD_MAX raises the threshold to its size and the trim threshold to twice that;
``mallopt(M_MMAP_THRESHOLD)`` sets ``no_dyn_threshold``) is what the probe below provokes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from fp4kit import memory

PROBE = textwrap.dedent("""
    import json, os, sys, torch
    from fp4kit import memory

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    applied = memory.return_large_frees_to_os() if sys.argv[1] == "tuned" else None
    big = torch.ones(24 << 20, dtype=torch.uint8)  # mapped; its free raises glibc's threshold to 24 MiB
    del big
    before = rss()
    buffer = torch.ones(8 << 20, dtype=torch.uint8)  # an expert-sized buffer, written to
    del buffer
    print(json.dumps({"applied": applied, "kept": rss() - before}))
""")


def _glibc() -> bool:
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (AttributeError, ValueError):
        return False


def probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not _glibc() or not os.path.exists("/proc/self/statm"), reason="glibc on Linux only")
def test_a_freed_buffer_of_a_few_mb_leaves_the_resident_set():
    untuned, tuned = probe("default"), probe("tuned")
    assert untuned["kept"] >= 4 << 20, untuned  # glibc's default: the freed 8 MiB stay resident in its heap
    assert tuned["applied"] is True
    assert tuned["kept"] < 1 << 20, tuned


@pytest.fixture
def fresh_libc_lookup():
    memory._glibc.cache_clear()
    yield
    memory._glibc.cache_clear()


def test_no_op_where_the_c_library_is_not_glibc(monkeypatch, fresh_libc_lookup):
    def not_glibc(name: str) -> str:
        raise ValueError("unrecognized configuration name")  # what musl's and macOS's Pythons raise

    monkeypatch.setattr(os, "confstr", not_glibc)
    assert memory.return_large_frees_to_os() is False
    memory.trim_freed_memory()  # nothing to call, no error


def test_no_op_where_libc_lacks_mallopt_and_malloc_trim(monkeypatch):
    monkeypatch.setattr(memory, "_glibc", lambda: object())
    assert memory.return_large_frees_to_os() is False
    memory.trim_freed_memory()
