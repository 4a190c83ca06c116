"""quantize --scheme-for: mixed-precision checkpoints in both dialects, read back by vLLM 0.33's own config parsers
(the scheme vLLM gives every module, fused ones included, is the one compressed-tensors' first match gives) and
ModelOpt's own config conversion; NVFP4 modules unchanged from a single-scheme run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import VLLM_PACKED, fused_serving_names, load_all, vllm_ct_scheme

from fp4kit.errors import Fp4kitError
from fp4kit.fp8 import quantize_fp8
from fp4kit.quantize.checkpoint import QuantizeOptions, quantize_checkpoint

# per family: attention FP8 per channel, a dense / shared MLP in FP8 blocks, some routed experts kept, the rest of
# the experts NVFP4 (the default scheme)
RULES = {
    "qwen3_moe": [r"self_attn\.=fp8-dynamic", r"layers\.1\.mlp\.experts\.[0-3]\.=bf16"],
    "deepseek_v3": [r"self_attn\.=fp8-dynamic", r"mlp\.(shared_experts|gate_proj|up_proj|down_proj)=fp8-block",
                    r"layers\.2\.mlp\.experts\.[0-3]\.=bf16"],
}
# vLLM's packed_modules_mapping (qwen3_moe.py, deepseek_v2.py); deepseek_v2.py's fused_qkv_a_proj is not in it




@pytest.fixture(scope="module")
def mixed(tiny, tmp_path_factory):
    built: dict[tuple[str, str, tuple[str, ...]], Path] = {}

    def get(family: str, dialect: str, rules: tuple[str, ...] | None = None) -> Path:
        rules = tuple(RULES[family]) if rules is None else rules
        key = (family, dialect, rules)
        if key not in built:
            dst = tmp_path_factory.mktemp(f"mixed-{family}-{dialect}") / "out"
            quantize_checkpoint(tiny(family), dst, QuantizeOptions(format=dialect, scheme_for=list(rules)))
            built[key] = dst
        return built[key]

    return get


def _expected(root: Path) -> dict[str, str]:
    """module -> scheme, from the tensors on disk: FP8 weights (by the scale's shape) and NVFP4 ones."""
    tensors = load_all(root)
    out = {}
    for name, t in tensors.items():
        module, leaf = name.rsplit(".", 1)
        if leaf == "weight" and t.dtype == torch.float8_e4m3fn:
            scale = tensors[f"{module}.weight_scale"]
            out[module] = "fp8-dynamic" if scale.numel() == t.shape[0] else "fp8-block"
        elif leaf in ("weight_packed", "weight_scale_2"):
            out[module] = "nvfp4a16"
    return out


@pytest.mark.parametrize("family", sorted(RULES))
def test_compressed_tensors_mixed_config_resolves_in_vllm_as_first_match(mixed, tiny, family):
    from compressed_tensors.quantization import QuantizationConfig

    root = mixed(family, "compressed-tensors")
    config = json.loads((root / "config.json").read_text())["quantization_config"]
    assert config["format"] == "mixed-precision"
    QuantizationConfig.model_validate(config)  # compressed-tensors' own classes take it
    resolved = vllm_ct_scheme(config)
    expected = _expected(root)
    assert {"fp8-dynamic", "nvfp4a16"} <= set(expected.values())
    for module, scheme in expected.items():
        assert resolved(module) == scheme, module
    # what vLLM asks for: fused Linears by their serving names, routed experts by expert 0's
    for fused, part in fused_serving_names(expected).items():
        assert resolved(fused) == expected[part], fused
    kept = [m for m in json.loads((root / "config.json").read_text())["quantization_config"]["ignore"]
            if ".experts." in m]
    assert kept and all(resolved(m) is None for m in kept)


@pytest.mark.parametrize("family", sorted(RULES))
def test_modelopt_mixed_config_resolves_in_vllm(mixed, family):
    from helpers import vllm_module
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format

    modelopt_config = vllm_module("model_executor.layers.quantization.modelopt")
    root = mixed(family, "modelopt")
    hf_quant = json.loads((root / "hf_quant_config.json").read_text())
    config_json = json.loads((root / "config.json").read_text())["quantization_config"]
    # config.json's section is what ModelOpt derives from hf_quant_config.json
    assert config_json == convert_hf_quant_config_format(hf_quant)
    assert modelopt_config.ModelOptMixedPrecisionConfig.override_quantization_method(config_json, None) == \
        "modelopt_mixed"
    algos = {"fp8-dynamic": "FP8_PER_CHANNEL_PER_TOKEN", "fp8-block": "FP8_PB_WO", "nvfp4a16": "W4A16_NVFP4"}
    expected = _expected(root)
    for source in (hf_quant, config_json):
        parsed = modelopt_config.ModelOptMixedPrecisionConfig.from_config(source)
        parsed.packed_modules_mapping = dict(VLLM_PACKED)
        assert parsed.get_name() == "modelopt_mixed"
        for module, scheme in expected.items():
            assert not parsed.is_layer_excluded(module), module
            assert parsed._resolve_quant_algo(module) == algos[scheme], module
        for fused, part in fused_serving_names(expected).items():
            assert parsed._resolve_quant_algo(fused) == algos[expected[part]], fused
        experts = sorted({m.rsplit(".", 2)[0] for m in expected if ".experts." in m})
        assert experts and all(parsed._resolve_quant_algo(e) == "W4A16_NVFP4" for e in experts)
        kept = [m for m in hf_quant["quantization"]["exclude_modules"] if ".experts." in m]
        assert kept and all(parsed.is_layer_excluded(m) for m in kept)


@pytest.mark.parametrize("dialect", ["compressed-tensors", "modelopt"])
def test_fp8_tensors_have_the_shapes_vllm_registers(mixed, monkeypatch, dialect):
    """Every FP8 module's tensors, by name and shape, as vLLM 0.33's FP8 linear methods create their parameters."""
    from helpers import vllm_module

    root = mixed("deepseek_v3", dialect)
    tensors = load_all(root)
    expected = _expected(root)
    param = vllm_module("model_executor.parameter")
    monkeypatch.setattr(param, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(param, "get_tensor_model_parallel_world_size", lambda: 1)
    fp8 = {m: s for m, s in expected.items() if s.startswith("fp8")}
    assert {"fp8-dynamic", "fp8-block"} <= set(fp8.values())
    for module, scheme in fp8.items():
        n, k = tensors[f"{module}.weight"].shape
        if dialect == "modelopt":
            mo = vllm_module("model_executor.layers.quantization.modelopt")
            layer = torch.nn.Module()
            key_scheme = {"fp8-dynamic": mo.KFp8StaticChannel, "fp8-block": mo.KFp8Block128}[scheme]()
            if scheme == "fp8-block" and k % 128:
                with pytest.raises(ValueError, match="divisible by 128"):
                    key_scheme.create_weights(layer, mo.WEIGHT, mo.CkptCtx(), mo.Shapes([n], k, torch.bfloat16),
                                              lambda *a, **kw: None)
                continue
            key_scheme.create_weights(layer, mo.WEIGHT, mo.CkptCtx(), mo.Shapes([n], k, torch.bfloat16),
                                      lambda *a, **kw: None)
        else:
            fp8_utils = vllm_module("model_executor.layers.quantization.utils.fp8_utils")
            ct_utils = vllm_module("model_executor.layers.quantization.compressed_tensors.utils")
            from compressed_tensors.quantization import QuantizationStrategy

            strategy = {"fp8-dynamic": QuantizationStrategy.CHANNEL, "fp8-block": QuantizationStrategy.BLOCK}[scheme]
            layer = torch.nn.Module()
            layer.register_parameter("weight", fp8_utils.create_fp8_weight_parameter(n, k, lambda *a, **kw: None))
            layer.register_parameter("weight_scale", fp8_utils.create_fp8_scale_parameter(
                ct_utils.STRATEGY_TO_PARAMETER_TYPE[strategy], [n], k,
                [128, 128] if scheme == "fp8-block" else None, lambda *a, **kw: None))
        ours = {name.removeprefix(module + "."): tuple(t.shape) for name, t in tensors.items()
                if name.rsplit(".", 1)[0] == module}
        theirs = {name: tuple(p.shape) for name, p in layer.named_parameters()}
        assert ours == theirs, module


@pytest.mark.parametrize("dialect", ["compressed-tensors", "modelopt"])
def test_nvfp4_modules_unchanged_and_fp8_modules_quantized_from_source(mixed, tiny, tmp_path, dialect):
    root = mixed("qwen3_moe", dialect)
    plain = tmp_path / "plain"
    quantize_checkpoint(tiny("qwen3_moe"), plain, QuantizeOptions(format=dialect))
    ours, single, source = load_all(root), load_all(plain), load_all(tiny("qwen3_moe"))
    expected = _expected(root)
    nvfp4 = [n for n in ours if n.rsplit(".", 1)[0] in expected and expected[n.rsplit(".", 1)[0]] == "nvfp4a16"]
    assert nvfp4 and all(torch.equal(ours[n].reshape(-1).view(torch.uint8), single[n].reshape(-1).view(torch.uint8))
                      for n in nvfp4)
    for module, scheme in expected.items():
        if scheme == "fp8-dynamic":
            q = quantize_fp8(source[f"{module}.weight"], scheme)
            assert torch.equal(ours[f"{module}.weight"].view(torch.uint8), q.codes.view(torch.uint8)), module
            assert torch.equal(ours[f"{module}.weight_scale"].flatten(), q.scale.float().flatten()
                               .to(ours[f"{module}.weight_scale"].dtype)), module
    kept = [m for m in RULES["qwen3_moe"] if m.endswith("=bf16")]
    assert kept and torch.equal(ours["model.layers.1.mlp.experts.0.gate_proj.weight"],
                                source["model.layers.1.mlp.experts.0.gate_proj.weight"])


def test_single_scheme_rules_write_a_plain_nvfp4_checkpoint(mixed, tiny, tmp_path):
    """A rule that gives every module the same NVFP4 scheme writes what --scheme alone writes."""
    root = mixed("qwen3_moe", "compressed-tensors", (r"self_attn=nvfp4a16",))
    plain = tmp_path / "plain"
    quantize_checkpoint(tiny("qwen3_moe"), plain, QuantizeOptions())
    for name in ("config.json", "model.safetensors"):
        assert (root / name).read_bytes() == (plain / name).read_bytes(), name


def test_refusals_are_one_line(tiny, tmp_path):
    with pytest.raises(Fp4kitError, match="must share one scheme") as info:
        quantize_checkpoint(tiny("qwen3_moe"), tmp_path / "a", QuantizeOptions(scheme_for=[r"q_proj=fp8-dynamic"]))
    assert "\n" not in str(info.value)
    with pytest.raises(Fp4kitError, match="fused"):
        quantize_checkpoint(tiny("llama4"), tmp_path / "b",
                            QuantizeOptions(format="modelopt", scheme_for=[r"experts=fp8-dynamic"]))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_calibrated_mixed_run_keeps_w4a4_experts_and_calibrates_fp8_static(tiny, tmp_path):
    """W4A4 experts beside fp8-dynamic attention and fp8-static o_proj: the experts'
    weights and input scales are the single-scheme W4A4 run's bytes (one calibration pass, the same statistics),
    fp8-static modules carry a positive input scale in the weight's dtype."""
    src = tiny("qwen3_moe")
    options = {"scheme": "nvfp4", "samples": 4, "seq_len": 32}
    mixed_dst, plain_dst = tmp_path / "mixed", tmp_path / "plain"
    quantize_checkpoint(src, mixed_dst, QuantizeOptions(
        **options, scheme_for=[r"self_attn\.(q|k|v)_proj=fp8-dynamic", r"self_attn\.o_proj=fp8-static"]))
    quantize_checkpoint(src, plain_dst, QuantizeOptions(**options))
    ours, plain = load_all(mixed_dst), load_all(plain_dst)
    experts = [n for n in ours if ".experts." in n]
    assert any(n.endswith(".input_global_scale") for n in experts)
    assert all(torch.equal(ours[n].reshape(-1).view(torch.uint8), plain[n].reshape(-1).view(torch.uint8))
               for n in experts)
    o_proj = "model.layers.0.self_attn.o_proj"
    assert ours[f"{o_proj}.weight_scale"].shape == (1,) and ours[f"{o_proj}.input_scale"].shape == (1,)
    assert ours[f"{o_proj}.input_scale"].dtype == torch.bfloat16 and float(ours[f"{o_proj}.input_scale"]) > 0
    assert "model.layers.0.self_attn.q_proj.input_scale" not in ours
    config = json.loads((mixed_dst / "config.json").read_text())["quantization_config"]
    static = [g for g in config["config_groups"].values() if g["weights"]["num_bits"] == 8
              and g["weights"]["strategy"] == "tensor"]
    assert len(static) == 1 and static[0]["input_activations"]["dynamic"] is False
