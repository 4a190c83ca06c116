"""The compressed-tensors dialect ("nvfp4-pack-quantized"), as llm-compressor writes it and vLLM loads it.

Per quantized Linear `<m>`: `<m>.weight_packed` u8 [N, K/2], `<m>.weight_scale` fp8 [N, K/16],
`<m>.weight_global_scale` fp32 [1] (multiplier 448*6/amax) and, for W4A4, `<m>.input_global_scale` fp32 [1]
(multiplier). The config is built with compressed-tensors' own classes so that it always validates.
"""

from __future__ import annotations

import torch

from fp4kit.checkpoint import PlannedTensor
from fp4kit.nvfp4 import BLOCK, NVFP4Tensor

FORMAT = "nvfp4-pack-quantized"
SCHEMES = {"nvfp4a16": "NVFP4A16", "nvfp4": "NVFP4"}


def planned(module: str, out_features: int, in_features: int, with_input_scale: bool) -> list[PlannedTensor]:
    specs = [
        PlannedTensor(f"{module}.weight_packed", torch.uint8, (out_features, in_features // 2)),
        PlannedTensor(f"{module}.weight_scale", torch.float8_e4m3fn, (out_features, in_features // BLOCK)),
        PlannedTensor(f"{module}.weight_global_scale", torch.float32, (1,)),
    ]
    if with_input_scale:
        specs.append(PlannedTensor(f"{module}.input_global_scale", torch.float32, (1,)))
    return specs


def encode(module: str, weight: NVFP4Tensor, input_scale_div: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    tensors = {
        f"{module}.weight_packed": weight.packed,
        f"{module}.weight_scale": weight.block_scale,
        f"{module}.weight_global_scale": weight.global_scale_mul_fp32.reshape(1),
    }
    if input_scale_div is not None:
        tensors[f"{module}.input_global_scale"] = (1.0 / input_scale_div.double()).to(torch.float32).reshape(1)
    return tensors


def decode(module: str, tensors: dict[str, torch.Tensor]) -> tuple[NVFP4Tensor, torch.Tensor | None]:
    global_mul = tensors[f"{module}.weight_global_scale"].reshape(())
    weight = NVFP4Tensor(
        tensors[f"{module}.weight_packed"],
        tensors[f"{module}.weight_scale"],
        1.0 / global_mul.double(),
    )
    input_mul = tensors.get(f"{module}.input_global_scale")
    return weight, None if input_mul is None else 1.0 / input_mul.reshape(()).double()


def quantization_config(scheme: str, ignore: list[str]) -> dict:
    """config.json `quantization_config` for every Linear quantized with `scheme` except the `ignore` modules."""
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme

    quant_scheme = preset_name_to_scheme(SCHEMES[scheme], ["Linear"])
    quant_scheme.format = FORMAT
    config = QuantizationConfig(
        config_groups={"group_0": quant_scheme},
        format=FORMAT,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=ignore,
    )
    out = config.model_dump(mode="json")
    out["version"] = compressed_tensors.__version__
    return out
