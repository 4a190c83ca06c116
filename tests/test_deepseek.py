"""The deepseek_v3 family (DeepSeek-V3/R1, Kimi-K2): routing against transformers 5.17's DeepseekV3TopkRouter
and the whole DeepseekV3MoE block (`models/deepseek_v3/modeling_deepseek_v3.py`), what is quantized by default
(vLLM's `model_executor/models/deepseek_v2.py` builds every MLA projection with the quant config, q_a_proj and
kv_a_proj_with_mqa fused as `fused_qkv_a_proj`), the output of the tiny fixture, and every verify check (reference,
Triton under the interpreter, layouts, EP shards, NaN routing rows) on W4A4 and W4A16 NVFP4 made from an FP8-block
source."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

# Before anything imports fp4kit's Triton kernels: on a CPU they can only run under the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fp4kit.errors import Fp4kitError  # noqa: E402
from fp4kit.families import detect  # noqa: E402
from fp4kit.families.routing import route  # noqa: E402
from fp4kit.io.checkpoint import CheckpointReader  # noqa: E402
from fp4kit.quantize.plan import build_plan  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _sorted_by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids_sorted, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids_sorted


@pytest.mark.parametrize(("experts", "top_k", "n_group", "topk_group", "norm", "scaling"),
                         [(64, 8, 8, 4, True, 2.5),  # DeepSeek-V3's shape of routing (256 experts, 8 groups, 4 kept)
                          (48, 8, 1, 1, True, 2.827),  # Kimi-K2: no groups
                          (32, 4, 4, 2, False, 1.0)])
def test_routing_matches_deepseek_v3_router_nan_rows_included(experts, top_k, n_group, topk_group, norm, scaling):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=32, n_routed_experts=experts, num_experts_per_tok=top_k, n_group=n_group,
                              topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=scaling)
    router = DeepseekV3TopkRouter(config)
    torch.manual_seed(experts)
    torch.nn.init.normal_(router.weight, std=0.5)
    router.e_score_correction_bias.copy_(torch.randn(experts) * 0.3)
    hidden = torch.randn(96, 32)
    hidden[[5, 40]] = float("nan")  # padding rows of a CUDA graph
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(hidden)
    spec = detect(config.to_dict()).routing(config.to_dict())
    assert (spec.num_experts, spec.top_k, spec.n_group, spec.topk_group) == (experts, top_k, n_group, topk_group)
    weights, ids = route(logits, spec, router.e_score_correction_bias)
    valid = torch.isfinite(logits).all(dim=1)
    assert int((~valid).sum()) == 2
    # transformers selects with sorted=False: compare as sets, weights up to the summation order of the denominator
    weights_v, ids_v = _sorted_by_id(weights[valid], ids[valid])
    hf_weights_v, hf_ids_v = _sorted_by_id(hf_weights[valid], hf_ids[valid])
    assert torch.equal(ids_v, hf_ids_v)
    torch.testing.assert_close(weights_v, hf_weights_v, rtol=1e-6, atol=0)
    assert all(len(set(row.tolist())) == top_k for row in ids[~valid])
    assert bool(torch.isfinite(weights).all()) and bool(((ids >= 0) & (ids < experts)).all())


def test_kimi_k2_is_deepseek_v3_and_other_scoring_is_refused():
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(n_routed_experts=16, num_experts_per_tok=2, n_group=1, topk_group=1).to_dict()
    assert detect({**config, "model_type": "kimi_k2"}).name == "deepseek_v3"
    with pytest.raises(Fp4kitError, match="scoring_func 'softmax'"):
        detect(config).check_config({**config, "scoring_func": "softmax"}, {})


def test_default_plan_quantizes_mla_mlps_and_experts(tiny):
    src = tiny("deepseek_v3")
    config = json.loads((src / "config.json").read_text())
    with CheckpointReader(src) as reader:
        plan = build_plan(reader, config)
    quantized = {c.linear.module for g in plan.groups for c in g.members}
    layer1 = "model.layers.1."
    for module in ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.q_b_proj", "self_attn.kv_b_proj",
                   "self_attn.o_proj", "mlp.shared_experts.gate_proj", "mlp.experts.7.down_proj"):
        assert layer1 + module in quantized, module
    assert "model.layers.0.mlp.gate_proj" in quantized  # the dense layer
    assert not any(m.endswith("mlp.gate") or m.startswith("model.layers.3.") or m == "lm_head" for m in quantized)
    fused = [sorted(c.linear.module.rsplit(".", 1)[1] for c in g.members) for g in plan.groups
             if g.members[0].linear.module.startswith(layer1 + "self_attn.")]
    assert ["kv_a_proj_with_mqa", "q_a_proj"] in fused  # one global scale: vLLM's fused_qkv_a_proj


def test_output_shares_fused_qkv_a_scale_and_keeps_router_bias(tiny, tiny_nvfp4a16):
    src, out = tiny("deepseek_v3"), tiny_nvfp4a16("deepseek_v3")
    attn = "model.layers.2.self_attn."
    with safe_open(out / "model.safetensors", "pt") as q, safe_open(src / "model.safetensors", "pt") as s:
        assert torch.equal(q.get_tensor(attn + "q_a_proj.weight_global_scale"),
                           q.get_tensor(attn + "kv_a_proj_with_mqa.weight_global_scale"))
        assert q.get_tensor(attn + "kv_a_proj_with_mqa.weight_packed").shape == (80, 32)  # kv_lora_rank + rope rows
        bias = "model.layers.1.mlp.gate.e_score_correction_bias"
        assert q.get_tensor(bias).dtype == torch.float32 and torch.equal(q.get_tensor(bias), s.get_tensor(bias))
        assert q.get_tensor("model.layers.3.mlp.experts.0.gate_proj.weight").dtype == torch.bfloat16  # MTP kept


def test_source_layer_and_routing_match_transformers_moe_block(tiny):
    """verify's view of a DeepSeek-V3 MoE layer (router weight and fp32 correction bias, grouped sigmoid top-k,
    routed scaling, shared expert), read from the tiny fixture, against transformers' DeepseekV3MoE of the same
    checkpoint on random hidden states; NaN rows (padding) leave the other rows alone."""
    from transformers import AutoModelForCausalLM

    from fp4kit.verify.checks import route_batch, shared_output
    from fp4kit.verify.moe_layer import model_spec, read_source_layer
    from fp4kit.verify.reference import moe_reference

    src = tiny("deepseek_v3")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, experts_implementation="eager").eval()
    config = json.loads((src / "config.json").read_text())
    _, spec = model_spec(config)
    assert spec.kind == "sigmoid_grouped_topk" and spec.n_group > 1 and spec.routed_scaling_factor != 1.0
    for layer in (1, 2):
        block = model.model.layers[layer].mlp
        source = read_source_layer(src, f"model.layers.{layer}.mlp.experts", spec.num_experts)
        hidden = torch.randn(64, config["hidden_size"], generator=torch.Generator().manual_seed(layer))
        hidden[[3, 17]] = float("nan")
        with torch.no_grad():
            expected = block(hidden)
        _, weights, ids = route_batch(source, hidden, spec)
        got = moe_reference(hidden, weights, ids, source.w13, source.w2, spec) + shared_output(source.shared, hidden)
        valid = torch.isfinite(hidden).all(dim=1)
        torch.testing.assert_close(got[valid], expected[valid], rtol=1e-5, atol=1e-6)
        assert bool(((ids >= 0) & (ids < spec.num_experts)).all())


@pytest.fixture(scope="module")
def from_fp8(tmp_path_factory) -> dict[str, Path]:
    """The DeepSeek stand-in (H 128, I 64, 8 experts: every backend's shape rules) as an FP8-block source, quantized
    to W4A4 (calibrated through the dequantized layers) and W4A16; the W4A4 one laid out for TRT-LLM-gen and CUTLASS
    and split for EP 2, the W4A16 one for Marlin."""
    from fp4kit.ep.shard import ShardOptions, shard_checkpoint
    from fp4kit.layouts.directory import LayoutOptions, layout_checkpoint
    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint
    from fp4kit.testing.fixtures import RECIPE_STAND_INS, build_fixture, write_fp8_block_source

    root = tmp_path_factory.mktemp("deepseek-fp8")
    paths = {"bf16": build_fixture("deepseek_v3", root / "bf16", overrides=RECIPE_STAND_INS["deepseek_v3"])}
    paths["fp8"] = write_fp8_block_source(paths["bf16"], root / "fp8")
    quantize_checkpoint(paths["fp8"], root / "nvfp4", QuantizeOptions(scheme="nvfp4", samples=4, seq_len=16))
    quantize_checkpoint(paths["fp8"], root / "nvfp4a16")
    for backend, base in (("trtllm", "nvfp4"), ("cutlass", "nvfp4"), ("marlin", "nvfp4a16")):
        layout_checkpoint(root / base, root / backend, LayoutOptions(backend=backend))
    shard_checkpoint(root / "nvfp4", root / "ep2", ShardOptions(ep=2))
    return {**paths, **{name: root / name for name in ("nvfp4", "nvfp4a16", "trtllm", "cutlass", "marlin", "ep2")}}


def _failures(report) -> list[str]:
    return [f"layer {r.layer} {r.check} {r.target}: {r.error} {r.detail}" for r in report.results if r.failed]


@pytest.mark.parametrize(("checkpoint", "layouts", "shards"), [("nvfp4", ["trtllm", "cutlass"], "ep2"),
                                                               ("nvfp4a16", ["marlin"], None)])
def test_every_reference_check_passes_against_the_fp8_source(from_fp8, checkpoint, layouts, shards):
    from fp4kit.verify.checks import VerifyOptions
    from fp4kit.verify.runner import verify_checkpoint

    options = VerifyOptions(source=from_fp8["fp8"], tokens=[1, 16, 256], backend="reference",
                            layouts=[from_fp8[name] for name in layouts],
                            ep_shards=from_fp8[shards] if shards else None)
    report = verify_checkpoint(from_fp8[checkpoint], options)
    assert report.passed, _failures(report)
    assert report.mode == ("w4a4" if checkpoint == "nvfp4" else "w4a16")
    assert {r.layer for r in report.results} == {1, 2}  # the MoE layers; layer 0 is dense, layer 3 the MTP layer
    checks = {r.check for r in report.results}
    assert {"source", "source-expert", "routing", "layout", "layout-source"} <= checks
    # the source checks name what they compared against: the FP8 source's dequantized weights
    assert {r.target for r in report.results if r.check in ("source", "source-expert")} == {"fp8-block 128x128"}
    assert [r.detail for r in report.results if r.check == "layout"] == ["bit exact"] * 2 * len(layouts)
    if shards:
        ep_sum = [r for r in report.results if r.check == "ep-sum"]
        assert len(ep_sum) == 2 and all(r.error < 1e-5 for r in ep_sum)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("checkpoint", ["nvfp4", "nvfp4a16"])
def test_triton_matches_the_reference_nan_rows_included(from_fp8, checkpoint):
    """The interpreter on a CPU; compiled where a GPU is (the interpreter cannot run once triton is imported)."""
    from fp4kit.verify.checks import VerifyOptions
    from fp4kit.verify.runner import verify_checkpoint

    device = "cuda" if torch.cuda.is_available() else "cpu"
    report = verify_checkpoint(from_fp8[checkpoint], VerifyOptions(tokens=[1, 6], backend="triton", layers=[1],
                                                                  device=device))
    assert report.passed, _failures(report)
    kernel = [r for r in report.results if r.check == "kernel" and r.target == "triton"]
    assert len(kernel) == 2 and all(r.error is not None and r.error < 1e-2 for r in kernel)
    assert {r.target for r in report.results if r.check == "routing"} == {"route", "reference", "triton"}
