"""Filling `fp4kit shard`'s output files by copying byte ranges straight from the source shards.

Sharding never changes a tensor's bytes (except a few activation scales, written from memory), so the data moves
file to file with ``os.copy_file_range``: inside the kernel, no tensor passes through this process's memory, and
tensors that are contiguous in both files move in one call. Alongside, worker threads compute each output file's
sha256 from what the file is made of (its header, the source ranges through a read-only memory map of at most
``_MAP_BYTES`` at a time, the rewritten bytes): nothing is read twice, and checksumming a file overlaps with copying
it. Each file is fsynced once copied.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from fp4kit.shard_io import ShardLayout, SourceTensor

_CHUNK = 64 << 20  # bytes per copy call: bounds the work between progress reports
_MAP_BYTES = 32 << 20  # source bytes mapped at once per hashing thread
_BUFFER = 4 << 20
# Populating the whole window at map time costs less kernel time than faulting it in page by page.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP}


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    nbytes: int

    def as_json(self) -> dict[str, object]:
        return {"sha256": self.sha256, "bytes": self.nbytes}


def sha256_file(path: Path) -> FileEntry:
    digest = hashlib.sha256()
    buffer = bytearray(_BUFFER)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while got := f.readinto(buffer):
            digest.update(view[:got])
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


@dataclass
class FileJob:
    """One output file: its header, the source ranges to copy and the bytes to write (by offset)."""

    path: Path
    head: bytes
    runs: list[CopyRun]
    writes: dict[int, bytes]

    def pieces(self) -> list[CopyRun | bytes]:
        """The file's content in order, checked to cover it without gap or overlap."""
        parts: list[tuple[int, CopyRun | bytes]] = [(0, self.head)]
        parts += [(run.dst_offset, run) for run in coalesce(self.runs)] + sorted(self.writes.items())
        parts.sort(key=lambda p: p[0])
        end = 0
        for offset, part in parts:
            if offset != end:
                raise AssertionError(f"{self.path}: planned content has a gap or overlap at byte {end}")
            end += part.nbytes if isinstance(part, CopyRun) else len(part)
        return [part for _, part in parts]


def file_jobs(layout: ShardLayout, tensors: list[SourceTensor], replaced: dict[str, bytes]) -> list[FileJob]:
    jobs = {f: FileJob(layout.directory / f, layout.heads[f], [], {}) for f in layout.files}
    for t in sorted(tensors, key=lambda t: layout.slots[t.name][1]):
        file, offset = layout.slots[t.name]
        if t.name in replaced:
            jobs[file].writes[offset] = replaced[t.name]
        else:
            jobs[file].runs.append(CopyRun(t.file, t.begin, offset, t.nbytes))
    return list(jobs.values())


def _checksum(job: FileJob) -> FileEntry:
    digest, size = hashlib.sha256(), 0
    for part in job.pieces():
        if isinstance(part, bytes):
            digest.update(part)
            size += len(part)
            continue
        with open(part.src, "rb") as f:
            done = 0
            while done < part.nbytes:
                start = part.src_offset + done
                aligned = start - start % mmap.ALLOCATIONGRANULARITY
                length = min(_MAP_BYTES, part.nbytes - done)
                with mmap.mmap(f.fileno(), start - aligned + length, flags=_MAP_FLAGS, prot=mmap.PROT_READ,
                               offset=aligned) as m:
                    with memoryview(m) as view:
                        digest.update(view[start - aligned:])
                done += length
        size += part.nbytes
    return FileEntry(digest.hexdigest(), size)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ShardCopier:
    """Fills output files; ``results()`` waits for their checksums. ``progress(nbytes)`` is called as data moves."""

    def __init__(self, progress: Callable[[int], None] | None = None):
        self._src_fds: dict[Path, int] = {}
        self._pool = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1), thread_name_prefix="fp4kit-sha256")
        self._pending: dict[Path, Future[FileEntry]] = {}
        self._syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fp4kit-fsync")
        self._synced: list[Future[None]] = []
        self._progress = progress
        self._kernel_copy = hasattr(os, "copy_file_range")

    def fill(self, job: FileJob) -> None:
        job.pieces()  # fail before copying if the plan does not tile the file
        self._pending[job.path] = self._pool.submit(_checksum, job)
        fd = os.open(job.path, os.O_WRONLY)
        try:
            for run in coalesce(job.runs):
                self._copy(run, fd)
            for offset, data in job.writes.items():
                if os.pwrite(fd, data, offset) != len(data):
                    raise OSError(errno.EIO, f"{job.path}: short write")
        finally:
            os.close(fd)
        self._synced.append(self._syncer.submit(_fsync, job.path))

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
        """Wait until every file is checksummed and on disk."""
        for future in self._synced:
            future.result()
        return {path: future.result() for path, future in self._pending.items()}

    def close(self) -> None:
        for future in (*self._pending.values(), *self._synced):
            future.cancel()
        self._pool.shutdown(wait=True)
        self._syncer.shutdown(wait=True)
        for fd in self._src_fds.values():
            os.close(fd)
        self._src_fds.clear()
