"""convert on mixed-precision checkpoints (quantize --scheme-for): compressed-tensors <-> ModelOpt lossless both ways
(every FP8 and NVFP4 tensor's bytes, each module's scheme, the ignores), the converted output what quantize writes
in the target dialect, and vLLM 0.33's own config parsers giving every module its scheme in the converted output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import VLLM_PACKED, fused_serving_names, load_all, same_bytes, vllm_ct_scheme, vllm_module

from fp4kit.formats.detect import open_checkpoint
from fp4kit.quantize.checkpoint import QuantizeOptions, quantize_checkpoint
from fp4kit.tools.convert import convert_checkpoint

DIALECTS = ("compressed-tensors", "modelopt")
OTHER = {"compressed-tensors": "modelopt", "modelopt": "compressed-tensors"}
# attention FP8 per channel, DeepSeek's dense and shared MLPs in FP8 blocks, some routed experts kept, the rest NVFP4;
# and a calibrated one: W4A4 experts beside a calibrated fp8-static o_proj
CASES = {
    "qwen3_moe": ((r"self_attn\.=fp8-dynamic", r"layers\.1\.mlp\.experts\.[0-3]\.=bf16"), "nvfp4a16"),
    "deepseek_v3": ((r"self_attn\.=fp8-dynamic", r"mlp\.(shared_experts|gate_proj|up_proj|down_proj)=fp8-block",
                     r"layers\.2\.mlp\.experts\.[0-3]\.=bf16"), "nvfp4a16"),
    "qwen3_moe-w4a4": ((r"self_attn\.(q|k|v)_proj=fp8-dynamic", r"self_attn\.o_proj=fp8-static"), "nvfp4"),
}
# vLLM's packed_modules_mapping (qwen3_moe.py, deepseek_v2.py) and deepseek_v2.py's fused_qkv_a_proj
MODELOPT_ALGOS = {"fp8-dynamic": "FP8_PER_CHANNEL_PER_TOKEN", "fp8-block": "FP8_PB_WO", "fp8-static": "FP8",
                  "nvfp4a16": "W4A16_NVFP4", "nvfp4": "NVFP4"}


@pytest.fixture(scope="module")
def quantized(tiny, tmp_path_factory):
    built: dict[tuple[str, str], Path] = {}

    def get(case: str, dialect: str) -> Path:
        if (case, dialect) not in built:
            rules, scheme = CASES[case]
            extra = {"samples": 4, "seq_len": 16} if scheme == "nvfp4" else {}
            dst = tmp_path_factory.mktemp(f"mixed-{case}-{dialect}") / "out"
            quantize_checkpoint(tiny(case.split("-")[0]), dst,
                                QuantizeOptions(format=dialect, scheme=scheme, scheme_for=list(rules), **extra))
            built[case, dialect] = dst
        return built[case, dialect]

    return get


def _same_tensors(a: Path, b: Path, nearly: frozenset[str] = frozenset()) -> None:
    """Every tensor's bytes; those in ``nearly`` to within an fp32 rounding."""
    ours, theirs = load_all(a), load_all(b)
    assert sorted(ours) == sorted(theirs)
    for name, tensor in ours.items():
        assert tensor.dtype == theirs[name].dtype and tensor.shape == theirs[name].shape, name
        if name in nearly:
            torch.testing.assert_close(tensor, theirs[name], rtol=2**-23, atol=0)
        else:
            assert same_bytes(tensor.reshape(-1), theirs[name].reshape(-1)), name


def _configs(root: Path) -> dict[str, str]:
    return {f.name: f.read_text() for f in sorted(root.glob("*.json")) if f.name in ("config.json",
                                                                                     "hf_quant_config.json")}


