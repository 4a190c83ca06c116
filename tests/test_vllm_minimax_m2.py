"""fp4kit's MiniMax-M2 checkpoints through vLLM 0.33.0's own loading rules (model_executor/models/minimax_m2.py).

What that file does, and what is run here: MiniMaxM2MoE builds its routed experts with ``ckpt_names=("w1", "w2",
"w3")`` (gate, down, up) under the decoder layer's ``block_sparse_moe``, so the expert tensors map onto the NVFP4
MoE parameters by vLLM's own ``RoutedExperts.build_expert_params_mapping("w1", "w2", "w3")`` into the parameters
vLLM's NVFP4 MoE methods create (``create_weights``, as tests/helpers.py); the router is a ``GateLinear``
without a quant config and the correction bias an fp32 parameter, both loaded as stored; ``hf_to_vllm_mapper``
stacks q/k/v into ``qkv_proj``. The MoE layer's quant-config prefix is ``{layer}.mlp.experts`` (vLLM passes
``prefix=f"{prefix}.mlp"``), so the dialects' ignore lists are checked with vLLM's own matching on that name.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import vllm_module, vllm_moe_parameters
from safetensors.torch import load_file

from fp4kit.quantize import QuantizeOptions, quantize_checkpoint

minimax_m2 = vllm_module("model_executor.models.minimax_m2")
RoutedExperts = vllm_module("model_executor.layers.fused_moe.routed_experts").RoutedExperts
ct_config = vllm_module("model_executor.layers.quantization.compressed_tensors.compressed_tensors")
ct_utils = vllm_module("model_executor.layers.quantization.compressed_tensors.utils")
modelopt_config = vllm_module("model_executor.layers.quantization.modelopt")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

# MiniMaxM2MoE(... ckpt_names=("w1", "w2", "w3")): FusedMoE's (gate, down, up) checkpoint names
CKPT_NAMES = ("w1", "w2", "w3")


@pytest.fixture(scope="module")
def quantized(tiny, tmp_path_factory):
    built = {}

    def get(dialect: str, scheme: str):
        if (dialect, scheme) not in built:
            out = tmp_path_factory.mktemp(f"minimax-{dialect}-{scheme}") / "out"
            quantize_checkpoint(tiny("minimax_m2"), out, QuantizeOptions(scheme=scheme, format=dialect, samples=4,
                                                                         seq_len=16, batch_size=4))
            built[dialect, scheme] = out
        return built[dialect, scheme]

    return get


def _tensors(root) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(root.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


@pytest.mark.parametrize("dialect", ["compressed-tensors", "modelopt"])
@pytest.mark.parametrize("scheme", ["nvfp4a16", "nvfp4"])
def test_expert_tensors_fill_vllm_moe_parameters(monkeypatch, quantized, tiny, dialect, scheme) -> None:
    root = quantized(dialect, scheme)
    config = json.loads((root / "config.json").read_text())
    num_experts, hidden, inter = config["num_local_experts"], config["hidden_size"], config["intermediate_size"]
    params = dict(vllm_moe_parameters(monkeypatch, dialect, num_experts, hidden, inter).named_parameters())
    mapping = RoutedExperts.build_expert_params_mapping(*CKPT_NAMES, num_experts)
    mapper = minimax_m2.MiniMaxM2Model.hf_to_vllm_mapper
    tensors = _tensors(root)
    filled: dict[str, set] = {}
    for name, tensor in mapper.apply(sorted(tensors.items())):
        if ".experts." not in name:
            continue
        assert ".block_sparse_moe.experts." in name, name  # the attribute vLLM's decoder layer holds them under
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
    assert len(filled) == config["num_hidden_layers"]
    for layer, seen in filled.items():
        assert {leaf for leaf, _, _ in seen} == expected, layer
        assert len(seen) == sum(num_experts * (1 if p.startswith("w2_") else 2) for p in expected), layer
    # what vLLM loads unquantized (router, correction bias, attention, norms, embeddings) is the source's, unchanged
    source = _tensors(tiny("minimax_m2"))
    for name, tensor in tensors.items():
        if ".experts." not in name:
            assert name in source and torch.equal(tensor, source[name]), name


@pytest.mark.parametrize("dialect", ["compressed-tensors", "modelopt"])
def test_vllm_quantizes_the_experts_and_keeps_attention(quantized, dialect) -> None:
    root = quantized(dialect, "nvfp4a16")
    config = json.loads((root / "config.json").read_text())
    packed = minimax_m2.MiniMaxM2ForCausalLM.packed_modules_mapping
    layers = range(config["num_hidden_layers"])
    if dialect == "compressed-tensors":
        parsed = ct_config.CompressedTensorsConfig.from_config(config["quantization_config"])

        def ignored(prefix: str) -> bool:
            return ct_utils.should_ignore_layer(prefix, ignore=parsed.ignore, fused_mapping=packed)
    else:
        parsed = modelopt_config.ModelOptNvFp4Config.from_config(
            json.loads((root / "hf_quant_config.json").read_text()))
        parsed.packed_modules_mapping = packed
        ignored = parsed.is_layer_excluded
    for layer in layers:
        assert not ignored(f"model.layers.{layer}.mlp.experts")  # vLLM's prefix for MiniMaxM2MoE's experts
        assert ignored(f"model.layers.{layer}.self_attn.qkv_proj")
        assert ignored(f"model.layers.{layer}.self_attn.o_proj")
