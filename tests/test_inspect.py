"""`fp4kit inspect`: each defect class is found on a checkpoint built to have it; fp4kit's own output is clean."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import EXPERT0, rewrite, run_cli, with_input_scales

from fp4kit.errors import Fp4kitError
from fp4kit.nvfp4 import quantize_group
from fp4kit.testing.fixtures import FIXTURES
from fp4kit.tools.convert import convert_checkpoint
from fp4kit.tools.inspect import inspect_checkpoint

ROUTER = "model.layers.1.mlp.gate"


@pytest.mark.parametrize("family", FIXTURES)
def test_fp4kit_output_is_clean_in_both_dialects(family, tiny_nvfp4a16, tmp_path):
    report = inspect_checkpoint(tiny_nvfp4a16(family))
    assert report.clean, report.problems
    assert report.family == family.removesuffix("_text")
    assert report.dialect == "compressed-tensors" and report.scheme == "nvfp4a16"
    assert report.num_experts and sum(s.quantized_linears for s in report.layers) > 20
    convert_checkpoint(tiny_nvfp4a16(family), tmp_path / "mo", "modelopt")
    assert inspect_checkpoint(tmp_path / "mo").clean


def scale_up(name: str, factor: float):
    return lambda t: t.update({name: t[name] * factor})


def set_value(name: str, value: float):
    return lambda t: t.update({name: torch.full_like(t[name], value)})


def quantized_router(tensors: dict) -> None:
    weight = tensors.pop(f"{ROUTER}.weight")
    (q,) = quantize_group([weight])
    tensors.update({f"{ROUTER}.weight_packed": q.packed, f"{ROUTER}.weight_scale": q.block_scale,
                    f"{ROUTER}.weight_global_scale": q.global_scale_mul_fp32.reshape(1)})


def nan_block_scale(tensors: dict) -> None:
    name = f"{EXPERT0}.down_proj.weight_scale"
    raw = tensors[name].view(torch.uint8).clone()
    raw[0, 0] = 0x7F
    tensors[name] = raw.view(torch.float8_e4m3fn)


def nan_weight(tensors: dict) -> None:
    name = "model.layers.0.input_layernorm.weight"
    tensors[name] = tensors[name].clone()
    tensors[name][3] = float("nan")


CASES = {
    # name: (W4A4?, edit, expected check, expected module or None)
    "gate_up_mismatch": (False, scale_up(f"{EXPERT0}.up_proj.weight_global_scale", 2.0), "fused_scale_mismatch",
                         EXPERT0),
    "qkv_mismatch": (False, scale_up("model.layers.1.self_attn.k_proj.weight_global_scale", 0.5),
                     "fused_scale_mismatch", "model.layers.1.self_attn"),
    "zero_input_scale": (True, set_value(f"{EXPERT0}.down_proj.input_global_scale", float("inf")), "bad_scale",
                         f"{EXPERT0}.down_proj"),
    "inf_input_scale": (True, set_value(f"{EXPERT0}.down_proj.input_global_scale", 0.0), "bad_scale",
                        f"{EXPERT0}.down_proj"),
    "nan_weight_scale": (False, set_value(f"{EXPERT0}.down_proj.weight_global_scale", float("nan")), "bad_scale",
                         f"{EXPERT0}.down_proj"),
    "missing_input_scale": (True, lambda t: t.pop(f"{EXPERT0}.down_proj.input_global_scale"),
                            "missing_input_scale", f"{EXPERT0}.down_proj"),
    "expert_input_spread": (True, lambda t: None, "expert_input_scale_spread",
                            "model.layers.0.mlp.experts.*.gate_proj"),
    "quantized_router": (False, quantized_router, "quantized_router", ROUTER),
    "nan_block_scale": (False, nan_block_scale, "bad_block_scale", f"{EXPERT0}.down_proj"),
    "nan_weight": (False, nan_weight, "nonfinite_weight", "model.layers.0.input_layernorm.weight"),
}


REFUSED_BY_CONVERT = {"missing_input_scale": "missing input scale", "nan_weight_scale": "is NaN",
                      "nan_block_scale": "NaN or Inf", "nan_weight": "NaN or Inf"}


@pytest.mark.parametrize("case", CASES)
def test_each_defect_is_found(case, tiny_nvfp4a16, tmp_path):
    w4a4, edit, check, module = CASES[case]
    src = tiny_nvfp4a16("qwen3_moe")
    if w4a4:
        src = with_input_scales(src, tmp_path / "w4a4")
    report = inspect_checkpoint(rewrite(src, tmp_path / "bad", edit))
    found = [p for p in report.problems if p.check == check]
    assert found, report.problems
    assert module in {p.module for p in found}
    if case == "gate_up_mismatch":
        assert found[0].ratio == pytest.approx(2.0)
    # in ModelOpt form the same defect is found too; convert refuses a missing scale and NaN anywhere (exit 2)
    if case in REFUSED_BY_CONVERT:
        with pytest.raises(Fp4kitError, match=REFUSED_BY_CONVERT[case]):
            convert_checkpoint(tmp_path / "bad", tmp_path / "bad_mo", "modelopt")
    else:
        convert_checkpoint(tmp_path / "bad", tmp_path / "bad_mo", "modelopt")
        assert check in {p.check for p in inspect_checkpoint(tmp_path / "bad_mo").problems}


def test_backend_constraints_count_only_when_asked(tiny_nvfp4a16):
    src = tiny_nvfp4a16("qwen3_moe")  # H 64, I 32, E 8
    report = inspect_checkpoint(src)
    assert report.clean and report.backends["cutlass"].startswith("intermediate size I = 32")
    assert report.even_ep_sizes == [2, 4, 8]
    asked = inspect_checkpoint(src, backends=["cutlass", "marlin", "trtllm"], ep=3)
    assert {p.module for p in asked.problems} == {"cutlass", "marlin", "trtllm", "ep=3"}  # trtllm: weight-only


def test_cli_exit_codes_and_json(monkeypatch, capsys, tiny, tiny_nvfp4a16, tmp_path):
    code, out, err = run_cli(monkeypatch, capsys, "inspect", tiny_nvfp4a16("glm4_moe"))
    assert code == 0 and "no problems found" in out + err
    bad = rewrite(tiny_nvfp4a16("qwen3_moe"), tmp_path / "bad", scale_up(f"{EXPERT0}.up_proj.weight_global_scale", 3))
    code, out, _ = run_cli(monkeypatch, capsys, "inspect", bad, "--json")
    report = json.loads(out)
    assert code == 1 and not report["clean"] and report["problems"][0]["check"] == "fused_scale_mismatch"
    assert report["layers"][1]["experts"] == 8
    code, out, err = run_cli(monkeypatch, capsys, "inspect", tiny("qwen3_moe"))  # a source: its precision, exit 0
    assert code == 0 and "bfloat16 source, family qwen3_moe" in out + err


@pytest.mark.pinned
def test_llm_compressor_model_free_ptq_defects_are_found(tiny, tmp_path):
    """llm-compressor 0.14.0.1's model_free_ptq quantizes embed_tokens and gives each expert's gate and up their own
    global scale; inspect reports both."""
    pytest.importorskip("llmcompressor")
    from llmcompressor import model_free_ptq

    model_free_ptq(tiny("qwen3_moe"), tmp_path / "mfp", scheme="NVFP4A16", ignore=["lm_head", "re:.*mlp.gate$"])
    checks = {p.check for p in inspect_checkpoint(tmp_path / "mfp").problems}
    assert {"fused_scale_mismatch", "quantized_embedding"} <= checks


@pytest.mark.parametrize("hidden, intermediate", [(128, 64), (64, 32)])
def test_backend_table_says_what_layout_does(hidden, intermediate, monkeypatch, capsys, tmp_path_factory):
    """Every backend row of inspect's table against `fp4kit layout --backend` on the same checkpoint: weight-only and
    W4A4, sizes every backend runs and sizes only TRT-LLM (which pads) runs."""
    from helpers import shared_source

    from fp4kit.tools.inspect import BACKENDS

    w4a4 = shared_source(tmp_path_factory, hidden, intermediate)
    for ckpt in (w4a4, w4a4.parent / "nvfp4a16"):
        table = inspect_checkpoint(ckpt).backends
        for backend in BACKENDS:
            out_dir = tmp_path_factory.mktemp(f"layout-{backend}") / "out"
            code, out, err = run_cli(monkeypatch, capsys, "layout", str(ckpt), str(out_dir), "--backend", backend,
                                     "-q")
            assert (code == 0) == (table[backend] == "ok"), (ckpt.name, backend, table[backend], out, err)
            if code:
                assert code == 2 and table[backend] in out + err, (table[backend], out, err)
    assert "weight-only" in inspect_checkpoint(w4a4.parent / "nvfp4a16").backends["trtllm"]
