"""The torch-free part of reading a HF safetensors checkpoint directory: which shard files it has, each shard's
header, config.json, and size arguments. fp4kit.checkpoint builds tensor reads on it; `fp4kit shard`, which only
moves bytes, uses it alone and so starts without importing torch."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, TypeVar

from fp4kit.errors import Fp4kitError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


class _Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


SizedT = TypeVar("SizedT", bound=_Sized)


def shard_layout(tensors: Iterable[SizedT], max_shard_bytes: int) -> list[list[SizedT]]:
    """Tensors in order, packed into consecutive shards of at most ``max_shard_bytes`` (a larger tensor alone)."""
    shards: list[list[SizedT]] = [[]]
    filled = 0
    for tensor in tensors:
        if shards[-1] and filled + tensor.nbytes > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(tensor)
        filled += tensor.nbytes
    return shards


def shard_files(root: Path) -> list[Path]:
    """The shards the index names (each must exist), else model.safetensors, else every *.safetensors."""
    index = root / INDEX_NAME
    if index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise Fp4kitError(f"{index}: not a valid safetensors index") from None
        for name in files:
            if not (root / name).exists():
                raise Fp4kitError(f"{root / name}: shard named in {INDEX_NAME} is missing")
        return [root / f for f in files]
    if (root / SINGLE_NAME).exists():
        return [root / SINGLE_NAME]
    found = sorted(root.glob("*.safetensors"))
    if not found:
        raise Fp4kitError(f"{root}: no safetensors files (and no {INDEX_NAME})")
    return found


def read_header(path: Path) -> tuple[dict, int]:
    """(header dict, absolute offset where the data starts); truncated or corrupt files are one clear error."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise Fp4kitError(f"{path}: truncated safetensors file (no header)")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > size - 8 or header_len > 100_000_000:
                raise Fp4kitError(f"{path}: truncated or corrupt safetensors header")
            header = json.loads(f.read(header_len))
    except FileNotFoundError:
        raise Fp4kitError(f"{path}: shard file is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise Fp4kitError(f"{path}: corrupt safetensors header") from None
    if not isinstance(header, dict):
        raise Fp4kitError(f"{path}: corrupt safetensors header")
    return header, 8 + header_len


def read_config(root: str | os.PathLike) -> dict:
    if not Path(root).is_dir():
        raise Fp4kitError(f"{root}: not a directory")
    path = Path(root) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise Fp4kitError(f"{path}: missing (fp4kit needs the model's config.json)") from None
    except json.JSONDecodeError as exc:
        raise Fp4kitError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '1024' -> bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    s = text.strip().upper()
    number = s.rstrip("KMGTIB")
    unit = s[len(number):]
    try:
        value = float(number)
    except ValueError:
        raise Fp4kitError(f"cannot read size {text!r} (use e.g. 5GB or 500MB)") from None
    if unit not in units or value <= 0:
        raise Fp4kitError(f"cannot read size {text!r} (use e.g. 5GB or 500MB)")
    return int(value * units[unit])
