"""Tiny checkpoints of every family, built offline with transformers from configs shipped in fp4kit/data.

Weights are seeded random, never downloaded. They are saved the way each family's real checkpoints are: bf16,
GLM's router weight and correction bias in fp32 (DeepSeek's bias; MLA_FIXTURES), and the MTP layers of GLM, DeepSeek,
the MLA families and MiniMax-M2 (which transformers does not instantiate) added as extra tensors after the last
decoder layer.
``write_fp8_block_source`` and ``write_pack_quantized_source`` turn a fixture into the quantized sources those models
are published as.
"""

from __future__ import annotations

import json
import re
import shutil
from importlib import resources
from pathlib import Path

import torch

FIXTURES = ("qwen3_moe", "qwen3_vl_moe", "glm4_moe", "glm4v_moe", "llama4", "llama4_text", "deepseek_v3",
            "glm4_moe_lite",
            "deepseek_v32",
            "glm_moe_dsa",
            "qwen3_next",
            "qwen3_5_moe",
            "qwen3_5_moe_text",
            "minimax_m2",
            "gpt_oss",
            "deepseek_v4",
            )


def streams_layers(fixture: str) -> bool:
    """Whether the fixture's family streams transformers' decoder layers (calibration, eval; Family.streams_layers)."""
    from fp4kit.families import FAMILIES

    return next((family.streams_layers for family in FAMILIES if family.name == fixture), True)


# MLA families: stored like GLM-4.5 / DeepSeek-V3 (the MTP layer after the decoder layers), with these tensors fp32:
# the GLM router as GLM-4.5's files (not checked against GLM-4.7-Flash's or GLM-5's), DeepSeek-V3.2's indexer k_norm
# as its release stores it
MLA_FIXTURES = {
    "glm4_moe_lite": ("e_score_correction_bias", "mlp.gate.weight"),
    "deepseek_v32": ("e_score_correction_bias", "indexer.k_norm.weight", "indexer.k_norm.bias"),
    "glm_moe_dsa": ("e_score_correction_bias", "mlp.gate.weight"),
}
# the Qwen hybrids, whose checkpoints carry an `mtp.*` block that transformers' classes do not hold
QWEN_MTP_FIXTURES = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")

# Tiny stand-ins that meet the seed recipes' backend rules: I % 64 (CUTLASS gated GEMM, Marlin), 8 experts so that
# EP 8 divides them (TRT-LLM-gen, CUTLASS), and for Llama-4 (Scout) and DeepSeek (Marlin) H % 128. The fixtures' H
# is 64, which CUTLASS accepts; the vision-language families keep it, since their M-RoPE sections are sized for it.
RECIPE_STAND_INS = {
    "qwen3_moe": {"moe_intermediate_size": 64, "num_experts": 8},
    "qwen3_vl_moe": {"moe_intermediate_size": 64, "num_experts": 8},
    "glm4_moe": {"moe_intermediate_size": 64, "n_routed_experts": 8},
    "glm4v_moe": {"moe_intermediate_size": 64, "n_routed_experts": 8,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                                      "partial_rotary_factor": 0.5}},
    "llama4": {"hidden_size": 128, "intermediate_size": 64, "num_local_experts": 8},
    "deepseek_v3": {"hidden_size": 128, "moe_intermediate_size": 64, "n_routed_experts": 8},
    "glm4_moe_lite": {"hidden_size": 128, "moe_intermediate_size": 64, "n_routed_experts": 8},
    "deepseek_v32": {"hidden_size": 128, "moe_intermediate_size": 64, "n_routed_experts": 8},
    "glm_moe_dsa": {"hidden_size": 128, "moe_intermediate_size": 64, "n_routed_experts": 8},
    "qwen3_next": {"moe_intermediate_size": 64, "num_experts": 8},
    "qwen3_5_moe": {"moe_intermediate_size": 64, "num_experts": 8},
    "qwen3_5_moe_text": {"moe_intermediate_size": 64, "num_experts": 8},
    "minimax_m2": {"intermediate_size": 64, "num_local_experts": 8},
    "gpt_oss": {"intermediate_size": 64, "num_local_experts": 8},  # down projection [E, 64, 64] square, as the 120b's
    "deepseek_v4": {},  # H 128, I 128, 8 experts already: whole 128x128 FP8 blocks, as the release's
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
    """Save a tiny ``name`` checkpoint (see FIXTURES) to ``path`` and return it (a single model.safetensors)."""
    from safetensors.torch import load_file, save_file

    path = Path(path)
    model = build_model(name, seed, overrides).to(torch.bfloat16)
    model.save_pretrained(path)
    if name.startswith("glm4") or name == "deepseek_v3" or name in MLA_FIXTURES:
        single = path / "model.safetensors"
        tensors = load_file(single)
        fp32 = ("e_score_correction_bias", "mlp.gate.weight")[: 2 if name.startswith("glm4") else 1]
        fp32 = MLA_FIXTURES.get(name, fp32)
        for tname in list(tensors):
            if tname.endswith(fp32):
                tensors[tname] = tensors[tname].float()
        if name in ("glm4_moe", "deepseek_v3") or name in MLA_FIXTURES:
            tensors.update(_glm_mtp_layer(tensors, model.config, seed))
        save_file(tensors, single, metadata={"format": "pt"})
    if name in QWEN_MTP_FIXTURES:
        single = path / "model.safetensors"
        tensors = load_file(single)
        tensors.update(_qwen_mtp_block(tensors, model.config.get_text_config(), seed))
        save_file(tensors, single, metadata={"format": "pt"})
    if name == "minimax_m2":
        single = path / "model.safetensors"
        _minimax_correction_bias(single, seed)
        tensors = load_file(single)
        tensors.update(_glm_mtp_layer(tensors, model.config, seed, layers=model.config.num_mtp_modules))
        save_file(tensors, single, metadata={"format": "pt"})
    if name == "deepseek_v4":
        _deepseek_v4_release(path / "model.safetensors", model.config, seed)
    return path


