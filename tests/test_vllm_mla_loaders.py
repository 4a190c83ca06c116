"""fp4kit's GLM-4.7-Flash, DeepSeek-V3.2 and GLM-5 checkpoints through vLLM 0.33.0's own model `load_weights`.

vLLM: model_executor/models/glm4_moe_lite.py (Glm4MoeLiteModel.load_weights), models/deepseek_v32/nvidia/model.py
(DeepseekV32Model.load_weights: DeepSeek-V3.2 and GLM-5 on CUDA) and model_executor/models/deepseek_v2.py
(DeepseekV2Model.load_weights: both elsewhere). The model is a stand-in holding the parameters vLLM's model holds
under the names it gives them (MLA's ``fused_qkv_a_proj``, the MLPs' ``gate_up_proj``, the indexer's ``wq_b`` and
``wk_weights_proj``, the routed experts' ``experts.routed_experts.w13_*``), each created by the quant method vLLM's
own quant config picks for that prefix (`CompressedTensorsConfig` / `ModelOptNvFp4Config.get_quant_method`, with
the packed-modules mapping the model class declares; the indexer's ``wk_weights_proj`` and the router without one, as
vLLM builds them) and that method's ``create_weights``. Every tensor of the checkpoint must land in a parameter of
its dtype and shape (an unmapped name is vLLM's KeyError) and every parameter must be filled (none missing); the MTP
layer is left to vLLM's drafter, as the main model's loader skips it.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _vllm_oracle import vllm_module
from safetensors.torch import load_file
from test_vllm_loaders import vllm_moe_parameters
from torch import nn

from fp4kit.quantize import QuantizeOptions, quantize_checkpoint

linear = vllm_module("model_executor.layers.linear")
ct_config = vllm_module("model_executor.layers.quantization.compressed_tensors.compressed_tensors")
ct_nvfp4 = vllm_module("model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4")
modelopt = vllm_module("model_executor.layers.quantization.modelopt")
parameter = vllm_module("model_executor.parameter")
deepseek_v2 = vllm_module("model_executor.models.deepseek_v2")
glm4_moe_lite = vllm_module("model_executor.models.glm4_moe_lite")
dsa_cuda = vllm_module("models.deepseek_v32.nvidia.model")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

PACKED = {"gate_up_proj": ["gate_proj", "up_proj"], "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]}
LOADERS = {"glm4_moe_lite": [glm4_moe_lite.Glm4MoeLiteModel.load_weights],
           "deepseek_v32": [dsa_cuda.DeepseekV32Model.load_weights, deepseek_v2.DeepseekV2Model.load_weights],
           "glm_moe_dsa": [dsa_cuda.DeepseekV32Model.load_weights, deepseek_v2.DeepseekV2Model.load_weights]}


class _KernelStandIn:
    """What the NVFP4 linear schemes ask of the kernel vLLM picks at construction (none runs on a CPU)."""

    def input_quant_key(self):
        return None


@pytest.fixture
def vllm_quant_methods(monkeypatch):
    monkeypatch.setattr(ct_nvfp4, "init_nvfp4_linear_kernel", lambda **kwargs: _KernelStandIn())
    monkeypatch.setattr(modelopt, "init_nvfp4_linear_kernel", lambda **kwargs: _KernelStandIn(), raising=False)
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_world_size", lambda: 1)


class Recorder:
    """Every parameter's weight loader: what was loaded into it, shard by shard."""

    def __init__(self) -> None:
        self.loaded: dict[str, list[tuple[object, torch.Tensor]]] = {}

    def loader(self, name: str):
        def load(param, weight, *args, **kwargs):
            shard = kwargs.get("shard_id", args[0] if args and not isinstance(args[0], str) else None)
            if "expert_id" in kwargs:
                shard = (kwargs["shard_id"], kwargs["expert_id"])
            self.loaded.setdefault(name, []).append((shard, weight))
            return True

        load.supports_moe_loading = True
        return load


def _quant_config(root: Path):
    config = json.loads((root / "config.json").read_text())["quantization_config"]
    cls = ct_config.CompressedTensorsConfig if config.get("quant_method") == "compressed-tensors" \
        else modelopt.ModelOptNvFp4Config
    parsed = cls.from_config(config)
    parsed.packed_modules_mapping = dict(PACKED)  # as the model class hands it over at construction
    return parsed


