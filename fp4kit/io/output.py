"""Output directories that appear complete or not at all, one run at a time.

A run that writes DST first takes an exclusive lock on ``.DST.fp4kit-lock`` beside it (``fcntl.flock``: released by
the kernel when the process dies, so a killed run never leaves a stale lock), then works in a directory of its own,
``.DST.fp4kit-partial-<pid>-<random>``, renamed onto DST at the end. A second run into the same DST while the
first holds the lock is refused at once, naming the holder. With the lock held, work directories that interrupted
runs left behind are removed: a rerun starts clean. docs/bad_input.md describes the files.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from fp4kit.errors import Fp4kitError

PARTIAL_SUFFIX = ".fp4kit-partial"


def lock_path(dst: Path) -> Path:
    return dst.parent / f".{dst.name}.fp4kit-lock"


def partial_prefix(dst: Path) -> str:
    return f".{dst.name}{PARTIAL_SUFFIX}"


def new_partial_dir(dst: Path) -> Path:
    return dst.parent / f"{partial_prefix(dst)}-{os.getpid()}-{secrets.token_hex(4)}"


def leftovers(dst: Path) -> list[Path]:
    """What runs into ``dst`` keep beside it while they work (lock, work directories, a replaced DST): none of it
    outlives a run that ended, except a killed run's work directory, which the next run removes."""
    return sorted(p for p in dst.parent.glob(f".{dst.name}.fp4kit-*"))


def check_destination(src: Path, dst: Path, overwrite: bool) -> None:
    if dst.resolve() == src.resolve():
        raise Fp4kitError(f"{dst}: output directory is the input directory")
    if dst.exists() and not dst.is_dir():
        raise Fp4kitError(f"{dst}: exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise Fp4kitError(f"{dst}: exists and is not empty (pass --overwrite to replace it)")


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 4096, 0).decode()
        info = json.loads(text)
        return (f"pid {info['pid']} on {info['host']}, started {info['started']}: {info['command']}"
                if isinstance(info, dict) else "another run")
    except (OSError, ValueError, KeyError, UnicodeDecodeError):
        return "another run"


@contextlib.contextmanager
def exclusive(dst: Path) -> Iterator[None]:
    """Hold the lock of output ``dst`` for the block; refuse at once if another run holds it. The lock file is
    removed at the end: a run that opened it before the removal finds, once it gets the lock, that the path now
    names another file (or none), and tries again."""
    path = lock_path(dst)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise Fp4kitError(f"{dst}: another fp4kit run is writing it ({holder}; lock {path.name})") from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        info = {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv)[:300],
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def remove_stale_partials(dst: Path) -> None:
    """Work directories of interrupted runs into ``dst`` (call with its lock held)."""
    prefix = partial_prefix(dst)
    for leftover in dst.parent.glob(f"{prefix}*"):
        if leftover.name == prefix or leftover.name.startswith(f"{prefix}-"):
            shutil.rmtree(leftover, ignore_errors=True)


def replace_directory(work: Path, dst: Path) -> None:
    """Rename the finished ``work`` onto ``dst``; an existing ``dst`` (--overwrite) is moved aside first and removed
    after. If a rename fails, ``work`` is removed and the error raised: nothing complete-looking stays behind."""
    old = dst.parent / f".{dst.name}.fp4kit-old-{secrets.token_hex(4)}"
    try:
        if dst.exists():
            os.rename(dst, old)
        try:
            os.rename(work, dst)
        except OSError:
            if old.exists():
                os.rename(old, dst)
            raise
    except OSError:
        shutil.rmtree(work, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(dst: Path, src: Path | None = None, overwrite: bool = True) -> Iterator[Path]:
    """Yield an empty work directory of this run's own beside ``dst``, holding ``dst``'s lock; on success the work
    directory replaces ``dst`` with one rename, on any failure it is removed. With ``src``, ``check_destination``
    runs under the lock, so a run that finished meanwhile is seen."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(dst):
        if src is not None:
            check_destination(src, dst, overwrite)
        remove_stale_partials(dst)
        work = new_partial_dir(dst)
        work.mkdir()
        try:
            yield work
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        replace_directory(work, dst)
