"""fp4kit's Qwen3-Next and Qwen3.5/3.6-MoE checkpoints (compressed-tensors and ModelOpt, W4A16 and W4A4) through vLLM
0.33.0's own loading rules, for the main model and its MTP drafter: every tensor reaches a vLLM module, and every
module gets exactly the parameters vLLM creates for it.

vLLM: models/qwen3_next.py (Qwen3NextForCausalLM, Qwen3NextModel: `hf_to_vllm_mapper`, `packed_modules_mapping`;
the router `GateLinear` and `shared_expert_gate` built without a quant config), models/qwen3_5.py
(Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeForCausalLM, Qwen3_5Model), models/qwen3_next_mtp.py and
models/qwen3_5_mtp.py (the drafters: `mtp.` renamed to their predictor, whose modules live under `mtp.`; `mtp.fc`
unquantized under modelopt_fp4), model_loader/utils.py (the quant config gets the class's rename mapper and packed
modules), layers/quantization/{compressed_tensors,modelopt}.py (`get_quant_method`, `create_weights`: which modules
are quantized and the parameters each gets), layers/fused_moe/routed_experts.py (build_expert_params_mapping).
The chain of mappers is the one the models' nested `load_weights` calls apply (AutoWeightsLoader, models/utils.py).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from helpers import vllm_module, vllm_module_without_torchvision
from safetensors.torch import load_file
from torch import nn

from fp4kit.quantize import QuantizeOptions, quantize_checkpoint

next_models = vllm_module("model_executor.models.qwen3_next")
next_mtp = vllm_module("model_executor.models.qwen3_next_mtp")
qwen3_5 = vllm_module_without_torchvision("model_executor.models.qwen3_5")
qwen3_5_mtp = vllm_module_without_torchvision("model_executor.models.qwen3_5_mtp")
linear = vllm_module("model_executor.layers.linear")
ct_config = vllm_module("model_executor.layers.quantization.compressed_tensors.compressed_tensors")
ct_linear = vllm_module("model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4")
ct_moe = vllm_module("model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
                     "compressed_tensors_moe_w4a4_nvfp4")
modelopt = vllm_module("model_executor.layers.quantization.modelopt")
parameter = vllm_module("model_executor.parameter")
RoutedExperts = vllm_module("model_executor.layers.fused_moe.routed_experts").RoutedExperts
pytestmark = pytest.mark.usefixtures("one_torch_thread")

# family -> (main model class, the (child prefix, mapper) steps its load_weights chain applies, drafter predictor)
MODELS = {
    "qwen3_next": (next_models.Qwen3NextForCausalLM,
                   [("", next_models.Qwen3NextForCausalLM.hf_to_vllm_mapper),
                    ("model.", next_models.Qwen3NextModel.hf_to_vllm_mapper)],
                   next_mtp.Qwen3NextMultiTokenPredictor),
    "qwen3_5_moe": (qwen3_5.Qwen3_5MoeForConditionalGeneration,
                    [("", qwen3_5.Qwen3_5MoeForConditionalGeneration.hf_to_vllm_mapper),
                     ("language_model.", qwen3_5.Qwen3_5MoeForCausalLM.hf_to_vllm_mapper),
                     ("language_model.model.", qwen3_5.Qwen3_5Model.hf_to_vllm_mapper)],
                    qwen3_5_mtp.Qwen3_5MultiTokenPredictor),
    "qwen3_5_moe_text": (qwen3_5.Qwen3_5MoeForCausalLM,
                         [("", qwen3_5.Qwen3_5MoeForCausalLM.hf_to_vllm_mapper),
                          ("model.", qwen3_5.Qwen3_5Model.hf_to_vllm_mapper)],
                         qwen3_5_mtp.Qwen3_5MultiTokenPredictor),
}
# built without a quant config (qwen3_next.py: GateLinear, ReplicatedLinear(quant_config=None); ParallelLMHead)
UNQUANTIZED_BY_CONSTRUCTION = (".mlp.gate", ".shared_expert_gate", "lm_head")
NOT_LINEAR = ("norm", "embed_tokens", "conv1d", "pos_embed", "patch_embed")  # A_log, dt_bias: no `weight` leaf


@pytest.fixture(scope="module")
def checkpoints(tiny, tmp_path_factory):
    built = {}

    def get(family: str, dialect: str, scheme: str, mtp: str = "keep"):
        key = (family, dialect, scheme, mtp)
        if key not in built:
            out = tmp_path_factory.mktemp(f"vllm-{family}-{dialect}-{scheme}-{mtp}") / "out"
            quantize_checkpoint(tiny(family), out, QuantizeOptions(scheme=scheme, format=dialect, samples=4,
                                                                   seq_len=16, batch_size=2, mtp=mtp))
            built[key] = out
        return built[key]

    return get


def _quant_config(root, dialect: str, model_class):
    if dialect == "compressed-tensors":
        config = ct_config.CompressedTensorsConfig.from_config(
            json.loads((root / "config.json").read_text())["quantization_config"])
    else:
        config = modelopt.ModelOptNvFp4Config.from_config(json.loads((root / "hf_quant_config.json").read_text()))
    config.apply_vllm_mapper(model_class.hf_to_vllm_mapper.get_rename_mapper())  # model_loader/utils.py
    config.packed_modules_mapping = model_class.packed_modules_mapping
    return config


def _mapped(names, steps, quant_config) -> dict[str, tuple[str, object]]:
    """checkpoint name -> (vLLM parameter path, shard id) through the load_weights chain; dropped names absent."""
    extra = quant_config.get_cache_scale_mapper() | quant_config.get_checkpoint_weight_mapper()
    items = {name: (name, None) for name in names}
    for prefix, mapper in steps:
        mapper = mapper | extra
        for original, (name, shard) in list(items.items()):
            if not name.startswith(prefix):
                continue
            result = mapper._map_name_with_shard(name[len(prefix):])
            if result is None:
                del items[original]
            else:
                items[original] = (prefix + result[0], shard if result[1] is None else result[1])
    return items


def _linear_parameters(quant_config, prefix: str) -> tuple[str, set[str]]:
    """The quant method vLLM picks for a Linear at ``prefix`` and the parameters it creates (kernel selection, which
    needs a GPU, stubbed: the parameters do not depend on it)."""
    layer = linear.LinearBase.__new__(linear.ReplicatedLinear)
    nn.Module.__init__(layer)
    method = quant_config.get_quant_method(layer, prefix)
    method.create_weights(layer, 64, [64], 64, 64, torch.bfloat16, weight_loader=lambda *args, **kwargs: None)
    return type(method).__name__, {name for name, _ in layer.named_parameters()} - {"bias"}


def _moe_parameters(dialect: str, num_experts: int, hidden: int, inter: int, w4a4: bool) -> set[str]:
    layer = nn.Module()
    method = SimpleNamespace(moe=SimpleNamespace(is_act_and_mul=True), group_size=16, use_global_sf=False,
                             quant_config=SimpleNamespace(is_checkpoint_nvfp4_serialized=True, group_size=16))
    create = (ct_moe.CompressedTensorsW4A4Nvfp4MoEMethod if dialect == "compressed-tensors"
              else modelopt.ModelOptNvFp4FusedMoE).create_weights
    create(method, layer, num_experts, hidden, inter, torch.bfloat16, weight_loader=None,
           global_num_experts=num_experts)
    return {n for n, _ in layer.named_parameters() if w4a4 or "input" not in n}


def _experts_excluded(quant_config, prefix: str) -> bool:
    """Whether vLLM builds the experts at ``prefix`` unquantized: compressed-tensors asks its scheme of expert 0's
    Linears (CompressedTensorsMoEMethod.get_moe_method: `{prefix}.0.{proj}`, None when ignored), ModelOpt matches
    the prefix against exclude_modules (get_quant_method)."""
    if isinstance(quant_config, ct_config.CompressedTensorsConfig):
        layer = linear.LinearBase.__new__(linear.ReplicatedLinear)
        nn.Module.__init__(layer)
        found = [quant_config.get_scheme_dict(layer, f"{prefix}.0.{proj}") is None
                 for proj in ("gate_proj", "up_proj", "down_proj")]
        assert len(set(found)) == 1, (prefix, found)  # vLLM refuses projections of differing schemes
        return found[0]
    return quant_config.is_layer_excluded(prefix)


CASES = [(family, dialect, scheme, "keep") for family in MODELS for dialect in ("compressed-tensors", "modelopt")
         for scheme in ("nvfp4a16", "nvfp4")] + [(family, dialect, "nvfp4a16", "quantize") for family in
                                                 ("qwen3_next", "qwen3_5_moe") for dialect in ("compressed-tensors",
                                                                                                "modelopt")]


@pytest.mark.parametrize(("family", "dialect", "scheme", "mtp"), CASES)
def test_vllm_loads_every_tensor_into_the_parameters_it_creates(monkeypatch, checkpoints, family, dialect, scheme,
                                                                 mtp) -> None:
    stub = lambda **kwargs: SimpleNamespace(input_quant_key=lambda: None)  # noqa: E731
    monkeypatch.setattr(ct_linear, "init_nvfp4_linear_kernel", stub)
    monkeypatch.setattr(modelopt, "init_nvfp4_linear_kernel", stub)
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_world_size", lambda: 1)
    root = checkpoints(family, dialect, scheme, mtp)
    tensors = load_file(root / "model.safetensors")
    model_class, steps, predictor = MODELS[family]
    quant_config = _quant_config(root, dialect, model_class)
    main = _mapped(tensors, steps, quant_config)
    assert {n for n in tensors if n not in main} == {n for n in tensors if n.startswith("mtp.")}
    # the drafter: `mtp.` -> its predictor (module path `mtp.`), which maps names as the main text model does
    drafter = {name: ("mtp." + mapped, shard) for name, (mapped, shard) in
               _mapped([n[len("mtp."):] for n in tensors if n.startswith("mtp.")], [("", predictor.hf_to_vllm_mapper)],
                       quant_config).items()}
    drafter = {"mtp." + name: value for name, value in drafter.items()}
    assert len(drafter) == len([n for n in tensors if n.startswith("mtp.")])

    text = json.loads((root / "config.json").read_text())
    text = text.get("text_config", text)
    modules: dict[str, dict[str, set]] = {}  # vLLM module -> parameter leaf -> shard ids
    experts: dict[str, dict[str, torch.Tensor]] = {}  # vLLM experts module -> checkpoint name relative to it
    for original, (path, shard) in {**main, **drafter}.items():
        if ".experts." in path:
            head, _, rest = path.partition(".experts.")
            experts.setdefault(f"{head}.experts", {})[f"experts.{rest}"] = tensors[original]
            continue
        module, leaf = path.rsplit(".", 1)
        modules.setdefault(module, {}).setdefault(leaf, set()).add(str(shard))
    linears = 0
    for module, leaves in modules.items():
        if any(part in module for part in NOT_LINEAR) or not leaves.keys() & {"weight", "weight_packed"}:
            continue
        leaves.pop("bias", None)
        if module.endswith(UNQUANTIZED_BY_CONSTRUCTION) or (module == "mtp.fc" and dialect == "modelopt"):
            assert set(leaves) == {"weight"}, module
            continue
        method, expected = _linear_parameters(quant_config, module)
        if dialect == "modelopt" and scheme == "nvfp4a16":
            expected -= {"input_scale"}  # modelopt.py _DropInputScale: registered for old exports, then dropped
        assert set(leaves) == expected, (module, method, sorted(leaves))
        quantized = method != "UnquantizedLinearMethod"
        fp4kit_quantizes = (".self_attn." in module or ".shared_expert." in module) and not module.startswith("mtp.")
        assert quantized == fp4kit_quantizes, (module, method)
        packed = model_class.packed_modules_mapping.get(module.rsplit(".", 1)[1])
        if packed and len(packed) > 1:  # every shard of a stacked parameter, for every parameter
            assert all(len(shards) == len(packed) for shards in leaves.values()), (module, leaves)
        linears += quantized
    assert linears >= 4

    mapping = RoutedExperts.build_expert_params_mapping("gate_proj", "down_proj", "up_proj", text["num_experts"])
    routed = _moe_parameters(dialect, text["num_experts"], text["hidden_size"], text["moe_intermediate_size"],
                             scheme == "nvfp4")
    assert len(experts) == text["num_hidden_layers"] + 1
    for module, held in experts.items():
        kept = module.startswith("mtp.") and mtp == "keep"
        assert _experts_excluded(quant_config, module) == kept, module
        filled = set()
        for name in held:
            hits = [(p, w, e, s) for p, w, e, s in mapping if w in name]
            assert len(hits) == 1, (module, name)
            param, weight_name, expert, shard = hits[0]
            filled.add((name.replace(weight_name, param).removeprefix("experts.routed_experts."), expert, shard))
        leaves = {leaf for leaf, _, _ in filled}
        assert leaves == ({"w13_weight", "w2_weight"} if kept else routed), (module, sorted(leaves))
        assert len(filled) == sum(text["num_experts"] * (1 if leaf.startswith("w2_") else 2) for leaf in leaves)
