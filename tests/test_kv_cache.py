"""quantize --kv-cache fp8: per-layer k_scale / v_scale against llm-compressor 0.14's kv_cache_scheme calibration,
through vLLM 0.33's own name mapping and KV-cache quant methods in both dialects, read back by convert (byte for byte
both ways), shard and inspect, and emulated by eval."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import load_all

from fp4kit.errors import Fp4kitError
from fp4kit.quantize import QuantizeOptions, quantize_checkpoint

SAMPLES, SEQ_LEN = 4, 32
CALIB = dict(samples=SAMPLES, seq_len=SEQ_LEN, batch_size=4)
SUFFIXES = {"compressed-tensors": (".k_scale", ".v_scale"), "modelopt": (".k_proj.k_scale", ".v_proj.v_scale")}


@pytest.fixture(scope="module")
def kv(tiny, tmp_path_factory):
    built = {}

    def get(family: str, dialect: str, scheme: str = "nvfp4a16", dtype: str = "auto"):
        key = (family, dialect, scheme, dtype)
        if key not in built:
            dst = tmp_path_factory.mktemp(f"kv-{family}-{dialect}") / "out"
            quantize_checkpoint(tiny(family), dst, QuantizeOptions(scheme=scheme, format=dialect, kv_cache="fp8",
                                                                   dtype=dtype, **CALIB))
            built[key] = dst
        return built[key]

    return get


def _kv_tensors(root, dialect: str) -> dict[str, torch.Tensor]:
    return {n: t for n, t in load_all(root).items() if n.endswith(SUFFIXES[dialect])}


@pytest.mark.pinned
def test_scales_equal_llm_compressor_kv_cache_scheme(tiny, kv, tmp_path):
    """llm-compressor's oneshot with a per-tensor FP8 kv_cache_scheme (observer static_minmax: the running max, as
    fp4kit's pass) on the same windows, both in fp32: with its basic pipeline (one forward of the source model, as
    fp4kit's rtn pass) every k_scale / v_scale equal within fp32 rounding; its default sequential pipeline
    propagates other inputs than the source model's forward from layer to layer, so only layer 0 is compared."""
    pytest.importorskip("llmcompressor")
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    from fp4kit.quantize.calib_data import load_calibration

    src = tiny("qwen3_moe")
    ours = _kv_tensors(kv("qwen3_moe", "compressed-tensors", dtype="fp32"), "compressed-tensors")
    ids = load_calibration(None, src, 256, SAMPLES, SEQ_LEN)
    dataset = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    scheme = dict(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True, observer="static_minmax")
    for pipeline in ("basic", "sequential"):
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        oneshot(model=model, dataset=dataset, num_calibration_samples=SAMPLES, max_seq_length=SEQ_LEN,
                pipeline=pipeline, recipe=QuantizationModifier(targets="Linear", scheme="NVFP4A16",
                                                               ignore=["lm_head", "re:.*mlp.gate$"],
                                                               kv_cache_scheme=scheme))
        model.save_pretrained(tmp_path / pipeline, save_compressed=True)
        theirs = _kv_tensors(tmp_path / pipeline, "compressed-tensors")
        assert set(theirs) == set(ours) and len(ours) == 4
        compared = ours if pipeline == "basic" else {n: t for n, t in ours.items() if ".layers.0." in n}
        for name, scale in compared.items():
            assert scale.dtype == torch.float32 and scale.shape == theirs[name].shape == (1,)
            torch.testing.assert_close(scale, theirs[name].float(), rtol=1e-6, atol=0, msg=name)
        config = json.loads((tmp_path / pipeline / "config.json").read_text())["quantization_config"]
        ours_config = json.loads((kv("qwen3_moe", "compressed-tensors", dtype="fp32") / "config.json").read_text())
        assert ours_config["quantization_config"]["kv_cache_scheme"] == config["kv_cache_scheme"]


