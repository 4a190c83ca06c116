"""vLLM 0.33 as the oracle of an NVFP4 checkpoint cast from an MXFP4 source (fp4kit.nvfp4.cast_mxfp4_group): its
compressed-tensors config parses as NVFP4, and vLLM's own NVFP4 dequantization
(`model_executor/layers/quantization/utils/nvfp4_emulation_utils.py`, dequantize_to_dtype, the emulation path)
gives every weight of the source's MXFP4 values bit for bit (compressed-tensors' MXFP4 decompression of the
llm-compressor `model_free_ptq(scheme="MXFP4A16")` source)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import vllm_module
from safetensors.torch import load_file

emulation = vllm_module("model_executor.layers.quantization.utils.nvfp4_emulation_utils")
ct_config = vllm_module("model_executor.layers.quantization.compressed_tensors.compressed_tensors")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.pinned
def test_vllm_dequantizes_the_cast_to_the_mxfp4_values(tiny, tmp_path):
    pytest.importorskip("llmcompressor")
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from llmcompressor import model_free_ptq

    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint

    src, dst = tmp_path / "mxfp4", tmp_path / "nvfp4"
    model_free_ptq(tiny("qwen3_moe"), src, scheme="MXFP4A16", ignore=["lm_head", "re:.*mlp.gate$"])
    assert quantize_checkpoint(src, dst, QuantizeOptions()).mxfp4_cast == {"exact": 7680, "requantized": 0}
    parsed = ct_config.CompressedTensorsConfig.from_config(
        json.loads((dst / "config.json").read_text())["quantization_config"])
    assert parsed._is_nvfp4_format(parsed.target_scheme_map["Linear"]["weights"])
    expected = CompressedTensorsDequantizer(src, dtype=torch.float32).process(load_file(src / "model.safetensors"))
    out = load_file(dst / "model.safetensors")
    modules = [n.removesuffix(".weight_packed") for n in out if n.endswith(".weight_packed")]
    assert len(modules) == 56
    for module in modules:
        values = emulation.dequantize_to_dtype(out[f"{module}.weight_packed"], out[f"{module}.weight_scale"],
                                               1.0 / out[f"{module}.weight_global_scale"], torch.float32,
                                               swizzle=False)
        assert torch.equal(values.view(torch.int32), expected[f"{module}.weight"].view(torch.int32)), module
