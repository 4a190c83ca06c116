"""NVFP4 quantization of bf16 and fp32 weights on the CPU through a small C loop (nvfp4_cpu.c), built on first use;
also of FP8-block weights straight from their stored e4m3 codes (``Fp8BlockWeight``: the bytes of their fp32 values),
and the block scales of the exact MXFP4 cast (``mxfp4_top``, ``mxfp4_cast_scales``: fp4kit.nvfp4.cast_mxfp4_group).

The C file is compiled with the system C compiler into a per-user cache (like inductor or triton do) and loaded
with ctypes; the call releases the GIL, so the reader and writer threads keep going while a group is encoded. Where
no compiler works, ``available()`` is False and fp4kit.nvfp4 quantizes with torch ops: the same bytes, slower.

A cached library is named by a hash of everything that decides its bytes (the shipped C source, the compiler's
resolved path and ``--version``, the flags, the platform), so a changed source or compiler never finds a stale
build. Beside it a ``.sha256`` file records the digest of what the build wrote; a library whose bytes do not match
it, or either file owned by another user or writable by others, is rebuilt before anything loads it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

SOURCE = Path(__file__).with_name("nvfp4_cpu.c")
# -ffp-contract=off: no FMA contraction, every fp32 step rounds as torch's does; no -ffast-math (no flush-to-zero)
CFLAGS = ["-O3", "-std=c11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno"]
BLOCK = 16

_lock = threading.Lock()
_library: ctypes.CDLL | None | bool = None  # False: tried and failed


def cache_dir() -> Path:
    root = os.environ.get("FP4KIT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fp4kit"
    )
    return Path(root)


def _compiler() -> str | None:
    candidates = [os.environ.get("CC"), (sysconfig.get_config_var("CC") or "").split(" ")[0], "cc", "gcc", "clang"]
    for name in candidates:
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build_key(compiler: str) -> str:
    """Hash of the inputs that decide the library's bytes: source, compiler (resolved path and version), flags."""
    version = subprocess.run([compiler, "--version"], capture_output=True, timeout=60).stdout
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), os.path.realpath(compiler).encode(), version, " ".join(CFLAGS).encode(),
                 sys.platform.encode(), platform.machine().encode()):
        digest.update(len(part).to_bytes(8, "little") + part)  # length-prefixed: no two inputs hash alike
    return digest.hexdigest()[:32]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _trusted(library: Path, recorded: Path) -> bool:
    """Whether ``library`` is what this user's build wrote: both files ours, not writable by others, digest equal."""
    try:
        for path in (library, recorded):
            info = path.stat()
            if info.st_uid != os.getuid() or info.st_mode & 0o022:
                return False
        return recorded.read_text().strip() == _sha256(library)
    except (OSError, UnicodeDecodeError):
        return False


def _build(compiler: str) -> Path:
    target = cache_dir() / f"nvfp4_cpu-{build_key(compiler)}.so"
    recorded = target.with_suffix(".sha256")
    if _trusted(target, recorded):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: concurrent processes (torchrun ranks) never load a half-written file; a
    # reader that sees one process's digest beside another's library rebuilds rather than loading it
    fd, partial = tempfile.mkstemp(prefix=target.stem, suffix=".so.partial", dir=target.parent)
    os.close(fd)
    fd, partial_digest = tempfile.mkstemp(prefix=target.stem, suffix=".sha256.partial", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *CFLAGS, "-o", partial, str(SOURCE), "-lm"], check=True, capture_output=True,
                       timeout=120)
        os.chmod(partial, 0o755)
        Path(partial_digest).write_text(_sha256(Path(partial)) + "\n")
        os.chmod(partial_digest, 0o644)
        os.replace(partial_digest, recorded)
        os.replace(partial, target)
    finally:
        for path in (partial, partial_digest):
            if os.path.exists(path):
                os.unlink(path)
    if not _trusted(target, recorded):  # another process replaced one of them meanwhile: load nothing
        raise OSError(f"{target}: changed while it was being built")
    return target


