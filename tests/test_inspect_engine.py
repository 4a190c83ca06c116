"""`fp4kit inspect --engine vllm`: a planted case of every load-contract check is flagged (exit 1, tensor named,
JSON like the other checks), and fp4kit's own outputs of every family are clean."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import EXPERT0, rewrite, run_cli

from fp4kit.formats import compressed_tensors as ct
from fp4kit.quantize import QuantizeOptions, quantize_checkpoint
from fp4kit.testing.fixtures import FIXTURES
from fp4kit.tools.convert import convert_checkpoint
from fp4kit.tools.engine_checks import SOURCES
from fp4kit.tools.inspect import inspect_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def shared_input_scales(src, dst):
    """fp4kit's NVFP4A16 output made W4A4 with one bf16-valued input multiplier per layer and projection (gate and
    up together), as `fp4kit quantize --scheme nvfp4` writes by default."""

    def add(tensors: dict) -> None:
        for name in [n for n in tensors if n.endswith(".weight_packed")]:
            module = name.removesuffix(".weight_packed")
            parent, leaf = module.rsplit(".", 1)
            parent = parent.split(".experts.")[0]  # every expert of the layer together
            group = parent + (leaf if leaf in ("down_proj", "o_proj") else ".input")  # q/k/v and gate/up share one
            value = 100.0 + (sum(map(ord, group)) % 300)
            tensors[f"{module}.input_global_scale"] = torch.tensor([value]).bfloat16().float()

    def config(cfg: dict) -> None:
        cfg["quantization_config"] = ct.quantization_config("nvfp4", cfg["quantization_config"]["ignore"])

    return rewrite(src, dst, add, config)


@pytest.mark.parametrize("family", FIXTURES)
def test_fp4kit_outputs_are_clean_for_vllm(family, tiny_nvfp4a16, tmp_path):
    assert inspect_checkpoint(tiny_nvfp4a16(family), engine="vllm").problems == []
    convert_checkpoint(tiny_nvfp4a16(family), tmp_path / "mo", "modelopt")
    assert inspect_checkpoint(tmp_path / "mo", engine="vllm").problems == []


def test_fp4kit_w4a4_quantize_is_clean_for_vllm(tiny, tmp_path):
    for family, fmt in (("qwen3_moe", "compressed-tensors"), ("llama4", "modelopt")):
        out = tmp_path / f"{family}-{fmt}"
        quantize_checkpoint(tiny(family), out, QuantizeOptions(scheme="nvfp4", format=fmt, samples=4, seq_len=16,
                                                               batch_size=4))
        assert inspect_checkpoint(out, engine="vllm").problems == [], family


def zero_block_scale(tensors: dict) -> None:
    name = f"{EXPERT0}.down_proj.weight_scale"
    raw = tensors[name].view(torch.uint8).clone()
    packed = tensors[f"{EXPERT0}.down_proj.weight_packed"]
    row = int(torch.nonzero(packed[:, :8].reshape(packed.shape[0], -1).bitwise_and(0x77).any(dim=1))[0])
    raw[row, 0] = 0  # a block whose codes are not all zero
    tensors[name] = raw.view(torch.float8_e4m3fn)


def per_expert_input(tensors: dict) -> None:
    for proj in ("gate_proj", "up_proj"):
        name = f"model.layers.0.mlp.experts.1.{proj}.input_global_scale"
        tensors[name] = tensors[name] * 2


def kv_cache_scheme(config: dict) -> None:
    config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                        "dynamic": False, "symmetric": True}


CASES = {
    # name: (edit, config edit, check, named tensor or module)
    "input_scale_inf": (lambda t: t.update({f"{EXPERT0}.down_proj.input_global_scale": torch.tensor([float("inf")])}),
                        None, "vllm_w4a4_input_scale", f"{EXPERT0}.down_proj.input_global_scale"),
    "input_scale_missing": (lambda t: t.pop(f"{EXPERT0}.down_proj.input_global_scale"), None,
                            "vllm_w4a4_input_scale", f"{EXPERT0}.down_proj"),
    "gate_up_global": (lambda t: t.update({f"{EXPERT0}.up_proj.weight_global_scale":
                                           t[f"{EXPERT0}.up_proj.weight_global_scale"] * 2}), None,
                       "vllm_gate_up_global_scale", f"{EXPERT0}.up_proj"),
    "per_expert_input": (per_expert_input, None, "vllm_per_expert_input_scale",
                         "model.layers.0.mlp.experts.*.gate_proj"),
    "kv_cache_without_scales": (lambda t: None, kv_cache_scheme, "vllm_kv_cache_scale",
                                "model.layers.0.self_attn.k_scale"),
    "zero_block_scale": (zero_block_scale, None, "vllm_zero_block_scale", f"{EXPERT0}.down_proj.weight_scale"),
}


@pytest.fixture(scope="module")
def w4a4(tiny_nvfp4a16, tmp_path_factory):
    out = shared_input_scales(tiny_nvfp4a16("qwen3_moe"), tmp_path_factory.mktemp("engine") / "w4a4")
    assert inspect_checkpoint(out, engine="vllm").problems == []
    return out


@pytest.mark.parametrize("case", CASES)
def test_each_planted_contract_breach_is_flagged(case, w4a4, tmp_path):
    edit, config_edit, check, name = CASES[case]
    report = inspect_checkpoint(rewrite(w4a4, tmp_path / "bad", edit, config_edit), engine="vllm")
    found = [p for p in report.problems if p.check == check]
    assert found and name in {p.module for p in found}, report.problems
    assert all(p.source == SOURCES[check] and p.source.startswith("vllm/") for p in found)
    assert not [p for p in inspect_checkpoint(tmp_path / "bad").problems if p.check.startswith("vllm_")]


def test_pre_quant_scale_is_flagged(w4a4, tmp_path):
    convert_checkpoint(w4a4, tmp_path / "mo", "modelopt")
    name = f"{EXPERT0}.down_proj.pre_quant_scale"
    bad = rewrite(tmp_path / "mo", tmp_path / "bad", lambda t: t.update({name: torch.ones(32, dtype=torch.bfloat16)}))
    found = [p for p in inspect_checkpoint(bad, engine="vllm").problems if p.check == "vllm_pre_quant_scale"]
    assert [p.module for p in found] == [name]


def test_mtp_layer_missing_or_quantized_is_flagged(tiny, tiny_nvfp4a16, tmp_path):
    glm = tiny_nvfp4a16("glm4_moe")
    first_mtp = json.loads((glm / "config.json").read_text())["num_hidden_layers"]
    two = rewrite(glm, tmp_path / "two", lambda t: None, lambda c: c.update({"num_nextn_predict_layers": 2}))
    found = [p for p in inspect_checkpoint(two, engine="vllm").problems if p.check == "vllm_mtp_layer"]
    assert [p.module for p in found] == [f"layers.{first_mtp + 1}"]
    quantized = tmp_path / "quantized-mtp"
    quantize_checkpoint(tiny("glm4_moe"), quantized, QuantizeOptions(default_ignore=False, ignore=[r"mlp\.gate$"]))
    found = [p for p in inspect_checkpoint(quantized, engine="vllm").problems if p.check == "vllm_mtp_layer"]
    assert found and all(f"layers.{first_mtp}." in p.module for p in found)


def test_cli_engine_exit_code_json_and_sources(monkeypatch, capsys, w4a4, tmp_path):
    code, out, err = run_cli(monkeypatch, capsys, "inspect", w4a4, "--engine", "vllm")
    assert code == 0 and "no problems found" in out + err
    bad = rewrite(w4a4, tmp_path / "bad", per_expert_input)
    code, out, _ = run_cli(monkeypatch, capsys, "inspect", bad, "--engine", "vllm", "--json")
    report = json.loads(out)
    assert code == 1 and report["engine"] == "vllm" and not report["clean"]
    assert {p["check"] for p in report["problems"]} >= {"vllm_per_expert_input_scale"}
    assert all(p["source"] for p in report["problems"] if p["check"].startswith("vllm_"))
    code, out, err = run_cli(monkeypatch, capsys, "inspect", bad, "--engine", "vllm")
    assert code == 1 and "flashinfer_fp4_moe.py" in out + err
    code, out, err = run_cli(monkeypatch, capsys, "inspect", w4a4, "--engine", "tgi")
    assert code == 2 and not out and err.startswith("error:")


def test_inspect_reports_the_scales_marlin_zeroes(w4a4, tmp_path):
    name = f"{EXPERT0}.gate_proj.weight_scale"

    def near_dead(tensors: dict) -> None:
        raw = tensors[name].view(torch.uint8).clone()
        raw[0, 0] = 0x01  # 2^-9, next to the expert's 448: vLLM's Marlin path stores it as 0
        tensors[name] = raw.view(torch.float8_e4m3fn)

    report = inspect_checkpoint(rewrite(w4a4, tmp_path / "dead", near_dead))
    assert report.clean and report.marlin_zeroed_scales == {"model.layers.0.mlp.experts.w13": 1}
    assert inspect_checkpoint(w4a4).marlin_zeroed_scales == {}
