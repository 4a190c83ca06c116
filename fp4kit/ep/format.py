"""fp4kit's EP format (``fp4kit-ep``, docs/formats.md): the file names and the one reader of each of its JSON files.

``fp4kit shard`` (fp4kit.ep.shard) writes the format; inspect and verify read it through these readers, which check
what they return against the format, so a malformed or foreign file is one error naming the file and the field.
What the readers do not judge is left to inspect's findings: whether the files agree with each other and with the
tensors the ranks hold.
"""

from __future__ import annotations

from pathlib import Path

from fp4kit.errors import Fp4kitError
from fp4kit.io.safetensors_files import read_json

MANIFEST = "fp4kit_shard.json"
EXPERT_MAP = "expert_map.json"
SHARED_DIR = "_shared"
FORMAT, VERSION = "fp4kit-ep", 1


def rank_dir_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def _is_int(value: object, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _object(path: Path, what: str) -> dict:
    document = read_json(path, what)
    if not isinstance(document, dict):
        raise Fp4kitError(f"{path}: not a JSON object ({what})")
    return document


def _manifest(path: Path, what: str) -> dict:
    manifest = _object(path, what)
    if manifest.get("format") != FORMAT or not _is_int(manifest.get("version")) or manifest["version"] != VERSION:
        raise Fp4kitError(f"{path}: format {manifest.get('format')!r} version {manifest.get('version')!r};"
                          f" this fp4kit reads {FORMAT!r} version {VERSION}")
    return manifest


def _require_counts(path: Path, document: dict, keys: tuple[str, ...], least: int = 0) -> None:
    for key in keys:
        if not _is_int(document.get(key), least):
            raise Fp4kitError(f"{path}: '{key}' must be an integer of at least {least}, not {document.get(key)!r}")


def read_root_manifest(root: Path) -> dict:
    """The EP split's ``fp4kit_shard.json``: format and version, ``ranks`` (directory names inside ROOT),
    ``num_experts`` and ``ep_size`` checked."""
    path = root / MANIFEST
    manifest = _manifest(path, "the EP split's manifest")
    names = manifest.get("ranks")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise Fp4kitError(f"{path}: needs 'ranks' (directory names), 'num_experts' and 'ep_size'")
    for name in names:
        if name in ("", ".", "..") or Path(name).name != name or "\\" in name:
            raise Fp4kitError(f"{path}: rank {name!r} is not a directory name inside the split")
    _require_counts(path, manifest, ("num_experts", "ep_size"), least=1)
    return manifest


def rank_directories(root: Path) -> list[Path]:
    """The rank directories the EP split at ``root`` lists, in rank order."""
    return [root / name for name in read_root_manifest(root)["ranks"]]


def read_rank_manifest(rank_dir: Path) -> dict:
    """A rank's ``fp4kit_shard.json``: format and version, ``ep_rank`` and ``ep_size`` checked."""
    path = rank_dir / MANIFEST
    manifest = _manifest(path, "the rank's manifest")
    _require_counts(path, manifest, ("ep_rank",))
    _require_counts(path, manifest, ("ep_size",), least=1)
    return manifest


def read_expert_map(rank_dir: Path) -> dict:
    """A rank's ``expert_map.json``: ``ep_rank``, ``ep_size``, ``num_experts`` and ``layers``, an object of decoder
    layer numbers to lists of local ids (-1: on another rank), checked; the lists' lengths and order are inspect's."""
    path = rank_dir / EXPERT_MAP
    expert_map = _object(path, "the rank's expert map")
    _require_counts(path, expert_map, ("ep_rank",))
    _require_counts(path, expert_map, ("ep_size", "num_experts"), least=1)
    layers = expert_map.get("layers")
    if not isinstance(layers, dict) or not all(isinstance(v, list) for v in layers.values()):
        raise Fp4kitError(f"{path}: needs a 'layers' object of lists (docs/formats.md)")
    for key, local_ids in layers.items():
        if not key.isdecimal() or not key.isascii():
            raise Fp4kitError(f"{path}: layer {key!r} is not a decoder layer number")
        for local in local_ids:
            if not _is_int(local, least=-1):
                raise Fp4kitError(f"{path}: layer {key} maps an expert to {local!r}, not a local id or -1")
    return expert_map
