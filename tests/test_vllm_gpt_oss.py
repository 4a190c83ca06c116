"""fp4kit's gpt-oss checkpoints through vLLM 0.33.0's own gpt-oss loader: it cannot take them (docs/serving.md).

vLLM (model_executor/models/gpt_oss.py) sends an NVFP4 checkpoint (quant_method compressed-tensors or modelopt)
through ``GptOssModel._load_weights_other`` after ``GptOssForCausalLM.hf_to_vllm_mapper``. That function loads
routed experts only in two forms: layer tensors whose names contain ``.w13_weight`` / ``.w2_weight`` (every one
narrowed as ``weight[:, :, ...]`` and permuted as an unquantized [E, K, N] tensor), or per-expert
``experts.{e}.<param>`` with ``<param>`` one of ``_GPT_OSS_STREAMED_EXPERT_SUFFIX_TO_SHARD`` (weights, packed
weights, block scales, biases: no global or input scale). Run here, on a stand-in
holding the parameters vLLM's own NVFP4 MoE ``create_weights`` makes (tests/helpers.py): fp4kit's
per-expert gate and up tensors and every global scale are skipped without a word (down's block scales load, through
the mapper's entries for quark), and the streamed form, the only one it routes per expert, has no name for the
global scales, which then hit the unquantized-tensor branch and fail. When a vLLM release loads them, these tests
fail and the gpt-oss section of docs/serving.md is to be rewritten.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from helpers import vllm_module, vllm_moe_parameters
from safetensors.torch import load_file
from torch import nn

from fp4kit.quantize import QuantizeOptions, quantize_checkpoint

gpt_oss = vllm_module("model_executor.models.gpt_oss")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


class StandIn(nn.Module):
    """GptOssModel's attributes that ``_load_weights_other`` reads, and its expert parameters."""

    _load_weights_other = gpt_oss.GptOssModel._load_weights_other
    _try_load_streamed_expert = gpt_oss.GptOssModel._try_load_streamed_expert

    def __init__(self, layers: list[nn.Module], config: dict) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        for routed in layers:
            layer = nn.Module()
            layer.mlp = nn.Module()
            layer.mlp.experts = nn.Module()
            layer.mlp.experts.routed_experts = routed
            self.layers.append(layer)
        self.config = SimpleNamespace(intermediate_size=config["intermediate_size"])
        self.parallel_config = SimpleNamespace(enable_expert_parallel=False)


def _stand_in(monkeypatch, dialect: str, config: dict, loaded: list) -> StandIn:
    one = SimpleNamespace(world_size=1, rank_in_group=0)
    monkeypatch.setattr(gpt_oss, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(gpt_oss, "get_dp_group", lambda: one)
    monkeypatch.setattr(gpt_oss, "get_pcp_group", lambda: one)
    layers = []
    for _ in range(config["num_hidden_layers"]):
        routed = vllm_moe_parameters(monkeypatch, dialect, config["num_local_experts"], config["hidden_size"],
                                     config["intermediate_size"])
        for name, param in routed.named_parameters():
            def record(param_, weight, weight_name=None, shard_id=None, expert_id=None, return_success=False,
                       name=name):
                loaded.append((name, shard_id, expert_id))
                return True
            param.weight_loader = record
        layers.append(routed)
    return StandIn(layers, config)


def _expert_tensors(root) -> list[tuple[str, torch.Tensor]]:
    tensors = {}
    for shard in sorted(root.glob("*.safetensors")):
        tensors.update(load_file(shard))
    mapped = gpt_oss.GptOssForCausalLM.hf_to_vllm_mapper.apply(sorted(tensors.items()))
    return [(n.removeprefix("model."), t) for n, t in mapped if ".mlp.experts." in n and "_bias" not in n]


@pytest.mark.parametrize("dialect", ["compressed-tensors", "modelopt"])
def test_vllm_skips_fp4kit_s_per_expert_tensors(monkeypatch, tiny, tmp_path, dialect) -> None:
    out = tmp_path / "out"
    quantize_checkpoint(tiny("gpt_oss"), out, QuantizeOptions(scheme="nvfp4a16", format=dialect))
    config = json.loads((out / "config.json").read_text())
    loaded: list = []
    model = _stand_in(monkeypatch, dialect, config, loaded)
    experts = _expert_tensors(out)
    assert len(experts) >= 2 * 8 * 3 * 3  # packed weights, block scales, global scales of every expert Linear
    names = model._load_weights_other(1, 0, experts, [])
    # The mapper's quark entries turn down_proj.weight / .weight_scale into the streamed w2_weight / w2_weight_scale,
    # so down's block scales (ModelOpt: and packed weights) load per expert; gate, up and every global scale are
    # skipped without a word: vLLM would serve experts it never filled
    down = {"w2_weight_scale"} | ({"w2_weight"} if dialect == "modelopt" else set())
    assert {n for n, _, _ in loaded} == down
    assert {n.rsplit(".", 1)[1] for n in names} == down


def test_vllm_s_streamed_expert_form_has_no_global_scales(monkeypatch, tiny, tmp_path) -> None:
    """The per-expert names vLLM does route (w13_weight_packed, w13_weight_scale) carry fp4kit's tensors; the global
    scale, which NVFP4 needs, has no streamed name and fails as a fused unquantized tensor."""
    out = tmp_path / "out"
    quantize_checkpoint(tiny("gpt_oss"), out, QuantizeOptions(scheme="nvfp4a16"))
    config = json.loads((out / "config.json").read_text())
    tensors = {}
    for shard in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(shard))
    experts = "layers.0.mlp.experts"
    streamed = []
    for e in range(config["num_local_experts"]):
        for leaf in ("weight_packed", "weight_scale"):
            gate, up = (tensors[f"model.{experts}.{e}.{p}.{leaf}"] for p in ("gate_proj", "up_proj"))
            streamed.append((f"{experts}.{e}.w13_{leaf}", torch.stack([gate, up], dim=1).flatten(0, 1)))
    loaded: list = []
    model = _stand_in(monkeypatch, "compressed-tensors", config, loaded)
    names = model._load_weights_other(1, 0, streamed, [])
    assert {n for n, _, _ in loaded} == {"w13_weight_packed", "w13_weight_scale"} and names
    scale = tensors[f"model.{experts}.0.gate_proj.weight_global_scale"]
    with pytest.raises(IndexError):
        model._load_weights_other(1, 0, [(f"{experts}.0.w13_weight_global_scale", scale)], [])