# vLLM model classes whose AutoWeightsLoader mappers the names go through: (outer, inner)
VLLM_MODELS = {"qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeModel"),
               "qwen3_next": ("qwen3_next", "Qwen3NextForCausalLM", "Qwen3NextModel")}


@pytest.mark.parametrize("family", sorted(VLLM_MODELS))
@pytest.mark.parametrize("dialect", ["compressed-tensors", "modelopt"])
def test_vllm_maps_every_scale_to_its_attention_layer_kv_cache_method(kv, tiny, family, dialect):
    """vLLM 0.33: the quant config's KV-cache method for every Attention layer (compressed-tensors' validates the
    kv_cache_scheme; ModelOpt's reads kv_cache_quant_algo FP8), and each k_scale / v_scale mapped by the loaders'
    mappers (the model's hf_to_vllm_mapper with the quant config's get_cache_scale_mapper, as AutoWeightsLoader
    combines them) onto `<attention>.attn.k_scale` / `v_scale`, loaded by KVCacheScaleParameter's loader. Qwen3-Next:
    full-attention layers only."""
    from helpers import vllm_module

    kv_cache = vllm_module("model_executor.layers.quantization.kv_cache")
    attention_cls = vllm_module("model_executor.layers.attention").Attention
    module, outer, inner = VLLM_MODELS[family]
    models = vllm_module(f"model_executor.models.{module}")
    root = kv(family, dialect)
    if dialect == "compressed-tensors":
        ct = vllm_module("model_executor.layers.quantization.compressed_tensors.compressed_tensors")
        config = ct.CompressedTensorsConfig.from_config(json.loads((root / "config.json").read_text())
                                                        ["quantization_config"])
        expected_method = ct.CompressedTensorsKVCacheMethod
    else:
        mo = vllm_module("model_executor.layers.quantization.modelopt")
        hf_quant = json.loads((root / "hf_quant_config.json").read_text())
        config = mo.ModelOptNvFp4Config.from_config(hf_quant)
        assert config.kv_cache_quant_algo == "FP8"
        expected_method = mo.ModelOptKVCacheMethod
    tensors = _kv_tensors(root, dialect)
    attention = sorted({n[: -len(SUFFIXES[dialect][0])] for n in tensors if n.endswith(SUFFIXES[dialect][0])})
    source_layers = json.loads((tiny(family) / "config.json").read_text())["num_hidden_layers"]
    if family == "qwen3_next":
        assert 0 < len(attention) < source_layers  # the Gated DeltaNet layers have no KV cache
    else:
        assert len(attention) == source_layers
    method = config.get_quant_method(attention_cls.__new__(attention_cls), prefix=f"{attention[0]}.attn")
    assert isinstance(method, expected_method)
    cache = config.get_cache_scale_mapper()
    mapped = {}
    for name, tensor in tensors.items():
        name = (getattr(models, outer).hf_to_vllm_mapper | cache).map_name(name)
        name = (getattr(models, inner).hf_to_vllm_mapper | cache).map_name(name)
        param = kv_cache.KVCacheScaleParameter()
        kv_cache.KVCacheScaleParameter.weight_loader(param, tensor)
        assert float(param) == float(tensor.reshape(())) > 0
        mapped[name] = tensor
    assert set(mapped) == {f"{a}.attn.{p}_scale" for a in attention for p in "kv"}


