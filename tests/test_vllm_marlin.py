"""`fp4kit layout --backend marlin` against vLLM 0.33.0's own ``prepare_nvfp4_moe_layer_for_marlin``, byte for byte.

vLLM: model_executor/layers/quantization/utils/marlin_utils_fp4.py (prepare_nvfp4_moe_layer_for_marlin,
_nvfp4_compute_scale_factor, nvfp4_marlin_process_scales, nvfp4_marlin_process_global_scale), fed the way
fused_moe/oracle/nvfp4.py::convert_to_nvfp4_moe_kernel_format feeds it; only ``gptq_marlin_repack`` (CUDA) is
swapped for vLLM's test reference (tests/helpers.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers import MARLIN_ACT, assert_same_as_marlin, shared_source, vllm_expert_inputs, vllm_marlin

from fp4kit.layouts import marlin
from fp4kit.layouts.directory import LayoutOptions, layout_checkpoint
from fp4kit.layouts.runtime import read_layer
from fp4kit.nvfp4 import NVFP4Tensor, quantize_group
from fp4kit.tools.convert import convert_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, object]:
    w4a4 = shared_source(tmp_path_factory, 128, 64)
    modelopt = tmp_path_factory.mktemp("marlin-mo") / "mo"
    convert_checkpoint(w4a4, modelopt, "modelopt")
    return {"ct-nvfp4": w4a4, "ct-nvfp4a16": w4a4.parent / "nvfp4a16", "mo-nvfp4": modelopt}


@pytest.mark.parametrize("act", ["bf16", "fp16"])
@pytest.mark.parametrize("source", ["ct-nvfp4", "ct-nvfp4a16", "mo-nvfp4"])
def test_layout_checkpoint_equals_vllm(monkeypatch, sources, tmp_path, source, act) -> None:
    out = tmp_path / "marlin"
    layout_checkpoint(sources[source], out, LayoutOptions("marlin", act_dtype=act))
    for layer in (0, 1):
        tensors, meta, document = read_layer(out, layer)
        inputs = vllm_expert_inputs(sources[source], f"model.layers.{layer}.mlp.experts", meta.num_experts)
        assert_same_as_marlin(tensors, vllm_marlin(monkeypatch, inputs, MARLIN_ACT[act]))
        assert document["layers"][str(layer)]["options"]["w13_zeroed_scales"] == 0


def quantized_layer(experts: int, hidden: int, intermediate: int, seed: int) -> tuple[NVFP4Tensor, NVFP4Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def stacked(rows: int, cols: int) -> NVFP4Tensor:
        parts = [quantize_group([torch.randn(rows, cols, generator=generator).to(torch.bfloat16)])[0]
                 for _ in range(experts)]
        return NVFP4Tensor(torch.stack([p.packed for p in parts]), torch.stack([p.block_scale for p in parts]),
                           torch.stack([p.global_scale_div for p in parts]))

    return stacked(2 * intermediate, hidden), stacked(hidden, intermediate)


def divisor_inputs(w13: NVFP4Tensor, w2: NVFP4Tensor) -> dict[str, torch.Tensor]:
    return {"w13": w13.packed, "w13_scale": w13.block_scale, "w13_scale_2": w13.global_scale_div.float(),
            "w2": w2.packed, "w2_scale": w2.block_scale, "w2_scale_2": w2.global_scale_div.float()}


@pytest.mark.parametrize("act", ["bf16", "fp16"])
def test_a_near_dead_block_is_zeroed_as_vllm_does_and_counted(monkeypatch, act) -> None:
    # a quantized layer (largest block scale 448 in every expert) with one 16-weight block almost dead: vLLM keeps
    # f = 1 and zeroes that scale (scale * 2^7 < 2); fp4kit used to raise "too wide a range" instead
    w13, w2 = quantized_layer(2, 128, 64, seed=3)
    w13.block_scale.view(torch.uint8)[1, 5, 2] = 0x01  # 2^-9
    ours = marlin.transform(w13, w2, None, None, act_dtype=MARLIN_ACT[act])
    assert_same_as_marlin(ours, vllm_marlin(monkeypatch, divisor_inputs(w13, w2), MARLIN_ACT[act]))
    meta = marlin.describe(w13, w2, None, None, act_dtype=MARLIN_ACT[act])
    small = (w13.block_scale.to(torch.float64) * 2**7 < 2) & (w13.block_scale.to(torch.float64) > 0)
    assert meta.options["w13_scale_factor"] == 1.0 and meta.options["w13_zeroed_scales"] == int(small.sum()) >= 1


@pytest.mark.parametrize("act", ["bf16", "fp16"])
def test_a_largest_scale_below_448_takes_vllm_factor(monkeypatch, act) -> None:
    # third-party scales that do not reach 448 (e.g. global scale 1): vLLM lifts the largest to <= 448
    w13, w2 = quantized_layer(3, 128, 128, seed=4)
    for tensor in (w13, w2):
        raw = tensor.block_scale.view(torch.uint8)
        raw.copy_(torch.where(raw > 0x30, raw - 0x28, raw))  # divide the larger scales by 2^5: largest < 448
    ours = marlin.transform(w13, w2, None, None, act_dtype=MARLIN_ACT[act])
    assert_same_as_marlin(ours, vllm_marlin(monkeypatch, divisor_inputs(w13, w2), MARLIN_ACT[act]))
    factor = marlin.describe(w13, w2, None, None, act_dtype=MARLIN_ACT[act]).options["w13_scale_factor"]
    assert factor == (32.0 if act == "bf16" else 1.0)


def test_layout_of_a_checkpoint_with_a_near_dead_block(monkeypatch, sources, tmp_path) -> None:
    # what `fp4kit layout --backend marlin` refused ("too wide a range") while inspect called the checkpoint clean
    import shutil

    from safetensors.torch import load_file, save_file

    from fp4kit.tools.inspect import inspect_checkpoint

    src = tmp_path / "src"
    shutil.copytree(sources["ct-nvfp4a16"], src)
    tensors = load_file(src / "model.safetensors")
    name = "model.layers.1.mlp.experts.3.down_proj.weight_scale"
    raw = tensors[name].view(torch.uint8).clone()
    raw[7, 1] = 0x01
    tensors[name] = raw.view(torch.float8_e4m3fn)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    report = inspect_checkpoint(src)
    assert report.clean and report.marlin_zeroed_scales == {"model.layers.1.mlp.experts.w2": 1}
    layout_checkpoint(src, tmp_path / "marlin", LayoutOptions("marlin"))
    tensors, meta, document = read_layer(tmp_path / "marlin", 1)
    assert document["layers"]["1"]["options"]["w2_zeroed_scales"] == 1
    assert_same_as_marlin(tensors, vllm_marlin(monkeypatch, vllm_expert_inputs(src, "model.layers.1.mlp.experts", 8),
                                     torch.bfloat16))