def _add_linear(owner: nn.Module, path: str, out_sizes: list[int], in_size: int, quant, recorder: Recorder,
                prefix: str) -> None:
    module = owner.get_submodule(path.rsplit(".", 1)[0]) if "." in path else owner
    layer = object.__new__(linear.ReplicatedLinear)
    nn.Module.__init__(layer)
    # vLLM's prefixes name the module from the top ("model.layers..."), as the checkpoint and its ignore list do
    method = quant.get_quant_method(layer, f"model.{prefix}{path}") if quant is not None \
        else linear.UnquantizedLinearMethod()
    method.create_weights(layer, in_size, out_sizes, in_size, sum(out_sizes), torch.bfloat16,
                          weight_loader=recorder.loader(prefix + path))
    for name, param in layer.named_parameters():
        param.weight_loader = recorder.loader(f"{prefix}{path}.{name}")
    module.add_module(path.rsplit(".", 1)[-1], layer)


def _add_param(owner: nn.Module, path: str, shape: tuple[int, ...], dtype: torch.dtype, recorder: Recorder,
               prefix: str) -> None:
    module_path, leaf = path.rsplit(".", 1)
    module = owner
    for part in module_path.split("."):
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    param = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = recorder.loader(prefix + path)
    module.register_parameter(leaf, param)


def vllm_model(config: dict, quant, recorder: Recorder, monkeypatch, dialect: str) -> nn.Module:
    """The text model's parameters as vLLM 0.33 builds them for this config and quant config (main model only)."""
    model = nn.Module()
    model.config = SimpleNamespace(**config)
    model.num_redundant_experts, model.is_fused_shared_expert_enabled, model.use_mha = 0, False, False
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, q_lora, kv_lora = config["num_attention_heads"], config["q_lora_rank"], config["kv_lora_rank"]
    nope, rope, v_dim = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    experts, inter = config["n_routed_experts"], config["moe_intermediate_size"]
    dense = config.get("mlp_layer_types") or ["dense"] * config["first_k_dense_replace"] + ["sparse"] * layers
    _add_param(model, "embed_tokens.weight", (config["vocab_size"], hidden), torch.bfloat16, recorder, "")
    _add_param(model, "norm.weight", (hidden,), torch.bfloat16, recorder, "")
    model.layers = nn.ModuleList(nn.Module() for _ in range(layers))
    for i in range(layers):
        layer, prefix = model.layers[i], f"layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            _add_param(layer, f"{norm}.weight", (hidden,), torch.bfloat16, recorder, prefix)
        layer.add_module("self_attn", nn.Module())
        layer.self_attn.add_module("indexer", nn.Module())
        attn = {"fused_qkv_a_proj": ([q_lora, kv_lora + rope], hidden), "q_b_proj": ([heads * (nope + rope)], q_lora),
                "kv_b_proj": ([heads * (nope + v_dim)], kv_lora), "o_proj": ([hidden], heads * v_dim)}
        for name, (out_sizes, in_size) in attn.items():
            _add_linear(layer, f"self_attn.{name}", out_sizes, in_size, quant, recorder, prefix)
        for norm, size in (("q_a_layernorm", q_lora), ("kv_a_layernorm", kv_lora)):
            _add_param(layer, f"self_attn.{norm}.weight", (size,), torch.bfloat16, recorder, prefix)
        if "index_topk" in config:
            idx_heads, idx_dim = config["index_n_heads"], config["index_head_dim"]
            _add_linear(layer, "self_attn.indexer.wq_b", [idx_heads * idx_dim], q_lora, quant, recorder, prefix)
            # vLLM: MergedColumnParallelLinear(..., quant_config=None)
            _add_linear(layer, "self_attn.indexer.wk_weights_proj", [idx_dim, idx_heads], hidden, None, recorder,
                        prefix)
            for leaf in ("weight", "bias"):
                _add_param(layer, f"self_attn.indexer.k_norm.{leaf}", (idx_dim,), torch.float32, recorder, prefix)
        layer.add_module("mlp", nn.Module())
        if dense[i] == "dense":
            _add_linear(layer, "mlp.gate_up_proj", [config["intermediate_size"]] * 2, hidden, quant, recorder, prefix)
            _add_linear(layer, "mlp.down_proj", [hidden], config["intermediate_size"], quant, recorder, prefix)
            continue
        _add_param(layer, "mlp.gate.weight", (experts, hidden), torch.float32, recorder, prefix)
        _add_param(layer, "mlp.gate.e_score_correction_bias", (experts,), torch.float32, recorder, prefix)
        layer.mlp.add_module("shared_experts", nn.Module())
        shared = inter * config["n_shared_experts"]
        _add_linear(layer, "mlp.shared_experts.gate_up_proj", [shared] * 2, hidden, quant, recorder, prefix)
        _add_linear(layer, "mlp.shared_experts.down_proj", [hidden], shared, quant, recorder, prefix)
        routed = vllm_moe_parameters(monkeypatch, dialect, experts, hidden, inter)
        for name, param in routed.named_parameters():
            param.weight_loader = recorder.loader(f"{prefix}mlp.experts.routed_experts.{name}")
        layer.mlp.add_module("experts", nn.Module())
        layer.mlp.experts.add_module("routed_experts", routed)
    return model


