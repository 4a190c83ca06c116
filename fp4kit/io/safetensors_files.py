"""The one reader of safetensors checkpoint directories' metadata, torch-free: shard headers validated in full,
index, shards and tensors reconciled, config.json and other JSON side files read.

Nothing here reads tensor data. Every byte range it hands out has been checked against the safetensors format
(docs/bad_input.md lists the checks), so the readers built on it (fp4kit.io.checkpoint for tensor reads, the
byte-moving `fp4kit shard`) never see an offset outside the data section, two tensors sharing bytes, or a tensor
the index and the shards disagree about. `fp4kit shard`, which only moves bytes, starts without importing torch.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from fp4kit.errors import Fp4kitError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
# bytes per element of every safetensors dtype fp4kit reads
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I64": 8, "I32": 4,
            "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
# safetensors' own limit on the header length
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor as its shard's header describes it; ``begin``/``end`` are absolute offsets in ``file``."""

    name: str
    file: Path
    dtype: str  # safetensors dtype string: F32, BF16, U8, F8_E4M3, ...
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class CheckpointFiles:
    """Every tensor of a checkpoint directory (each exactly once) and the shards' merged ``__metadata__``."""

    root: Path
    shards: list[Path]
    tensors: dict[str, HeaderEntry]
    metadata: dict[str, str]


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


def _regular_file(path: Path, what: str) -> os.stat_result:
    try:
        info = path.stat()
    except FileNotFoundError:
        raise Fp4kitError(f"{path}: {what} is missing") from None
    if not stat.S_ISREG(info.st_mode):
        raise Fp4kitError(f"{path}: {what} is not a regular file")
    return info


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        duplicate = next(k for k in keys if keys.count(k) > 1)
        raise _DuplicateKey(duplicate)
    return dict(pairs)


class _DuplicateKey(ValueError):
    pass


