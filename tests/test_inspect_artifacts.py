"""`fp4kit inspect` on each kind of directory: a bf16 / FP8-block / INT4 source, an NVFP4 checkpoint with routing
statistics, a layout directory, an EP root and an EP rank; the JSON's format version, kind and unquantized modules;
a defect of each kind found (exit 1), an unreadable manifest refused (exit 2); Llama-4's vision tower kept out of
the decoder layers."""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import pytest
from helpers import run_cli

from fp4kit.ep.shard import EXPERT_MAP, MANIFEST, ShardOptions, rank_dir_name, shard_checkpoint
from fp4kit.layouts.directory import LayoutOptions, layout_checkpoint
from fp4kit.quantize import QuantizeOptions, quantize_checkpoint
from fp4kit.quantize.input_scales import ROUTING_STATS_NAME
from fp4kit.testing.fixtures import write_fp8_block_source, write_pack_quantized_source
from fp4kit.tools.inspect import FORMAT
from fp4kit.tools.inspect_artifacts import inspect_path

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def made(tiny, tmp_path_factory) -> dict[str, Path]:
    """A calibrated W4A4 quantize output of tiny Qwen3-MoE (8 experts) and what fp4kit makes from it."""
    root = tmp_path_factory.mktemp("artifacts")
    w4a4 = root / "w4a4"
    quantize_checkpoint(tiny("qwen3_moe"), w4a4, QuantizeOptions(scheme="nvfp4", samples=4, seq_len=16))
    layout_checkpoint(w4a4, root / "layout", LayoutOptions(backend="trtllm"))
    shard_checkpoint(w4a4, root / "ep2", ShardOptions(ep=2, placement="balanced", stats=w4a4 / ROUTING_STATS_NAME))
    shard_checkpoint(w4a4, root / "ep3", ShardOptions(ep=3))
    return {"w4a4": w4a4, "layout": root / "layout", "ep2": root / "ep2", "ep3": root / "ep3"}


def inspect_json(monkeypatch, capsys, path: Path, *args: object) -> tuple[int, dict]:
    code, out, err = run_cli(monkeypatch, capsys, "inspect", path, "--json", *args)
    assert code in (0, 1), err
    return code, json.loads(out)


def copy(path: Path, tmp_path: Path) -> Path:
    target = tmp_path / path.name
    shutil.copytree(path, target, symlinks=True)
    return target


@pytest.mark.parametrize("kind", ["bf16", "fp8-block", "int4-pack-quantized"])
def test_source_precision(kind, tiny, tmp_path, monkeypatch, capsys) -> None:
    src = tiny("qwen3_moe")
    writers = {"fp8-block": partial(write_fp8_block_source, block=(32, 32)),
               "int4-pack-quantized": partial(write_pack_quantized_source, targets=r"\.experts\.\d+\.")}
    if kind != "bf16":
        src = writers[kind](src, tmp_path / kind)
    code, document = inspect_json(monkeypatch, capsys, src)
    assert code == 0 and document["format"] == FORMAT and document["kind"] == "source"
    assert document["precision"] == "bfloat16" if kind == "bf16" else document["precision"].startswith(kind)
    assert document["family"] == "qwen3_moe" and document["num_experts"] == 8
    assert [layer["experts"] for layer in document["layers"] if layer["layer"] is not None] == [8, 8]
    code, out, _ = run_cli(monkeypatch, capsys, "inspect", src)
    assert code == 0 and out.splitlines()[0].endswith(f"{document['precision']} source, family qwen3_moe")


def test_checkpoint_with_routing_statistics(made, tmp_path, monkeypatch, capsys) -> None:
    code, document = inspect_json(monkeypatch, capsys, made["w4a4"])
    assert code == 0 and (document["format"], document["kind"], document["scheme"]) == (FORMAT, "checkpoint", "nvfp4")
    assert document["unquantized_modules"] == ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    routing = document["routing"]
    assert routing["layers"] == 2 and routing["calibration"]["tokens"] == 64
    assert routing["tokens_per_layer"] == 64 * 2  # top-2 of every token
    assert routing["max_over_mean_expert"] >= 1

    broken = copy(made["w4a4"], tmp_path)
    stats = json.loads((broken / ROUTING_STATS_NAME).read_text())
    stats["num_experts"] = 16
    (broken / ROUTING_STATS_NAME).write_text(json.dumps(stats))
    code, document = inspect_json(monkeypatch, capsys, broken)
    assert code == 1 and [(p["check"], p["module"]) for p in document["problems"]] == [
        ("routing_stats", ROUTING_STATS_NAME)]
    assert "16 experts, the model has 8" in document["problems"][0]["detail"]


def test_layout_directory(made, tmp_path, monkeypatch, capsys) -> None:
    code, document = inspect_json(monkeypatch, capsys, made["layout"])
    assert code == 0 and document["kind"] == "layout" and document["num_experts"] == 8
    layout = document["layout"]
    assert layout["backend"] == "trtllm" and layout["kernel"] == "flashinfer.fused_moe.trtllm_fp4_block_scale_moe"
    assert [(layer["layer"], layer["num_experts"]) for layer in layout["layers"]] == [(0, 8), (1, 8)]
    assert [layer["experts"] for layer in document["layers"] if layer["layer"] is not None] == [8, 8]
    assert not any("experts" in module for module in document["unquantized_modules"])

    broken = copy(made["layout"], tmp_path)
    manifest = json.loads((broken / "fp4kit_layout.json").read_text())
    tensor = manifest["layers"]["1"]["tensors"]["gemm2_weights"]
    tensor["shape"] = [tensor["shape"][0], 1, 1]
    manifest["layers"]["0"]["scales"]["w2_global_scale_div"][3] = (0.0).hex()
    (broken / "fp4kit_layout.json").write_text(json.dumps(manifest))
    code, document = inspect_json(monkeypatch, capsys, broken)
    assert code == 1
    assert sorted((p["check"], p["module"]) for p in document["problems"]) == [
        ("bad_scale", "model.layers.0.mlp.experts"), ("layout_tensor", tensor["name"])]

    manifest["version"] = 99
    (broken / "fp4kit_layout.json").write_text(json.dumps(manifest))
    code, _, err = run_cli(monkeypatch, capsys, "inspect", broken)
    assert code == 2 and err.startswith("error: ") and "manifest version 99" in err


