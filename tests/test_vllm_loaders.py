"""fp4kit's checkpoints through vLLM 0.33.0's own loading code: names, shapes and expert placement.

vLLM: model_executor/models/llama4.py (Llama4Model.load_weights / load_moe_expert_weights, Llama4ForCausalLM),
models/mllama4.py (Llama4ForConditionalGeneration.load_weights, _rename_weight_for_modelopt_checkpoint),
layers/fused_moe/routed_experts.py (the expert parameter mapping), layers/quantization/modelopt.py
(ModelOptNvFp4Config, ModelOptNvFp4FusedMoE.create_weights: the parameter shapes used below),
layers/quantization/compressed_tensors/compressed_tensors.py (CompressedTensorsConfig) and
layers/fused_moe/expert_map_manager.py (determine_expert_map).
The models are stand-ins that hold vLLM's expert parameters (shapes of ModelOptNvFp4FusedMoE.create_weights)
with a recording weight loader, and run vLLM's own load_weights methods.
"""

from __future__ import annotations

import json
import types

import pytest
import torch
from helpers import add_wide_input_scales, vllm_module, vllm_module_without_torchvision, vllm_moe_parameters
from safetensors.torch import load_file
from torch import nn

from fp4kit.quantize import QuantizeOptions, quantize_checkpoint

llama4 = vllm_module("model_executor.models.llama4")
mllama4 = vllm_module_without_torchvision("model_executor.models.mllama4")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


