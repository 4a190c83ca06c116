"""Llama-4 (multimodal: ModelOpt's fused expert tensors; text-only: per-expert) laid out by fp4kit against vLLM
0.33.0's own preparation functions, fed the way vLLM's loaders fill the expert parameters (tests/helpers.py)."""

from __future__ import annotations

import pytest
from helpers import (
    MARLIN_ACT,
    assert_same_as_marlin,
    same_bytes,
    vllm_expert_inputs,
    vllm_marlin,
    vllm_module,
    vllm_prepare,
)

from fp4kit.layouts.directory import LayoutOptions, layout_checkpoint
from fp4kit.layouts.runtime import read_layer
from fp4kit.quantize import QuantizeOptions, quantize_checkpoint
from fp4kit.testing.fixtures import build_fixture

Backend = vllm_module("model_executor.layers.fused_moe.oracle.nvfp4").NvFp4MoeBackend
pytestmark = pytest.mark.usefixtures("one_torch_thread")
SIZES = {"hidden_size": 128, "intermediate_size": 64}  # what Marlin's tiles need (H % 128, I % 64)


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    built = {}

    def get(family: str):
        if family not in built:
            root = tmp_path_factory.mktemp(f"vllm-{family}")
            build_fixture(family, root / "bf16", overrides=SIZES)
            quantize_checkpoint(root / "bf16", root / "mo", QuantizeOptions(scheme="nvfp4", format="modelopt",
                                                                           samples=4, seq_len=16, batch_size=4))
            built[family] = root / "mo"
        return built[family]

    return get


def experts_module(family: str, layer: int) -> str:
    prefix = "language_model.model" if family == "llama4" else "model"
    return f"{prefix}.layers.{layer}.feed_forward.experts"


@pytest.mark.parametrize("act", ["bf16", "fp16"])
@pytest.mark.parametrize("family", ["llama4", "llama4_text"])
def test_marlin_equals_vllm(monkeypatch, llama4, tmp_path, family, act) -> None:
    src = llama4(family)
    layout_checkpoint(src, tmp_path / "m", LayoutOptions("marlin", act_dtype=act))
    for layer in (0, 1):
        tensors, meta, _ = read_layer(tmp_path / "m", layer)
        inputs = vllm_expert_inputs(src, experts_module(family, layer), meta.num_experts)
        assert_same_as_marlin(tensors, vllm_marlin(monkeypatch, inputs, MARLIN_ACT[act]))


@pytest.mark.parametrize("family", ["llama4", "llama4_text"])
def test_trtllm_and_cutlass_equal_vllm(monkeypatch, llama4, tmp_path, family) -> None:
    src = llama4(family)
    for options, backend, names in (
            (LayoutOptions("trtllm"), Backend.FLASHINFER_TRTLLM, ("gemm1_weights", "gemm1_weights_scale",
                                                                   "output1_scale_gate_scalar")),
            (LayoutOptions("cutlass", cutlass_flavor="vllm"), Backend.VLLM_CUTLASS, ("w1_fp4", "w1_blockscale",
                                                                                     "w1_alphas"))):
        out = tmp_path / options.backend
        layout_checkpoint(src, out, options)
        for layer in (0, 1):
            tensors, meta, _ = read_layer(out, layer)
            theirs = vllm_prepare(monkeypatch, backend, vllm_expert_inputs(src, experts_module(family, layer),
                                                                           meta.num_experts))
            weights, scales, alpha = names
            assert same_bytes(tensors[weights], theirs["w13"]) and same_bytes(tensors[scales], theirs["w13_scale"])
            assert same_bytes(tensors[alpha], theirs["g1_alphas"])
