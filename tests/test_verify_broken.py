"""`fp4kit verify` fails on deliberately broken checkpoints, each caught by the check meant for it: swapped w1/w3, a
transposed expert, a wrong global scale, a layout with one permutation step skipped, an EP shard missing an expert."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import copy_with, load_all, run_cli
from safetensors.torch import load_file, save_file

from fp4kit.ep.shard import EXPERT_MAP, rank_dir_name
from fp4kit.io.safetensors_files import INDEX_NAME
from fp4kit.layouts.manifest import MANIFEST as LAYOUT_MANIFEST
from fp4kit.layouts.trtllm import shuffle_rows
from fp4kit.quantize.checkpoint import quantize_checkpoint
from fp4kit.verify.checks import VerifyOptions
from fp4kit.verify.runner import verify_checkpoint

TOKENS = [16, 256]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _failed(report) -> dict[str, list]:
    found: dict[str, list] = {}
    for r in report.results:
        if r.failed:
            found.setdefault(r.check, []).append(r)
    return found


def _verify(ckpt: Path, **options) -> dict[str, list]:
    report = verify_checkpoint(ckpt, VerifyOptions(tokens=TOKENS, backend="reference", **options))
    assert not report.passed
    return _failed(report)


def test_swapped_w1_w3(tiny, tiny_nvfp4a16, tmp_path) -> None:
    src = tiny_nvfp4a16("qwen3_moe")
    tensors = load_all(src)
    expert = "model.layers.1.mlp.experts.2"
    for name in [n for n in tensors if n.startswith(f"{expert}.gate_proj.")]:
        up = name.replace(".gate_proj.", ".up_proj.")
        tensors[name], tensors[up] = tensors[up], tensors[name]
    failed = _verify(copy_with(src, tmp_path / "swapped", tensors), source=tiny("qwen3_moe"))
    assert [r.detail for r in failed["source-expert"]] == ["worst expert 2"]
    assert {r.layer for r in failed["source-expert"]} == {1}


def test_transposed_expert(square_moe, tmp_path) -> None:
    tensors = load_all(square_moe["bf16"])
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    assert tensors[name].shape[0] == tensors[name].shape[1]  # square: the transposed expert still loads
    tensors[name] = tensors[name].t().contiguous()
    broken_bf16 = copy_with(square_moe["bf16"], tmp_path / "bf16", tensors)
    quantize_checkpoint(broken_bf16, tmp_path / "nvfp4a16")
    failed = _verify(tmp_path / "nvfp4a16", source=square_moe["bf16"])
    assert [(r.layer, r.detail) for r in failed["source-expert"]] == [(0, "worst expert 3")]
    assert failed["source-expert"][0].error > 0.5


def test_wrong_global_scale(tiny, tiny_nvfp4a16, tmp_path, monkeypatch, capsys) -> None:
    src = tiny_nvfp4a16("glm4_moe")
    tensors = load_all(src)
    tensors["model.layers.2.mlp.experts.5.down_proj.weight_global_scale"] *= 2
    broken = copy_with(src, tmp_path / "scale", tensors)
    failed = _verify(broken, source=tiny("glm4_moe"))
    assert [(r.layer, r.detail) for r in failed["source-expert"]] == [(2, "worst expert 5")]
    out = tmp_path / "report.json"
    code, stdout, _ = run_cli(monkeypatch, capsys, "verify", broken, "--source", tiny("glm4_moe"), "--tokens", "16",
                              "--backend", "reference", "--device", "cpu", "--json", out)
    assert code == 1 and "FAIL" in stdout
    assert json.loads(out.read_text())["passed"] is False


def _skip_trtllm_shuffle(layout: Path, dst: Path) -> Path:
    """The TRT-LLM layout of layer 0 with gemm1's 32-row shuffle left out (its row interleave kept)."""
    manifest = json.loads((layout / LAYOUT_MANIFEST).read_text())
    name = manifest["layers"]["0"]["tensors"]["gemm1_weights"]["name"]
    tensors = load_all(layout)
    rows = tensors[name].shape[1]
    tensors[name] = tensors[name][:, torch.argsort(shuffle_rows(rows))].contiguous()
    return copy_with(layout, dst, tensors)


def test_layout_with_a_permutation_step_skipped(square_moe, tmp_path) -> None:
    broken = _skip_trtllm_shuffle(square_moe["trtllm"], tmp_path / "trtllm")
    failed = _verify(square_moe["nvfp4"], layouts=[broken])
    assert [r.layer for r in failed["layout"]] == [0] and "w13 packed" in failed["layout"][0].detail
    # The layout alone, against the BF16 source: undone, its layer 0 computes something else.
    failed = _verify(broken, source=square_moe["bf16"])
    assert {r.layer for r in failed["source"]} == {0} and failed["source"][0].error > 0.5


def _drop_expert(shards: Path, dst: Path, rank: int, also_from_map: bool) -> tuple[Path, int]:
    shutil.copytree(shards, dst)
    rank_dir = dst / rank_dir_name(rank)
    expert_map = json.loads((rank_dir / EXPERT_MAP).read_text())
    expert = next(g for g, local in enumerate(expert_map["layers"]["1"]) if local >= 0)
    prefix = f"model.layers.1.mlp.experts.{expert}."
    for path in rank_dir.glob("experts-*.safetensors"):
        tensors = load_file(path)
        path.unlink()  # a private copy: never write through a hard link
        save_file({n: t for n, t in tensors.items() if not n.startswith(prefix)}, path, metadata={"format": "pt"})
    index_path = rank_dir / INDEX_NAME  # a rank that is consistent in itself, only without the expert
    if index_path.exists():
        index = json.loads(index_path.read_text())
        index["weight_map"] = {n: f for n, f in index["weight_map"].items() if not n.startswith(prefix)}
        index_path.unlink()
        index_path.write_text(json.dumps(index))
    if also_from_map:
        expert_map["layers"]["1"][expert] = -1
        (rank_dir / EXPERT_MAP).unlink()
        (rank_dir / EXPERT_MAP).write_text(json.dumps(expert_map))
    return dst, expert


@pytest.mark.parametrize("also_from_map", [False, True], ids=["tensors-missing", "expert-on-no-rank"])
def test_ep_shard_missing_an_expert(square_moe, tmp_path, also_from_map: bool) -> None:
    shards, expert = _drop_expert(square_moe["ep4"], tmp_path / "ep", 2, also_from_map)
    failed = _verify(square_moe["nvfp4"], ep_shards=shards)
    assert [r.layer for r in failed["ep"]] == [1]
    expected = f"expert {expert} is on 0 ranks" if also_from_map else f"expert {expert} is in its expert_map"
    assert expected in failed["ep"][0].detail
    assert [r.layer for r in failed["ep-sum"]] == [1] and failed["ep-sum"][0].error > 1e-3
