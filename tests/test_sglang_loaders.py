"""SGLang 0.5.23's own quantization-config parsers on fp4kit's outputs (both dialects, W4A16 and W4A4), and
`fp4kit inspect --engine sglang` agreeing with them: what SGLang's ModelOpt exclude rules build unquantized, what
its compressed-tensors config ignores, and the scheme it picks. SGLang is the oracle (`helpers.sglang_module`)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import EXPERT0, rewrite, run_cli, sglang_module, with_input_scales

from fp4kit.formats.detect import open_checkpoint
from fp4kit.tools.convert import convert_checkpoint
from fp4kit.tools.inspect import inspect_checkpoint
from fp4kit.tools.sglang_checks import SOURCES, excluded_by, modelopt_exclude_modules

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# the families SGLang 0.5.23 has model files for among fp4kit's fixtures (qwen3_moe.py, deepseek_v2.py, glm4_moe.py,
# mllama4.py / llama4.py, qwen3_next.py)
FAMILIES = ("qwen3_moe", "deepseek_v3", "glm4_moe", "llama4", "qwen3_next")
SCHEMES = ("nvfp4a16", "nvfp4")


@pytest.fixture(scope="module")
def outputs(tiny_nvfp4a16, tmp_path_factory):
    """outputs(family, scheme, dialect) -> fp4kit's checkpoint: its NVFP4A16 output, made W4A4 with per-module input
    scales for ``nvfp4``, converted to ModelOpt for ``modelopt``."""
    built = {}

    def get(family: str, scheme: str, dialect: str):
        key = (family, scheme, dialect)
        if key not in built:
            root = tmp_path_factory.mktemp(f"{family}-{scheme}-{dialect}")
            ckpt = tiny_nvfp4a16(family)
            if scheme == "nvfp4":
                ckpt = with_input_scales(ckpt, root / "ct")
            if dialect == "modelopt":
                convert_checkpoint(ckpt, root / "mo", "modelopt")
                ckpt = root / "mo"
            built[key] = ckpt
        return built[key]

    return get


def _sglang_names(ckpt) -> list[str]:
    """The module names SGLang asks its quantization config about: each quantized Linear, and each layer's routed
    experts as one FusedMoE module."""
    from fp4kit.families.base import expert_module

    with open_checkpoint(ckpt) as opened:
        return sorted({(e.experts if (e := expert_module(m.name, opened.grammar)) else m.name)
                       for m in opened.modules})


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("family", FAMILIES)
def test_sglang_modelopt_config_reads_fp4kit_output(family, scheme, outputs):
    modelopt = sglang_module("srt.layers.quantization.modelopt_quant")
    ckpt = outputs(family, scheme, "modelopt")
    hf_quant = json.loads((ckpt / "hf_quant_config.json").read_text())
    from_config = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    with open_checkpoint(ckpt) as opened:
        exclude = modelopt_exclude_modules(opened)
    flagged = {p.module for p in inspect_checkpoint(ckpt, engine="sglang").problems
               if p.check == "sglang_excluded_module"}
    for document in (hf_quant, from_config):  # SGLang reads config.json's when it has a quant_algo
        config = modelopt.ModelOptFp4Config.from_config(document)
        assert config.is_checkpoint_nvfp4_serialized and config.group_size == 16
        assert config.is_w4a16 == (scheme == "nvfp4a16")
        assert sorted(config.exclude_modules) == sorted(exclude)
        excluded = {name for name in _sglang_names(ckpt) if config.is_layer_excluded(name)}
        assert excluded == flagged == {n for n in _sglang_names(ckpt) if excluded_by(n, exclude)}, family
    if family in ("deepseek_v3",):
        # the MTP layer's MLA projections in exclude_modules: SGLang's fused-name rule excludes every layer's
        assert "model.layers.0.self_attn.q_a_proj" in flagged
    else:
        assert not flagged


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("family", FAMILIES)
def test_sglang_compressed_tensors_config_reads_fp4kit_output(family, scheme, outputs):
    ct = sglang_module("srt.layers.quantization.compressed_tensors.compressed_tensors")
    utils = sglang_module("srt.layers.quantization.compressed_tensors.utils")
    ckpt = outputs(family, scheme, "compressed-tensors")
    config = ct.CompressedTensorsConfig.from_config(json.loads((ckpt / "config.json").read_text())
                                                    ["quantization_config"])
    linear = config.target_scheme_map["Linear"]
    weights, inputs = linear["weights"], linear.get("input_activations")
    if scheme == "nvfp4":
        assert config._is_fp4a4_nvfp4(weights, inputs) and not config._is_fp4a16_nvfp4(weights, inputs)
    else:
        assert config._is_fp4a16_nvfp4(weights, inputs) and not config._is_fp4a4_nvfp4(weights, inputs)
    for name in _sglang_names(ckpt):
        assert not utils.should_ignore_layer(name, ignore=config.ignore), name
    report = inspect_checkpoint(ckpt)
    head = "language_model.lm_head" if family == "llama4" else "lm_head"
    assert head in report.unquantized_modules and utils.should_ignore_layer(head, ignore=config.ignore)
    assert not [p for p in inspect_checkpoint(ckpt, engine="sglang").problems if p.check.startswith("sglang_")]


def test_planted_exclude_pattern_is_caught_as_sglang_reads_it(outputs, tmp_path):
    """A ModelOpt exclude entry naming one dotted part ("experts") excludes every layer's routed experts in SGLang
    (is_layer_excluded matches each part of a name): SGLang builds them unquantized."""
    modelopt = sglang_module("srt.layers.quantization.modelopt_quant")
    ckpt = outputs("qwen3_moe", "nvfp4", "modelopt")

    def add_pattern(config: dict) -> None:
        config["quantization_config"]["ignore"] = [*config["quantization_config"]["ignore"], "experts"]

    bad = rewrite(ckpt, tmp_path / "bad", lambda t: None, add_pattern)
    sglang = modelopt.ModelOptFp4Config.from_config(json.loads((bad / "config.json").read_text())
                                                    ["quantization_config"])
    found = [p for p in inspect_checkpoint(bad, engine="sglang").problems if p.check == "sglang_excluded_module"]
    assert {p.module for p in found} == {n for n in _sglang_names(bad) if sglang.is_layer_excluded(n)}
    assert "model.layers.0.mlp.experts" in {p.module for p in found}
    assert all(p.source == SOURCES["sglang_excluded_module"] and p.source.startswith("sglang/") for p in found)
    assert not [p for p in inspect_checkpoint(bad, engine="vllm").problems if p.check.startswith("sglang_")]


@pytest.mark.parametrize("dialect", ["compressed-tensors", "modelopt"])
def test_gate_up_global_scale_is_caught(dialect, outputs, tmp_path):
    ckpt = outputs("qwen3_moe", "nvfp4", "compressed-tensors")
    name = f"{EXPERT0}.up_proj.weight_global_scale"
    bad = rewrite(ckpt, tmp_path / "bad", lambda t: t.update({name: t[name] * 2}))
    if dialect == "modelopt":
        convert_checkpoint(bad, tmp_path / "bad_mo", "modelopt")
        bad = tmp_path / "bad_mo"
    found = [p for p in inspect_checkpoint(bad, engine="sglang").problems
             if p.check == "sglang_gate_up_global_scale"]
    assert [p.module for p in found] == [f"{EXPERT0}.up_proj"]
    assert ("Marlin" in found[0].detail) == (dialect == "modelopt")


def test_cli_text_says_which_engine_was_checked(monkeypatch, capsys, outputs, tmp_path):
    ckpt = outputs("qwen3_moe", "nvfp4a16", "modelopt")
    code, out, _ = run_cli(monkeypatch, capsys, "inspect", str(ckpt), "--engine", "sglang")
    assert code == 0 and "engine sglang 0.5.23: 3 load-contract checks, none found a problem" in out
    assert "--moe-runner-backend marlin" in out  # W4A16 experts: the backend note
    code, out, _ = run_cli(monkeypatch, capsys, "inspect", str(ckpt), "--engine", "vllm")
    assert code == 0 and "engine vllm 0.33.0: " in out and "none found a problem" in out
    code, out, _ = run_cli(monkeypatch, capsys, "inspect", str(ckpt))
    assert code == 0 and "engine " not in out
    bad = rewrite(outputs("qwen3_moe", "nvfp4", "compressed-tensors"), tmp_path / "bad", lambda t: t.update(
        {f"{EXPERT0}.up_proj.weight_global_scale": t[f"{EXPERT0}.up_proj.weight_global_scale"] * 2}))
    code, out, _ = run_cli(monkeypatch, capsys, "inspect", str(bad), "--engine", "sglang")
    assert code == 1 and "engine sglang 0.5.23: 3 load-contract checks, 1 problem (below)" in out
    assert "compressed_tensors_w4a4_nvfp4_moe.py" in out


def _sglang_moe_parameters(dialect: str, scheme: str) -> set[str]:
    """The parameters SGLang's MoE method for this dialect and scheme registers on a FusedMoE layer (its own
    ``create_weights``; the constructors' GPU checks are skipped, the attributes they set given)."""
    from types import SimpleNamespace

    if dialect == "modelopt":
        modelopt = sglang_module("srt.layers.quantization.modelopt_quant")
        method = object.__new__(modelopt.ModelOptNvFp4FusedMoEMethod)
        method.quant_config = modelopt.ModelOptFp4Config(True, None, 16, [], None)
        method.enable_flashinfer_trtllm_moe = method.use_flashinfer_trtllm_weight_layout = False
    elif scheme == "nvfp4":
        schemes = sglang_module("srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4_moe")
        method = object.__new__(schemes.CompressedTensorsW4A4Nvfp4MoE)
        method.group_size = 16
    else:
        schemes = sglang_module("srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a16_nvfp4_moe")
        method = schemes.CompressedTensorsW4A16Nvfp4MoE()
    layer = torch.nn.Module()
    layer.moe_runner_config = SimpleNamespace(is_gated=True)
    layer.num_experts = layer.num_local_experts = 8
    layer.moe_ep_rank, layer.intermediate_size_per_partition, layer.params_dtype = 0, 32, torch.bfloat16
    method.create_weights(layer, num_experts=8, hidden_size=64, intermediate_size_per_partition=32,
                          params_dtype=torch.bfloat16, weight_loader=lambda *args, **kwargs: None)
    return {name for name, _ in layer.named_parameters()}


