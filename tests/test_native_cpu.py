"""fp4kit's C encode loop (fp4kit/native/nvfp4_cpu.c) against the torch ops of fp4kit.nvfp4, bit for bit.

test_nvfp4.py runs the compressed-tensors parity cases through both paths; here the native path is driven over every
bf16 magnitude under many block scales (so every E2M1 boundary, tie and fp8 subnormal scale is hit), fp32 values
a few ulps around every boundary under many block scales, random bit patterns of both dtypes, NaN/Inf detection,
and the fallback when no compiler works."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4kit.native import nvfp4_cpu
from fp4kit.nvfp4 import NonFiniteError, block_amax, quantize_group, quantize_stacked


def test_the_library_builds_here():
    """CI machines have a C compiler: the native path must really run there, not fall back silently."""
    assert nvfp4_cpu.available()


def assert_same(a, b):
    assert torch.equal(a.packed, b.packed)
    assert torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8))
    assert torch.equal(a.global_scale_div, b.global_scale_div)


def every_magnitude_under(block_amaxes: list[float]) -> torch.Tensor:
    """One row per block amax: blocks led by that amax (setting the block's fp8 scale) and filled with every bf16
    magnitude up to it, both signs."""
    magnitudes = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    rows = []
    for amax in block_amaxes:
        amax_bf16 = torch.tensor(amax, dtype=torch.bfloat16)
        values = magnitudes[magnitudes <= amax_bf16]
        values = torch.cat([values, -values])
        values = values[: values.numel() // 15 * 15].reshape(-1, 15)
        blocks = torch.cat([amax_bf16.expand(values.shape[0], 1), values], dim=1)
        rows.append(blocks.reshape(-1))
    width = max(r.numel() for r in rows)
    return torch.stack([torch.nn.functional.pad(r, (0, width - r.numel())) for r in rows])


@pytest.mark.parametrize("tensor_amax", [1.0, 3.0e4, 2.0e-30])
def test_every_magnitude_and_block_scale(tensor_amax):
    """Block amaxes from the tensor's amax down through the fp8 subnormal scales to the all-zero block, each with
    every smaller bf16 magnitude: the torch ops and the C loop give the same codes and scales."""
    block_amaxes = [tensor_amax * 2.0**-e for e in range(0, 40)] + [tensor_amax * 0.7, tensor_amax * 0.3, 0.0]
    w = every_magnitude_under(block_amaxes)
    assert_same(quantize_group([w], native=True)[0], quantize_group([w], native=False)[0])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 6), st.booleans())
def test_random_bit_patterns(seed, rows, exact_fp32):
    """Any finite bf16 bit pattern (denormals, both zeros, the largest finite values)."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 1 << 16, (rows, 64), generator=gen, dtype=torch.int32)
    bits = torch.where((bits & 0x7F80) == 0x7F80, bits & 0x807F, bits)  # exponent all ones -> zero exponent
    w = bits.to(torch.int16).view(torch.bfloat16)
    assert_same(quantize_group([w], exact_fp32, native=True)[0], quantize_group([w], exact_fp32, native=False)[0])


def test_stack_and_fused_group():
    gen = torch.Generator().manual_seed(3)
    stack = torch.randn(3, 32, 128, generator=gen) * torch.tensor([1e-3, 1.0, 1e3]).reshape(3, 1, 1)
    stack = stack.bfloat16()
    assert_same(quantize_stacked(stack, native=True), quantize_stacked(stack, native=False))
    gate, up = stack[1, :16], stack[2, 16:]
    for native_q, torch_q in zip(quantize_group([gate, up], native=True), quantize_group([gate, up]), strict=True):
        assert_same(native_q, torch_q)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_are_refused(bad):
    w = torch.randn(8, 64).bfloat16()
    w[5, 37] = bad
    with pytest.raises(NonFiniteError):
        block_amax(w, native=True)
    with pytest.raises(NonFiniteError):
        quantize_group([w], native=True)


def test_other_dtypes_and_layouts_take_the_torch_path():
    w = torch.randn(32, 64)
    assert nvfp4_cpu.handles(w) and not nvfp4_cpu.handles_mse(w)  # fp32: RTN only
    assert not nvfp4_cpu.handles(w.half())
    assert not nvfp4_cpu.handles(w.bfloat16().t())  # not contiguous
    assert_same(quantize_group([w.half()], native=True)[0], quantize_group([w.half()])[0])


def near_boundaries(block_amax: float, global_mul: float, ulps: int = 3) -> torch.Tensor:
    """fp32 rows of blocks led by ``block_amax`` (setting the block's fp8 scale under ``global_mul``) and filled with
    the values within a few ulps of every E2M1 rounding boundary times the block's divisor, both signs, and the
    smallest values whose quotient is or is not zero."""
    from fp4kit.nvfp4 import rtn_block_scale

    amax = torch.tensor([block_amax], dtype=torch.float32)
    divisor = float(rtn_block_scale(amax, torch.tensor(global_mul, dtype=torch.float32))[0] / global_mul)
    centres = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]) * divisor
    bits = centres.view(torch.int32)[:, None] + torch.arange(-ulps, ulps + 1, dtype=torch.int32)
    values = torch.cat([bits.flatten(), torch.arange(0, 8, dtype=torch.int32)]).view(torch.float32)
    values = values[values <= block_amax]
    values = torch.cat([values, -values])
    values = torch.nn.functional.pad(values, (0, -values.numel() % 15)).reshape(-1, 15)
    return torch.cat([torch.full((values.shape[0], 1), block_amax), values], dim=1).reshape(-1)


