"""Small NVFP4 checkpoints for the layout and runtime tests, built without transformers (fp4kit.testing.synthetic).

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
from fp4kit.io.checkpoint import PlannedTensor, ShardWriter
from fp4kit.quantize.checkpoint import quantize_checkpoint
from fp4kit.testing.synthetic import Qwen3MoeDims, qwen3_moe_config, write_synthetic_qwen3_moe


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


def random_moe_only_source(root: Path, layers: int, num_experts: int, hidden: int, intermediate: int) -> Path:
    """A W4A4 compressed-tensors Qwen3-MoE holding only routed experts (random bytes) and routers: big layers, fast
    to write, for measuring how memory grows with the number of layers."""
    root.mkdir(parents=True)
    shapes = {"gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden),
              "down_proj": (hidden, intermediate)}
    plan = []
    for layer in range(layers):
        plan.append(PlannedTensor(f"model.layers.{layer}.mlp.gate.weight", torch.bfloat16, (num_experts, hidden)))
        for e in range(num_experts):
            for proj, (n, k) in shapes.items():
                module = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                plan += [PlannedTensor(f"{module}.weight_packed", torch.uint8, (n, k // 2)),
                         PlannedTensor(f"{module}.weight_scale", torch.float8_e4m3fn, (n, k // 16)),
                         PlannedTensor(f"{module}.weight_global_scale", torch.float32, (1,)),
                         PlannedTensor(f"{module}.input_global_scale", torch.float32, (1,))]
    writer = ShardWriter(root, plan, 10**12)
    generator = torch.Generator().manual_seed(0)
    for t in plan:
        if t.dtype == torch.float32:
            value = torch.full(t.shape, 2688.0)
        elif t.dtype == torch.bfloat16:
            value = torch.zeros(t.shape, dtype=t.dtype)
        elif t.dtype == torch.float8_e4m3fn:
            value = torch.randint(0x30, 0x50, t.shape, dtype=torch.uint8, generator=generator).view(t.dtype)
        else:
            value = torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=generator).view(t.dtype)
        writer.write(t.name, value)
    writer.finish()
    config = qwen3_moe_config(Qwen3MoeDims(layers, hidden, intermediate, num_experts, top_k=2))
    config["quantization_config"] = ct.quantization_config("nvfp4", [])
    (root / "config.json").write_text(json.dumps(config, indent=2))
    return root
