"""layout and verify on mixed-precision checkpoints (quantize --scheme-for): FP8 Linears travel into a layout as
stored, like kept tensors, beside the NVFP4 MoE layers in kernel form; verify runs the NVFP4 MoE layers and says in
its notes what it left out (the FP8 Linears, FP8 routed experts); FP8 experts beside NVFP4 ones in a layer are one
error line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import cli_result, load_all, same_bytes

from fp4kit.formats.detect import open_checkpoint
from fp4kit.quantize.checkpoint import QuantizeOptions, quantize_checkpoint

FP8_ATTENTION = (r"self_attn\.=fp8-dynamic", r"mlp\.(shared_experts|gate_proj|up_proj|down_proj)=fp8-block")


def _quantize(src: Path, dst: Path, rules: tuple[str, ...], scheme: str = "nvfp4") -> Path:
    quantize_checkpoint(src, dst, QuantizeOptions(scheme=scheme, scheme_for=list(rules), samples=4, seq_len=16))
    return dst


def _fp8_tensor_names(root: Path) -> list[str]:
    with open_checkpoint(root, mixed=True) as ckpt:
        return [n for m in ckpt.fp8_modules for n in (m.weight, m.scale, m.input_scale) if n]


@pytest.fixture(scope="module")
def mixed_w4a4(tiny, tmp_path_factory):
    return _quantize(tiny("deepseek_v3"), tmp_path_factory.mktemp("mixed") / "out", FP8_ATTENTION)


def test_layout_carries_fp8_tensors_as_stored_and_verify_passes(mixed_w4a4, tmp_path):
    layout = tmp_path / "layout"
    run = cli_result("layout", mixed_w4a4, layout, "--backend", "trtllm")
    assert run.returncode == 0, run.stderr
    source, laid_out = load_all(mixed_w4a4), load_all(layout)
    fp8 = _fp8_tensor_names(mixed_w4a4)
    assert fp8 and all(source[n].dtype == laid_out[n].dtype and same_bytes(source[n].reshape(-1),
                                                                           laid_out[n].reshape(-1)) for n in fp8)
    manifest = json.loads((layout / "fp4kit_layout.json").read_text())
    assert sorted(manifest["layers"]) == ["1", "2"]
    with open_checkpoint(layout, mixed=True, modules_required=False) as ckpt:
        assert {m.weight for m in ckpt.fp8_modules} == {n for n in fp8 if n.endswith(".weight")}
    inspected = cli_result("inspect", "--json", layout)
    assert inspected.returncode == 0 and json.loads(inspected.stdout)["clean"], inspected.stdout + inspected.stderr
    verified = cli_result("verify", mixed_w4a4, "--layout", layout, "--json", "-")
    assert verified.returncode == 0, verified.stderr
    report = json.loads(verified.stdout)
    assert report["passed"]
    notes = [n for n in report["notes"] if n.startswith("mixed precision:")]
    assert notes == [f"mixed precision: {len([n for n in fp8 if n.endswith('.weight')])} FP8 Linears "
                     "(fp8-block, fp8-dynamic) not run: verify runs the fused NVFP4 MoE kernels (an FP8 shared "
                     "expert joins the reference at its exact dequantized weights; fp4kit eval measures FP8 modules)"]


def test_fp8_routed_experts_travel_as_stored_and_verify_names_them(tiny, tmp_path):
    root = _quantize(tiny("deepseek_v3"), tmp_path / "q", (r"self_attn\.=fp8-dynamic",
                                                           r"layers\.2\.mlp\.experts\.=fp8-dynamic"))
    layout = tmp_path / "layout"
    run = cli_result("layout", root, layout, "--backend", "trtllm")
    assert run.returncode == 0, run.stderr
    assert sorted(json.loads((layout / "fp4kit_layout.json").read_text())["layers"]) == ["1"]
    source, laid_out = load_all(root), load_all(layout)
    expert = "model.layers.2.mlp.experts.5.down_proj.weight"
    assert same_bytes(source[expert], laid_out[expert])
    verified = cli_result("verify", root, "--json", "-")
    assert verified.returncode == 0, verified.stderr
    report = json.loads(verified.stdout)
    assert report["passed"] and {r["layer"] for r in report["results"]} == {1}
    assert "routed experts in FP8, not verified (no NVFP4 MoE kernel runs them): model.layers.2.mlp.experts" in \
        report["notes"]


def test_fp8_experts_beside_nvfp4_experts_are_one_error_line(tiny, tmp_path):
    root = _quantize(tiny("qwen3_moe"), tmp_path / "q", (r"layers\.1\.mlp\.experts\.[0-3]\.=fp8-dynamic",),
                     scheme="nvfp4a16")
    for command in (("layout", root, tmp_path / "layout", "--backend", "marlin"), ("verify", root)):
        run = cli_result(*command)
        assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
        assert "fp8-dynamic routed expert in a layer of NVFP4 experts" in run.stderr, run.stderr
    assert not (tmp_path / "layout").exists()
