"""`fp4kit inspect --engine trtllm`: what TensorRT-LLM's PyTorch backend cannot take from a checkpoint's config.

The checks come from TensorRT-LLM's compressed-tensors config parser, `tensorrt_llm/models/quant_config_utils.py`
(``update_quant_config_from_compressed_tensors``, read on the main branch at commit 2a26169d), and its caller
`tensorrt_llm/_torch/model_config.py` (``ModelConfig.load_hf_quant_config``, at commit 008e0af8). Findings name
the config group; they concern the compressed-tensors dialect (TensorRT-LLM reads ModelOpt's hf_quant_config.json on
another path, which fp4kit does not check).
"""

from __future__ import annotations

from collections.abc import Callable

from fp4kit.formats.compressed_tensors import NAME as CT
from fp4kit.formats.detect import QuantizedCheckpoint

ENGINE = "trtllm"  # inspect --engine: the engine TensorRT-LLM, not the layout backend of that name
VERSION = "main (2026-08)"
_UTILS = "tensorrt_llm/models/quant_config_utils.py"
SOURCES = {
    "trtllm_ct_config_groups": f"{_UTILS} (update_quant_config_from_compressed_tensors: one config group is one "
                               "global quant_algo; several resolve per module only from module names passed in, "
                               "and _build_layer_quant_configs refuses a class-name target such as Linear: 'targets "
                               "matched no checkpoint module'), tensorrt_llm/_torch/model_config.py "
                               "(load_hf_quant_config passes no module names)",
    "trtllm_ct_group_scheme": f"{_UTILS} (_quant_config_from_config_group: NVFP4 needs tensor_group input "
                              "activations, which a weight-only group has none of; FP8 takes channel weights with "
                              "token inputs or 128-block weights with group-128 inputs, no per-tensor weights)",
}
CLASS_TARGETS = ("Linear",)

Report = Callable[[str, str, str], None]


def group_problem(group: dict) -> str | None:
    """Why TensorRT-LLM's compressed-tensors parser does not take a config group as fp4kit writes it, or None."""
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    bits, strategy = weights.get("num_bits"), weights.get("strategy")
    if bits == 4 and weights.get("type") == "float" and strategy == "tensor_group":
        if not inputs:
            return "weight-only NVFP4 (no input_activations): its NVFP4 branch reads the input strategy of W4A4"
        return None
    if bits == 8:
        if strategy == "channel" and (inputs or {}).get("strategy") == "token":
            return None
        if strategy == "block" and (inputs or {}).get("strategy") == "group" and inputs.get("group_size") == 128:
            return None
        return f"FP8 with {strategy} weights and {(inputs or {}).get('strategy')} inputs: it takes channel weights " \
               "with token inputs (fp8-dynamic) or 128-blocks with group-128 inputs (fp8-block)"
    return None


def trtllm_checks(ckpt: QuantizedCheckpoint, report: Report) -> None:
    if ckpt.dialect != CT:
        return
    qconfig = ckpt.config.get("quantization_config") or {}
    groups = qconfig.get("config_groups") or {}
    if len(groups) > 1:
        by_class = [name for name, g in groups.items() if set(g.get("targets") or []) & set(CLASS_TARGETS)]
        why = f" ({', '.join(by_class)} targets the class Linear, which it refuses)" if by_class else ""
        report("trtllm_ct_config_groups", "quantization_config.config_groups",
               f"{len(groups)} config groups{why}: TensorRT-LLM's loader gives modules no per-module scheme from "
               "a multi-group compressed-tensors config; give it one scheme per checkpoint")
    for name, group in groups.items():
        if problem := group_problem(group):
            report("trtllm_ct_group_scheme", f"quantization_config.config_groups.{name}", problem)
