"""Tiny checkpoints of every family, built offline with transformers from configs shipped in fp4kit/data.

Weights are seeded random, never downloaded. They are saved the way each family's real checkpoints are: bf16,
GLM's router weight and correction bias in fp32, and GLM's MTP layer (which transformers does not instantiate)
added as extra tensors after the last decoder layer.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch

FIXTURES = ("qwen3_moe", "qwen3_vl_moe", "glm4_moe", "glm4v_moe", "llama4", "llama4_text")

# Tiny stand-ins that meet the seed recipes' backend rules: I % 64 (CUTLASS gated GEMM, Marlin), 8 experts so that
# EP 8 divides them (TRT-LLM-gen, CUTLASS), and for Llama-4 (Scout: Marlin) H % 128. The fixtures' H is 64, which
# CUTLASS accepts; the vision-language families keep it, since their M-RoPE sections are sized for it.
RECIPE_STAND_INS = {
    "qwen3_moe": {"moe_intermediate_size": 64, "num_experts": 8},
    "qwen3_vl_moe": {"moe_intermediate_size": 64, "num_experts": 8},
    "glm4_moe": {"moe_intermediate_size": 64, "n_routed_experts": 8},
    "glm4v_moe": {"moe_intermediate_size": 64, "n_routed_experts": 8,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                                      "partial_rotary_factor": 0.5}},
    "llama4": {"hidden_size": 128, "intermediate_size": 64, "num_local_experts": 8},
}


def fixture_spec(name: str) -> dict:
    return json.loads(resources.files("fp4kit.data").joinpath(f"tiny_{name}.json").read_text())


def build_model(name: str, seed: int = 0, overrides: dict | None = None) -> torch.nn.Module:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    spec = fixture_spec(name)
    config_kwargs = spec["config"]
    for key, value in (overrides or {}).items():  # text config keys, and "vision_config" merged into that config
        if key == "vision_config":
            config_kwargs[key] = config_kwargs[key] | value
            continue
        target = config_kwargs.get("text_config", config_kwargs)
        target[key] = value
    config = getattr(transformers, spec["config_class"])(**config_kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, spec["model_class"])(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "norm" in pname and pname.endswith("weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    return model.eval()


def build_fixture(name: str, path: str | Path, seed: int = 0, overrides: dict | None = None) -> Path:
    """Save a tiny ``name`` checkpoint (see FIXTURES) to ``path`` and return it."""
    from safetensors.torch import load_file, save_file

    path = Path(path)
    model = build_model(name, seed, overrides).to(torch.bfloat16)
    model.save_pretrained(path)
    if name.startswith("glm4"):
        single = path / "model.safetensors"
        tensors = load_file(single)
        for tname in list(tensors):
            if tname.endswith(("mlp.gate.weight", "e_score_correction_bias")):
                tensors[tname] = tensors[tname].float()
        if name == "glm4_moe":
            tensors.update(_glm_mtp_layer(tensors, model.config, seed))
        save_file(tensors, single, metadata={"format": "pt"})
    return path


def _glm_mtp_layer(tensors: dict[str, torch.Tensor], config, seed: int) -> dict[str, torch.Tensor]:
    """GLM-4.5 checkpoints carry the MTP layer as `model.layers.{num_hidden_layers}.*`: a full MoE decoder layer
    plus eh_proj / enorm / hnorm / shared_head. Build one from the last layer's shapes."""
    last, mtp = config.num_hidden_layers - 1, config.num_hidden_layers
    generator = torch.Generator().manual_seed(seed + 1)
    out = {}
    for tname, t in tensors.items():
        prefix = f"model.layers.{last}."
        if tname.startswith(prefix):
            noise = 0.05 * torch.randn(t.shape, generator=generator)
            out[f"model.layers.{mtp}." + tname[len(prefix):]] = noise.to(t.dtype)
    hidden = config.hidden_size
    out[f"model.layers.{mtp}.eh_proj.weight"] = (0.05 * torch.randn(hidden, 2 * hidden, generator=generator)).bfloat16()
    out[f"model.layers.{mtp}.enorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    out[f"model.layers.{mtp}.hnorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    out[f"model.layers.{mtp}.shared_head.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    return out