@pytest.mark.parametrize("dialect", ["compressed-tensors", "modelopt"])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_sglang_expert_mapping_loads_every_expert_tensor(family, scheme, dialect, outputs):
    """SGLang's model files (qwen3_moe.py, deepseek_v2.py) map each routed-expert tensor with
    FusedMoE.make_expert_params_mapping and skip, without a word, any name that is then not a parameter: every expert
    tensor of fp4kit's output lands on a parameter of SGLang's MoE method, and the only parameters nothing fills
    are the ones SGLang derives after loading, and the W4A16 ModelOpt input scales the backend note is about."""
    layer_module = sglang_module("srt.layers.moe.fused_moe_triton.layer")
    mapping = layer_module.FusedMoE.make_expert_params_mapping(
        ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name="down_proj", ckpt_up_proj_name="up_proj", num_experts=8)
    parameters = _sglang_moe_parameters(dialect, scheme)
    ckpt = outputs(family, scheme, dialect)
    from safetensors import safe_open

    from fp4kit.families.base import layer_of

    decoder_layers = json.loads((ckpt / "config.json").read_text())["num_hidden_layers"]
    filled: set[str] = set()
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        # the MTP layer (DeepSeek-V3's last, kept bf16) is the drafter's, which SGLang's main model skips
        for name in [n for n in f.keys() if (layer_of(n) or 0) < decoder_layers]:
            for param_name, weight_name, _, _ in mapping:
                if weight_name in name:
                    leaf = name.replace(weight_name, param_name).split(".experts.", 1)[1]
                    assert leaf in parameters, (name, leaf, sorted(parameters))
                    filled.add(leaf)
                    break
    unfilled = parameters - filled - {"w13_blockscale_swizzled", "w2_blockscale_swizzled"}
    if dialect == "modelopt" and scheme == "nvfp4a16":
        assert unfilled == {"w13_input_scale", "w2_input_scale"}
        notes = inspect_checkpoint(ckpt, engine="sglang").notes
        assert any("--moe-runner-backend marlin" in note for note in notes)
    else:
        assert unfilled == set()
        assert not inspect_checkpoint(ckpt, engine="sglang").notes
