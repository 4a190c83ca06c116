"""Streaming reader and writer for HF safetensors checkpoint directories.

The reader takes the tensors' byte ranges from fp4kit.io.safetensors_files (headers validated, index and shards
reconciled) and reads one tensor's byte range (or one slice along dim 0) with
``os.pread`` into a buffer of its own, so resident memory follows the tensor being processed, not the shard. Bytes
that go to the output unchanged can instead be ``mapped``: a view of the file whose pages are read only where
touched, and whose place in the file (``file_span``) lets the writer copy them file to file inside the kernel
(``copy_file_range``), with no pass through a buffer. The writer is told every output tensor (name, dtype, shape)
before any data arrives, lays out shards and headers from that plan, then places each tensor's bytes at its offset
as it comes; nothing waits in memory for a shard to fill. A producer that computes a large tensor can instead ask
for its ``destination``, a tensor mapped onto the shard's bytes, and compute into it: no buffer of its own to fault
in, no second copy into the page cache.
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
import struct
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from fp4kit.errors import Fp4kitError
from fp4kit.io.safetensors_files import (  # noqa: F401  (read_config, parse_size: re-exported for callers)
    INDEX_NAME,
    SINGLE_NAME,
    WEIGHT_SUFFIXES,
    HeaderEntry,
    checkpoint_files,
    parse_size,
    read_config,
    shard_layout,
)

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# the bits that are all ones exactly in NaN (E4M3FN has no Inf) / in NaN and Inf (E5M2) / in NaN (E8M0: 0xFF)
_FP8_NONFINITE = {torch.float8_e4m3fn: (0x7F, 0x7F), torch.float8_e5m2: (0x7C, 0x7C),
                  torch.float8_e8m0fnu: (0xFF, 0xFF)}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def has_nonfinite(tensor: torch.Tensor) -> bool:
    """Whether a floating-point tensor holds NaN or Inf (two reductions, no copy of the tensor)."""
    if not tensor.dtype.is_floating_point or tensor.numel() == 0:
        return False
    if tensor.dtype in _FP8_NONFINITE:
        mask, value = _FP8_NONFINITE[tensor.dtype]
        return bool((tensor.view(torch.uint8) & mask).eq(value).any())
    low, high = torch.aminmax(tensor)
    return not bool(torch.isfinite(low) & torch.isfinite(high))


def require_finite(name: str, tensor: torch.Tensor, file: Path | str) -> None:
    if has_nonfinite(tensor):
        raise Fp4kitError(f"{file}: tensor {name} holds NaN or Inf")


def _tensor_info(entry: HeaderEntry) -> TensorInfo:
    return TensorInfo(entry.name, entry.file, DTYPES[entry.dtype], entry.shape, entry.begin, entry.end)


class CheckpointReader:
    """Tensor metadata of a HF checkpoint directory (validated and reconciled by
    fp4kit.io.safetensors_files.checkpoint_files), and reads of one tensor at a time. Every read checks that a
    floating-point tensor is finite, unless the caller checks it itself (``check_finite=False``)."""

    def __init__(self, root: str | os.PathLike, pin_memory: bool = False, check_finite: bool = True):
        """``pin_memory``: read into page-locked buffers, for fast non-blocking copies to a GPU. ``check_finite``:
        the default of every read's check (False for health checks that report non-finite values themselves)."""
        self.root = Path(root)
        self.pin_memory = pin_memory
        self.check_finite = check_finite
        files = checkpoint_files(self.root)
        self.metadata: dict[str, str] = files.metadata
        self.tensors: dict[str, TensorInfo] = {name: _tensor_info(entry) for name, entry in files.tensors.items()}
        self._fds: dict[Path, int] = {}
        self._fds_lock = threading.Lock()  # reads may come from several threads
        # live mappings of ``mapped``: id -> (the mapping's weak reference, its address, length, fd, file offset)
        self._mappings: dict[int, tuple[weakref.ref, int, int, int, int]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            with self._fds_lock:
                fd = self._fds.get(path)
                if fd is None:
                    fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def _pread(self, info: TensorInfo, begin: int, nbytes: int) -> torch.Tensor:
        # torch.empty, not bytearray: no zero-filling pass over a buffer the read overwrites anyway
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        self._pread_into(info, begin, buffer)
        return buffer

    def _pread_into(self, info: TensorInfo, begin: int, buffer: torch.Tensor) -> None:
        view = memoryview(buffer.numpy())
        nbytes = len(view)
        fd = self._fd(info.file)
        done = 0
        while done < nbytes:
            got = os.preadv(fd, [view[done:]], begin + done)
            if got <= 0:
                raise Fp4kitError(f"{info.file}: truncated while reading tensor {info.name}")
            done += got

    def read(self, name: str, check_finite: bool | None = None) -> torch.Tensor:
        """The whole tensor, in a buffer of its own."""
        info = self.tensors[name]
        raw = self._pread(info, info.begin, info.nbytes)
        tensor = raw.view(info.dtype).reshape(info.shape)
        if self.check_finite if check_finite is None else check_finite:
            require_finite(name, tensor, info.file)
        return tensor

    def read_into(self, name: str, out: torch.Tensor, check_finite: bool | None = None) -> None:
        """Read the whole tensor into ``out`` (contiguous, CPU, same dtype and shape), without a buffer between."""
        info = self.tensors[name]
        if out.dtype != info.dtype or tuple(out.shape) != info.shape or not out.is_contiguous() or out.is_cuda:
            raise Fp4kitError(f"internal: {name} is {info.dtype}{list(info.shape)}, cannot be read into "
                              f"{out.dtype}{list(out.shape)}")
        self._pread_into(info, info.begin, out.reshape(-1).view(torch.uint8))
        if self.check_finite if check_finite is None else check_finite:
            require_finite(name, out, info.file)

    def read_rows(self, name: str, start: int, stop: int, check_finite: bool | None = None) -> torch.Tensor:
        """tensor[start:stop] along dim 0 (e.g. one expert of a fused [E, ...] tensor) without reading the rest."""
        info = self.tensors[name]
        row_bytes = info.nbytes // info.shape[0]
        raw = self._pread(info, info.begin + start * row_bytes, (stop - start) * row_bytes)
        tensor = raw.view(info.dtype).reshape((stop - start, *info.shape[1:]))
        if self.check_finite if check_finite is None else check_finite:
            require_finite(name, tensor, info.file)
        return tensor

    def mapped(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """The tensor, or tensor[start:stop] along dim 0, as a view of its bytes in the file: a private mapping whose
        pages come from the page cache where touched, nothing copied (callers only read it: a write would stay in
        this process). Not checked for NaN or Inf. ``file_span`` says where a view of it lies in the file."""
        info = self.tensors[name]
        if start is None or stop is None or not info.shape:
            start, stop, shape = 0, 1, info.shape
            row_bytes = info.nbytes
        else:
            shape = (stop - start, *info.shape[1:])
            row_bytes = info.nbytes // info.shape[0]
        begin, nbytes = info.begin + start * row_bytes, (stop - start) * row_bytes
        if nbytes == 0:
            return torch.empty(shape, dtype=info.dtype)
        fd = self._fd(info.file)
        aligned = begin - begin % mmap.ALLOCATIONGRANULARITY
        mapping = mmap.mmap(fd, begin + nbytes - aligned, flags=mmap.MAP_PRIVATE,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=aligned)
        whole = torch.frombuffer(mapping, dtype=torch.uint8)
        key = id(mapping)
        # dict operations are atomic, and file_span reads a snapshot: the callback may run on any thread
        self._mappings[key] = (weakref.ref(mapping, lambda _: self._mappings.pop(key, None)), whole.data_ptr(),
                               len(mapping), fd, aligned)
        return whole[begin - aligned : begin - aligned + nbytes].view(info.dtype).reshape(shape)

    def file_span(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        """(file descriptor, offset) where the bytes of ``tensor`` lie in a source file, when it is a contiguous view
        of a live ``mapped`` tensor; else None. A live mapping holds its address range, so a tensor inside one is a
        view of it."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() == 0:
            return None
        begin = tensor.data_ptr()
        end = begin + tensor.numel() * tensor.element_size()
        for ref, address, length, fd, offset in list(self._mappings.values()):
            if address <= begin and end <= address + length and ref() is not None:
                return fd, offset + begin - address
        return None

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class ShardWriter:
    """Writes a planned set of tensors into safetensors shards inside ``directory``.

    ``write`` may be called in any order, and from several threads at once (each tensor has its own byte range);
    ``finish`` checks that every planned tensor arrived and writes the index.
    Several processes can fill one output (fp4kit.quantize.distributed): one writer creates the shards, the others open
    them with ``create=False``; each is told the names it writes (``written_here``) and checks only those.
    """

    def __init__(
        self,
        directory: Path,
        plan: Iterable[PlannedTensor],
        max_shard_bytes: int,
        metadata: dict[str, str] | None = None,
        written_here: Iterable[str] | None = None,
        create: bool = True,
    ):
        self.directory = directory
        self.create = create
        plan = list(plan)
        names = [t.name for t in plan]
        if len(set(names)) != len(names):
            dupes = sorted({n for n in names if names.count(n) > 1})
            raise Fp4kitError(f"output would contain tensor {dupes[0]} twice")
        shards = shard_layout(plan, max_shard_bytes)
        count = len(shards)
        self.files: list[str] = []
        self.slots: dict[str, tuple[int, int, PlannedTensor]] = {}  # name -> (file idx, absolute offset, tensor)
        self.total_bytes = 0
        self._fds: list[int] = []
        for i, shard in enumerate(shards):
            fname = SINGLE_NAME if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
            offset = 0
            for t in shard:
                header[t.name] = {
                    "dtype": DTYPE_NAMES[t.dtype],
                    "shape": list(t.shape),
                    "data_offsets": [offset, offset + t.nbytes],
                }
                offset += t.nbytes
            header_bytes = json.dumps(header, separators=(",", ":")).encode()
            header_bytes += b" " * (-len(header_bytes) % 8)
            data_start = 8 + len(header_bytes)
            if create:
                fd = os.open(directory / fname, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                os.pwrite(fd, struct.pack("<Q", len(header_bytes)) + header_bytes, 0)
                os.ftruncate(fd, data_start + offset)
            else:
                fd = os.open(directory / fname, os.O_RDWR)
            self._fds.append(fd)
            self.files.append(fname)
            for t in shard:
                entry = header[t.name]
                self.slots[t.name] = (i, data_start + entry["data_offsets"][0], t)  # type: ignore[index]
            self.total_bytes += offset
        self.pending = set(self.slots) if written_here is None else set(written_here)
        self._destinations: dict[str, int] = {}  # name -> data_ptr of the mapped tensor handed out

    def destination(self, name: str) -> torch.Tensor | None:
        """The planned tensor as a writable CPU tensor mapped (MAP_SHARED) onto its bytes in the shard, or None where
        that is not possible (its offset is not 8-byte aligned, or the platform cannot map it). Fill it, then hand it
        to :meth:`write` like any tensor: ``write`` sees that the bytes are already in place and only records them.
        The mapping lives as long as the tensor (and its views); the file's blocks are allocated first, so a full
        disk is an OSError here rather than a SIGBUS while filling."""
        file_idx, offset, planned = self._slot(name)
        if offset % 8 or planned.nbytes == 0 or not hasattr(os, "posix_fallocate"):
            return None
        fd = self._fds[file_idx]
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        try:
            os.posix_fallocate(fd, offset, planned.nbytes)
            mapping = mmap.mmap(fd, offset + planned.nbytes - start, flags=mmap.MAP_SHARED,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise
            return None  # a file system that cannot preallocate or map files: write() copies instead
        tensor = torch.frombuffer(mapping, dtype=torch.uint8, count=planned.nbytes, offset=offset - start)
        tensor = tensor.view(planned.dtype).reshape(planned.shape)
        self._destinations[name] = tensor.data_ptr()
        return tensor

    def _slot(self, name: str) -> tuple[int, int, PlannedTensor]:
        try:
            return self.slots[name]
        except KeyError:
            raise Fp4kitError(f"internal: tensor {name} was not planned for output") from None

    def write(self, name: str, tensor: torch.Tensor, source: tuple[int, int] | None = None) -> None:
        """Place a tensor's bytes. ``source``: (file descriptor, offset) where the same bytes lie in a file (a
        reader's ``file_span``): copied file to file inside the kernel, no pass through a buffer of this process."""
        file_idx, offset, planned = self._slot(name)
        if tensor.dtype != planned.dtype or tuple(tensor.shape) != planned.shape:
            raise Fp4kitError(
                f"internal: tensor {name} is {tensor.dtype}{list(tensor.shape)}, "
                f"planned {planned.dtype}{list(planned.shape)}"
            )
        if self._destinations.get(name) == tensor.data_ptr() and tensor.is_contiguous():
            del self._destinations[name]  # filled in place through destination()
            self.pending.discard(name)
            return
        if source is not None and self._copy_file_range(source, file_idx, offset, planned.nbytes):
            self.pending.discard(name)
            return
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        fd = self._fds[file_idx]
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)
        self.pending.discard(name)

    def _copy_file_range(self, source: tuple[int, int], file_idx: int, offset: int, nbytes: int) -> bool:
        """Copy ``nbytes`` from ``source`` to ``offset`` of shard ``file_idx`` inside the kernel; False where the
        platform or the file systems cannot (the caller then writes the bytes itself)."""
        fd, begin = source
        done = 0
        try:
            while done < nbytes:
                got = os.copy_file_range(fd, self._fds[file_idx], nbytes - done, begin + done, offset + done)
                if got <= 0:
                    break
                done += got
        except (AttributeError, OSError) as exc:
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EIO, errno.EDQUOT):
                raise
        return done == nbytes

    def finish(self) -> None:
        if self.pending:
            raise Fp4kitError(f"internal: {len(self.pending)} planned tensors were never written, e.g. "
                              f"{sorted(self.pending)[0]}")
        for fd in self._fds:
            os.fsync(fd)
            os.close(fd)
        self._fds.clear()
        if self.create and len(self.files) > 1:
            weight_map = {name: self.files[slot[0]] for name, slot in sorted(self.slots.items())}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")

    def abort(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


SKIP_FILES = {INDEX_NAME, "config.json", "hf_quant_config.json"}


def copy_side_files(src: Path, dst: Path, skip: Iterable[str] = ()) -> list[str]:
    """Copy SRC's side files (``fp4kit.io.shard_io.SIDE_FILES``: tokenizer, templates, processors, remote code,
    licence) but the files fp4kit rewrites (``SKIP_FILES``) and those in ``skip``."""
    from fp4kit.io.shard_io import copy_side_files as copy_named

    return copy_named(src, dst, skip=SKIP_FILES | set(skip))
