"""The EP format's readers (fp4kit.ep.format) on malformed files: each is one Fp4kitError naming the file, never
another exception and never a document returned; random mutations of valid files likewise; `fp4kit inspect` of a
broken split exits 2 with one line."""

from __future__ import annotations

import copy
import json
import random
import sys
from pathlib import Path

import pytest

from fp4kit.cli import main
from fp4kit.ep.format import (
    EXPERT_MAP,
    MANIFEST,
    rank_dir_name,
    rank_directories,
    read_expert_map,
    read_rank_manifest,
    read_root_manifest,
)
from fp4kit.errors import Fp4kitError

ROOT = {"format": "fp4kit-ep", "version": 1, "family": "qwen3_moe", "num_experts": 4, "ep_size": 2,
        "placement": "linear", "ranks": [rank_dir_name(0), rank_dir_name(1)], "moe_modules": {},
        "load": {}, "input_scales": {}, "shared_files": {}}
RANK = {"format": "fp4kit-ep", "version": 1, "ep_size": 2, "ep_rank": 1, "placement": "linear",
        "input_scales": {}, "files": {}}
EXPERT_MAP_DOC = {"ep_size": 2, "ep_rank": 1, "num_experts": 4, "placement": "linear",
                  "layers": {"0": [-1, -1, 0, 1], "1": [-1, -1, 0, 1]}}
READERS = {"root": (MANIFEST, ROOT, read_root_manifest), "rank": (MANIFEST, RANK, read_rank_manifest),
           "expert_map": (EXPERT_MAP, EXPERT_MAP_DOC, read_expert_map)}


def write(directory: Path, name: str, document: object) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(document if isinstance(document, str) else json.dumps(document))
    return directory


def changed(document: dict, key: str, value: object) -> dict:
    out = copy.deepcopy(document)
    if value is KeyError:
        del out[key]
    else:
        out[key] = value
    return out


@pytest.mark.parametrize("which", sorted(READERS))
def test_valid_files_read(which, tmp_path):
    name, document, reader = READERS[which]
    assert reader(write(tmp_path, name, document)) == document


def test_rank_directories(tmp_path):
    assert rank_directories(write(tmp_path, MANIFEST, ROOT)) == [tmp_path / "rank-00000", tmp_path / "rank-00001"]


BROKEN = [
    ("root", "{", "not valid JSON"),
    ("root", '{"format": "fp4kit-ep", "format": "x"}', "twice"),
    ("root", "[]", "not a JSON object"),
    ("root", changed(ROOT, "format", "other"), "this fp4kit reads 'fp4kit-ep'"),
    ("root", changed(ROOT, "version", 2), "version 2"),
    ("root", changed(ROOT, "version", True), "version True"),
    ("root", changed(ROOT, "ranks", KeyError), "needs 'ranks'"),
    ("root", changed(ROOT, "ranks", []), "needs 'ranks'"),
    ("root", changed(ROOT, "ranks", "rank-00000"), "needs 'ranks'"),
    ("root", changed(ROOT, "ranks", [0, 1]), "needs 'ranks'"),
    ("root", changed(ROOT, "ranks", ["../elsewhere"]), "not a directory name"),
    ("root", changed(ROOT, "ranks", ["rank-00000", "a/b"]), "not a directory name"),
    ("root", changed(ROOT, "ranks", [".."]), "not a directory name"),
    ("root", changed(ROOT, "ranks", [""]), "not a directory name"),
    ("root", changed(ROOT, "num_experts", "4"), "'num_experts' must be an integer"),
    ("root", changed(ROOT, "num_experts", True), "'num_experts' must be an integer"),
    ("root", changed(ROOT, "ep_size", 0), "'ep_size' must be an integer of at least 1"),
    ("root", changed(ROOT, "ep_size", KeyError), "'ep_size'"),
    ("rank", changed(RANK, "format", KeyError), "format None"),
    ("rank", changed(RANK, "ep_rank", -1), "'ep_rank' must be an integer of at least 0"),
    ("rank", changed(RANK, "ep_rank", 1.0), "'ep_rank'"),
    ("rank", changed(RANK, "ep_size", None), "'ep_size'"),
    ("expert_map", "null", "not a JSON object"),
    ("expert_map", changed(EXPERT_MAP_DOC, "layers", KeyError), "needs a 'layers' object of lists"),
    ("expert_map", changed(EXPERT_MAP_DOC, "layers", [[0, 1]]), "needs a 'layers' object of lists"),
    ("expert_map", changed(EXPERT_MAP_DOC, "layers", {"0": {"0": 1}}), "needs a 'layers' object of lists"),
    ("expert_map", changed(EXPERT_MAP_DOC, "layers", {"one": [0]}), "layer 'one' is not a decoder layer number"),
    ("expert_map", changed(EXPERT_MAP_DOC, "layers", {"-1": [0]}), "layer '-1'"),
    ("expert_map", changed(EXPERT_MAP_DOC, "layers", {"0": [0, "1"]}), "maps an expert to '1'"),
    ("expert_map", changed(EXPERT_MAP_DOC, "layers", {"0": [0, True]}), "maps an expert to True"),
    ("expert_map", changed(EXPERT_MAP_DOC, "layers", {"0": [-2]}), "maps an expert to -2"),
    ("expert_map", changed(EXPERT_MAP_DOC, "layers", {"0": [0.0]}), "maps an expert to 0.0"),
    ("expert_map", changed(EXPERT_MAP_DOC, "num_experts", 0), "'num_experts'"),
    ("expert_map", changed(EXPERT_MAP_DOC, "ep_rank", "1"), "'ep_rank'"),
]


