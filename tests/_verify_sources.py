"""Checkpoints for the verify tests: a square-expert Qwen3-MoE (H = I = 128, so a transposed expert still fits and
every layout backend's shape constraints hold), its W4A4 variant, and helpers that edit tensors in place."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fp4kit.formats import compressed_tensors as ct

SQUARE = {"hidden_size": 128, "moe_intermediate_size": 128}


def run_cli(monkeypatch, capsys, *args: object) -> tuple[int, str, str]:
    from fp4kit import cli

    monkeypatch.setattr(sys, "argv", ["fp4kit", *map(str, args)])
    try:
        cli.main()
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def load_all(root: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(root.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def copy_with(src: Path, dst: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    """``dst`` = ``src``'s side files (config, manifests) with ``tensors`` as its only safetensors file."""
    dst.mkdir(parents=True)
    for path in src.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors") and path.name != "model.safetensors.index.json":
            (dst / path.name).write_bytes(path.read_bytes())
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def add_input_scales(src: Path, dst: Path) -> Path:
    """``src`` (NVFP4A16) with per-expert activation scales: compressed-tensors ``input_global_scale`` multipliers,
    one per expert for gate and up (they see the same input) and one for down, declared as the NVFP4 scheme."""
    tensors = load_all(src)
    generator = torch.Generator().manual_seed(0)
    shared: dict[tuple[str, bool], torch.Tensor] = {}
    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        module = name.removesuffix(".weight_packed")
        parent, proj = module.rsplit(".", 1)
        key = (parent, proj == "down_proj")
        if key not in shared:
            low = 2.0 if proj == "down_proj" else 6.0  # above what random unit-scale hidden states reach
            amax = low + 2.0 * torch.rand(1, generator=generator)
            shared[key] = (448 * 6 / amax).to(torch.float32)
        tensors[f"{module}.input_global_scale"] = shared[key].clone()
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = ct.quantization_config("nvfp4", config["quantization_config"]["ignore"])
    return copy_with(src, dst, tensors, config)


def text_forward(model: torch.nn.Module) -> torch.nn.Module:
    """The module that runs a text-only forward of a transformers model: Llama-4's language model (the same
    computation for text input, and the only one transformers 5.24 runs: its Llama4ForConditionalGeneration.forward
    reads ``image_outputs`` from the language model's output, which has none; models/llama4/modeling_llama4.py),
    the model itself for every other family."""
    return model.language_model if type(model).__name__ == "Llama4ForConditionalGeneration" else model