@pytest.mark.parametrize("src_dialect", DIALECTS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_mixed_convert_is_lossless_both_ways_and_writes_what_quantize_writes(quantized, tmp_path, case,
                                                                             src_dialect):
    src, target = quantized(case, src_dialect), OTHER[src_dialect]
    converted, back = tmp_path / "converted", tmp_path / "back"
    report = convert_checkpoint(src, converted, target)
    assert report.fp8_modules > 0 and report.scheme.startswith("mixed (")
    convert_checkpoint(converted, back, src_dialect)
    # the round trip: every tensor's bytes and the configs as quantize wrote them
    _same_tensors(src, back)
    assert {n: json.loads(t) for n, t in _configs(back).items()} == \
        {n: json.loads(t) for n, t in _configs(src).items()}
    assert (back / "config.json").read_bytes() == (src / "config.json").read_bytes()
    # one way: what quantize writes in the target dialect, tensors and configs (key order included); a calibrated
    # NVFP4 input scale only to within its fp32 rounding, as for a single-scheme checkpoint: quantize rounds the
    # calibrated float64 divisor, convert the one the source dialect's fp32 form holds
    with open_checkpoint(quantized(case, target), mixed=True) as ckpt:
        nvfp4_inputs = frozenset(m.input_scale for m in ckpt.modules if m.input_scale)
    _same_tensors(converted, quantized(case, target), nvfp4_inputs)
    for name, text in _configs(quantized(case, target)).items():
        assert json.dumps(json.loads((converted / name).read_text())) == json.dumps(json.loads(text)), name
    with open_checkpoint(src, mixed=True) as a, open_checkpoint(converted, mixed=True) as b:
        assert b.mixed and a.module_schemes() == b.module_schemes()
        assert {m.name: m.scheme for m in a.fp8_modules} == {m.name: m.scheme for m in b.fp8_modules}
        for m, n in zip(sorted(a.fp8_modules, key=lambda m: m.name), sorted(b.fp8_modules, key=lambda m: m.name),
                        strict=True):
            (wa, ia), (wb, ib) = a.read_fp8(m), b.read_fp8(n)
            assert same_bytes(wa.codes, wb.codes) and torch.equal(wa.scale.double(), wb.scale.double()), m.name
            assert (ia is None) == (ib is None) and (ia is None or torch.equal(ia, ib)), m.name


def _disk_schemes(ckpt_root: Path) -> dict[str, str]:
    with open_checkpoint(ckpt_root, mixed=True) as ckpt:
        return ckpt.module_schemes()


@pytest.mark.parametrize("case", sorted(CASES))
def test_vllm_parses_the_converted_compressed_tensors_config(quantized, tmp_path, case):
    """vLLM 0.33's CompressedTensorsConfig gives every module of the converted checkpoint its scheme, fused Linears
    (by their serving names) and kept experts (none) included."""
    root = tmp_path / "ct"
    convert_checkpoint(quantized(case, "modelopt"), root, "compressed-tensors")
    config = json.loads((root / "config.json").read_text())["quantization_config"]
    assert config["format"] == "mixed-precision"
    resolved = vllm_ct_scheme(config)
    expected = _disk_schemes(root)
    assert len(set(expected.values())) >= 2
    for module, scheme in expected.items():
        assert resolved(module) == scheme, module
    for fused, part in fused_serving_names(expected).items():
        assert resolved(fused) == expected[part], fused
    kept = [m for m in config["ignore"] if ".experts." in m]
    assert all(resolved(m) is None for m in kept)
    assert kept or case.endswith("w4a4")


@pytest.mark.parametrize("case", sorted(CASES))
def test_vllm_parses_the_converted_modelopt_config(quantized, tmp_path, case):
    """vLLM 0.33's ModelOptMixedPrecisionConfig, from hf_quant_config.json and from config.json, resolves every
    module of the converted checkpoint to its scheme's algorithm and excludes the kept experts."""
    modelopt = vllm_module("model_executor.layers.quantization.modelopt")
    root = tmp_path / "modelopt"
    convert_checkpoint(quantized(case, "compressed-tensors"), root, "modelopt")
    hf_quant = json.loads((root / "hf_quant_config.json").read_text())
    config_json = json.loads((root / "config.json").read_text())["quantization_config"]
    assert modelopt.ModelOptMixedPrecisionConfig.override_quantization_method(config_json, None) == "modelopt_mixed"
    expected = _disk_schemes(root)
    for source in (hf_quant, config_json):
        parsed = modelopt.ModelOptMixedPrecisionConfig.from_config(source)
        parsed.packed_modules_mapping = dict(VLLM_PACKED)
        for module, scheme in expected.items():
            assert not parsed.is_layer_excluded(module), module
            assert parsed._resolve_quant_algo(module) == MODELOPT_ALGOS[scheme], module
        for fused, part in fused_serving_names(expected).items():
            assert parsed._resolve_quant_algo(fused) == MODELOPT_ALGOS[expected[part]], fused
        kept = [m for m in hf_quant["quantization"]["exclude_modules"] if ".experts." in m]
        assert all(parsed.is_layer_excluded(m) for m in kept)
        assert kept or case.endswith("w4a4")


def test_mixed_convert_to_bf16_dequantizes_fp8_and_nvfp4_modules(quantized, tmp_path):
    src = quantized("deepseek_v3", "modelopt")
    dense = tmp_path / "dense"
    convert_checkpoint(src, dense, "bf16")
    tensors = load_all(dense)
    with open_checkpoint(src, mixed=True) as ckpt:
        for m in ckpt.fp8_modules:
            assert torch.equal(tensors[f"{m.name}.weight"], ckpt.read_fp8(m)[0].dequantize(torch.bfloat16)), m.name
        m = ckpt.modules[0]
        assert torch.equal(tensors[f"{m.name}.weight"], ckpt.read_weight(m).dequantize(torch.bfloat16))
    assert "quantization_config" not in json.loads((dense / "config.json").read_text())
