"""`fp4kit quantize --format modelopt`: the same canonical tensors as the compressed-tensors output, in ModelOpt's
names and config (per-expert modules; Llama-4's experts fused with one layer-wide scale, as ModelOpt exports them)."""

import json

import pytest
import torch

from fp4kit.formats.detect import open_checkpoint
from fp4kit.quantize import QuantizeOptions, quantize_checkpoint


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe", "qwen3_vl_moe"])
def test_modelopt_output_holds_the_compressed_tensors_values(family, tiny, tiny_nvfp4a16, tmp_path):
    out = tmp_path / "mo"
    quantize_checkpoint(tiny(family), out, QuantizeOptions(format="modelopt"))
    hf_quant = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert hf_quant["quant_algo"] == "W4A16_NVFP4" and hf_quant["group_size"] == 16
    assert {"kv_cache_quant_algo", "exclude_modules"} <= set(hf_quant)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "modelopt"
    with open_checkpoint(out) as mo, open_checkpoint(tiny_nvfp4a16(family)) as ct:
        assert mo.dialect != ct.dialect
        ct_modules = {m.name: m for m in ct.modules}
        assert {m.name for m in mo.modules} == set(ct_modules)
        for module in mo.modules:
            ours, theirs = mo.read_weight(module), ct.read_weight(ct_modules[module.name])
            assert torch.equal(ours.packed, theirs.packed), module.name
            assert torch.equal(ours.block_scale.view(torch.uint8), theirs.block_scale.view(torch.uint8))
            # ModelOpt stores an fp32 divisor: 1/G is not always an fp32 value whose reciprocal is G again.
            torch.testing.assert_close(ours.global_scale_div, theirs.global_scale_div, rtol=2**-23, atol=0)


def test_llama4_modelopt_fused_experts_share_layer_scale(tiny, tmp_path):
    out = tmp_path / "mo"
    quantize_checkpoint(tiny("llama4"), out, QuantizeOptions(format="modelopt"))
    with open_checkpoint(out) as mo:
        reader = mo.reader
        prefix = "language_model.model.layers.1.feed_forward.experts"
        assert reader.info(f"{prefix}.gate_up_proj").shape == (4, 64 // 2, 2 * 32)
        assert reader.info(f"{prefix}.gate_up_proj_weight_scale").shape == (4, 64 // 16, 2 * 32)
        assert reader.info(f"{prefix}.down_proj").shape == (4, 32 // 2, 64)
        assert reader.info(f"{prefix}.gate_up_proj_weight_scale_2").shape == ()
        experts = [m for m in mo.modules if m.name.startswith(prefix)]
        assert len(experts) == 4 * 3
        from fp4kit.io.checkpoint import CheckpointReader

        gate_up = CheckpointReader(tiny("llama4")).read(f"{prefix}.gate_up_proj").float()  # [E, H, 2I]
        for module in experts:
            if module.name.endswith("gate_proj"):
                ref = gate_up[module.expert, :, :32].t()
                deq = mo.read_weight(module).dequantize()
                assert ((deq - ref).norm() / ref.norm()).item() < 0.15
