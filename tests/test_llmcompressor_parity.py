"""fp4kit's NVFP4A16 output equals llm-compressor's `oneshot` output on tiny fixtures of every family but DeepSeek-V3:
every tensor byte for byte (quantized and kept), and config.json's `quantization_config`.

llm-compressor 0.14.0.1 (`oneshot` + QuantizationModifier scheme NVFP4A16) is the producer vLLM users run today;
its per-expert names for fused Llama-4 and Qwen3-VL experts are the names fp4kit writes.

Deliberate differences, each checked for exactly what it is:

- GLM's router weight (`mlp.gate.weight`) keeps the source's fp32, as real GLM-4.5/4.5V checkpoints store it (and
  DeepSeek-V3.2's indexer `k_norm`, as its release does); `oneshot` runs on the model loaded in bf16 and saves them
  bf16. The values are the same.
- DeepSeek-V3.2 and GLM-5: `oneshot` is given their DSA indexer (`self_attn.indexer`) to ignore, as fp4kit's
  default ignore does.
- The MTP layer of GLM-4.5, GLM-4.7-Flash, DeepSeek-V3.2 and GLM-5 (`model.layers.<num_hidden_layers>.*`), which
  transformers does not instantiate, is kept unquantized (the source's bytes) and its Linear modules are listed in
  `ignore`; llm-compressor drops it.
- `quantization_config`: `weights.observer` is the observer llm-compressor calibrated with (memoryless_minmax),
  fp4kit writes compressed-tensors' preset (null): no loader reads it. llm-compressor also writes empty
  `sparsity_config` and `transform_config` (none of either). `ignore` is compared as a set.
- The rest of config.json is the source's; `save_pretrained` adds a `dtype` to each sub-config.
"""

import json

import pytest
import torch

from fp4kit.io.checkpoint import CheckpointReader

pytestmark = pytest.mark.pinned  # llm-compressor's pins (.ci/run)

FAMILIES = ["qwen3_moe", "qwen3_vl_moe", "glm4_moe", "glm4v_moe", "llama4",
            "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa"]
LLMC_IGNORE = ["re:.*lm_head", "re:.*mlp.gate$", "re:.*router", "re:.*vision_model.*", "re:.*visual.*",
               "re:.*multi_modal_projector.*",
               "re:.*self_attn.indexer.*"]  # DeepSeek-V3.2 / GLM-5's DSA indexer (fp4kit's default ignore)
MTP_FAMILIES = ("glm4_moe", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa")
QUANTIZED_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_global_scale")
# fp32 on disk, bf16 in `oneshot`'s model: GLM's router weight, DeepSeek-V3.2's indexer key norm
FP32_ON_DISK = {"glm": ("mlp.gate.weight",), "deepseek_v32": ("indexer.k_norm.weight", "indexer.k_norm.bias")}
LLMC_ONLY_CONFIG = {"sparsity_config": {}, "transform_config": {}}


def run_oneshot(src, dst, model_class: str) -> None:
    import transformers
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model = getattr(transformers, model_class).from_pretrained(src, dtype=torch.bfloat16)
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="NVFP4A16", ignore=LLMC_IGNORE))
    model.save_pretrained(dst, save_compressed=True)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


