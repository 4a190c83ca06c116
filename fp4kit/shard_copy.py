"""Filling `fp4kit shard`'s output files by copying byte ranges straight from the source shards.

Sharding never changes a tensor's bytes (except a few activation scales, written from memory), so the data moves
file to file with ``os.copy_file_range``: inside the kernel, no tensor passes through this process's memory, and
tensors that are contiguous in both files move in one call. Each output file is checksummed (sha256) and fsynced on
a worker thread as soon as it is complete, while the next file is being copied.
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from fp4kit.shard_io import ShardLayout, SourceTensor

_CHUNK = 64 << 20  # bytes per copy call: bounds the work between progress reports
_BUFFER = 4 << 20
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP}


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    nbytes: int

    def as_json(self) -> dict[str, object]:
        return {"sha256": self.sha256, "bytes": self.nbytes}


def sha256_file(path: Path, fsync: bool = False) -> FileEntry:
    digest = hashlib.sha256()
    buffer = bytearray(_BUFFER)
    view = memoryview(buffer)
    fd = os.open(path, os.O_RDONLY)
    try:
        while got := os.readv(fd, [buffer]):
            digest.update(view[:got])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return FileEntry(digest.hexdigest(), path.stat().st_size)


@dataclass(frozen=True)
class CopyRun:
    """Bytes [src_offset, src_offset + nbytes) of ``src`` go to [dst_offset, dst_offset + nbytes) of the output."""

    src: Path
    src_offset: int
    dst_offset: int
    nbytes: int


def coalesce(runs: Iterable[CopyRun]) -> list[CopyRun]:
    merged: list[CopyRun] = []
    for run in runs:
        last = merged[-1] if merged else None
        if (last and last.src == run.src and last.src_offset + last.nbytes == run.src_offset
                and last.dst_offset + last.nbytes == run.dst_offset):
            merged[-1] = CopyRun(last.src, last.src_offset, last.dst_offset, last.nbytes + run.nbytes)
        else:
            merged.append(run)
    return merged


def file_jobs(layout: ShardLayout, tensors: list[SourceTensor], replaced: dict[str, bytes]
              ) -> dict[str, tuple[list[CopyRun], dict[int, bytes]]]:
    """Per output file of ``layout``: the source ranges to copy, in output order, and the bytes to write by offset."""
    jobs: dict[str, tuple[list[CopyRun], dict[int, bytes]]] = {f: ([], {}) for f in layout.files}
    for t in sorted(tensors, key=lambda t: layout.slots[t.name][1]):
        file, offset = layout.slots[t.name]
        runs, writes = jobs[file]
        if t.name in replaced:
            writes[offset] = replaced[t.name]
        else:
            runs.append(CopyRun(t.file, t.begin, offset, t.nbytes))
    return jobs


class ShardCopier:
    """Fills output files; ``results()`` waits for their checksums. ``progress(nbytes)`` is called as data moves."""

    def __init__(self, progress: Callable[[int], None] | None = None):
        self._src_fds: dict[Path, int] = {}
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="fp4kit-sha256")
        self._pending: dict[Path, Future[FileEntry]] = {}
        self._progress = progress
        self._kernel_copy = hasattr(os, "copy_file_range")

    def fill(self, path: Path, runs: list[CopyRun], writes: dict[int, bytes]) -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            for run in coalesce(runs):
                self._copy(run, fd)
            for offset, data in writes.items():
                if os.pwrite(fd, data, offset) != len(data):
                    raise OSError(errno.EIO, f"{path}: short write")
        finally:
            os.close(fd)
        self._pending[path] = self._pool.submit(sha256_file, path, True)

    def _copy(self, run: CopyRun, dst_fd: int) -> None:
        if run.src not in self._src_fds:
            self._src_fds[run.src] = os.open(run.src, os.O_RDONLY)
        src_fd, done = self._src_fds[run.src], 0
        while done < run.nbytes:
            count = min(_CHUNK, run.nbytes - done)
            moved = self._copy_chunk(src_fd, dst_fd, run.src_offset + done, run.dst_offset + done, count)
            if moved <= 0:
                raise OSError(errno.EIO, f"{run.src}: file ended while copying (truncated shard?)")
            done += moved
            if self._progress:
                self._progress(moved)

    def _copy_chunk(self, src_fd: int, dst_fd: int, src_offset: int, dst_offset: int, count: int) -> int:
        if self._kernel_copy:
            try:
                return os.copy_file_range(src_fd, dst_fd, count, src_offset, dst_offset)
            except OSError as exc:
                if exc.errno not in _NO_KERNEL_COPY:
                    raise
                self._kernel_copy = False  # e.g. across filesystems: copy through a buffer from now on
        data = os.pread(src_fd, min(count, _BUFFER), src_offset)
        return os.pwrite(dst_fd, data, dst_offset) if data else 0

    def results(self) -> dict[Path, FileEntry]:
        return {path: future.result() for path, future in self._pending.items()}

    def close(self) -> None:
        for future in self._pending.values():
            future.cancel()
        self._pool.shutdown(wait=True)
        for fd in self._src_fds.values():
            os.close(fd)
        self._src_fds.clear()
