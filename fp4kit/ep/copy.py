"""Filling `fp4kit shard`'s output files from byte ranges of the source shards.

Sharding never changes a tensor's bytes (except a few activation scales, written from memory). Each output file is
assembled in order in page-aligned blocks of ``_BLOCK`` bytes: its header, the source ranges read with ``pread``, the
rewritten bytes. The file's sha256 is taken from each block while it is still in the CPU cache, and the block is
written with ``O_DIRECT`` where the filesystem takes it.

Why not ``copy_file_range`` or buffered writes: both make the kernel allocate and account a page-cache page per 4 KB
written (on ext4 ~2.5 s of system time per 2.9 GB, all that `cp` spends), and checksumming beside them meant reading
every source page a second time. A direct write hands the block to the disk as is; the only copy is the ``pread``
from the source's pages into the block. A few worker threads fill one file each, and each keeps ``_IN_FLIGHT`` block
writes queued so the disk stays busy while the next block is read and hashed. Each file is flushed to disk
(fdatasync) by its worker once written. docs/BENCHMARKS.md has the measurements.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import mmap
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from fp4kit.io.shard_io import ShardLayout, SourceTensor

_BLOCK = 4 << 20  # a multiple of every block size O_DIRECT may ask for alignment to
_IN_FLIGHT = 4  # queued block writes per file
_FILES_AT_ONCE = 8
_BUFFER = 4 << 20
_DIRECT = getattr(os, "O_DIRECT", 0)
_NO_DIRECT = {errno.EINVAL, errno.EOPNOTSUPP}


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


class _Cancelled(Exception):
    pass


class _Output:
    """One output file written block by block at increasing offsets, with ``O_DIRECT`` while the filesystem takes
    it (a block that is not a whole multiple of the alignment, the file's tail, is written through the page cache)."""

    def __init__(self, path: Path, size: int, writers: ThreadPoolExecutor):
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.direct = False
        if _DIRECT:
            try:
                self.fd = os.open(path, flags | _DIRECT, 0o644)
                self.direct = True
            except OSError as exc:
                if exc.errno not in _NO_DIRECT:
                    raise
        if not self.direct:
            self.fd = os.open(path, flags, 0o644)
        elif size:
            # Direct writes past the end of a file wait for each other (ext4 updates the size under the inode
            # lock); into allocated space several run at once.
            with contextlib.suppress(OSError):
                os.posix_fallocate(self.fd, 0, size)
        self._writers = writers
        self._pending: deque[Future[None]] = deque()

    def write(self, block: memoryview, offset: int) -> None:
        """Queue the write of ``block``; its buffer must stay unchanged until ``wait`` has seen the write done."""
        if len(block) % _BLOCK:
            self.wait(0)
            self._buffered()
            self._pwrite(block, offset)
        else:
            self._pending.append(self._writers.submit(self._pwrite, block, offset))

    def wait(self, keep: int) -> None:
        """Block until at most ``keep`` queued writes remain."""
        while len(self._pending) > keep:
            self._pending.popleft().result()

    def _pwrite(self, block: memoryview, offset: int) -> None:
        done = 0
        while done < len(block):
            try:
                done += os.pwrite(self.fd, block[done:], offset + done)
            except OSError as exc:
                if not (self.direct and exc.errno in _NO_DIRECT):
                    raise
                self._buffered()  # opened with O_DIRECT, but this filesystem refuses direct writes

    def _buffered(self) -> None:
        if self.direct:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~_DIRECT)
            self.direct = False

    def close(self, sync: bool) -> None:
        try:
            if sync:
                self.wait(0)
                os.fdatasync(self.fd)
            else:
                for future in self._pending:
                    future.cancel()
                for future in self._pending:
                    if not future.cancelled():
                        future.exception()
        finally:
            os.close(self.fd)


class ShardCopier:
    """Writes output files in worker threads; ``results()`` waits for them and returns their checksums.
    ``progress(nbytes)`` is called as data moves."""

    def __init__(self, progress: Callable[[int], None] | None = None):
        # Eight files at once even on a 2-core machine: the workers mostly wait for the disk, and the disk is
        # faster with more writes at once (benchmark VM, same minutes: 8 files 0.92x cp -r, 4 files 0.70x).
        workers = _FILES_AT_ONCE
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fp4kit-shard")
        self._writers = ThreadPoolExecutor(max_workers=workers * _IN_FLIGHT, thread_name_prefix="fp4kit-write")
        self._pending: dict[Path, Future[FileEntry]] = {}
        self._src_fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._progress = progress

    def fill(self, job: FileJob) -> None:
        pieces = job.pieces()  # fail before writing anything if the plan does not tile the file
        self._pending[job.path] = self._pool.submit(self._write_file, job.path, pieces)

    def _write_file(self, path: Path, pieces: list[CopyRun | bytes]) -> FileEntry:
        digest, size = hashlib.sha256(), 0
        buffers = [memoryview(mmap.mmap(-1, _BLOCK)) for _ in range(_IN_FLIGHT + 1)]  # page-aligned
        out = _Output(path, sum(p.nbytes if isinstance(p, CopyRun) else len(p) for p in pieces), self._writers)
        ok = False
        try:
            filled = 0
            for part in pieces:
                src_fd = self._source_fd(part.src) if isinstance(part, CopyRun) else -1
                total = part.nbytes if isinstance(part, CopyRun) else len(part)
                done = 0
                while done < total:
                    if self._stop.is_set():
                        raise _Cancelled
                    block = buffers[(size // _BLOCK) % len(buffers)]
                    if filled == 0:
                        out.wait(len(buffers) - 1)  # this buffer's previous write is done
                    count = min(total - done, _BLOCK - filled)
                    if isinstance(part, CopyRun):
                        _read_exactly(src_fd, block[filled:filled + count], part.src_offset + done, part.src)
                        self._moved(count)
                    else:
                        block[filled:filled + count] = part[done:done + count]
                    filled, done, size = filled + count, done + count, size + count
                    if filled == _BLOCK:
                        digest.update(block)
                        out.write(block, size - _BLOCK)
                        filled = 0
            if filled:
                tail = buffers[(size // _BLOCK) % len(buffers)][:filled]
                digest.update(tail)
                out.write(tail, size - filled)
            ok = True
        finally:
            out.close(sync=ok)
        return FileEntry(digest.hexdigest(), size)

    def _source_fd(self, path: Path) -> int:
        with self._lock:
            if path not in self._src_fds:
                self._src_fds[path] = os.open(path, os.O_RDONLY)
            return self._src_fds[path]

    def _moved(self, nbytes: int) -> None:
        if self._progress:
            with self._lock:
                self._progress(nbytes)

    def results(self) -> dict[Path, FileEntry]:
        """Wait until every file is written, fsynced and checksummed."""
        return {path: future.result() for path, future in self._pending.items()}

    def close(self) -> None:
        self._stop.set()
        for future in self._pending.values():
            future.cancel()
        self._pool.shutdown(wait=True)
        self._writers.shutdown(wait=True)
        for fd in self._src_fds.values():
            os.close(fd)
        self._src_fds.clear()


def _read_exactly(fd: int, into: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(into):
        got = os.preadv(fd, [into[done:]], offset + done)
        if got == 0:
            raise OSError(errno.EIO, f"{path}: file ended while copying (truncated shard?)")
        done += got