@pytest.fixture(scope="module")
def quantized(tiny, tmp_path_factory):
    built = {}

    def get(family: str, dialect: str, scheme: str) -> Path:
        if (family, dialect, scheme) not in built:
            out = tmp_path_factory.mktemp(f"vllm-{family}-{dialect}-{scheme}") / "out"
            quantize_checkpoint(tiny(family), out, QuantizeOptions(scheme=scheme, format=dialect, samples=4,
                                                                   seq_len=16, batch_size=4))
            built[family, dialect, scheme] = out
        return built[family, dialect, scheme]

    return get


@pytest.mark.parametrize("scheme", ["nvfp4a16", "nvfp4"])
@pytest.mark.parametrize("dialect", ["compressed-tensors", "modelopt"])
@pytest.mark.parametrize("family", ["glm4_moe_lite", "deepseek_v32", "glm_moe_dsa"])
def test_vllm_model_load_weights_takes_every_tensor(vllm_quant_methods, monkeypatch, quantized, family, dialect,
                                                    scheme) -> None:
    root = quantized(family, dialect, scheme)
    config = json.loads((root / "config.json").read_text())
    tensors = {}
    for shard in sorted(root.glob("*.safetensors")):
        tensors.update(load_file(shard))
    mtp = f"model.layers.{config['num_hidden_layers']}."
    weights = [(name.removeprefix("model."), t) for name, t in sorted(tensors.items())
               if name.startswith("model.") and not name.startswith(mtp)]
    assert {n for n in tensors if not n.startswith("model.")} == {"lm_head.weight"}
    for load_weights in LOADERS[family]:
        recorder = Recorder()
        model = vllm_model(config, _quant_config(root), recorder, monkeypatch, dialect)
        loaded_names = load_weights(model, iter(weights))
        params = dict(model.named_parameters())
        assert loaded_names and set(loaded_names) <= set(params)
        w4a4_only = ("input_scale", "input_global_scale", "w13_input_", "w2_input_")
        expected = {n for n in params if scheme == "nvfp4" or not any(k in n for k in w4a4_only)}
        missing = sorted(expected - set(recorder.loaded))
        assert not missing, (load_weights.__qualname__, missing[:5])
        for name, entries in recorder.loaded.items():
            param = params[name]
            if param.dtype in (torch.uint8, torch.float8_e4m3fn):  # packed codes and block scales: as stored
                assert all(w.dtype == param.dtype for _, w in entries), (name, param.dtype)
            if param.dim() >= 2 and ".routed_experts." not in name:  # Linear weights: the shards fill the rows
                assert sum(w.shape[0] for _, w in entries) == param.shape[0], (name, [w.shape for _, w in entries])
                assert all(w.shape[1:] == param.shape[1:] for _, w in entries), name


def test_a_quantized_indexer_does_not_load(vllm_quant_methods, monkeypatch, tiny, tmp_path) -> None:
    """Why the indexer is kept: vLLM builds wk + weights_proj as one Linear without quant config, so an NVFP4 wk has
    no parameter to land in."""
    out = tmp_path / "out"
    quantize_checkpoint(tiny("deepseek_v32"), out, QuantizeOptions(
        default_ignore=False, ignore=[r"(^|\.)lm_head$", r"mlp\.gate$", r"layers\.3\."]))
    tensors = load_file(out / "model.safetensors")
    assert "model.layers.1.self_attn.indexer.wk.weight_packed" in tensors
    weights = [(n.removeprefix("model."), t) for n, t in sorted(tensors.items())
               if n.startswith("model.") and not n.startswith("model.layers.3.")]
    config = json.loads((out / "config.json").read_text())
    for load_weights in LOADERS["deepseek_v32"]:
        model = vllm_model(config, _quant_config(out), Recorder(), monkeypatch, "compressed-tensors")
        with pytest.raises(KeyError, match=r"indexer\.wk"):
            load_weights(model, iter(weights))