def _without_sub_config_dtype(config: dict) -> dict:
    return {k: ({s: w for s, w in v.items() if s != "dtype"} if k.endswith("_config") and isinstance(v, dict) else v)
            for k, v in config.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_equal_to_llm_compressor_oneshot(family, tiny, tiny_nvfp4a16, tmp_path):
    pytest.importorskip("llmcompressor")
    from fp4kit.testing.fixtures import fixture_spec

    run_oneshot(tiny(family), tmp_path / "llmc", fixture_spec(family)["model_class"])
    src, ours, theirs = CheckpointReader(tiny(family)), CheckpointReader(tiny_nvfp4a16(family)), \
        CheckpointReader(tmp_path / "llmc")
    source_config = json.loads((tiny(family) / "config.json").read_text())
    mtp = f"model.layers.{source_config['num_hidden_layers']}." if family in MTP_FAMILIES else None

    our_names, their_names = set(ours.names()), set(theirs.names())
    assert len({n for n in our_names if n.endswith(QUANTIZED_SUFFIXES)}) > 30
    assert their_names <= our_names
    only_ours = our_names - their_names
    assert all(mtp and n.startswith(mtp) for n in only_ours), sorted(only_ours)[:5]
    assert bool(only_ours) == (mtp is not None)
    for name in sorted(our_names):
        if name.endswith(QUANTIZED_SUFFIXES):
            assert _same(ours.read(name), theirs.read(name)), name
            continue
        kept = ours.read(name)
        assert _same(kept, src.read(name)), f"{name}: not the source's tensor"  # kept tensors: the source's bytes
        if name in only_ours:
            continue
        if any(family.startswith(f) and name.endswith(fp32) for f, fp32 in FP32_ON_DISK.items()):
            assert kept.dtype == torch.float32 and theirs.read(name).dtype == torch.bfloat16, name
            kept = kept.to(torch.bfloat16)
            assert torch.equal(kept.float(), ours.read(name)), f"{name}: fp32 tensor not bf16-exact"
        assert _same(kept, theirs.read(name)), name

    our_config = json.loads((tiny_nvfp4a16(family) / "config.json").read_text())
    their_config = json.loads((tmp_path / "llmc" / "config.json").read_text())
    our_q, their_q = our_config.pop("quantization_config"), their_config.pop("quantization_config")
    assert _without_sub_config_dtype(our_config) == _without_sub_config_dtype(their_config)
    assert our_config == source_config
    assert {k: their_q.pop(k) for k in LLMC_ONLY_CONFIG} == LLMC_ONLY_CONFIG
    our_weights, their_weights = our_q["config_groups"]["group_0"]["weights"], \
        their_q["config_groups"]["group_0"]["weights"]
    assert (our_weights.pop("observer"), their_weights.pop("observer")) == (None, "memoryless_minmax")
    our_ignore, their_ignore = our_q.pop("ignore"), their_q.pop("ignore")
    assert len(our_ignore) == len(set(our_ignore))
    mtp_modules = {n.removesuffix(".weight") for n in only_ours if len(ours.info(n).shape) == 2}
    assert set(our_ignore) == set(their_ignore) | mtp_modules
    assert our_q == their_q


def test_minimax_m2_equal_to_llm_compressor_oneshot_under_its_names(tiny, tiny_nvfp4a16, tmp_path):
    """MiniMax-M2: llm-compressor 0.14 linearizes transformers' fused experts and saves them as
    `experts.E.gate_proj / up_proj / down_proj`; fp4kit keeps the release's `w1 / w3 / w2`, the names vLLM 0.33's
    MiniMaxM2MoE loads (ckpt_names w1, w2, w3). Under that renaming every quantized tensor is byte-identical; attention
    is ignored on both sides (fp4kit's default, as the published NVFP4 checkpoints). The correction bias is the
    fp32 the source stores; `oneshot` saves the bf16 model's. The MTP layers (`model.layers.{num_hidden_layers + i}`),
    which transformers does not instantiate, llm-compressor drops and fp4kit keeps as stored."""
    pytest.importorskip("llmcompressor")
    import transformers
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    src = tiny("minimax_m2")
    model = transformers.MiniMaxM2ForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="NVFP4A16",
                                                     ignore=[*LLMC_IGNORE, "re:.*self_attn.*"]))
    model.save_pretrained(tmp_path / "llmc", save_compressed=True)
    ours, theirs = CheckpointReader(tiny_nvfp4a16("minimax_m2")), CheckpointReader(tmp_path / "llmc")
    renamed = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

    def their_name(name: str) -> str:
        head, sep, tail = name.partition(".experts.")
        if sep:
            expert, proj, leaf = tail.split(".", 2)
            return f"{head}{sep}{expert}.{renamed[proj]}.{leaf}"
        return name

    config = json.loads((src / "config.json").read_text())
    mtp = tuple(f"model.layers.{config['num_hidden_layers'] + i}." for i in range(config["num_mtp_modules"]))
    main = [n for n in ours.names() if not n.startswith(mtp)]
    assert len(main) < len(ours.names())
    assert {their_name(n) for n in main} == set(theirs.names())
    assert len([n for n in ours.names() if n.endswith(QUANTIZED_SUFFIXES)]) == 2 * 8 * 3 * 3
    for name in main:
        kept, other = ours.read(name), theirs.read(their_name(name))
        if name.endswith("e_score_correction_bias"):
            assert kept.dtype == torch.float32 and torch.equal(kept.to(torch.bfloat16), other), name
            continue
        assert _same(kept, other), name
