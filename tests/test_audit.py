"""`fp4kit inspect --source`: input scales audited against the BF16 model's own causal forward."""

import pytest
import torch

from fp4kit.quantize import QuantizeOptions, quantize_checkpoint
from fp4kit.tools.audit import audit_input_scales

SAMPLES, SEQ_LEN = 4, 32


@pytest.mark.pinned
def test_fp4kit_calibration_passes_and_llm_compressor_attention_scales_clip(tiny, tmp_path):
    src = tiny("qwen3_moe")
    ours = tmp_path / "fp4kit"
    quantize_checkpoint(src, ours, QuantizeOptions(scheme="nvfp4", samples=SAMPLES, seq_len=SEQ_LEN, batch_size=4))
    findings, ratios = audit_input_scales(ours, src, None, SAMPLES, SEQ_LEN)
    assert not findings, findings
    assert ratios and min(ratios.values()) >= 1 - 2**-7

    pytest.importorskip("llmcompressor")
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    from fp4kit.quantize.calib_data import load_calibration

    ids = load_calibration(None, src, 256, SAMPLES, SEQ_LEN)
    dataset = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    oneshot(model=model, dataset=dataset, num_calibration_samples=SAMPLES, max_seq_length=SEQ_LEN,
            recipe=QuantizationModifier(targets="Linear", scheme="NVFP4", ignore=["lm_head", "re:.*mlp.gate$"]))
    theirs = tmp_path / "llmc"
    model.save_pretrained(theirs, save_compressed=True)
    findings, ratios = audit_input_scales(theirs, src, None, SAMPLES, SEQ_LEN)
    clipped = {f.module for f in findings if f.check == "input_scale_clips"}
    assert any(m.endswith("self_attn.o_proj") for m in clipped), ratios
