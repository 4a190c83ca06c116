"""Small NVFP4 checkpoints for the layout and runtime tests, built without transformers (fp4kit.synthetic).

``nvfp4_source`` quantizes a synthetic Qwen3-MoE with fp4kit (NVFP4A16) and, for ``w4a4``, adds per-expert
activation scales (compressed-tensors ``input_global_scale`` multipliers; gate and up of one expert share one, as
they see the same input) and declares the NVFP4 scheme, which is what the W4A4 backends need.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fp4kit.formats import compressed_tensors as ct
from fp4kit.quantize import quantize_checkpoint
from fp4kit.synthetic import write_synthetic_qwen3_moe


def add_input_scales(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(shard))
    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        module = name.removesuffix(".weight_packed")
        parent, proj = module.rsplit(".", 1)
        rng = random.Random(f"{parent}:{proj == 'down_proj'}")
        tensors[f"{module}.input_global_scale"] = torch.tensor([448 * 6 / rng.uniform(0.5, 8.0)], dtype=torch.float32)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = ct.quantization_config("nvfp4", config["quantization_config"]["ignore"])
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def nvfp4_source(root: Path, hidden: int = 128, intermediate: int = 64, num_experts: int = 8, layers: int = 2,
                 w4a4: bool = True) -> Path:
    """An NVFP4 (w4a4) or NVFP4A16 compressed-tensors Qwen3-MoE checkpoint with these MoE sizes."""
    bf16 = write_synthetic_qwen3_moe(root / "bf16", num_layers=layers, hidden=hidden, moe_intermediate=intermediate,
                                     num_experts=num_experts, top_k=2, num_heads=2, num_kv_heads=1, head_dim=32,
                                     vocab_size=64, threads=1)
    weight_only = root / "nvfp4a16"
    quantize_checkpoint(bf16, weight_only)
    return add_input_scales(weight_only, root / "nvfp4") if w4a4 else weight_only


_BUILT: dict[tuple, Path] = {}


def shared_source(tmp_path_factory, hidden: int, intermediate: int) -> Path:
    """nvfp4_source(...) built once per test session (its sibling `nvfp4a16` directory is the weight-only one)."""
    key = (hidden, intermediate)
    if key not in _BUILT:
        _BUILT[key] = nvfp4_source(tmp_path_factory.mktemp(f"nvfp4-h{hidden}-i{intermediate}"), hidden, intermediate)
    return _BUILT[key]
