"""safetensors checkpoint directories read and laid out from their headers alone, without importing torch.

`fp4kit shard` moves bytes and never does tensor math, so it works on header metadata (names, dtype strings,
shapes, byte ranges) and raw bytes. This mirrors fp4kit.checkpoint's CheckpointReader / ShardWriter layout (same
validation, same shard split and header format) minus the torch import, which costs seconds of start-up.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

from fp4kit.errors import Fp4kitError
from fp4kit.safetensors_files import (  # noqa: F401  (read_config, parse_size: re-exported for shard's callers)
    INDEX_NAME,
    WEIGHT_SUFFIXES,
    parse_size,
    read_config,
    read_header,
    shard_files,
    shard_layout,
)

ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
            "I8": 1, "U8": 1, "BOOL": 1}


@dataclass(frozen=True)
class SourceTensor:
    name: str
    file: Path
    dtype: str  # safetensors dtype string: F32, BF16, U8, F8_E4M3, ...
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_tensors(root: Path) -> dict[str, SourceTensor]:
    """Every tensor of checkpoint directory ``root``, from the shard headers, checked against the file sizes."""
    tensors: dict[str, SourceTensor] = {}
    for path in shard_files(root):
        header, data_start = read_header(path)
        size = path.stat().st_size
        header.pop("__metadata__", None)
        for name, entry in header.items():
            try:
                dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise Fp4kitError(f"{path}: tensor {name} has a malformed header entry") from None
            if dtype not in ITEMSIZE:
                raise Fp4kitError(f"{path}: tensor {name} has unsupported dtype {dtype}")
            if data_start + end > size:
                raise Fp4kitError(f"{path}: truncated shard (tensor {name} ends past the end of the file)")
            if end - begin != math.prod(shape) * ITEMSIZE[dtype]:
                raise Fp4kitError(f"{path}: tensor {name} has {end - begin} bytes, its shape needs "
                                  f"{math.prod(shape) * ITEMSIZE[dtype]}")
            tensors[name] = SourceTensor(name, path, dtype, shape, data_start + begin, data_start + end)
    return tensors


def read_bytes(tensor: SourceTensor) -> bytes:
    with open(tensor.file, "rb") as f:
        f.seek(tensor.begin)
        data = f.read(tensor.nbytes)
    if len(data) != tensor.nbytes:
        raise Fp4kitError(f"{tensor.file}: truncated while reading tensor {tensor.name}")
    return data


class ShardLayout:
    """Output shards of one directory for ``tensors`` (in that order), named ``{stem}-0000i-of-0000n.safetensors``:
    split at ``max_shard_bytes`` like fp4kit.checkpoint.ShardWriter. The directory is created, the files are not:
    ``heads[file]`` is a file's first bytes (length prefix and header) and tensor ``name`` goes at
    ``slots[name] = (file, absolute offset)``."""

    def __init__(self, directory: Path, tensors: list[SourceTensor], max_shard_bytes: int, stem: str):
        groups = shard_layout(tensors, max_shard_bytes)
        directory.mkdir(parents=True)
        self.directory = directory
        self.files = [f"{stem}-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
        self.slots: dict[str, tuple[str, int]] = {}
        self.heads: dict[str, bytes] = {}  # file -> its first bytes: length prefix and header
        self.total_bytes = 0
        for fname, group in zip(self.files, groups, strict=True):
            header: dict[str, object] = {"__metadata__": {"format": "pt", "producer": "fp4kit"}}
            offset = 0
            for t in group:
                header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
                offset += t.nbytes
            header_bytes = json.dumps(header, separators=(",", ":")).encode()
            header_bytes += b" " * (-len(header_bytes) % 8)
            data_start = 8 + len(header_bytes)
            self.heads[fname] = struct.pack("<Q", len(header_bytes)) + header_bytes
            for t in group:
                self.slots[t.name] = (fname, data_start + header[t.name]["data_offsets"][0])  # type: ignore[index]
            self.total_bytes += offset

    def weight_map(self) -> dict[str, str]:
        return {name: file for name, (file, _) in self.slots.items()}


def copy_side_files(src: Path, dst: Path, skip: set[str]) -> list[str]:
    """config.json, hf_quant_config.json and everything else that is not a weight file, an index or named in
    ``skip`` (tokenizer, templates, processors), byte for byte; returns their paths relative to ``dst``."""
    copied = []
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if path.is_dir() or rel.parts[0].startswith(".") or str(rel) in skip:
            continue
        if path.name == INDEX_NAME or path.name.endswith(WEIGHT_SUFFIXES) or path.name.endswith(".index.json"):
            continue
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dst / rel)
        copied.append(str(rel))
    return copied


def hard_link(src_dir: Path, dst_dir: Path, relpaths: list[str]) -> None:
    """``dst_dir/rel`` becomes another name of ``src_dir/rel`` (same inode: the bytes are stored once)."""
    for rel in relpaths:
        (dst_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        os.link(src_dir / rel, dst_dir / rel)


def write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
