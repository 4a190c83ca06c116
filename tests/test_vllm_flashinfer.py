"""`fp4kit layout --backend trtllm|cutlass` against vLLM 0.33.0's own ``prepare_nvfp4_moe_layer_for_fi_or_cutlass``.

vLLM: model_executor/layers/quantization/utils/flashinfer_fp4_moe.py (prepare_nvfp4_moe_layer_for_fi_or_cutlass,
prepare_static_weights_for_trtllm_fp4_moe), flashinfer_utils.py (align_fp4_moe_hidden_dim_for_fi,
align_fp4_moe_weights_for_fi), nvfp4_utils.py (swizzle_blockscale), and the scalar arithmetic of
fused_moe/experts/trtllm_nvfp4_moe.py (g1_alphas = w13_scale_2 * a13_scale, g1_scale_c = g1_alphas * a2_gscale) and
fused_moe/oracle/nvfp4.py::make_nvfp4_moe_quant_config (a1_gscale = 1 / a13_scale). FlashInfer's CUDA-only
``block_scale_interleave`` is swapped for FlashInfer's own torch copy ``_swizzle_sf_128x4``, and the ``.cuda()``
that ends vLLM's ``swizzle_blockscale`` leaves the tensor on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from helpers import same_bytes, shared_source, vllm_expert_inputs, vllm_module, vllm_prepare

from fp4kit.layouts import trtllm
from fp4kit.layouts.directory import LayoutOptions, layout_checkpoint
from fp4kit.layouts.runtime import read_layer
from fp4kit.tools.convert import convert_checkpoint

Backend = vllm_module("model_executor.layers.fused_moe.oracle.nvfp4").NvFp4MoeBackend
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, object]:
    """W4A4 compressed-tensors sources with per-expert input scales (H = 256 and H = 128), ModelOpt conversions,
    and a repaired copy (one input scale per layer and projection)."""
    root = tmp_path_factory.mktemp("fi-oracle")
    found = {"ct-256": shared_source(tmp_path_factory, 256, 64), "ct-128": shared_source(tmp_path_factory, 128, 64)}
    convert_checkpoint(found["ct-256"], root / "mo-256", "modelopt")
    convert_checkpoint(found["ct-256"], root / "shared-256", "compressed-tensors", repair=True)
    convert_checkpoint(found["ct-128"], root / "shared-128", "modelopt", repair=True)
    return found | {name: root / name for name in ("mo-256", "shared-256", "shared-128")}


def layers(src, dst, options: LayoutOptions):
    layout_checkpoint(src, dst, options)
    for layer in (0, 1):
        tensors, meta, document = read_layer(dst, layer)
        yield tensors, meta, document["layers"][str(layer)], vllm_expert_inputs(
            src, f"model.layers.{layer}.mlp.experts", meta.num_experts)


@pytest.mark.parametrize("source", ["ct-256", "mo-256", "shared-256"])
def test_trtllm_equals_vllm(monkeypatch, sources, tmp_path, source) -> None:
    for ours, _, record, inputs in layers(sources[source], tmp_path / "t", LayoutOptions("trtllm")):
        theirs = vllm_prepare(monkeypatch, Backend.FLASHINFER_TRTLLM, inputs)
        for name, key in (("gemm1_weights", "w13"), ("gemm1_weights_scale", "w13_scale"), ("gemm2_weights", "w2"),
                          ("gemm2_weights_scale", "w2_scale")):
            assert same_bytes(ours[name], theirs[key]), name
        # one hidden-state quantization for all experts: the gate/up input scale is the layer's largest
        assert same_bytes(ours["output1_scale_gate_scalar"], theirs["g1_alphas"])
        per_expert = inputs["a13_scale"][:, 0]
        assert record["options"]["collapsed_input_scales13"] == int((per_expert != per_expert.max()).sum())
        shared_down = bool((inputs["a2_scale"] == inputs["a2_scale"][0]).all())
        assert shared_down == (source == "shared-256")
        if shared_down:
            assert same_bytes(ours["output1_scale_scalar"], theirs["g1_scale_c"])
            assert same_bytes(ours["output2_scale_scalar"], theirs["g2_alphas"])
        else:  # vLLM also takes the max of the down scales; fp4kit keeps each expert's, which the kernel applies
            a2 = inputs["a2_scale"]
            assert same_bytes(ours["output1_scale_scalar"], theirs["g1_alphas"] * (1.0 / a2))
            assert same_bytes(ours["output2_scale_scalar"], inputs["w2_scale_2"] * a2)


@pytest.mark.parametrize("flavor", ["flashinfer", "vllm"])
@pytest.mark.parametrize("source", ["ct-256", "shared-128"])
def test_cutlass_equals_vllm(monkeypatch, sources, tmp_path, source, flavor) -> None:
    backend = Backend.FLASHINFER_CUTLASS if flavor == "flashinfer" else Backend.VLLM_CUTLASS
    names = {"flashinfer": ("fc1_expert_weights", "fc1_weight_block_scale", "fc1_dequant_scale",
                            "fc1_act_global_scale", "fc2_expert_weights", "fc2_weight_block_scale",
                            "fc2_dequant_scale", "fc2_act_global_scale"),
             "vllm": ("w1_fp4", "w1_blockscale", "w1_alphas", "a1_gscale", "w2_fp4", "w2_blockscale", "w2_alphas",
                      "a2_gscale")}[flavor]
    options = LayoutOptions("cutlass", cutlass_flavor=flavor)
    for ours, _, record, inputs in layers(sources[source], tmp_path / "c", options):
        theirs = vllm_prepare(monkeypatch, backend, inputs)
        w13, s13, alpha1, gscale1, w2, s2, alpha2, gscale2 = (ours[n] for n in names)
        # FlashInfer's binding takes int64 / int32 views of the same bytes
        assert same_raw(w13, theirs["w13"]) and same_raw(s13, theirs["w13_scale"])
        assert same_raw(w2, theirs["w2"]) and same_raw(s2, theirs["w2_scale"])
        # FlashInfer's kernel quantizes the hidden states once (layer max); vLLM's cutlass_moe_fp4 per expert
        assert same_bytes(alpha1, theirs["g1_alphas"]) and same_bytes(gscale1, theirs["a1_gscale"])
        expected_collapsed = int((inputs["a13_scale"][:, 0] != inputs["a13_scale"][:, 0].max()).sum())
        assert record["options"]["collapsed_input_scales13"] == (expected_collapsed if flavor == "flashinfer" else 0)
        a2 = inputs["a2_scale"]
        assert same_bytes(alpha2, inputs["w2_scale_2"] * a2) and same_bytes(gscale2, 1.0 / a2)
        if source == "shared-128":
            assert same_bytes(alpha2, theirs["g2_alphas"]) and same_bytes(gscale2, theirs["a2_gscale"])


def test_trtllm_gemm2_rows_vllm_pads_to_256_and_fp4kit_to_128_compute_the_same(monkeypatch, sources,
                                                                               tmp_path) -> None:
    # H = 128: vLLM's caller pads H to 256 before the shuffle (GEMM2 rows 256, the extra ones zero); fp4kit sizes
    # GEMM2's rows at roundUp(H, 128) as FlashInfer's launcher does when called with valid_hidden_size = H.
    # GEMM1 (K padded to 256 in both) is byte-identical; GEMM2's first 128 rows are, and vLLM's other rows hold
    # zero weights and scales, so they only add output columns that vLLM slices off (hidden_dim_unpadded).
    for ours, meta, _, inputs in layers(sources["shared-128"], tmp_path / "p", LayoutOptions("trtllm")):
        theirs = vllm_prepare(monkeypatch, Backend.FLASHINFER_TRTLLM, inputs)
        assert ours["gemm2_weights"].shape[1] == 128 and theirs["w2"].shape[1] == 256
        for name, key in (("gemm1_weights", "w13"), ("gemm1_weights_scale", "w13_scale")):
            assert same_bytes(ours[name], theirs[key]), name
        assert same_bytes(ours["gemm2_weights"], theirs["w2"][:, :128])
        assert same_bytes(ours["gemm2_weights_scale"], theirs["w2_scale"][:, :128])
        assert not theirs["w2"][:, 128:].any() and not theirs["w2_scale"][:, 128:].view(torch.uint8).any()
        # undone as a layer of H = 256, vLLM's tensors give fp4kit's down projection plus 128 all-zero rows
        wide = dict(ours, gemm1_weights=theirs["w13"], gemm1_weights_scale=theirs["w13_scale"],
                    gemm2_weights=theirs["w2"], gemm2_weights_scale=theirs["w2_scale"])
        _, back2, _, _ = trtllm.undo(wide, _as_hidden(meta, 256))
        _, w2, _, _ = trtllm.undo(ours, meta)
        assert same_bytes(back2.packed[:, :128], w2.packed) and not back2.packed[:, 128:].any()
        assert same_bytes(back2.block_scale[:, :128], w2.block_scale)
        assert not back2.block_scale[:, 128:].view(torch.uint8).any()


def same_raw(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    return ours.shape[:-1] == theirs.shape[:-1] and same_bytes(ours.contiguous().view(torch.uint8),
                                                               theirs.contiguous().view(torch.uint8))


def _as_hidden(meta, hidden: int):
    from dataclasses import replace

    return replace(meta, hidden_size=hidden)
