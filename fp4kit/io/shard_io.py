"""`fp4kit shard`'s side of safetensors directories, without importing torch: tensors as their validated headers
describe them (fp4kit.io.safetensors_files, the same reader fp4kit.io.checkpoint uses), raw byte reads, and output
shards laid out like fp4kit.io.checkpoint.ShardWriter's (same split, same header format). `fp4kit shard` moves bytes
and never does tensor math, and the torch import would cost seconds of start-up.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Collection
from pathlib import Path

from fp4kit.errors import Fp4kitError
from fp4kit.io.safetensors_files import (  # noqa: F401  (read_config, parse_size: re-exported for shard's callers)
    INDEX_NAME,
    WEIGHT_SUFFIXES,
    HeaderEntry,
    checkpoint_files,
    parse_size,
    read_config,
    shard_layout,
)

# a tensor of a source checkpoint, as its validated header describes it
SourceTensor = HeaderEntry


def read_tensors(root: Path) -> dict[str, SourceTensor]:
    """Every tensor of checkpoint directory ``root`` (fp4kit.io.safetensors_files.checkpoint_files)."""
    return checkpoint_files(root).tensors


def read_bytes(tensor: SourceTensor) -> bytes:
    with open(tensor.file, "rb") as f:
        f.seek(tensor.begin)
        data = f.read(tensor.nbytes)
    if len(data) != tensor.nbytes:
        raise Fp4kitError(f"{tensor.file}: truncated while reading tensor {tensor.name}")
    return data


class ShardLayout:
    """Output shards of one directory for ``tensors`` (in that order), named ``{stem}-0000i-of-0000n.safetensors``:
    split at ``max_shard_bytes`` like fp4kit.io.checkpoint.ShardWriter. The directory is created, the files are not:
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


# The files of a model directory besides its weights and index that engines and the Hugging Face Hub use, as
# published model repositories hold them: configs (`*_config.json`: generation, tokenizer, processors, a dialect's
# own beside config.json), tokenizers (sentencepiece, BPE, tiktoken), chat templates,
# processors of multimodal models, remote code (`*.py`: its config names it, engines run it only when trusted),
# licence terms (a redistributed model keeps them) and fp4kit's own records. Anything else in SRC
# (training logs, calibration or evaluation data, notebooks, images) is not the model's and is not copied.
SIDE_FILES = (
    "config.json", "*_config.json",
    "tokenizer.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt",
    "merges.txt", "spiece.model", "sentencepiece.bpe.model", "*.tiktoken", "tiktoken.model",
    "chat_template.jinja", "chat_template.json", "additional_chat_templates/*.jinja",
    "*.py",
    "LICENSE", "LICENSE.*", "LICENSE-*", "NOTICE", "NOTICE.*", "USE_POLICY.md",
    "fp4kit_*.json",
)


def is_side_file(rel: Path) -> bool:
    """Whether ``rel`` (a path relative to a model directory) is one of ``SIDE_FILES``."""
    return any(rel.match(pattern) and len(rel.parts) == len(Path(pattern).parts) for pattern in SIDE_FILES)


def side_files(src: Path, skip: Collection[str] = ()) -> list[Path]:
    """SRC's side files (``SIDE_FILES``) but those named in ``skip``, as paths relative to SRC, sorted."""
    found = [path.relative_to(src) for path in src.rglob("*") if path.is_file()]  # a Hub cache's links count
    return sorted(rel for rel in found if is_side_file(rel) and str(rel) not in skip)


def copy_side_files(src: Path, dst: Path, skip: set[str]) -> list[str]:
    """config.json, hf_quant_config.json and the other side files of SRC (``SIDE_FILES``) but those named in
    ``skip``, byte for byte; returns their paths relative to ``dst``."""
    copied = []
    for rel in side_files(src, skip):
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, dst / rel)
        copied.append(str(rel))
    return copied


def hard_link(src_dir: Path, dst_dir: Path, relpaths: list[str]) -> None:
    """``dst_dir/rel`` becomes another name of ``src_dir/rel`` (same inode: the bytes are stored once)."""
    for rel in relpaths:
        (dst_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        os.link(src_dir / rel, dst_dir / rel)


def write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