@pytest.mark.parametrize(("which", "document", "message"), BROKEN)
def test_malformed_files_are_one_error(which, document, message, tmp_path):
    name, _, reader = READERS[which]
    with pytest.raises(Fp4kitError) as caught:
        reader(write(tmp_path, name, document))
    text = str(caught.value)
    assert text.startswith(str(tmp_path / name)) and message in text and "\n" not in text


@pytest.mark.parametrize("which", sorted(READERS))
def test_missing_and_unreadable_files(which, tmp_path):
    name, _, reader = READERS[which]
    with pytest.raises(Fp4kitError, match=name):
        reader(tmp_path)
    (tmp_path / name).mkdir()
    with pytest.raises(Fp4kitError, match=name):
        reader(tmp_path)
    (tmp_path / name).rmdir()
    (tmp_path / name).write_bytes(b"\xff\xfe\x00{")
    with pytest.raises(Fp4kitError, match=name):
        reader(tmp_path)


def _mutations(document: object, rng: random.Random) -> object:
    """One random change somewhere in a JSON document: a key dropped, a value of another type, a list emptied."""
    if isinstance(document, dict) and document and rng.random() < 0.7:
        key = rng.choice(sorted(document))
        out = dict(document)
        if rng.random() < 0.25:
            del out[key]
        else:
            out[key] = _mutations(out[key], rng)
        return out
    if isinstance(document, list) and document and rng.random() < 0.7:
        index = rng.randrange(len(document))
        return [_mutations(v, rng) if i == index else v for i, v in enumerate(document)]
    return rng.choice([None, True, -3, 0, 2.5, "", "x", "rank-00000", "../x", [], [None], {}, {"0": [1]}])


@pytest.mark.parametrize("which", sorted(READERS))
def test_random_mutations_are_read_or_refused(which, tmp_path):
    """A mutated file is either still valid to the reader or one Fp4kitError: no other exception."""
    name, document, reader = READERS[which]
    rng = random.Random(which)
    refused = 0
    for trial in range(300):
        mutated = _mutations(document, rng)
        try:
            got = reader(write(tmp_path / str(trial), name, mutated))
        except Fp4kitError as exc:
            assert "\n" not in str(exc)
            refused += 1
        else:
            assert got == mutated
    assert refused > 50, "the mutations should break most documents"


def _cli(monkeypatch, capsys, *args: object) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["fp4kit", *map(str, args)])
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err.strip()


def test_inspect_of_a_broken_split_is_one_line(tmp_path, monkeypatch, capsys):
    root = write(tmp_path / "ep", MANIFEST, changed(ROOT, "ranks", ["../../etc"]))
    code, err = _cli(monkeypatch, capsys, "inspect", root)
    assert code == 2 and len(err.splitlines()) == 1 and "not a directory name" in err