def test_ep_root(made, tmp_path, monkeypatch, capsys) -> None:
    code, document = inspect_json(monkeypatch, capsys, made["ep2"])
    assert code == 0 and document["kind"] == "ep-root" and document["scheme"] == "nvfp4"
    split = document["expert_parallel"]
    assert (split["ep_size"], split["placement"], split["num_experts"]) == (2, "balanced", 8)
    assert [(r["rank"], r["experts_per_layer"], r["problems"]) for r in split["ranks"]] == [(0, [4], 0), (1, [4], 0)]
    assert document["routing"]["layers"] == 2

    code, document = inspect_json(monkeypatch, capsys, made["ep3"])
    assert code == 0 and any("uneven (3/3/2 per rank)" in note for note in document["notes"])
    code, document = inspect_json(monkeypatch, capsys, made["ep3"], "--ep", "3")
    assert code == 1 and [p["check"] for p in document["problems"]] == ["backend_constraint"]

    broken = copy(made["ep2"], tmp_path)
    expert_map_path = broken / rank_dir_name(1) / EXPERT_MAP
    expert_map = json.loads(expert_map_path.read_text())
    dropped = next(e for e, local in enumerate(expert_map["layers"]["0"]) if local == 0)
    expert_map["layers"]["0"] = [-1 if e == dropped else (local - 1 if local > 0 else local)
                                 for e, local in enumerate(expert_map["layers"]["0"])]
    expert_map_path.unlink()  # a hard link to nothing else, but replace it rather than edit in place
    expert_map_path.write_text(json.dumps(expert_map))
    shared_config = broken / "_shared" / "config.json"
    text = shared_config.read_text()
    shared_config.unlink()
    shared_config.write_text(text + " ")
    code, document = inspect_json(monkeypatch, capsys, broken)
    found = sorted((p["check"], p["module"]) for p in document["problems"])
    assert code == 1 and found == [
        ("ep_files", "_shared/config.json"),
        ("ep_files", f"{rank_dir_name(1)}/{EXPERT_MAP}"),  # its size is in the rank's manifest
        ("ep_split", "layer 0"),
        ("expert_map", f"{rank_dir_name(1)} layer 0"),
    ], found
    assert any(p["detail"] == f"experts {dropped} are on no rank" for p in document["problems"])


def test_ep_rank(made, tmp_path, monkeypatch, capsys) -> None:
    rank_dir = made["ep2"] / rank_dir_name(1)
    code, document = inspect_json(monkeypatch, capsys, rank_dir)
    assert code == 0 and document["kind"] == "ep-rank" and document["num_experts"] == 8
    split = document["expert_parallel"]
    assert (split["ep_rank"], split["ep_size"], split["placement"]) == (1, 2, "balanced")
    expert_map = json.loads((rank_dir / EXPERT_MAP).read_text())
    assert split["experts"] == {layer: [e for e, local in enumerate(ids) if local >= 0]
                                for layer, ids in expert_map["layers"].items()}
    assert [layer["experts"] for layer in document["layers"] if layer["layer"] is not None] == [4, 4]

    broken = copy(rank_dir, tmp_path)
    manifest = json.loads((broken / MANIFEST).read_text())
    manifest["ep_rank"] = 0
    (broken / MANIFEST).unlink()
    (broken / MANIFEST).write_text(json.dumps(manifest))
    code, document = inspect_json(monkeypatch, capsys, broken)
    assert code == 1 and [p["check"] for p in document["problems"]] == ["expert_map"]
    assert "ep_rank 1, the rank's fp4kit_shard.json says 0" in document["problems"][0]["detail"]


def test_llama4_vision_tower_is_not_decoder_layer_0(tiny, tiny_nvfp4a16) -> None:
    report = inspect_path(tiny_nvfp4a16("llama4"))
    assert report.clean and report.kind == "checkpoint"
    text_layers = [s for s in report.layers if s.part == "text" and s.layer is not None]
    vision = [s for s in report.layers if s.part == "vision"]
    assert len(vision) == 1 and vision[0].layer is None and vision[0].other_bytes > 0
    assert text_layers[0].other_bytes == text_layers[1].other_bytes  # nothing of the vision tower's in layer 0
    assert any(m.startswith(("vision_model.", "model.vision_model.")) for m in report.unquantized_modules)
    source = inspect_path(tiny("llama4"))
    assert [s.layer for s in source.layers if s.part == "text" and s.layer is not None] == \
        [s.layer for s in text_layers]
    layer0_bytes = next(s.other_bytes for s in source.layers if s.part == "text" and s.layer == 0)
    assert layer0_bytes == next(s.other_bytes for s in source.layers if s.part == "text" and s.layer == 1)