class RecordingExperts(nn.Module):
    """vLLM's NVFP4 RoutedExperts parameters (ModelOptNvFp4FusedMoE.create_weights) under `routed_experts`."""

    def __init__(self, num_experts: int, hidden: int, inter: int, loaded: list) -> None:
        super().__init__()
        self.expert_map = None
        self.routed_experts = nn.Module()
        shapes = {"w13_weight": ((num_experts, 2 * inter, hidden // 2), torch.uint8),
                  "w2_weight": ((num_experts, hidden, inter // 2), torch.uint8),
                  "w13_weight_scale": ((num_experts, 2 * inter, hidden // 16), torch.float8_e4m3fn),
                  "w2_weight_scale": ((num_experts, hidden, inter // 16), torch.float8_e4m3fn),
                  "w13_weight_scale_2": ((num_experts, 2), torch.float32), "w2_weight_scale_2": ((num_experts,),
                                                                                              torch.float32),
                  "w13_input_scale": ((num_experts, 2), torch.float32), "w2_input_scale": ((num_experts,),
                                                                                        torch.float32)}
        for name, (shape, dtype) in shapes.items():
            param = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
            param.weight_loader = self._loader(name, param, loaded, inter)
            self.routed_experts.register_parameter(name, param)

    @staticmethod
    def _loader(name: str, param: nn.Parameter, loaded: list, inter: int):
        def load(param_, weight, weight_name=None, shard_id=None, expert_id=None):
            per_expert = param.shape[1:]
            if name.startswith("w13_") and len(per_expert) == 2:
                per_expert = (inter, per_expert[1])  # one of w1 / w3
            if len(per_expert) <= 1:
                assert weight.numel() == 1, (name, tuple(weight.shape))
            elif weight.dim() == 3:  # fused: every expert at once, one shard or (flat scale names) both
                assert tuple(weight.shape[1:]) in (tuple(per_expert), tuple(param.shape[1:])), (name, weight.shape)
            else:
                assert tuple(weight.shape) == tuple(per_expert), (name, tuple(weight.shape), per_expert)
            assert weight.dtype == param.dtype or len(per_expert) <= 1, (name, weight.dtype, param.dtype)
            loaded.append((name, shard_id, expert_id, weight.dim() == 3))
        load.supports_moe_loading = True  # as RoutedExperts.weight_loader: the loaders then pass shard and expert
        return load


class Layer(nn.Module):
    def __init__(self, experts: RecordingExperts) -> None:
        super().__init__()
        self.feed_forward = nn.Module()
        self.feed_forward.experts = experts


class TextModel(nn.Module):
    load_weights = llama4.Llama4Model.load_weights
    load_moe_expert_weights = llama4.Llama4Model.load_moe_expert_weights

    def __init__(self, config: dict, loaded: list) -> None:
        super().__init__()
        self.num_experts, self.n_redundant_experts = config["num_local_experts"], 0
        self.layers = nn.ModuleList(Layer(RecordingExperts(config["num_local_experts"], config["hidden_size"],
                                                           config["intermediate_size"], loaded))
                                    for _ in range(config["num_hidden_layers"]))


class CausalLM(nn.Module):
    load_weights = llama4.Llama4ForCausalLM.load_weights
    permute_qk_weight_for_rotary = llama4.Llama4ForCausalLM.permute_qk_weight_for_rotary

    def __init__(self, config: dict, loaded: list) -> None:
        super().__init__()
        self.model = TextModel(config, loaded)


_MULTIMODAL = mllama4.Llama4ForConditionalGeneration


class ConditionalGeneration(nn.Module):
    load_weights = _MULTIMODAL.load_weights
    _rename_weight_for_modelopt_checkpoint = _MULTIMODAL._rename_weight_for_modelopt_checkpoint
    _load_other_weights = _MULTIMODAL._load_other_weights

    def __init__(self, config: dict, loaded: list) -> None:
        super().__init__()
        self.use_data_parallel = False
        self.language_model = CausalLM(config["text_config"], loaded)


def expert_tensors(root) -> list[tuple[str, torch.Tensor]]:
    tensors = {}
    for shard in sorted(root.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return [(name, t) for name, t in sorted(tensors.items()) if ".experts." in name]


@pytest.fixture(scope="module")
def modelopt(tiny, tmp_path_factory):
    built = {}

    def get(family: str, scheme: str):
        if (family, scheme) not in built:
            out = tmp_path_factory.mktemp(f"mo-{family}-{scheme}") / "out"
            quantize_checkpoint(tiny(family), out, QuantizeOptions(scheme=scheme, format="modelopt", samples=4,
                                                                   seq_len=16, batch_size=4))
            built[family, scheme] = out
        return built[family, scheme]

    return get


def assert_every_expert_loaded(loaded: list, config: dict, with_input: bool, model: nn.Module) -> None:
    experts, layers = config["num_local_experts"], config["num_hidden_layers"]
    names = ["w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale", "w13_weight_scale_2",
             "w2_weight_scale_2"] + (["w13_input_scale", "w2_input_scale"] if with_input else [])
    for name in names:
        entries = [e for e in loaded if e[0] == name]
        fused = [e for e in entries if e[3]]
        shards = ("w2",) if name.startswith("w2") else ("w1", "w3")
        covered = {(shard, expert) for _, shard, expert, is_fused in entries if not is_fused for expert in [expert]}
        if not entries:  # a layer scalar that mllama4.py broadcasts into the parameter itself (param.data.fill_)
            params = [p for n, p in model.named_parameters() if n.endswith(f".{name}")]
            assert len(params) == layers and all(bool((p != 0).all()) for p in params), name
        elif fused:  # the whole [E, ...] tensor per layer, per shard or both shards at once
            assert len(fused) in (layers, layers * len(shards)), name
        elif len(entries) == layers:  # one layer scalar broadcast (a fused ModelOpt scale)
            pass
        else:
            assert covered == {(s, e) for s in shards for e in range(experts)}, name
            assert len(entries) == layers * experts * len(shards), name


@pytest.mark.parametrize("scheme", ["nvfp4a16", "nvfp4"])
def test_text_only_llama4_modelopt_loads_through_vllm_llama4model(modelopt, scheme) -> None:
    # fp4kit used to write the fused experts layout here, whose scale names (experts.gate_up_proj_weight_scale)
    # load_moe_expert_weights maps onto `w13_weight_weight_scale`: KeyError
    root = modelopt("llama4_text", scheme)
    config = json.loads((root / "config.json").read_text())
    loaded: list = []
    model = CausalLM(config, loaded)
    names = model.load_weights(expert_tensors(root))
    assert names and all(".routed_experts.w" in n for n in names)
    assert_every_expert_loaded(loaded, config, scheme == "nvfp4", model)


@pytest.mark.parametrize("scheme", ["nvfp4a16"])
def test_multimodal_llama4_modelopt_loads_through_vllm_mllama4(modelopt, scheme) -> None:
    root = modelopt("llama4", scheme)
    config = json.loads((root / "config.json").read_text())
    loaded: list = []
    model = ConditionalGeneration(config, loaded)
    names = model.load_weights(expert_tensors(root))
    assert names and all(".routed_experts.w" in n for n in names)
    assert_every_expert_loaded(loaded, config["text_config"], scheme == "nvfp4", model)


modelopt_config = vllm_module("model_executor.layers.quantization.modelopt")
ct_config = vllm_module("model_executor.layers.quantization.compressed_tensors.compressed_tensors")
expert_maps = vllm_module("model_executor.layers.fused_moe.expert_map_manager")


@pytest.mark.parametrize("family, scheme", [("llama4_text", "nvfp4a16"), ("llama4_text", "nvfp4"),
                                            ("llama4", "nvfp4a16")])
def test_vllm_parses_the_modelopt_configs(modelopt, family, scheme) -> None:
    root = modelopt(family, scheme)
    algo = {"nvfp4": "NVFP4", "nvfp4a16": "W4A16_NVFP4"}[scheme]
    hf_quant = json.loads((root / "hf_quant_config.json").read_text())
    config_json = json.loads((root / "config.json").read_text())["quantization_config"]
    # config.json's quantization_config picks the method (vLLM's config resolution calls this override)
    assert modelopt_config.ModelOptNvFp4Config.override_quantization_method(config_json, None) == "modelopt_fp4"
    # the producer is fp4kit, not ModelOpt: vLLM's config resolution keeps config.json's quant_method (it reads
    # producer.name only from an hf_quant_config.json that stands without one)
    assert hf_quant["producer"]["name"] == config_json["producer"]["name"] == "fp4kit"
    from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase

    normalized = ModelArchConfigConvertorBase._normalize_quantization_config(
        None, types.SimpleNamespace(quantization_config=dict(config_json)))  # type: ignore[arg-type]
    assert normalized["quant_method"] == "modelopt"
    for source in (hf_quant, config_json):
        parsed = modelopt_config.ModelOptNvFp4Config.from_config(source)
        assert parsed.get_name() == "modelopt_fp4" and parsed.quant_method == algo
        assert parsed.group_size == 16 and parsed.kv_cache_quant_algo is None
        routers = [m for m in hf_quant["quantization"]["exclude_modules"] if m.endswith(".router")]
        assert routers and all(parsed.is_layer_excluded(m) for m in routers)
        assert not parsed.is_layer_excluded(routers[0].removesuffix(".router") + ".experts")


@pytest.mark.parametrize("scheme", ["nvfp4a16", "nvfp4"])
def test_vllm_parses_the_compressed_tensors_config(tiny_nvfp4a16, tmp_path, scheme) -> None:
    root = tiny_nvfp4a16("qwen3_moe")
    if scheme == "nvfp4":
        root = add_wide_input_scales(root, tmp_path / "w4a4")
    parsed = ct_config.CompressedTensorsConfig.from_config(json.loads((root / "config.json").read_text())
                                                           ["quantization_config"])
    assert parsed.get_name() == "compressed-tensors"
    scheme_map = parsed.target_scheme_map["Linear"]
    assert parsed._is_nvfp4_format(scheme_map["weights"])
    if scheme == "nvfp4":
        assert parsed._is_nvfp4_format(scheme_map["input_activations"])
    else:
        assert scheme_map["input_activations"] is None
    assert any("mlp.gate" in i for i in parsed.ignore)


@pytest.mark.parametrize("strategy", ["linear", "round-robin"])
@pytest.mark.parametrize("num_experts, ep", [(8, 2), (8, 4), (6, 4), (5, 3), (128, 8), (160, 6)])
def test_placements_equal_vllm_expert_maps(num_experts, ep, strategy) -> None:
    from fp4kit.ep.placement import place

    rank_of = place(strategy, num_experts, ep).rank_of
    for rank in range(ep):
        local, expert_map, _ = expert_maps.determine_expert_map(ep, rank, num_experts,
                                                                strategy.replace("-", "_"))
        ours = [-1] * num_experts
        for i, e in enumerate(e for e in range(num_experts) if rank_of[e] == rank):
            ours[e] = i
        assert expert_map.tolist() == ours and local == sum(1 for r in rank_of if r == rank)


@pytest.mark.parametrize("strategy", ["linear", "round-robin"])
def test_shard_outputs_equal_vllm_expert_maps(tiny_nvfp4a16, tmp_path, strategy) -> None:
    from fp4kit.ep.shard import ShardOptions, shard_checkpoint

    src = tiny_nvfp4a16("qwen3_moe")
    num_experts = json.loads((src / "config.json").read_text())["num_local_experts"]
    ep = 3
    shard_checkpoint(src, tmp_path / "ep", ShardOptions(ep=ep, placement=strategy))
    for rank in range(ep):
        directory = tmp_path / "ep" / f"rank-{rank:05d}"
        document = json.loads((directory / "expert_map.json").read_text())
        _, expert_map, _ = expert_maps.determine_expert_map(ep, rank, num_experts, strategy.replace("-", "_"))
        index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
        for layer, stored in document["layers"].items():
            assert stored == expert_map.tolist(), (rank, layer)
            held = {int(n.split(".experts.")[1].split(".")[0]) for n in index
                    if f"layers.{layer}.mlp.experts." in n}
            assert held == {e for e, local in enumerate(stored) if local >= 0}


RoutedExperts = vllm_module("model_executor.layers.fused_moe.routed_experts").RoutedExperts


@pytest.mark.parametrize("dialect", ["compressed-tensors", "modelopt"])
@pytest.mark.parametrize("scheme", ["nvfp4a16", "nvfp4"])
def test_per_expert_tensors_map_onto_vllm_moe_parameters(monkeypatch, tiny_nvfp4a16, tmp_path, dialect,
                                                         scheme) -> None:
    # the checkpoint-name -> parameter rule of vLLM's per-expert loaders (qwen3_moe.py / glm4_moe.py load_weights:
    # name.replace(weight_name, param_name) over RoutedExperts.build_expert_params_mapping), each tensor checked
    # against the slot of the parameter it lands in: [w1 | w3] rows of w13 per expert, or the whole w2 expert
    from fp4kit.tools.convert import convert_checkpoint

    root = tiny_nvfp4a16("qwen3_moe")
    if scheme == "nvfp4":
        root = add_wide_input_scales(root, tmp_path / "w4a4")
    if dialect == "modelopt":
        convert_checkpoint(root, tmp_path / "mo", "modelopt")
        root = tmp_path / "mo"
    config = json.loads((root / "config.json").read_text())
    num_experts, hidden, inter = config["num_local_experts"], config["hidden_size"], config["moe_intermediate_size"]
    params = dict(vllm_moe_parameters(monkeypatch, dialect, num_experts, hidden, inter).named_parameters())
    mapping = RoutedExperts.build_expert_params_mapping("gate_proj", "down_proj", "up_proj", num_experts)
    filled: dict[str, set] = {}
    for name, tensor in expert_tensors(root):
        if ".mlp.experts." not in name:
            continue
        hits = [(p, w, e, s) for p, w, e, s in mapping if w in name]
        assert len(hits) == 1, name
        param_name, weight_name, expert, shard = hits[0]
        leaf = name.replace(weight_name, param_name).split(".experts.routed_experts.")[1]
        assert leaf in params, (name, leaf)
        slot = params[leaf][expert]
        if leaf.startswith("w13_") and slot.dim() >= 1:
            slot = slot.chunk(2, dim=0)[0 if shard == "w1" else 1]
        assert tensor.numel() == slot.numel() and tensor.dtype in (slot.dtype, torch.float32), (name, leaf)
        if tensor.dim() == 2:
            assert tuple(tensor.shape) == tuple(slot.shape), (name, leaf)
        filled.setdefault(name.split(".experts.")[0], set()).add((leaf, expert, shard))
    expected = {p for p in params if scheme == "nvfp4" or "input" not in p}
    for layer, seen in filled.items():
        assert {leaf for leaf, _, _ in seen} == expected, layer
        assert len(seen) == sum(num_experts * (1 if p.startswith("w2_") else 2) for p in expected), layer
