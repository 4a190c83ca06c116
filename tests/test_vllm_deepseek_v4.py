"""`fp4kit quantize --source-config --format modelopt` of DeepSeek-V4's release through vLLM 0.33's own DeepSeek-V4
config and weight mapping (models/deepseek_v4/quant_config.py, models/deepseek_v4/nvidia/model.py).

vLLM picks ``DeepseekV4FP8Config`` for the release's ``quant_method: fp8``, which gives the routed experts ModelOpt's
NVFP4 MoE method under ``moe_quant_algo: NVFP4`` and every other Linear the FP8 block method with E8M0 scales. Every
tensor of the output is either a routed expert's, which ``DeepseekV4Model.load_weights`` sends through the expert
mapping (``RoutedExperts.build_expert_params_mapping`` with the release's ``w1`` / ``w2`` / ``w3``) into a parameter
that ``ModelOptNvFp4FusedMoE.create_weights`` registers, at that expert's shard and shape; or the release's own
tensor, byte for byte under its name (what vLLM loads from the release). The MTP block (``mtp.N.*``, which the main
model's mapper hands to the drafter) is checked the same way by its names.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from helpers import load_all, vllm_module, vllm_moe_parameters

from fp4kit.quantize import QuantizeOptions, quantize_checkpoint

quant_config = vllm_module("models.deepseek_v4.quant_config")
dsv4_model = vllm_module("models.deepseek_v4.nvidia.model")
modelopt = vllm_module("model_executor.layers.quantization.modelopt")
fused_moe = vllm_module("model_executor.layers.fused_moe")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def served(tiny, tmp_path_factory):
    """(release, output) of the tiny fixture as DeepSeek-V4 is released, and its --source-config output."""
    from fp4kit.testing.fixtures import write_deepseek_v4_release_source

    root = tmp_path_factory.mktemp("dsv4-serve")
    release = write_deepseek_v4_release_source(tiny("deepseek_v4"), root / "release")
    dst = root / "out"
    quantize_checkpoint(release, dst, QuantizeOptions(format="modelopt", source_config=True, mtp="quantize"))
    return release, dst


def test_vllm_picks_its_deepseek_v4_config_with_nvfp4_experts(served, monkeypatch):
    _, dst = served
    config = json.loads((dst / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["moe_quant_algo"] == "NVFP4"
    assert not (dst / "hf_quant_config.json").exists()
    cls = quant_config.DeepseekV4FP8Config
    assert cls.override_quantization_method(qc, None, SimpleNamespace(model_type="deepseek_v4")) == "deepseek_v4_fp8"
    parsed = cls.from_config(qc)
    hf_config = SimpleNamespace(expert_dtype=config.get("expert_dtype", "fp4"), quantization_config=qc)
    monkeypatch.setattr(quant_config, "get_current_vllm_config",
                        lambda: SimpleNamespace(model_config=SimpleNamespace(hf_config=hf_config)))
    assert parsed.expert_dtype == "fp4" and parsed.moe_quant_algo == "NVFP4" and parsed.is_scale_e8m0
    assert parsed.weight_block_size == [128, 128]

    built = {}

    def record(self, quant_config, moe_config):  # its kernel selection needs a GPU: record what it was given
        built["config"] = quant_config

    monkeypatch.setattr(modelopt.ModelOptNvFp4FusedMoE, "__init__", record)
    experts = fused_moe.RoutedExperts.__new__(fused_moe.RoutedExperts)
    torch.nn.Module.__init__(experts)
    experts.moe_config = None
    method = parsed.get_quant_method(experts, "model.layers.1.ffn.experts")
    assert isinstance(method, modelopt.ModelOptNvFp4FusedMoE)
    assert built["config"].quant_method == "NVFP4" and built["config"].group_size == 16


def test_every_tensor_maps_into_vllms_deepseek_v4(served, monkeypatch):
    release_root, dst = served
    config = json.loads((dst / "config.json").read_text())
    experts, hidden, inter = config["n_routed_experts"], config["hidden_size"], config["moe_intermediate_size"]
    ours, release = load_all(dst), load_all(release_root)
    mapper = dsv4_model._make_deepseek_v4_weights_mapper(config.get("expert_dtype", "fp4"))
    mapping = fused_moe.RoutedExperts.build_expert_params_mapping("w1", "w2", "w3", experts)
    params = dict(vllm_moe_parameters(monkeypatch, "modelopt", experts, hidden, inter).named_parameters())

    def is_routed_expert(name: str) -> bool:
        return ".ffn.experts." in name

    filled: dict[str, set[tuple[int, str]]] = {}
    for name, tensor in ours.items():
        mapped = mapper._map_name(name)
        if not is_routed_expert(name):
            # the release's own tensor: what vLLM loads from the release, under the release's name
            assert name in release and tensor.dtype == release[name].dtype, name
            assert torch.equal(tensor.view(torch.uint8), release[name].view(torch.uint8)), name
            if name.endswith(".scale") and not name.startswith("mtp."):
                assert mapped.endswith(".weight_scale_inv") and tensor.dtype == torch.float8_e8m0fnu, name
            continue
        if name.startswith("mtp."):
            assert mapped is None  # the drafter's, under the same per-expert names
            name = "layers.0." + name.split(".", 2)[2]
            mapped = mapper._map_name(name)
        match = [(param, expert, shard) for param, weight, expert, shard in mapping if weight in mapped]
        assert len(match) == 1, name
        param_prefix, expert, shard = match[0]
        leaf = mapped.replace(next(w for p, w, e, s in mapping if w in mapped), param_prefix).rsplit(".", 1)[-1]
        assert leaf in params, name
        param = params[leaf][expert]
        if leaf.endswith("_scale_2"):
            assert tensor.numel() == 1, name
        elif shard in ("w1", "w3"):
            assert tensor.shape == param[: param.shape[0] // 2].shape and tensor.dtype == param.dtype, name
        else:
            assert tensor.shape == param.shape and tensor.dtype == param.dtype, name
        filled.setdefault(mapped.rsplit(".experts.", 1)[0] + "." + leaf, set()).add((expert, shard))
    # every expert's shards of every weight and weight scale, in each MoE layer (and the MTP block's)
    layers = config["num_hidden_layers"] + config["num_nextn_predict_layers"]
    for leaf in ("w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w2_weight", "w2_weight_scale",
                 "w2_weight_scale_2"):
        shards = ("w1", "w3") if leaf.startswith("w13") else ("w2",)
        for layer in range(config["num_hidden_layers"]):
            assert filled[f"model.layers.{layer}.ffn.{leaf}"] == {(e, s) for e in range(experts) for s in shards}
    assert len(filled) == 6 * config["num_hidden_layers"] and layers > config["num_hidden_layers"]
    # data-free: no input scales (vLLM's W4A4 method then needs per-token activation scales: docs/serving.md)
    assert not any(n.endswith("input_scale") for n in ours) and "w13_input_scale" in params
    assert {n for n in release if not is_routed_expert(n)} == {n for n in ours if not is_routed_expert(n)}
