"""fp4kit's GLM-4.7-Flash, DeepSeek-V3.2 and GLM-5 checkpoints through vLLM 0.33.0's own model `load_weights`.

vLLM: model_executor/models/glm4_moe_lite.py (Glm4MoeLiteModel.load_weights), models/deepseek_v32/nvidia/model.py
(DeepseekV32Model.load_weights: DeepSeek-V3.2 and GLM-5 on CUDA) and model_executor/models/deepseek_v2.py
(DeepseekV2Model.load_weights: both elsewhere). The model is a stand-in holding the parameters vLLM's model holds
under the names it gives them (MLA's ``fused_qkv_a_proj``, the MLPs' ``gate_up_proj``, the indexer's ``wq_b`` and
``wk_weights_proj``, the routed experts' ``experts.routed_experts.w13_*``), each created by the quant method vLLM's
own quant config picks for that prefix (`CompressedTensorsConfig` / `ModelOptNvFp4Config.get_quant_method`, with
the packed-modules mapping the model class declares; the indexer's ``wk_weights_proj`` and the router without one, as
vLLM builds them) and that method's ``create_weights``. Every tensor of the checkpoint must land in a parameter of
its dtype and shape (an unmapped name is vLLM's KeyError) and every parameter must be filled (none missing). The MTP
layer, which the main model's loader skips, goes through the drafters' own load_weights (glm4_moe_lite_mtp.py;
deepseek_v32/nvidia/mtp.py and deepseek_mtp.py), unquantized as fp4kit keeps it.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import vllm_module, vllm_moe_parameters
from safetensors.torch import load_file
from torch import nn

from fp4kit.quantize import QuantizeOptions, quantize_checkpoint

linear = vllm_module("model_executor.layers.linear")
ct_config = vllm_module("model_executor.layers.quantization.compressed_tensors.compressed_tensors")
ct_utils = vllm_module("model_executor.layers.quantization.compressed_tensors.utils")
unquantized_moe = vllm_module("model_executor.layers.fused_moe.unquantized_fused_moe_method")
ct_nvfp4 = vllm_module("model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4")
modelopt = vllm_module("model_executor.layers.quantization.modelopt")
parameter = vllm_module("model_executor.parameter")
deepseek_v2 = vllm_module("model_executor.models.deepseek_v2")
glm4_moe_lite = vllm_module("model_executor.models.glm4_moe_lite")
dsa_cuda = vllm_module("models.deepseek_v32.nvidia.model")
deepseek_mtp = vllm_module("model_executor.models.deepseek_mtp")
glm4_moe_lite_mtp = vllm_module("model_executor.models.glm4_moe_lite_mtp")
dsa_cuda_mtp = vllm_module("models.deepseek_v32.nvidia.mtp")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

PACKED = {"gate_up_proj": ["gate_proj", "up_proj"], "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]}
LOADERS = {"glm4_moe_lite": [glm4_moe_lite.Glm4MoeLiteModel.load_weights],
           "deepseek_v32": [dsa_cuda.DeepseekV32Model.load_weights, deepseek_v2.DeepseekV2Model.load_weights],
           "glm_moe_dsa": [dsa_cuda.DeepseekV32Model.load_weights, deepseek_v2.DeepseekV2Model.load_weights]}

DRAFTERS = {"glm4_moe_lite": [glm4_moe_lite_mtp.Glm4MoeLiteMTP],
            "deepseek_v32": [dsa_cuda_mtp.DeepseekV32MTP, deepseek_mtp.DeepSeekMTP],
            "glm_moe_dsa": [dsa_cuda_mtp.DeepseekV32MTP, deepseek_mtp.DeepSeekMTP]}
QUANTIZED_LEAVES = (".weight_packed", ".weight_scale", ".weight_global_scale", ".weight_scale_2", ".input_scale",
                    ".input_global_scale")


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
                prefix: str, quant_prefix: str) -> None:
    """An nn.Linear's parameters at ``prefix + path`` as the quant method vLLM picks for ``quant_prefix + path``
    (None: vLLM builds it without quant config) creates them."""
    module = owner.get_submodule(path.rsplit(".", 1)[0]) if "." in path else owner
    layer = object.__new__(linear.ReplicatedLinear)
    nn.Module.__init__(layer)
    method = quant.get_quant_method(layer, quant_prefix + path) if quant is not None \
        else linear.UnquantizedLinearMethod()
    method.create_weights(layer, in_size, out_sizes, in_size, sum(out_sizes), torch.bfloat16,
                          weight_loader=recorder.loader(prefix + path))
    for name, param in layer.named_parameters():
        param.weight_loader = recorder.loader(f"{prefix}{path}.{name}")
    module.add_module(path.rsplit(".", 1)[-1], layer)


def _add_param(owner: nn.Module, path: str, shape: tuple[int, ...], dtype: torch.dtype, recorder: Recorder,
               prefix: str) -> None:
    module = owner
    *parents, leaf = path.split(".")
    for part in parents:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    param = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = recorder.loader(prefix + path)
    module.register_parameter(leaf, param)


def _decoder_layer(layer: nn.Module, config: dict, quant, recorder: Recorder, monkeypatch, dialect: str,
                   prefix: str, quant_prefix: str, moe: bool) -> None:
    """One decoder layer's parameters under ``prefix`` (its modules' quant prefix ``quant_prefix``, which names
    them as the checkpoint does: "model.layers.3.")."""
    hidden = config["hidden_size"]
    heads, q_lora, kv_lora = config["num_attention_heads"], config["q_lora_rank"], config["kv_lora_rank"]
    nope, rope, v_dim = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    experts, inter = config["n_routed_experts"], config["moe_intermediate_size"]

    def add_linear(path: str, out_sizes: list[int], in_size: int, with_quant: bool = True) -> None:
        _add_linear(layer, path, out_sizes, in_size, quant if with_quant else None, recorder, prefix, quant_prefix)

    for norm in ("input_layernorm", "post_attention_layernorm"):
        _add_param(layer, f"{norm}.weight", (hidden,), torch.bfloat16, recorder, prefix)
    for name in ("self_attn.indexer", "mlp.shared_experts", "mlp.experts"):
        _add_module(layer, name)
    add_linear("self_attn.fused_qkv_a_proj", [q_lora, kv_lora + rope], hidden)
    add_linear("self_attn.q_b_proj", [heads * (nope + rope)], q_lora)
    add_linear("self_attn.kv_b_proj", [heads * (nope + v_dim)], kv_lora)
    add_linear("self_attn.o_proj", [hidden], heads * v_dim)
    for norm, size in (("q_a_layernorm", q_lora), ("kv_a_layernorm", kv_lora)):
        _add_param(layer, f"self_attn.{norm}.weight", (size,), torch.bfloat16, recorder, prefix)
    if "index_topk" in config:
        idx_heads, idx_dim = config["index_n_heads"], config["index_head_dim"]
        add_linear("self_attn.indexer.wq_b", [idx_heads * idx_dim], q_lora)
        add_linear("self_attn.indexer.wk_weights_proj", [idx_dim, idx_heads], hidden, with_quant=False)
        for leaf in ("weight", "bias"):
            _add_param(layer, f"self_attn.indexer.k_norm.{leaf}", (idx_dim,), torch.float32, recorder, prefix)
    if not moe:
        add_linear("mlp.gate_up_proj", [config["intermediate_size"]] * 2, hidden)
        add_linear("mlp.down_proj", [hidden], config["intermediate_size"])
        return
    _add_param(layer, "mlp.gate.weight", (experts, hidden), torch.float32, recorder, prefix)
    _add_param(layer, "mlp.gate.e_score_correction_bias", (experts,), torch.float32, recorder, prefix)
    shared = inter * config["n_shared_experts"]
    add_linear("mlp.shared_experts.gate_up_proj", [shared] * 2, hidden)
    add_linear("mlp.shared_experts.down_proj", [hidden], shared)
    routed = _routed_experts(quant, f"{quant_prefix}mlp.experts", monkeypatch, dialect, experts, hidden, inter)
    for name, param in routed.named_parameters():
        param.weight_loader = recorder.loader(f"{prefix}mlp.experts.routed_experts.{name}")
    layer.mlp.experts.add_module("routed_experts", routed)


def _routed_experts(quant, prefix: str, monkeypatch, dialect: str, experts: int, hidden: int,
                    inter: int) -> nn.Module:
    """The routed experts' parameters: NVFP4 (vllm_moe_parameters), or vLLM's UnquantizedFusedMoEMethod's where
    the quant config leaves the experts module out, decided as vLLM's dispatch does: compressed-tensors'
    CompressedTensorsMoEMethod.get_moe_method asks get_scheme_dict about expert 0's projections, whose first step
    is should_ignore_layer; ModelOpt's get_quant_method asks is_layer_excluded about the experts module."""
    if isinstance(quant, ct_config.CompressedTensorsConfig):
        names = [f"{prefix}.0.{proj}" for proj in ("gate_proj", "up_proj", "down_proj")]
        excluded = all(ct_utils.should_ignore_layer(n, ignore=quant.ignore, fused_mapping=quant.packed_modules_mapping)
                       for n in names)
    else:
        excluded = quant.is_layer_excluded(prefix)
    if not excluded:
        return vllm_moe_parameters(monkeypatch, dialect, experts, hidden, inter)
    layer = nn.Module()
    moe = SimpleNamespace(intermediate_size_per_partition_unpadded=inter, is_act_and_mul=True,
                          hidden_dim_unpadded=hidden, has_bias=False)
    unquantized_moe.UnquantizedFusedMoEMethod.create_weights(SimpleNamespace(moe=moe), layer, experts, hidden, inter,
                                                             torch.bfloat16)
    return layer


