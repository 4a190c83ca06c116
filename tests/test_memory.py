"""fp4kit.io.memory: with glibc, within the block a freed buffer of a few MB leaves the resident set at once, after it
the heaps serve such buffers again; elsewhere, nothing happens.

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

from fp4kit.io import memory

PROBE = textwrap.dedent("""
    import json, os, torch
    from fp4kit.io import memory

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def kept():
        # resident bytes left by writing an expert-sized buffer of 8 MiB and freeing it
        before = rss()
        buffer = torch.ones(8 << 20, dtype=torch.uint8)
        del buffer
        return rss() - before

    big = torch.ones(24 << 20, dtype=torch.uint8)  # mapped; its free raises glibc's threshold to 24 MiB
    del big
    result = {"default": kept()}
    with memory.large_frees_returned_to_os() as applied:
        result["inside"] = kept()
    result["after"] = kept()
    print(json.dumps({**result, "applied": applied}))
""")


def _glibc() -> bool:
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (AttributeError, ValueError):
        return False


@pytest.mark.skipif(not _glibc() or not os.path.exists("/proc/self/statm"), reason="glibc on Linux only")
def test_a_freed_buffer_of_a_few_mb_leaves_the_resident_set_within_the_block():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    kept = json.loads(out.stdout.strip().splitlines()[-1])
    assert kept["applied"] is True
    assert kept["default"] >= 4 << 20, kept  # glibc's default: the freed 8 MiB stay resident in its heap
    assert kept["inside"] < 1 << 20, kept
    assert kept["after"] >= 4 << 20, kept  # after the block, the heaps serve such buffers again


@pytest.fixture
def fresh_libc_lookup():
    memory._glibc.cache_clear()
    yield
    memory._glibc.cache_clear()


def test_no_op_where_the_c_library_is_not_glibc(monkeypatch, fresh_libc_lookup):
    def not_glibc(name: str) -> str:
        raise ValueError("unrecognized configuration name")  # what musl's and macOS's Pythons raise

    monkeypatch.setattr(os, "confstr", not_glibc)
    with memory.large_frees_returned_to_os() as applied:
        assert applied is False
    memory.trim_freed_memory()  # nothing to call, no error


def test_no_op_where_libc_lacks_mallopt_and_malloc_trim(monkeypatch):
    monkeypatch.setattr(memory, "_glibc", lambda: object())
    with memory.large_frees_returned_to_os() as applied:
        assert applied is False
    memory.trim_freed_memory()


ONEDNN_PROBE = textwrap.dedent("""
    import json, os, torch
    from fp4kit.io import memory

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    capacity = memory.bound_onednn_kernel_cache()
    weight = torch.randn(256, 256, dtype=torch.bfloat16)
    x = torch.randn(1200, 256, dtype=torch.bfloat16)
    torch.nn.functional.linear(x[:7], weight)
    before = rss()
    for rows in range(8, 1200):  # a new GEMM shape each time, as routed experts' token counts give
        torch.nn.functional.linear(x[:rows], weight)
    print(json.dumps({"capacity": capacity, "growth": rss() - before}))
""")


def _onednn_growth(env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", ONEDNN_PROBE], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident set from /proc")
def test_onednn_kernel_cache_is_bounded_unless_the_environment_sets_it():
    import torch

    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        pytest.skip("this CPU's bf16 GEMMs do not go through oneDNN")
    env = {k: v for k, v in os.environ.items() if k not in memory.ONEDNN_CACHE_CAPACITIES}
    bounded = _onednn_growth(env)
    defaults = dict.fromkeys(memory.ONEDNN_CACHE_CAPACITIES, "1024")  # the libraries' own defaults, set explicitly
    unbounded = _onednn_growth({**env, **defaults})
    assert bounded["capacity"] == {k: str(n) for k, n in memory.ONEDNN_CACHE_CAPACITIES.items()}
    assert unbounded["capacity"] == defaults  # the user's settings win
    assert unbounded["growth"] > 256 << 20, unbounded  # over a thousand shapes' kernels stay resident
    # about a fifth on an idle machine (177 against 830-860 MB); a busy one's allocator has given 3.8x
    assert bounded["growth"] < unbounded["growth"] / 3, (bounded, unbounded)
