"""Output directories that appear complete or not at all."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from fp4kit.errors import Fp4kitError


def partial_dir(dst: Path) -> Path:
    return dst.parent / f".{dst.name}.fp4kit-partial"


def check_destination(src: Path, dst: Path, overwrite: bool) -> None:
    if dst.resolve() == src.resolve():
        raise Fp4kitError(f"{dst}: output directory is the input directory")
    if dst.exists() and not dst.is_dir():
        raise Fp4kitError(f"{dst}: exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise Fp4kitError(f"{dst}: exists and is not empty (pass --overwrite to replace it)")


@contextlib.contextmanager
def atomic_directory(dst: Path) -> Iterator[Path]:
    """Yield an empty work directory beside ``dst``; on success it replaces ``dst`` with one rename.

    A leftover work directory from an interrupted run is removed first: a rerun starts clean.
    """
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    work = partial_dir(dst)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir()
    try:
        yield work
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    old = dst.parent / f".{dst.name}.fp4kit-old"
    if dst.exists():
        if old.exists():
            shutil.rmtree(old)
        os.rename(dst, old)
    os.rename(work, dst)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)
