"""A quantized source's bf16 copy as the peers make it, for tests that compare against quantizing that copy."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def dequantized_bf16_copy(src: Path, dst: Path) -> Path:
    """SRC dequantized to bf16 by compressed-tensors' own converters (FP8BlockDequantizer, or
    CompressedTensorsDequantizer for pack-quantized INT) and saved as a plain checkpoint."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer

    tensors = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    if config["quantization_config"]["quant_method"] == "fp8":
        blocked = [n.removesuffix(".weight_scale_inv") for n in tensors if n.endswith(".weight_scale_inv")]
        tensors = FP8BlockDequantizer(targets=blocked, dtype=torch.bfloat16).process(tensors)
    else:
        tensors = CompressedTensorsDequantizer(src, dtype=torch.bfloat16).process(tensors)
    dst.mkdir()
    save_file({n: t.contiguous() for n, t in tensors.items()}, dst / "model.safetensors", metadata={"format": "pt"})
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    return dst