def test_convert_round_trip_shard_and_inspect(kv, tmp_path, monkeypatch, capsys):
    from helpers import run_cli

    from fp4kit.tools.convert import convert_checkpoint

    ct = kv("qwen3_moe", "compressed-tensors", "nvfp4")
    convert_checkpoint(ct, tmp_path / "mo", "modelopt")
    convert_checkpoint(tmp_path / "mo", tmp_path / "ct", "compressed-tensors")
    original, mo, back = load_all(ct), _kv_tensors(tmp_path / "mo", "modelopt"), load_all(tmp_path / "ct")
    assert {n: t.shape for n, t in mo.items()} == {
        n.replace(".self_attn.k_scale", ".self_attn.k_proj.k_scale").replace(".self_attn.v_scale",
                                                                            ".self_attn.v_proj.v_scale"): ()
        for n in _kv_tensors(ct, "compressed-tensors")}
    for name in _kv_tensors(ct, "compressed-tensors"):
        assert torch.equal(original[name], back[name]), name
    assert json.loads((tmp_path / "mo" / "hf_quant_config.json").read_text())["quantization"][
        "kv_cache_quant_algo"] == "FP8"
    assert json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]["kv_cache_scheme"] == \
        json.loads((ct / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]

    code, out, _ = run_cli(monkeypatch, capsys, "shard", ct, tmp_path / "ep", "--ep", "2")
    assert code == 0
    for rank in ("rank-00000", "rank-00001"):
        tensors = load_all(tmp_path / "ep" / rank)
        for name, scale in _kv_tensors(ct, "compressed-tensors").items():
            assert torch.equal(tensors[name], scale), (rank, name)

    code, out, _ = run_cli(monkeypatch, capsys, "inspect", tmp_path / "mo", "--json")
    report = json.loads(out)
    assert code == 0 and report["kv_cache"]["scheme"] == "fp8" and report["kv_cache"]["attention_layers"] == 2


def test_eval_emulates_the_fp8_kv_cache(kv, tiny, tmp_path):
    from fp4kit.fp8 import fake_quantize_fp8_kv
    from fp4kit.tools.evaluate import evaluate

    root = kv("qwen3_moe", "compressed-tensors", "nvfp4")
    plain = tmp_path / "plain"
    quantize_checkpoint(tiny("qwen3_moe"), plain, QuantizeOptions(scheme="nvfp4", **CALIB))
    from fp4kit.quantize.calib_data import load_calibration

    ids = load_calibration(None, tiny("qwen3_moe"), 256, 2, 32)
    with_kv = evaluate(tiny("qwen3_moe"), root, ids)
    without = evaluate(tiny("qwen3_moe"), plain, ids)
    assert with_kv.scheme == "nvfp4 + fp8 KV cache" and without.scheme == "nvfp4"
    assert with_kv.kl != without.kl
    x = torch.tensor([1.0, -1000.0, 0.3])  # saturates at 448 x scale, rounds to E4M3 like vLLM's cache write
    assert fake_quantize_fp8_kv(x, torch.tensor(0.5)).tolist() == [1.0, -224.0, 0.3125]


def test_gptq_records_the_quantized_layers_keys_and_values(tiny, kv, tmp_path):
    """--method gptq: the scales come from its pass's forward of the quantized layers (their k_proj / v_proj
    already quantized), one per attention module as rtn's, in the same form."""
    dst = tmp_path / "gptq"
    quantize_checkpoint(tiny("qwen3_moe"), dst, QuantizeOptions(method="gptq", kv_cache="fp8", **CALIB))
    ours, rtn = _kv_tensors(dst, "compressed-tensors"), _kv_tensors(kv("qwen3_moe", "compressed-tensors"),
                                                                   "compressed-tensors")
    assert set(ours) == set(rtn) and all(float(t) > 0 and t.shape == (1,) for t in ours.values())
    assert any(not torch.equal(ours[n], rtn[n]) for n in ours)


def test_refusals_are_one_line(tiny, tmp_path):
    with pytest.raises(Fp4kitError, match="MLA attention"):
        quantize_checkpoint(tiny("deepseek_v3"), tmp_path / "a", QuantizeOptions(kv_cache="fp8", **CALIB))
    with pytest.raises(Fp4kitError, match="unknown --kv-cache"):
        quantize_checkpoint(tiny("qwen3_moe"), tmp_path / "b", QuantizeOptions(kv_cache="int8", **CALIB))
