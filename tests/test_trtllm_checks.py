"""inspect --engine trtllm: the compressed-tensors configs TensorRT-LLM's parser cannot take (several config groups,
a weight-only NVFP4 group) are findings citing its source; W4A4 single-scheme and ModelOpt outputs have none."""

from __future__ import annotations

import pytest
from helpers import run_cli

from fp4kit.formats.compressed_tensors import quantization_config
from fp4kit.quantize.checkpoint import QuantizeOptions, quantize_checkpoint
from fp4kit.tools.inspect import inspect_checkpoint
from fp4kit.tools.trtllm_checks import SOURCES, group_problem


@pytest.fixture(scope="module")
def outputs(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("trtllm")
    made = {}
    calibrated = {"samples": 4, "seq_len": 16}
    for name, options in {
        "mixed": QuantizeOptions(scheme="nvfp4", scheme_for=[r"self_attn\.=fp8-dynamic"], **calibrated),
        "w4a16": QuantizeOptions(),
        "w4a4": QuantizeOptions(scheme="nvfp4", **calibrated),
        "mixed-modelopt": QuantizeOptions(format="modelopt", scheme_for=[r"self_attn\.=fp8-dynamic"]),
    }.items():
        quantize_checkpoint(tiny("qwen3_moe"), root / name, options)
        made[name] = root / name
    return made


def _findings(root) -> dict[str, str]:
    return {p.module: p.check for p in inspect_checkpoint(root, engine="trtllm").problems
            if p.check.startswith("trtllm_")}


def test_a_mixed_precision_config_is_a_finding_naming_the_class_target(outputs):
    problems = [p for p in inspect_checkpoint(outputs["mixed"], engine="trtllm").problems
                if p.check.startswith("trtllm_")]
    assert [(p.check, p.module) for p in problems] == [("trtllm_ct_config_groups", "quantization_config.config_groups")]
    assert "group_1 targets the class Linear" in problems[0].detail
    assert problems[0].source == SOURCES["trtllm_ct_config_groups"]


def test_a_weight_only_nvfp4_group_is_a_finding(outputs):
    assert _findings(outputs["w4a16"]) == {"quantization_config.config_groups.group_0": "trtllm_ct_group_scheme"}


@pytest.mark.parametrize("name", ["w4a4", "mixed-modelopt"])
def test_w4a4_and_modelopt_outputs_have_no_finding(outputs, name):
    assert _findings(outputs[name]) == {}


def test_group_problem_takes_what_trtllm_takes():
    nvfp4, nvfp4a16 = (quantization_config(scheme, [])["config_groups"]["group_0"] for scheme in ("nvfp4", "nvfp4a16"))
    assert group_problem(nvfp4) is None
    assert "weight-only" in (group_problem(nvfp4a16) or "")
    fp8 = {"weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
           "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor"}}
    assert "tensor weights" in (group_problem(fp8) or "")
    fp8["weights"]["strategy"], fp8["input_activations"]["strategy"] = "channel", "token"
    assert group_problem(fp8) is None


def test_cli_exit_1_and_source_in_brackets(outputs, monkeypatch, capsys):
    code, out, _ = run_cli(monkeypatch, capsys, "inspect", str(outputs["mixed"]), "--engine", "trtllm")
    assert code == 1 and "[trtllm_ct_config_groups]" in out and "quant_config_utils.py" in out