def loads(text: str | bytes, path: Path, what: str) -> object:
    """JSON text read from ``path`` (``what`` names it in errors); duplicate keys are an error."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        raise Fp4kitError(f"{path}: {what} names {exc.args[0]!r} twice") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        where = f" ({exc.msg} at line {exc.lineno})" if isinstance(exc, json.JSONDecodeError) else ""
        raise Fp4kitError(f"{path}: {what} is not valid JSON{where}") from None


def read_json(path: Path, what: str = "file") -> object:
    """A JSON file fp4kit depends on; a missing, unreadable or malformed one is one clear error."""
    _regular_file(path, what)
    return loads(path.read_bytes(), path, what)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_shard(path: Path) -> tuple[list[HeaderEntry], dict[str, str]]:
    """A shard's tensors in file order and its ``__metadata__``, after checking the header against the format: a
    JSON object of entries {dtype, shape, data_offsets}, offsets that tile the data section exactly (in order, no
    gap, no overlap, ending at the end of the file), byte counts that match dtype and shape."""
    size = _regular_file(path, "shard file").st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise Fp4kitError(f"{path}: truncated safetensors file (no header)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise Fp4kitError(f"{path}: truncated or corrupt safetensors header (length {header_len})")
        if header_len > MAX_HEADER_BYTES:
            raise Fp4kitError(f"{path}: safetensors header of {header_len} bytes is larger than the format allows")
        raw = f.read(header_len)
    if not raw.lstrip(b" ").startswith(b"{"):
        raise Fp4kitError(f"{path}: corrupt safetensors header (not a JSON object)")
    header = loads(raw, path, "safetensors header")
    if not isinstance(header, dict):
        raise Fp4kitError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_start = 8 + header_len
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise Fp4kitError(f"{path}: __metadata__ must map strings to strings")
    entries = [_entry(path, name, value, data_start) for name, value in header.items()]
    entries.sort(key=lambda e: (e.begin, e.end))
    offset = data_start
    for entry in entries:
        if entry.begin != offset:
            problem = "overlaps the tensor before it" if entry.begin < offset else "leaves a gap before it"
            raise Fp4kitError(f"{path}: tensor {entry.name}'s data_offsets {problem}")
        offset = entry.end
    if offset != size:
        problem = "ends past the end of the file: truncated shard" if offset > size else "stops before the end"
        raise Fp4kitError(f"{path}: the tensors' data {problem} ({offset - data_start} of "
                          f"{size - data_start} data bytes)")
    return entries, metadata


def _entry(path: Path, name: str, value: object, data_start: int) -> HeaderEntry:
    if not name:
        raise Fp4kitError(f"{path}: a tensor has an empty name")
    if not isinstance(value, dict):
        raise Fp4kitError(f"{path}: tensor {name} has a malformed header entry (not an object)")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise Fp4kitError(f"{path}: tensor {name} has unsupported dtype {_short(dtype)}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise Fp4kitError(f"{path}: tensor {name} has a malformed shape {_short(shape)}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets)
            or offsets[0] > offsets[1]):
        raise Fp4kitError(f"{path}: tensor {name} has malformed data_offsets {_short(offsets)}")
    expected = math.prod(shape) * ITEMSIZE[dtype]
    if offsets[1] - offsets[0] != expected:
        raise Fp4kitError(f"{path}: tensor {name} has {offsets[1] - offsets[0]} bytes, its shape needs {expected}")
    return HeaderEntry(name, path, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _index_shards(root: Path) -> tuple[list[Path], dict[str, str]]:
    index = root / INDEX_NAME
    document = read_json(index, "safetensors index")
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict):
        raise Fp4kitError(f"{index}: not a safetensors index (no weight_map object)")
    if not weight_map:
        raise Fp4kitError(f"{index}: weight_map is empty")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file.endswith(".safetensors"):
            raise Fp4kitError(f"{index}: weight_map[{_short(name)}] is {_short(file)}, not a .safetensors file name")
        if Path(file).name != file or file.startswith(".") or "\\" in file:
            raise Fp4kitError(f"{index}: weight_map[{_short(name)}] = {_short(file)} is not a file inside {root}")
    named = sorted(set(weight_map.values()))
    unnamed = sorted(p.name for p in root.glob("*.safetensors") if p.name not in named)
    if unnamed:
        raise Fp4kitError(f"{root / unnamed[0]}: shard is not named in {INDEX_NAME} (its tensors would be lost)")
    for file in named:
        if not (root / file).exists():
            raise Fp4kitError(f"{root / file}: shard named in {INDEX_NAME} is missing")
    return [root / f for f in named], weight_map


def checkpoint_files(root: str | os.PathLike) -> CheckpointFiles:
    """Every tensor of checkpoint directory ``root``, reconciled: with an index, every shard in the directory is
    named by it and exists, and every tensor is in the shard the index names, once; without one, ``model.safetensors``
    (alone) or the ``*.safetensors`` files, no tensor in two of them."""
    root = Path(root)
    if not root.is_dir():
        raise Fp4kitError(f"{root}: not a directory")
    weight_map: dict[str, str] | None = None
    if (root / INDEX_NAME).exists():
        shards, weight_map = _index_shards(root)
    else:
        shards = sorted(root.glob("*.safetensors"))
        if not shards:
            raise Fp4kitError(f"{root}: no safetensors files (and no {INDEX_NAME})")
        if (root / SINGLE_NAME) in shards and len(shards) > 1:
            other = next(p for p in shards if p.name != SINGLE_NAME)
            raise Fp4kitError(f"{other}: beside {SINGLE_NAME} without an index: which shards form the model?")
    tensors: dict[str, HeaderEntry] = {}
    metadata: dict[str, str] = {}
    for shard in shards:
        entries, shard_metadata = read_shard(shard)
        metadata.update(shard_metadata)
        for entry in entries:
            if entry.name in tensors:
                raise Fp4kitError(f"{shard}: tensor {entry.name} is also in {tensors[entry.name].file.name}")
            if weight_map is not None and weight_map.get(entry.name) != shard.name:
                where = weight_map.get(entry.name)
                said = f"in {where}" if where else "nowhere"
                raise Fp4kitError(f"{shard}: holds tensor {entry.name}, which {INDEX_NAME} places {said}")
            tensors[entry.name] = entry
    if weight_map is not None:
        lost = sorted(set(weight_map) - set(tensors))
        if lost:
            raise Fp4kitError(f"{root / weight_map[lost[0]]}: lacks tensor {lost[0]}, which {INDEX_NAME} places "
                              f"there ({len(lost)} such)")
    if not tensors:
        raise Fp4kitError(f"{root}: the checkpoint holds no tensors")
    return CheckpointFiles(root, shards, tensors, metadata)


def read_config(root: str | os.PathLike) -> dict:
    if not Path(root).is_dir():
        raise Fp4kitError(f"{root}: not a directory")
    path = Path(root) / "config.json"
    if not path.exists():
        raise Fp4kitError(f"{path}: missing (fp4kit needs the model's config.json)")
    config = read_json(path, "config.json")
    if not isinstance(config, dict):
        raise Fp4kitError(f"{path}: not a JSON object")
    return config


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
    if unit not in units or not math.isfinite(value) or value <= 0:
        raise Fp4kitError(f"cannot read size {text!r} (use e.g. 5GB or 500MB)")
    return int(value * units[unit])