def _load() -> ctypes.CDLL | None:
    global _library
    with _lock:
        if _library is None:
            _library = False
            if os.environ.get("FP4KIT_NATIVE", "1") != "0" and (compiler := _compiler()) is not None:
                try:
                    library = ctypes.CDLL(str(_build(compiler)))
                except (OSError, subprocess.SubprocessError):
                    library = None
                if library is not None:
                    for suffix in ("bf16", "f32"):
                        getattr(library, f"fp4kit_block_amax_{suffix}").restype = ctypes.c_int
                        getattr(library, f"fp4kit_block_amax_{suffix}").argtypes = [
                            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
                        getattr(library, f"fp4kit_encode_{suffix}").restype = ctypes.c_int
                        getattr(library, f"fp4kit_encode_{suffix}").argtypes = [
                            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p,
                            ctypes.c_void_p,
                        ]
                    library.fp4kit_dequant_fp8_block.restype = ctypes.c_int
                    library.fp4kit_dequant_fp8_block.argtypes = [
                        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                        ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                    ]
                    library.fp4kit_fp8_block_amax.restype = ctypes.c_int
                    library.fp4kit_fp8_block_amax.argtypes = [
                        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                        ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                    ]
                    library.fp4kit_encode_fp8_block.restype = ctypes.c_int
                    library.fp4kit_encode_fp8_block.argtypes = [
                        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                        ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p,
                    ]
                    library.fp4kit_mse_encode_bf16.restype = ctypes.c_int
                    library.fp4kit_mse_encode_bf16.argtypes = [
                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p,
                        ctypes.c_int, ctypes.c_float, ctypes.c_float, ctypes.c_void_p, ctypes.c_int64,
                        ctypes.c_void_p, ctypes.c_void_p,
                    ]
                    library.fp4kit_mxfp4_top.restype = ctypes.c_int
                    library.fp4kit_mxfp4_top.argtypes = [
                        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                        ctypes.c_int64,
                    ]
                    library.fp4kit_mxfp4_cast_scales.restype = ctypes.c_int64
                    library.fp4kit_mxfp4_cast_scales.argtypes = [
                        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                        ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                    ]
                    _library = library
        return _library or None


def available() -> bool:
    return _load() is not None


_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


@dataclass(frozen=True)
class Fp8BlockWeight:
    """An FP8-block weight as stored (fp4kit.io.sources): e4m3 codes [N, K] as uint8, one fp32 multiplier per
    (bm, bn) block [ceil(N/bm), ceil(K/bn)], ``table`` the fp32 value of each code. block_amax and encode take it as
    they take its fp32 dequantization and give the same bytes, reading one byte per weight; ``dequantize()`` gives
    that fp32 tensor. Made by ``fp8_block_weight`` where the C loop reads it."""

    codes: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]
    table: torch.Tensor
    dtype: ClassVar[torch.dtype] = torch.float32  # of the values it stands for

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        return dequantize_fp8_block(self.codes, self.scale_inv, self.block, self.table)


def fp8_block_weight(codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     table: torch.Tensor) -> Fp8BlockWeight | None:
    """The stored weight for block_amax and encode, or None where the C loop does not read it: not on the CPU, K not
    a multiple of 16, 16-blocks that straddle two scale blocks (bn not a multiple of 16), or no weights at all."""
    if (codes.device.type != "cpu" or codes.dim() != 2 or codes.shape[1] % BLOCK or block[1] % BLOCK
            or codes.numel() == 0 or not available()):
        return None
    rows, cols = codes.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(f"block multipliers {list(scale_inv.shape)} for codes {[rows, cols]}, expected {list(grid)}")
    return Fp8BlockWeight(codes.view(torch.uint8).contiguous(), scale_inv.to(torch.float32).contiguous(),
                          block, table.to(torch.float32).contiguous())


def as_tensor(weight: torch.Tensor | Fp8BlockWeight) -> torch.Tensor:
    """A weight as a tensor: an Fp8BlockWeight's fp32 values, a tensor itself."""
    return weight.dequantize() if isinstance(weight, Fp8BlockWeight) else weight


def handles(weight: torch.Tensor | Fp8BlockWeight) -> bool:
    """Whether this weight can take the native path of block_amax and encode (and the library is built)."""
    if isinstance(weight, Fp8BlockWeight):
        return True
    return (weight.device.type == "cpu" and weight.dtype in _SUFFIX and weight.is_contiguous()
            and weight.shape[-1] % BLOCK == 0 and available())


def handles_mse(weight: torch.Tensor) -> bool:
    """Whether mse_encode takes this weight: bf16 only."""
    return weight.dtype == torch.bfloat16 and handles(weight)


