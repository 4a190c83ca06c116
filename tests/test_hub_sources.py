"""A source given as a Hub id resolves through the local Hugging Face cache (fp4kit.io.hub): quantize, eval, verify
--source and inspect, with --revision; --download goes through huggingface_hub (here offline, from the cache);
otherwise one error line naming the id and the cache. The cache is built in the test in huggingface_hub's layout
(blobs, snapshots of links, refs), and huggingface_hub's own cache scan checks it."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from helpers import run_cli

from fp4kit.io.hub import resolve_source

REPO = "acme/Tiny-MoE"
MAIN = "1" * 40
OTHER = "2" * 40


def cache_model(cache: Path, repo_id: str, commit: str, src: Path, refs: tuple[str, ...] = ("main",)) -> Path:
    """Put ``src``'s files into ``cache`` as huggingface_hub stores a download of ``repo_id`` at ``commit``: content-
    addressed blobs, the snapshot's files as relative links to them, ``refs/<name>`` holding the commit."""
    from huggingface_hub.file_download import repo_folder_name

    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    snapshot = repo / "snapshots" / commit
    for file in sorted(p for p in src.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / file.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub(tiny, tmp_path, monkeypatch):
    """A Hugging Face cache holding REPO at MAIN (refs main) and a different model at OTHER (refs v2), used offline."""
    from huggingface_hub import constants, scan_cache_dir

    from fp4kit.testing.fixtures import build_fixture

    cache = tmp_path / "hf-cache"
    cache_model(cache, REPO, MAIN, tiny("qwen3_moe"))
    cache_model(cache, REPO, OTHER, build_fixture("qwen3_moe", tmp_path / "seed1", seed=1), refs=("v2",))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # no request leaves the test, --download included
    (scanned,) = scan_cache_dir(cache).repos  # huggingface_hub reads the test's cache as its own
    assert scanned.repo_id == REPO and {r.commit_hash for r in scanned.revisions} == {MAIN, OTHER}
    assert {ref for r in scanned.revisions for ref in r.refs} == {"main", "v2"}
    return cache


def weights(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.glob("*.safetensors"))}


def test_quantize_a_hub_id_from_the_cache(hub, tiny, tmp_path, monkeypatch, capsys) -> None:
    code, _, err = run_cli(monkeypatch, capsys, "quantize", tiny("qwen3_moe"), tmp_path / "local", "-q")
    assert code == 0, err
    code, _, err = run_cli(monkeypatch, capsys, "quantize", REPO, tmp_path / "hub", "-q")
    assert code == 0, err
    assert weights(tmp_path / "hub") == weights(tmp_path / "local")
    record = json.loads((tmp_path / "hub" / "fp4kit_provenance.json").read_text())
    assert record["base_model"] == REPO
    assert record["command"] == "fp4kit quantize SRC DST -q"
    assert (tmp_path / "hub" / "README.md").read_text().startswith(f"---\nbase_model: {REPO}\n")
    for name in ("config.json", "model.safetensors.index.json"):  # real files, not links into the cache
        assert not (tmp_path / "hub" / name).is_symlink()

    # another branch, and a commit hash: each its own snapshot
    code, _, err = run_cli(monkeypatch, capsys, "quantize", REPO, tmp_path / "v2", "--revision", "v2", "-q")
    assert code == 0, err
    code, _, err = run_cli(monkeypatch, capsys, "quantize", REPO, tmp_path / "by-hash", "--revision", OTHER, "-q")
    assert code == 0, err
    assert weights(tmp_path / "v2") == weights(tmp_path / "by-hash") != weights(tmp_path / "hub")


def test_download_goes_through_huggingface_hub(hub) -> None:
    assert resolve_source(REPO, download=True) == hub / "models--acme--Tiny-MoE" / "snapshots" / MAIN
    assert resolve_source(REPO, "v2", download=True).name == OTHER
    from fp4kit.errors import Fp4kitError

    with pytest.raises(Fp4kitError) as error:  # offline: huggingface_hub falls back to the cache, which lacks it
        resolve_source("acme/Absent", download=True)
    assert str(error.value) == (f"SRC acme/Absent: not a directory, and not downloadable now (the Hub cannot be "
                                f"reached) nor in the Hugging Face cache {hub}")


def test_an_id_the_cache_lacks_is_one_line(hub, tmp_path, monkeypatch, capsys) -> None:
    cases = [
        (("quantize", "acme/Absent", tmp_path / "out"), "SRC acme/Absent"),
        (("quantize", REPO, tmp_path / "out", "--revision", "v3"), f"SRC {REPO} at revision v3"),
        (("eval", "acme/Absent", tmp_path), "SRC acme/Absent"),
        (("inspect", "acme/Absent"), "CKPT acme/Absent"),
        (("verify", tmp_path, "--source", "acme/Absent"), "--source acme/Absent"),
    ]
    for args, named in cases:
        code, out, err = run_cli(monkeypatch, capsys, *args)
        assert (code, out) == (2, ""), (args, err)
        assert err == (f"error: {named}: not a directory, and not in the Hugging Face cache {hub} (--download fetches "
                       "it)\n"), args
    assert not (tmp_path / "out").exists()

    code, _, err = run_cli(monkeypatch, capsys, "quantize", tmp_path, tmp_path / "out", "--revision", "v2")
    assert code == 2 and err == f"error: --revision: SRC {tmp_path} is a local path, not a Hub id\n"


def test_a_partial_snapshot_names_what_is_missing(hub, monkeypatch, capsys, tmp_path) -> None:
    """A snapshot that lost a shard: the checkpoint's own check names it."""
    snapshot = hub / "models--acme--Tiny-MoE" / "snapshots" / MAIN
    shard = next(snapshot.glob("*.safetensors"))
    shard.unlink()
    code, out, err = run_cli(monkeypatch, capsys, "quantize", REPO, tmp_path / "out")
    assert (code, out) == (2, "")
    assert err.startswith("error: ") and shard.name in err and len(err.splitlines()) == 1


def test_eval_inspect_and_verify_take_a_hub_id(hub, tiny, tmp_path, monkeypatch, capsys) -> None:
    snapshot = hub / "models--acme--Tiny-MoE" / "snapshots" / MAIN
    code, out, err = run_cli(monkeypatch, capsys, "inspect", REPO, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert (report["kind"], Path(report["path"])) == ("source", snapshot)

    ckpt = tmp_path / "ckpt"
    assert run_cli(monkeypatch, capsys, "quantize", REPO, ckpt, "-q")[0] == 0
    code, out, err = run_cli(monkeypatch, capsys, "eval", REPO, ckpt, "--samples", "2", "--seq-len", "8",
                             "--json", "-", "-q")
    assert code == 0, err
    local = run_cli(monkeypatch, capsys, "eval", tiny("qwen3_moe"), ckpt, "--samples", "2", "--seq-len", "8",
                    "--json", "-", "-q")[1]
    assert json.loads(out)["kl"] == json.loads(local)["kl"]

    code, out, err = run_cli(monkeypatch, capsys, "verify", ckpt, "--source", REPO, "--backend", "reference",
                             "--layers", "0", "--tokens", "4", "--json", "-", "-q")
    assert code == 0, err
    assert any(r["check"] == "source" and r["passed"] for r in json.loads(out)["results"])  # against the snapshot