@pytest.mark.parametrize("tensor_amax", [1.0, 3.7e4, 2.0e-30])
def test_fp32_boundaries_and_block_scales(tensor_amax):
    """fp32 weights (a quantized source dequantized in fp32): for block amaxes from the tensor's down through the fp8
    subnormal scales, the values a few ulps around each rounding boundary of the block; C loop and torch agree."""
    global_mul = float(2688.0 / torch.tensor(tensor_amax, dtype=torch.float32))
    block_amaxes = [tensor_amax * 2.0**-e * f for e in range(0, 36, 3) for f in (1.0, 0.77, 0.513)]
    rows = [near_boundaries(a, global_mul) for a in block_amaxes]
    width = max(r.numel() for r in rows)
    w = torch.stack([torch.nn.functional.pad(r, (0, width - r.numel())) for r in rows])
    w[0, 0] = tensor_amax
    assert_same(quantize_group([w], native=True)[0], quantize_group([w], native=False)[0])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 6), st.booleans(), st.integers(-120, 120))
def test_fp32_random_bit_patterns(seed, rows, exact_fp32, exponent):
    """Finite fp32 values of every exponent (denormals and both zeros included), around a random magnitude."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(1 << 31), 1 << 31, (rows, 64), generator=gen, dtype=torch.int64).to(torch.int32)
    w = bits.view(torch.float32)
    w = torch.where(torch.isfinite(w), w, torch.zeros_like(w))
    w = torch.where(torch.rand(w.shape, generator=gen) < 0.7, torch.randn(w.shape, generator=gen) * 2.0**exponent, w)
    assert_same(quantize_group([w], exact_fp32, native=True)[0], quantize_group([w], exact_fp32, native=False)[0])


def test_fp32_stack_fused_group_and_nan():
    gen = torch.Generator().manual_seed(4)
    stack = torch.randn(3, 32, 128, generator=gen) * torch.tensor([1e-3, 1.0, 1e3]).reshape(3, 1, 1)
    assert_same(quantize_stacked(stack, native=True), quantize_stacked(stack, native=False))
    gate, up = stack[1, :16], stack[2, 16:]
    for native_q, torch_q in zip(quantize_group([gate, up], native=True), quantize_group([gate, up]), strict=True):
        assert_same(native_q, torch_q)
    for bad in (float("nan"), float("inf"), float("-inf")):
        w = stack[0].clone()
        w[5, 37] = bad
        with pytest.raises(NonFiniteError):
            quantize_group([w], native=True)


def test_without_a_compiler_quantize_falls_back_to_the_same_bytes(tmp_path):
    """A machine without a working C compiler: nothing is cached, the torch ops run, the bytes are the same."""
    code = (
        "import torch\n"
        "from fp4kit.native import nvfp4_cpu\n"
        "from fp4kit.nvfp4 import quantize_group\n"
        "w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)).bfloat16()\n"
        "q = quantize_group([w], native=True)[0]\n"
        "print(nvfp4_cpu.available(), q.packed.sum().item(), q.block_scale.view(torch.uint8).sum().item())\n"
    )
    env = {**os.environ, "CC": "/bin/false", "FP4KIT_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/nonexistent"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    q = quantize_group([w])[0]
    assert out.split() == ["False", str(q.packed.sum().item()), str(q.block_scale.view(torch.uint8).sum().item())]
    assert not any((tmp_path / "cache").glob("*.so"))


# a library with the loop's symbols that leaves a file behind as soon as anything loads it
FOREIGN_C = """
#include <stdio.h>
#include <stdint.h>
__attribute__((constructor)) static void loaded(void) { FILE *f = fopen(MARKER, "w"); if (f) fclose(f); }
int fp4kit_block_amax_bf16(const void *w, int64_t n, void *amax, void *tensor_amax) { return 0; }
int fp4kit_encode_bf16(const void *w, const void *amax, int64_t n, float g, void *packed, void *scale) { return 0; }
"""


def build_foreign(tmp_path, marker) -> bytes:
    source = tmp_path / "foreign.c"
    source.write_text(FOREIGN_C)
    out = tmp_path / "foreign.so"
    subprocess.run([nvfp4_cpu._compiler(), "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(out), str(source)],
                   check=True, capture_output=True)
    return out.read_bytes()


def test_cache_is_keyed_by_source_compiler_and_flags(tmp_path, monkeypatch):
    compiler = nvfp4_cpu._compiler()
    key = nvfp4_cpu.build_key(compiler)
    assert nvfp4_cpu.build_key(compiler) == key
    edited = tmp_path / "nvfp4_cpu.c"
    edited.write_bytes(nvfp4_cpu.SOURCE.read_bytes() + b"\n/* edited */\n")
    monkeypatch.setattr(nvfp4_cpu, "SOURCE", edited)
    assert nvfp4_cpu.build_key(compiler) != key
    monkeypatch.undo()
    monkeypatch.setattr(nvfp4_cpu, "CFLAGS", [*nvfp4_cpu.CFLAGS, "-ffast-math"])
    assert nvfp4_cpu.build_key(compiler) != key
    monkeypatch.undo()
    other = tmp_path / "other-cc"  # same compiler under another name that reports another version
    other.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && echo 'other 1.0' && exit 0\nexec {compiler} \"$@\"\n")
    other.chmod(0o755)
    assert nvfp4_cpu.build_key(str(other)) != key


def test_a_tampered_or_foreign_cached_library_is_never_loaded(tmp_path, monkeypatch):
    """A library in the cache under the right name that this build did not write is rebuilt before any load. A
    fresh process proves the end to end: the foreign library would leave its marker file the moment it was loaded."""
    cache, marker = tmp_path / "cache", tmp_path / "loaded-the-foreign-library"
    monkeypatch.setenv("FP4KIT_CACHE_DIR", str(cache))
    compiler = nvfp4_cpu._compiler()
    library = nvfp4_cpu._build(compiler)
    built = library.read_bytes()
    foreign = build_foreign(tmp_path, marker)
    for tamper in ("replaced", "no digest", "writable by others"):
        if tamper == "replaced":
            library.write_bytes(foreign)
        elif tamper == "no digest":
            library.write_bytes(foreign)
            library.with_suffix(".sha256").unlink()
        else:  # the right bytes, but anyone could have swapped them before this load
            library.chmod(0o777)
        assert nvfp4_cpu._build(compiler) == library, tamper
        assert library.read_bytes() == built and (library.stat().st_mode & 0o022) == 0, tamper

    library.write_bytes(foreign)
    code = ("from fp4kit.native import nvfp4_cpu\n"
            "from fp4kit.nvfp4 import quantize_group\n"
            "import torch\n"
            "w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)).bfloat16()\n"
            "q = quantize_group([w], native=True)[0]\n"
            "print(nvfp4_cpu.available(), q.packed.sum().item())\n")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), capture_output=True, text=True,
                         check=True).stdout
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert out.split() == ["True", str(quantize_group([w])[0].packed.sum().item())]
    assert not marker.exists() and library.read_bytes() == built


def test_the_foreign_library_would_leave_its_marker(tmp_path):
    """The marker of the test above works: loading the foreign library does leave it."""
    import ctypes

    marker = tmp_path / "loaded"
    path = tmp_path / "load-me.so"
    path.write_bytes(build_foreign(tmp_path, marker))
    ctypes.CDLL(str(path))
    assert marker.exists()


# --- FP8-block weights quantized from their stored codes (fp4kit_fp8_block_amax / fp4kit_encode_fp8_block) ---------

E4M3_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
NAN_CODES = (0x7F, 0xFF)


def fp8_values(codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The fp32 dequantization by torch ops: each e4m3 code's value times its block's multiplier, one fp32 product."""
    rows, cols = codes.shape
    full = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return codes.view(torch.float8_e4m3fn).to(torch.float32) * full


