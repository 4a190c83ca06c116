"""File plumbing for `fp4kit shard`: a shard writer that checksums its files as it fills them, read-ahead of
source tensors on a thread, hard links and small JSON files."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from fp4kit.checkpoint import INDEX_NAME, CheckpointReader, PlannedTensor, ShardWriter

READ_AHEAD = 4  # tensors in flight between the reader thread and the writer
_HASH_CHUNK = 1 << 22


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    nbytes: int

    def as_json(self) -> dict[str, object]:
        return {"sha256": self.sha256, "bytes": self.nbytes}


def sha256_file(path: Path) -> FileEntry:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return FileEntry(digest.hexdigest(), path.stat().st_size)


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())


class HashedShardWriter:
    """fp4kit.checkpoint.ShardWriter into a new ``directory`` whose files are named ``{stem}-0000i-of-0000n``.

    Each file's sha256 is computed from the bytes as they are written, so no file is read back, as long as the
    tensors arrive in plan order (a file written out of order is hashed from disk at ``finish``)."""

    def __init__(self, directory: Path, plan: list[PlannedTensor], max_shard_bytes: int, stem: str):
        directory.mkdir(parents=True)
        self.directory = directory
        self.writer = ShardWriter(directory, plan, max_shard_bytes, metadata={"producer": "fp4kit"})
        count = len(self.writer.files)
        self.names = [f"{stem}-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        self.hashers = []
        self.next_offset = []
        for fname in self.writer.files:
            with open(directory / fname, "rb") as f:
                head = f.read(8)
                header = head + f.read(struct.unpack("<Q", head)[0])
            self.hashers.append(hashlib.sha256(header))
            self.next_offset.append(len(header))
        self.out_of_order: set[int] = set()

    @property
    def total_bytes(self) -> int:
        return self.writer.total_bytes

    def write(self, name: str, tensor: torch.Tensor) -> None:
        file_idx, offset, _ = self.writer.slots[name]
        self.writer.write(name, tensor)
        if offset != self.next_offset[file_idx]:
            self.out_of_order.add(file_idx)
            return
        data = _tensor_bytes(tensor)
        self.hashers[file_idx].update(data)
        self.next_offset[file_idx] += len(data)

    def weight_map(self) -> dict[str, str]:
        return {name: self.names[slot[0]] for name, slot in self.writer.slots.items()}

    def finish(self) -> dict[str, FileEntry]:
        """Close the files, give them their final names; returns name -> checksum."""
        self.writer.finish()
        (self.directory / INDEX_NAME).unlink(missing_ok=True)  # the caller writes the index it needs
        entries = {}
        for i, (old, new) in enumerate(zip(self.writer.files, self.names, strict=True)):
            os.rename(self.directory / old, self.directory / new)
            if i in self.out_of_order:
                entries[new] = sha256_file(self.directory / new)
            else:
                entries[new] = FileEntry(self.hashers[i].hexdigest(), self.next_offset[i])
        return entries

    def abort(self) -> None:
        self.writer.abort()


def read_ahead(reader: CheckpointReader, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) in order, each read whole into its own buffer, a few tensors ahead on a thread."""
    slots: queue.Queue = queue.Queue(maxsize=READ_AHEAD)
    stop = threading.Event()

    def produce() -> None:
        try:
            for name in names:
                if stop.is_set():
                    return
                slots.put((name, reader.read(name)))
            slots.put(None)
        except BaseException as exc:  # handed to the consumer, which raises it
            slots.put(exc)

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    try:
        while (item := slots.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():
            try:
                slots.get_nowait()
            except queue.Empty:
                thread.join(0.05)


def link_files(src_dir: Path, dst_dir: Path, relpaths: list[str]) -> None:
    """Hard-link each ``src_dir/rel`` to ``dst_dir/rel`` (same inode: the bytes are stored once)."""
    for rel in relpaths:
        target = dst_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(src_dir / rel, target)


def write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