def _add_module(owner: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        if not hasattr(owner, part):
            owner.add_module(part, nn.Module())
        owner = getattr(owner, part)
    return owner


def _stand_in(config: dict) -> nn.Module:
    model = nn.Module()
    model.config = SimpleNamespace(**config)
    model.num_redundant_experts, model.is_fused_shared_expert_enabled, model.use_mha = 0, False, False
    return model


def vllm_model(config: dict, quant, recorder: Recorder, monkeypatch, dialect: str) -> nn.Module:
    """The text model's parameters as vLLM 0.33 builds them for this config and quant config (main model only:
    vLLM's prefixes, and so the quant decisions, name the modules from the top, "model.layers...")."""
    model = _stand_in(config)
    layers = config["num_hidden_layers"]
    kinds = config.get("mlp_layer_types") or ["dense"] * config["first_k_dense_replace"] + ["sparse"] * layers
    _add_param(model, "embed_tokens.weight", (config["vocab_size"], config["hidden_size"]), torch.bfloat16,
               recorder, "")
    _add_param(model, "norm.weight", (config["hidden_size"],), torch.bfloat16, recorder, "")
    model.layers = nn.ModuleList(nn.Module() for _ in range(layers))
    for i in range(layers):
        _decoder_layer(model.layers[i], config, quant, recorder, monkeypatch, dialect, f"layers.{i}.",
                       f"model.layers.{i}.", kinds[i] == "sparse")
    return model


def vllm_drafter(config: dict, quant, recorder: Recorder, monkeypatch, dialect: str, cls) -> nn.Module:
    """The MTP drafter's parameters (deepseek_mtp.py, deepseek_v32/nvidia/mtp.py, glm4_moe_lite_mtp.py): per MTP
    layer enorm, hnorm, eh_proj (a plain nn.Linear), shared_head.norm and a decoder layer under ``mtp_block`` whose
    modules keep the checkpoint's prefix ("model.layers.3.self_attn...") for the quant decisions."""
    model = _stand_in(config)
    model._rewrite_spec_layer_name = cls._rewrite_spec_layer_name.__get__(model)
    if hasattr(cls, "is_unused_checkpoint_weight"):
        model.is_unused_checkpoint_weight = cls.is_unused_checkpoint_weight.__get__(model)
    first, count, hidden = config["num_hidden_layers"], config["num_nextn_predict_layers"], config["hidden_size"]
    inner = _add_module(model, "model")
    inner.mtp_start_layer_idx, inner.num_mtp_layers = first, count
    _add_param(inner, "embed_tokens.weight", (config["vocab_size"], hidden), torch.bfloat16, recorder, "model.")
    inner.layers = nn.ModuleDict({str(i): nn.Module() for i in range(first, first + count)})
    for i in range(first, first + count):
        layer, prefix = inner.layers[str(i)], f"model.layers.{i}."
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            _add_param(layer, f"{norm}.weight", (hidden,), torch.bfloat16, recorder, prefix)
        _add_param(layer, "eh_proj.weight", (hidden, 2 * hidden), torch.bfloat16, recorder, prefix)
        _decoder_layer(_add_module(layer, "mtp_block"), config, quant, recorder, monkeypatch, dialect,
                       f"{prefix}mtp_block.", prefix, moe=True)
    return model


def _check_loaded(load_weights, model: nn.Module, recorder: Recorder, weights: list, scheme: str,
                  shared_with_target: tuple[str, ...] = ()) -> None:
    loaded_names = load_weights(model, iter(weights))
    params = dict(model.named_parameters())
    assert loaded_names and set(loaded_names) <= set(params)
    w4a4_only = ("input_scale", "input_global_scale", "w13_input_", "w2_input_")
    expected = {n for n in params if (scheme == "nvfp4" or not any(k in n for k in w4a4_only))
                and not any(k in n for k in shared_with_target)}
    missing = sorted(expected - set(recorder.loaded))
    assert not missing, (load_weights.__qualname__, missing[:5])
    for name, entries in recorder.loaded.items():
        param = params[name]
        if param.dtype in (torch.uint8, torch.float8_e4m3fn):  # packed codes and block scales: as stored
            assert all(w.dtype == param.dtype for _, w in entries), (name, param.dtype)
        if param.dim() >= 2 and ".routed_experts." not in name:  # Linear weights: the shards fill the rows
            assert sum(w.shape[0] for _, w in entries) == param.shape[0], (name, [w.shape for _, w in entries])
            assert all(w.shape[1:] == param.shape[1:] for _, w in entries), name


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
        _check_loaded(load_weights, vllm_model(config, _quant_config(root), recorder, monkeypatch, dialect), recorder,
                      weights, scheme)


@pytest.mark.parametrize("scheme", ["nvfp4a16", "nvfp4"])
@pytest.mark.parametrize("dialect", ["compressed-tensors", "modelopt"])
@pytest.mark.parametrize("family", ["glm4_moe_lite", "deepseek_v32", "glm_moe_dsa"])
def test_vllm_mtp_drafter_load_weights_takes_the_kept_mtp_layer(vllm_quant_methods, monkeypatch, quantized, family,
                                                               dialect, scheme) -> None:
    """The MTP layer fp4kit keeps (BF16, listed in the ignore list) through the drafter's own load_weights: its
    Linears are unquantized in vLLM too (their prefixes are the ignore list's names), and every parameter is filled.
    The drafter's embed_tokens is the target model's (`vllm/v1/spec_decode/llm_base_proposer.py`,
    `_maybe_share_embeddings`: "Detected MTP model"), as its shared_head.head, which the fixtures' MTP layer does not
    hold, is the target's lm_head (`_maybe_share_lm_head`)."""
    root = quantized(family, dialect, scheme)
    config = json.loads((root / "config.json").read_text())
    tensors = {}
    for shard in sorted(root.glob("*.safetensors")):
        tensors.update(load_file(shard))
    mtp = f"model.layers.{config['num_hidden_layers']}."
    weights = [(n, t) for n, t in sorted(tensors.items()) if n.startswith(mtp) or n == "model.embed_tokens.weight"]
    assert not any(n.endswith(QUANTIZED_LEAVES) for n, _ in weights)
    for cls in DRAFTERS[family]:
        recorder = Recorder()
        _check_loaded(cls.load_weights, vllm_drafter(config, _quant_config(root), recorder, monkeypatch, dialect, cls),
                      recorder, weights, scheme, shared_with_target=("embed_tokens",))


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


@pytest.mark.parametrize("dialect", ["compressed-tensors", "modelopt"])
def test_deepseek_v32_from_its_fp8_release_loads(vllm_quant_methods, monkeypatch, tiny, tmp_path, dialect) -> None:
    """From the FP8-block form of the release, the kept Linears (indexer, MTP layer) are written dequantized: vLLM's
    loaders take the output as they take the one made from BF16, no FP8 scale left over."""
    from fp4kit.testing.fixtures import write_fp8_block_source

    fp8 = write_fp8_block_source(tiny("deepseek_v32"), tmp_path / "fp8")
    out = tmp_path / "out"
    quantize_checkpoint(fp8, out, QuantizeOptions(format=dialect))
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(out / "model.safetensors")
    assert not any(n.endswith("weight_scale_inv") for n in tensors)
    main = [(n.removeprefix("model."), t) for n, t in sorted(tensors.items())
            if n.startswith("model.") and not n.startswith("model.layers.3.")]
    mtp = [(n, t) for n, t in sorted(tensors.items()) if n.startswith("model.layers.3.") or "embed_tokens" in n]
    for load_weights in LOADERS["deepseek_v32"]:
        recorder = Recorder()
        _check_loaded(load_weights, vllm_model(config, _quant_config(out), recorder, monkeypatch, dialect), recorder,
                      main, "nvfp4a16")
    for cls in DRAFTERS["deepseek_v32"]:
        recorder = Recorder()
        _check_loaded(cls.load_weights, vllm_drafter(config, _quant_config(out), recorder, monkeypatch, dialect, cls),
                      recorder, mtp, "nvfp4a16", shared_with_target=("embed_tokens",))