def block_amax(weight: torch.Tensor | Fp8BlockWeight) -> tuple[torch.Tensor | None, torch.Tensor, bool]:
    """(max |x| per 16-block along K in the weight's dtype [..., K/16], the largest of them as a 0-d tensor, whether
    any value is NaN or Inf). For an Fp8BlockWeight no per-block amax (None: encode finds each block's as it reads
    the block) and the fp32 tensor amax of its values."""
    if isinstance(weight, Fp8BlockWeight):
        rows, cols = weight.shape
        tensor_amax = torch.zeros((), dtype=torch.float32)
        nonfinite = _load().fp4kit_fp8_block_amax(
            weight.codes.data_ptr(), rows, cols, weight.scale_inv.data_ptr(), weight.block[0], weight.block[1],
            weight.table.data_ptr(), tensor_amax.data_ptr())
        if nonfinite < 0:
            raise MemoryError("fp4kit_fp8_block_amax")
        return None, tensor_amax, bool(nonfinite)
    amax = torch.empty((*weight.shape[:-1], weight.shape[-1] // BLOCK), dtype=weight.dtype)
    tensor_amax = torch.zeros((), dtype=weight.dtype)
    nonfinite = getattr(_load(), f"fp4kit_block_amax_{_SUFFIX[weight.dtype]}")(
        weight.data_ptr(), amax.numel(), amax.data_ptr(), tensor_amax.data_ptr())
    return amax, tensor_amax, bool(nonfinite)


def encode(weight: torch.Tensor | Fp8BlockWeight, amax: torch.Tensor | None,
           global_mul: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes uint8 [..., K/2], fp8 block scales [..., K/16]) of a weight with one fp32 multiplier G; ``amax``
    what block_amax returned (which also checked that an Fp8BlockWeight is finite)."""
    if isinstance(weight, Fp8BlockWeight):
        rows, cols = weight.shape
        packed = torch.empty((rows, cols // 2), dtype=torch.uint8)
        block_scale = torch.empty((rows, cols // BLOCK), dtype=torch.uint8)
        if _load().fp4kit_encode_fp8_block(
                weight.codes.data_ptr(), rows, cols, weight.scale_inv.data_ptr(), weight.block[0], weight.block[1],
                weight.table.data_ptr(), ctypes.c_float(global_mul), packed.data_ptr(), block_scale.data_ptr()):
            raise MemoryError("fp4kit_encode_fp8_block")
        return packed, block_scale.view(torch.float8_e4m3fn)
    if amax is None:
        raise ValueError("amax must be the block amax of the weight")
    if not amax.is_contiguous() or amax.dtype != weight.dtype:
        raise ValueError("amax must be the contiguous block amax of the weight, in its dtype")
    packed = torch.empty((*weight.shape[:-1], weight.shape[-1] // 2), dtype=torch.uint8)
    block_scale = torch.empty(amax.shape, dtype=torch.uint8)
    getattr(_load(), f"fp4kit_encode_{_SUFFIX[weight.dtype]}")(
        weight.data_ptr(), amax.data_ptr(), amax.numel(), ctypes.c_float(global_mul), packed.data_ptr(),
        block_scale.data_ptr())
    return packed, block_scale.view(torch.float8_e4m3fn)


def dequantize_fp8_block(codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                         table: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] of uint8 e4m3 codes [N, K] times their fp32 block multipliers [ceil(N/bm), ceil(K/bn)] (one pass;
    fp4kit.io.sources.dequantize_fp8_block's values). ``table``: fp32 [256], the value of each code."""
    rows, cols = codes.shape
    codes, scale_inv, table = codes.contiguous(), scale_inv.to(torch.float32).contiguous(), table.contiguous()
    out = torch.empty((rows, cols), dtype=torch.float32)
    _load().fp4kit_dequant_fp8_block(codes.data_ptr(), rows, cols, scale_inv.data_ptr(), block[0], block[1],
                                     table.data_ptr(), out.data_ptr())
    return out


MX_BLOCK = 32


def handles_mxfp4(packed: torch.Tensor, exponents: torch.Tensor) -> bool:
    """Whether mxfp4_top and mxfp4_cast_scales read this MXFP4 weight in place: uint8 code bytes [N, K/2] (K a
    multiple of 16) and exponent bytes [N, ceil(K/32)] on the CPU, each row's bytes contiguous (rows may be strided,
    as a fused tensor's row slices are), and the library built."""
    return (packed.device.type == "cpu" and exponents.device.type == "cpu" and packed.dtype == torch.uint8
            and exponents.dtype == torch.uint8 and packed.dim() == 2 and exponents.dim() == 2
            and packed.shape[1] % (BLOCK // 2) == 0
            and tuple(exponents.shape) == (packed.shape[0], -(-packed.shape[1] * 2 // MX_BLOCK))
            and (packed.shape[1] <= 1 or packed.stride(1) == 1)
            and (exponents.shape[1] <= 1 or exponents.stride(1) == 1)
            and available())


def mxfp4_top(packed: torch.Tensor, exponents: torch.Tensor) -> int:
    """The largest exponent byte of a 32-block holding a nonzero code (-1: every code is zero; -2: an exponent byte
    is 255, NaN) of a weight ``handles_mxfp4`` takes."""
    return _load().fp4kit_mxfp4_top(exponents.data_ptr(), exponents.stride(0), packed.data_ptr(), packed.stride(0),
                                    packed.shape[0], packed.shape[1])


def mxfp4_cast_scales(packed: torch.Tensor, exponents: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(E4M3 block-scale bytes uint8 [N, K/16] of 2^(e - 127 + m) clamped to 2^-9 .. 2^8, the 16-blocks holding a
    nonzero code whose scale was clamped as bool [N, K/16], how many) of a weight ``handles_mxfp4`` takes."""
    rows, blocks = packed.shape[0], packed.shape[1] // (BLOCK // 2)
    scale = torch.empty((rows, blocks), dtype=torch.uint8)
    redo = torch.zeros((0, blocks), dtype=torch.bool)
    for _ in range(2):  # the mask only where some block needs it (rare): a second pass then
        count = _load().fp4kit_mxfp4_cast_scales(exponents.data_ptr(), exponents.stride(0), packed.data_ptr(),
                                                 packed.stride(0), rows, packed.shape[1], m, scale.data_ptr(),
                                                 redo.data_ptr() if redo.numel() else None)
        if not count or redo.numel():
            break
        redo = torch.zeros((rows, blocks), dtype=torch.bool)
    return scale, redo, int(count)


# the mse search costs ~10x the RTN encode per weight: large tensors are split by rows over a few threads (the C
# call releases the GIL)
MSE_THREADS = min(4, os.cpu_count() or 1)
MSE_SPLIT_BLOCKS = 1 << 16
_pool: ThreadPoolExecutor | None = None


def mse_encode(weight: torch.Tensor, amax: torch.Tensor, global_mul: float, offsets: tuple[int, ...],
               importance: torch.Tensor | None, bounds: tuple[float, float] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """encode() with block scales chosen by fp4kit.quantize.scale_search's search (same bytes): the RTN code and the
    codes ``offsets`` away, by squared error weighted by ``importance`` (fp32 [K], one per input channel); with
    ``bounds`` (low, high) only the offset codes within that range of the unrounded RTN scale (the range search),
    else also max-to-4."""
    global _pool
    if not amax.is_contiguous() or amax.dtype != torch.bfloat16:
        raise ValueError("amax must be the contiguous bf16 block amax of the weight")
    packed = torch.empty((*weight.shape[:-1], weight.shape[-1] // 2), dtype=torch.uint8)
    block_scale = torch.empty(amax.shape, dtype=torch.uint8)
    offsets_c = (ctypes.c_int32 * len(offsets))(*offsets)
    low, high = bounds if bounds is not None else (0.0, 0.0)
    if importance is not None:
        importance = importance.to(torch.float32).contiguous()
        if importance.shape != (weight.shape[-1],):
            raise ValueError(f"importance must be one fp32 weight per input channel, got {list(importance.shape)}")
    k_blocks = weight.shape[-1] // BLOCK
    rows = amax.numel() // k_blocks
    parts = MSE_THREADS if amax.numel() >= MSE_SPLIT_BLOCKS else 1
    bounds = [rows * i // parts for i in range(parts + 1)]

    def run(first: int, last: int) -> None:
        blocks = first * k_blocks
        _load().fp4kit_mse_encode_bf16(
            weight.data_ptr() + blocks * BLOCK * 2, amax.data_ptr() + blocks * 2, (last - first) * k_blocks,
            ctypes.c_float(global_mul), offsets_c, len(offsets), ctypes.c_float(low), ctypes.c_float(high),
            None if importance is None else importance.data_ptr(), k_blocks,
            packed.data_ptr() + blocks * (BLOCK // 2), block_scale.data_ptr() + blocks)

    if parts == 1:
        run(0, rows)
    else:
        with _lock:
            _pool = _pool or ThreadPoolExecutor(MSE_THREADS, thread_name_prefix="fp4kit-mse")
        for future in [_pool.submit(run, a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]:
            future.result()
    return packed, block_scale.view(torch.float8_e4m3fn)