# transformers 5.17 saves DeepSeek-V4 half-renamed; the release's names (conversion_mapping.py "deepseek_v4", read
# backwards) have no `model.` prefix and the head's hyper-connection flat
_DEEPSEEK_V4_RENAMES = (("model.embed_tokens.", "embed."), ("model.hc_head.hc_", "hc_head_"), ("model.", ""))


def _deepseek_v4_release(single: Path, config, seed: int) -> None:
    """DeepSeek-V4 as released: the release's names, the router's selection bias fp32 and the hash layers'
    ``tid2eid`` table (zeros in a fresh model) seeded with distinct experts per token, and the MTP block ``mtp.0.*``
    (which transformers does not instantiate): the last layer's names, with ``e_proj`` / ``h_proj`` and its norms
    and head hyper-connection."""
    from safetensors.torch import load_file, save_file

    generator = torch.Generator().manual_seed(seed + 1)
    tensors = {}
    for tname, t in load_file(single).items():
        for old, new in _DEEPSEEK_V4_RENAMES:
            if tname.startswith(old):
                tname = new + tname[len(old):]
                break
        if tname.endswith("ffn.gate.bias"):
            t = 0.05 * torch.randn(t.shape, generator=generator)
        if tname.endswith("ffn.gate.tid2eid"):
            t = torch.stack([torch.randperm(config.n_routed_experts, generator=generator)[: t.shape[1]]
                             for _ in range(t.shape[0])]).to(t.dtype)
        tensors[tname] = t
    last = f"layers.{config.num_hidden_layers - 1}."
    hidden = config.hidden_size
    for tname, t in list(tensors.items()):
        if tname.startswith(last) and ".compressor." not in tname and ".indexer." not in tname:
            noise = (0.05 * torch.randn(t.shape, generator=generator)).to(t.dtype)
            tensors["mtp.0." + tname[len(last):]] = tensors[tname].clone() if "norm" in tname else noise
    for proj in ("e_proj", "h_proj"):
        tensors[f"mtp.0.{proj}.weight"] = (0.05 * torch.randn(hidden, hidden, generator=generator)).bfloat16()
    for norm in ("enorm", "hnorm", "norm"):
        tensors[f"mtp.0.{norm}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    for leaf in ("fn", "base", "scale"):
        tensors[f"mtp.0.hc_head_{leaf}"] = tensors[f"hc_head_{leaf}"].clone()
    save_file(tensors, single, metadata={"format": "pt"})


def _minimax_correction_bias(single: Path, seed: int) -> None:
    """MiniMax-M2's `block_sparse_moe.e_score_correction_bias` is a buffer (zeros in a fresh model) that selects
    experts: give it seeded values so that routing depends on it, in fp32 as transformers holds it and vLLM's
    MiniMaxM2MoE loads it."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(single)
    generator = torch.Generator().manual_seed(seed + 2)
    for tname, t in tensors.items():
        if tname.endswith("e_score_correction_bias"):
            tensors[tname] = 0.05 * torch.randn(t.shape, generator=generator)
    save_file(tensors, single, metadata={"format": "pt"})


def _linear_modules(tensors: dict[str, torch.Tensor]):
    from fp4kit.io.sources import KEPT_BY_FP8_SOURCES

    for tname, t in tensors.items():
        if tname.endswith(".weight") and t.dim() == 2 and not KEPT_BY_FP8_SOURCES.search(tname[: -len(".weight")]):
            yield tname[: -len(".weight")]


def _rewrite(src: Path, dst: Path, tensors: dict[str, torch.Tensor], quantization_config: dict,
             config: dict | None = None) -> Path:
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    for side in src.iterdir():
        if side.is_file() and side.suffix != ".safetensors" and side.name != "model.safetensors.index.json":
            shutil.copy2(side, dst / side.name)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = config or json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst


def write_fp8_block_source(src: str | Path, dst: str | Path, block: tuple[int, int] = (128, 128)) -> Path:
    """Fixture SRC as DeepSeek-V3's FP8 release stores it (fp4kit.io.sources.write_fp8_block_copy)."""
    from fp4kit.io.sources import write_fp8_block_copy

    return write_fp8_block_copy(src, dst, block)


def write_pack_quantized_source(src: str | Path, dst: str | Path, num_bits: int = 4, group_size: int = 32,
                                targets: str = r"\.experts\.\d+\.") -> Path:
    """A single-file bf16 fixture SRC as Kimi-K2-Thinking stores it: the Linears matching ``targets`` (the routed
    experts) compressed by compressed-tensors' own pack-quantized compressor (symmetric INT, bf16 group scales
    amax / (2^(b-1) - 0.5), as its min-max observer), the rest bf16 and listed in the config's ignore."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from safetensors.torch import load_file

    src, dst = Path(src), Path(dst)
    tensors = load_file(src / "model.safetensors")
    weights = QuantizationArgs(num_bits=num_bits, type="int", symmetric=True, strategy="group", group_size=group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    ignore = []
    for module in list(_linear_modules(tensors)):
        if not re.search(targets, module):
            ignore.append(module)
            continue
        weight = tensors.pop(f"{module}.weight")
        groups = weight.float().view(weight.shape[0], -1, group_size)
        scale = (groups.abs().amax(dim=-1) / ((1 << (num_bits - 1)) - 0.5)).clamp(min=1e-8).to(weight.dtype)
        packed = PackedQuantizationCompressor.compress({"weight": weight, "weight_scale": scale}, scheme)
        tensors.update({f"{module}.{key}": value for key, value in packed.items()})
    ignore += [m for m in ("lm_head",) if f"{m}.weight" in tensors]
    config = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                                quantization_status="compressed", ignore=sorted(ignore))
    return _rewrite(src, dst, tensors, config.model_dump(exclude_none=True))


# DeepSeek-V4's release: the Linears stored FP8 128x128 (the others are bf16, the routed experts FP4)
DEEPSEEK_V4_FP8 = re.compile(r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123]"
                             r"|mtp\.\d+\.(e_proj|h_proj))$")
DEEPSEEK_V4_FP4 = re.compile(r"\.experts\.\d+\.w[123]$")


def _e8m0(amax: torch.Tensor, top: float) -> torch.Tensor:
    """The E8M0 exponent bytes of the smallest powers of two 2^k with amax / 2^k <= top (127 for an all-zero block)."""
    k = torch.ceil(torch.log2(torch.where(amax > 0, amax / top, torch.ones_like(amax))))
    return (k + 127).clamp(0, 254).to(torch.uint8)


def write_deepseek_v4_release_source(src: str | Path, dst: str | Path) -> Path:
    """A single-file bf16 DeepSeek-V4 fixture SRC as the release stores it (fp4kit.families.deepseek_v4): routed
    experts int8 E2M1 pairs with F8_E8M0 ``.scale`` per 32 inputs (RTN under the smallest power of two that fits
    the block in +-6), DEEPSEEK_V4_FP8 Linears float8_e4m3fn with F8_E8M0 ``.scale`` per 128x128 block (the smallest
    power of two that fits it in +-448), config ``quant_method: fp8``, ``scale_fmt: ue8m0``, ``expert_dtype: fp4``."""
    from safetensors.torch import load_file

    from fp4kit.nvfp4 import e2m1_codes, pack_codes

    src, dst = Path(src), Path(dst)
    tensors = {}
    for tname, t in load_file(src / "model.safetensors").items():
        module = tname.removesuffix(".weight")
        weight = t.float()
        if tname.endswith(".weight") and DEEPSEEK_V4_FP4.search(module):
            blocks = weight.unflatten(-1, (-1, 32))
            exponents = _e8m0(blocks.abs().amax(-1), 6.0)
            scale = torch.ldexp(torch.ones(exponents.shape), exponents.to(torch.int32) - 127)
            codes = e2m1_codes((blocks / scale.unsqueeze(-1)).flatten(-2))
            tensors[tname] = pack_codes(codes).view(torch.int8)
            tensors[f"{module}.scale"] = exponents.view(torch.float8_e8m0fnu)
        elif tname.endswith(".weight") and DEEPSEEK_V4_FP8.search(module):
            rows, cols = weight.shape
            blocks = weight.view(rows // 128, 128, cols // 128, 128)
            exponents = _e8m0(blocks.abs().amax(dim=(1, 3)), 448.0)
            scale = torch.ldexp(torch.ones(exponents.shape), exponents.to(torch.int32) - 127)
            tensors[tname] = (blocks / scale[:, None, :, None]).view(rows, cols).to(torch.float8_e4m3fn)
            tensors[f"{module}.scale"] = exponents.view(torch.float8_e8m0fnu)
        else:
            tensors[tname] = t
    config = json.loads((src / "config.json").read_text())
    config["expert_dtype"] = "fp4"
    return _rewrite(src, dst, tensors, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}, config)


def _glm_mtp_layer(tensors: dict[str, torch.Tensor], config, seed: int, layers: int = 1) -> dict[str, torch.Tensor]:
    """GLM-4.5 and DeepSeek-V3 checkpoints carry the MTP layer as `model.layers.{num_hidden_layers}.*`: a full MoE
    decoder layer plus eh_proj / enorm / hnorm / shared_head. Build one from the last layer's shapes (or ``layers`` of
    them, numbered on: MiniMax-M2's `num_mtp_modules`, which vLLM's and SGLang's minimax_m2.py skip as
    `model.layers.{num_hidden_layers + i}.*`)."""
    last = config.num_hidden_layers - 1
    generator = torch.Generator().manual_seed(seed + 1)
    out = {}
    for mtp in range(config.num_hidden_layers, config.num_hidden_layers + layers):
        for tname, t in tensors.items():
            prefix = f"model.layers.{last}."
            if tname.startswith(prefix):
                noise = 0.05 * torch.randn(t.shape, generator=generator)
                out[f"model.layers.{mtp}." + tname[len(prefix):]] = noise.to(t.dtype)
        hidden = config.hidden_size
        eh_proj = 0.05 * torch.randn(hidden, 2 * hidden, generator=generator)
        out[f"model.layers.{mtp}.eh_proj.weight"] = eh_proj.bfloat16()
        out[f"model.layers.{mtp}.enorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        out[f"model.layers.{mtp}.hnorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        out[f"model.layers.{mtp}.shared_head.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    return out


def _qwen_mtp_block(tensors: dict[str, torch.Tensor], text_config, seed: int) -> dict[str, torch.Tensor]:
    """Qwen3-Next and Qwen3.5/3.6-MoE checkpoints carry their MTP block at the top level, outside the text model:
    `mtp.fc` [H, 2H], `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.norm` and `mtp.layers.0.*`, a
    full-attention MoE decoder layer with per-expert tensors. Built from the last full-attention layer's names."""
    full = max(i for i, kind in enumerate(text_config.layer_types) if kind == "full_attention")
    source = next(n for n in tensors if re.search(rf"layers\.{full}\.self_attn\.q_proj\.weight$", n))
    prefix = source[: source.index("self_attn.")]
    generator = torch.Generator().manual_seed(seed + 1)
    out = {}
    for tname, t in tensors.items():
        if tname.startswith(prefix):
            noise = 0.05 * torch.randn(t.shape, generator=generator)
            out["mtp.layers.0." + tname[len(prefix):]] = noise.to(t.dtype)
    hidden = text_config.hidden_size
    out["mtp.fc.weight"] = (0.05 * torch.randn(hidden, 2 * hidden, generator=generator)).bfloat16()
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{norm}.weight"] = (0.1 * torch.randn(hidden, generator=generator)).bfloat16()
    return out
