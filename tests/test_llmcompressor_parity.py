"""fp4kit's NVFP4A16 output equals llm-compressor's `oneshot` output byte for byte on tiny fixtures.

llm-compressor 0.14.0.1 (`oneshot` + QuantizationModifier scheme NVFP4A16) is the producer vLLM users run today;
its per-expert names for fused Llama-4 experts are the names fp4kit writes.
"""

import pytest
import torch

from fp4kit.checkpoint import CheckpointReader

LLMC_IGNORE = ["re:.*lm_head", "re:.*mlp.gate$", "re:.*router", "re:.*vision_model.*", "re:.*visual.*",
               "re:.*multi_modal_projector.*"]


def run_oneshot(src, dst, model_class: str) -> None:
    import transformers
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model = getattr(transformers, model_class).from_pretrained(src, dtype=torch.bfloat16)
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="NVFP4A16", ignore=LLMC_IGNORE))
    model.save_pretrained(dst, save_compressed=True)


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe", "llama4"])
def test_bytes_equal_llm_compressor_oneshot(family, tiny, tiny_nvfp4a16, tmp_path):
    pytest.importorskip("llmcompressor")
    from fp4kit.fixtures import fixture_spec

    run_oneshot(tiny(family), tmp_path / "llmc", fixture_spec(family)["model_class"])
    ours, theirs = CheckpointReader(tiny_nvfp4a16(family)), CheckpointReader(tmp_path / "llmc")
    suffixes = (".weight_packed", ".weight_scale", ".weight_global_scale")
    our_q = {n for n in ours.names() if n.endswith(suffixes)}
    their_q = {n for n in theirs.names() if n.endswith(suffixes)}
    assert our_q == their_q and len(our_q) > 30
    for name in sorted(our_q):
        assert torch.equal(ours.read(name).view(torch.uint8), theirs.read(name).view(torch.uint8)), name