def fp8_weight(codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> nvfp4_cpu.Fp8BlockWeight:
    weight = nvfp4_cpu.fp8_block_weight(codes, scale_inv, block, E4M3_VALUES)
    assert weight is not None
    return weight


def adversarial_codes(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Random e4m3 codes (no NaN) led by every finite code, with all-zero and negative-zero 16-blocks, blocks of
    subnormal codes only, and blocks of the largest magnitudes."""
    codes = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, codes & 0x80, codes)
    flat = codes.view(-1)
    finite = torch.tensor([c for c in range(256) if c not in NAN_CODES], dtype=torch.int32)
    flat[: min(flat.numel(), finite.numel())] = finite[: flat.numel()]
    blocks = codes.view(rows, cols // 16, 16)
    kind = torch.randint(0, 8, blocks.shape[:2], generator=gen)
    blocks[kind == 0] = 0
    blocks[kind == 1] = 0x80
    blocks[kind == 2] &= 0x87  # subnormal codes: exponent field 0
    blocks[kind == 3] = torch.tensor([0x7E, 0xFE, 0x7D, 0x00] * 4, dtype=torch.int32)
    return codes.to(torch.uint8)


def adversarial_scales(grid: tuple[int, int], exponent: int, gen: torch.Generator) -> torch.Tensor:
    """fp32 multipliers around 2^exponent over a few octaves, with zeros, negative ones and fp32 subnormals."""
    scale = 2.0 ** (exponent + 6 * torch.rand(grid, generator=gen) - 3)
    kind = torch.randint(0, 10, grid, generator=gen)
    scale = torch.where(kind == 0, torch.zeros_like(scale), scale)
    scale = torch.where(kind == 1, -scale, scale)
    scale = torch.where(kind == 2, torch.full_like(scale, -0.0), scale)
    scale = torch.where(kind == 3, scale * 2.0**-130, scale)  # subnormal fp32 multipliers and products
    return scale.to(torch.float32)


FP8_CASES = [((200, 336), (128, 128)), ((128, 256), (128, 128)), ((300, 64), (128, 128)), ((1, 16), (128, 128)),
             ((96, 160), (64, 48)), ((33, 48), (1, 16)), ((70, 96), (7, 32)), ((40, 128), (128, 16))]


@pytest.mark.parametrize(("shape", "block"), FP8_CASES)
@pytest.mark.parametrize("exponent", [0, -20, 60, -125])
def test_fp8_block_codes_match_the_torch_path(shape, block, exponent):
    """Shapes that are not multiples of the block, every finite code, zero and subnormal blocks, the largest codes,
    multipliers of both signs, zero and subnormal: the codes path gives the bytes of the torch ops on the fp32
    dequantization (and of the C loop's fp32 path)."""
    gen = torch.Generator().manual_seed(hash((shape, block, exponent)) % 2**31)
    grid = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    codes, scale_inv = adversarial_codes(*shape, gen), adversarial_scales(grid, exponent, gen)
    values = fp8_values(codes, scale_inv, block)
    for exact_fp32 in (False, True):
        from_codes = quantize_group([fp8_weight(codes, scale_inv, block)], exact_fp32, native=True)[0]
        assert_same(from_codes, quantize_group([values], exact_fp32, native=False)[0])
        assert_same(from_codes, quantize_group([values], exact_fp32, native=True)[0])


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 300), st.integers(1, 12), st.sampled_from([1, 5, 64, 128]),
       st.sampled_from([16, 48, 128]), st.integers(-126, 100))
def test_fp8_block_codes_random(seed, rows, k_blocks, bm, bn, exponent):
    gen = torch.Generator().manual_seed(seed)
    cols = 16 * k_blocks
    grid = (-(-rows // bm), -(-cols // bn))
    codes = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, codes & 0x80, codes).to(torch.uint8)
    scale_inv = (2.0 ** (exponent + 4 * torch.rand(grid, generator=gen) - 2)).to(torch.float32)
    values = fp8_values(codes, scale_inv, (bm, bn))
    if not torch.isfinite(values).all():  # products past fp32's range: both paths refuse them
        with pytest.raises(NonFiniteError):
            quantize_group([fp8_weight(codes, scale_inv, (bm, bn))], native=True)
        return
    assert_same(quantize_group([fp8_weight(codes, scale_inv, (bm, bn))], native=True)[0],
                quantize_group([values], native=False)[0])


def test_fp8_block_codes_in_fused_groups():
    """gate/up (and q/k/v) share one global scale: FP8 members from their codes, alone or beside a bf16 member."""
    gen = torch.Generator().manual_seed(7)
    block = (128, 128)
    members = []
    for rows, exponent in ((192, -8), (64, -6), (130, -9)):
        grid = (-(-rows // 128), 2)
        members.append((adversarial_codes(rows, 256, gen), adversarial_scales(grid, exponent, gen)))
    values = [fp8_values(c, s, block) for c, s in members]
    stored = [fp8_weight(c, s, block) for c, s in members]
    for native_q, torch_q in zip(quantize_group(stored, native=True), quantize_group(values), strict=True):
        assert_same(native_q, torch_q)
    bf16 = (torch.randn(32, 256, generator=gen) * 1e-2).bfloat16()
    for native_q, torch_q in zip(quantize_group([stored[0], bf16], native=True), quantize_group([values[0], bf16]),
                                 strict=True):
        assert_same(native_q, torch_q)
    # where the group cannot take the C loop (an fp16 member), the stored weights are quantized as their values
    half = bf16.half()
    for stored_q, torch_q in zip(quantize_group([stored[1], half], native=True), quantize_group([values[1], half]),
                                 strict=True):
        assert_same(stored_q, torch_q)


@pytest.mark.parametrize("bad", ["nan code", "negative nan code", "inf scale", "nan scale", "overflow",
                                 "inf scale on zeros"])
def test_fp8_block_codes_nan_and_inf_are_refused(bad):
    """As the torch path: a NaN code, a non-finite multiplier, or a product past fp32's range is refused."""
    gen = torch.Generator().manual_seed(11)
    codes = adversarial_codes(200, 272, gen)
    scale_inv = adversarial_scales((2, 3), -5, gen)
    if bad == "nan code":
        codes[150, 260] = 0x7F
    elif bad == "negative nan code":
        codes[3, 17] = 0xFF
    elif bad == "inf scale":
        scale_inv[1, 2] = float("inf")
    elif bad == "nan scale":
        scale_inv[0, 1] = float("nan")
    elif bad == "overflow":
        scale_inv[1, 0] = 1e37
        codes[140, 5] = 0xFE  # -448 * 1e37
    else:  # an all-zero block times Inf: 0 * Inf is NaN
        codes[128:, 256:] = 0
        scale_inv[1, 2] = float("inf")
    with pytest.raises(NonFiniteError):
        quantize_group([fp8_values(codes, scale_inv, (128, 128))], native=False)
    with pytest.raises(NonFiniteError):
        quantize_group([fp8_weight(codes, scale_inv, (128, 128))], native=True)


def test_fp8_block_layouts_the_codes_path_does_not_read():
    codes, scale_inv = torch.zeros(64, 96, dtype=torch.uint8), torch.ones(1, 4)
    assert nvfp4_cpu.fp8_block_weight(codes, scale_inv, (64, 24), E4M3_VALUES) is None  # 16-blocks across scales
    assert nvfp4_cpu.fp8_block_weight(codes[:, :90], scale_inv, (64, 24), E4M3_VALUES) is None  # K % 16
    assert nvfp4_cpu.fp8_block_weight(codes[:0], torch.ones(0, 1), (64, 128), E4M3_VALUES) is None  # no rows
    with pytest.raises(ValueError, match="block multipliers"):
        nvfp4_cpu.fp8_block_weight(codes, torch.ones(1, 2), (64, 32), E4M3_VALUES)
