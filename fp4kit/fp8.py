"""FP8 E4M3 weights of the per-module schemes (fp8-dynamic, fp8-block, fp8-static) and their static input scale.

The weights follow compressed-tensors' float quantization exactly (its ``calculate_qparams`` and ``_quantize``), in
the weight's own dtype: the scale is amax / 448 rounded to that dtype (an all-zero channel or block gets the dtype's
eps), and the codes are ``clamp(w / scale, -448, 448)`` cast to E4M3, the division rounded to the weight's dtype
first. Byte identity with llm-compressor's output depends on keeping those two roundings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fp4kit.errors import Fp4kitError

FP8_MAX = 448.0
FP8_BLOCK = 128  # fp8-block's weight blocks are FP8_BLOCK x FP8_BLOCK
ACTIVATION_GROUP = 128  # fp8-block's activations: one dynamic scale per token and 128 input features
# the floor vLLM 0.33 puts under a dynamic activation scale (quantization/input_quant_fp8.py, _FP8_MIN_SCALING_FACTOR)
MIN_DYNAMIC_SCALE = 1.0 / (FP8_MAX * 512.0)


@dataclass
class Fp8Weight:
    """An FP8 E4M3 weight [N, K] and its scale in the weight's dtype: [N, 1] per channel (fp8-dynamic),
    [ceil(N/128), ceil(K/128)] per block (fp8-block) or [1] per tensor (fp8-static); dequantized as codes * scale."""

    codes: torch.Tensor
    scale: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        scale = self.scale.float()
        n, k = self.codes.shape
        # per block (a grid of one column too, where K <= 128): expand each over its block, crop the padding
        if scale.dim() == 2 and tuple(scale.shape) != (n, 1):
            scale = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:n, :k]
        return (self.codes.float() * scale).to(dtype)


def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    scale = amax / torch.tensor(FP8_MAX, dtype=amax.dtype)
    eps = torch.tensor(torch.finfo(amax.dtype).eps, dtype=amax.dtype)
    return torch.where(scale == 0, eps, scale)


def _codes(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.clamp(weight / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _check(weight: torch.Tensor, module: str) -> None:
    if weight.dim() != 2 or not weight.dtype.is_floating_point or weight.dtype.itemsize == 1:
        raise Fp4kitError(f"{module}: an FP8 scheme needs a 2-D bf16/fp16/fp32 weight, got {weight.dtype} "
                          f"{list(weight.shape)}")
    if not torch.isfinite(weight).all():
        raise Fp4kitError(f"{module}: weight holds non-finite values")


def quantize_fp8_channel(weight: torch.Tensor, module: str = "weight") -> Fp8Weight:
    """fp8-dynamic's weight: one scale per output channel."""
    _check(weight, module)
    amax = weight.abs().amax(dim=1, keepdim=True)
    scale = _scale_from_amax(amax)
    return Fp8Weight(_codes(weight, scale), scale)


def quantize_fp8_block(weight: torch.Tensor, module: str = "weight") -> Fp8Weight:
    """fp8-block's weight: one scale per 128x128 block (partial edge blocks as compressed-tensors pads them)."""
    _check(weight, module)
    n, k = weight.shape
    rows, cols = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    padded = torch.zeros(rows * FP8_BLOCK, cols * FP8_BLOCK, dtype=weight.dtype)
    padded[:n, :k] = weight
    blocks = padded.unflatten(0, (rows, FP8_BLOCK)).unflatten(2, (cols, FP8_BLOCK))  # [r, 128, c, 128]
    amax = blocks.abs().amax(dim=(1, 3))
    scale = _scale_from_amax(amax)
    expanded = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:n, :k]
    return Fp8Weight(_codes(weight, expanded), scale)


def quantize_fp8_tensor(weight: torch.Tensor, module: str = "weight") -> Fp8Weight:
    """fp8-static's weight: one scale for the whole tensor."""
    _check(weight, module)
    scale = _scale_from_amax(weight.abs().amax().reshape(1))
    return Fp8Weight(_codes(weight, scale), scale)


def quantize_fp8(weight: torch.Tensor, scheme: str, module: str = "weight") -> Fp8Weight:
    if scheme == "fp8-dynamic":
        return quantize_fp8_channel(weight, module)
    if scheme == "fp8-block":
        return quantize_fp8_block(weight, module)
    if scheme == "fp8-static":
        return quantize_fp8_tensor(weight, module)
    raise ValueError(f"not an FP8 scheme: {scheme}")


def fp8_scale_shape(scheme: str, out_features: int, in_features: int) -> tuple[int, ...]:
    """The shape of an FP8 weight's scale as quantize_fp8 returns it."""
    if scheme == "fp8-dynamic":
        return (out_features, 1)
    if scheme == "fp8-block":
        return (-(-out_features // FP8_BLOCK), -(-in_features // FP8_BLOCK))
    if scheme == "fp8-static":
        return (1,)
    raise ValueError(f"not an FP8 scheme: {scheme}")


def fp8_input_scale(amax: float) -> torch.Tensor:
    """fp8-static's per-tensor input scale (a divisor, float64) from the calibrated input amax: amax / 448, and 1
    where the module saw no non-zero input (no scale is ever 0)."""
    if not math.isfinite(amax):
        raise Fp4kitError(f"calibration gave a non-finite input amax ({amax})")
    return torch.tensor(amax / FP8_MAX if amax > 0 else 1.0, dtype=torch.float64)


def fake_quantize_fp8_activation(x: torch.Tensor, scheme: str, input_scale_div: torch.Tensor | None = None
                                 ) -> torch.Tensor:
    """``x`` [..., K] quantized to E4M3 and dequantized (fp32) as vLLM 0.33 quantizes an FP8 Linear's input at run
    time (quantization/input_quant_fp8.py, ``QuantFP8.forward_native``): fp8-dynamic per token, fp8-block per token
    and 128-feature group (dynamic scales amax / 448, floored at ``MIN_DYNAMIC_SCALE``), fp8-static with the stored
    per-tensor input scale ``input_scale_div``."""
    xf = x.float()
    if scheme == "fp8-block":
        k = xf.shape[-1]
        groups = -(-k // ACTIVATION_GROUP)
        padded = torch.nn.functional.pad(xf, (0, groups * ACTIVATION_GROUP - k)).unflatten(-1, (groups,
                                                                                               ACTIVATION_GROUP))
        scale = (padded.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_DYNAMIC_SCALE)
        codes = (padded / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return (codes.float() * scale).flatten(-2)[..., :k]
    if scheme == "fp8-dynamic":
        scale = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_DYNAMIC_SCALE)
    elif scheme == "fp8-static":
        if input_scale_div is None:
            raise ValueError("fp8-static activations need the stored input scale")
        scale = input_scale_div.float().reshape(())
    else:
        raise ValueError(f"not an FP8 scheme: {scheme}")
    codes = (xf * scale.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.float() * scale


def fp8_kv_scale(amax: float, where: str = "KV cache") -> torch.Tensor:
    """A per-tensor FP8 KV-cache scale (a divisor, fp32 scalar) from the calibrated amax of a layer's keys or values:
    amax / 448 in fp32, as ModelOpt's export writes it (``postprocess_state_dict``: ``_amax.float() / 448``); 1 where
    the layer saw no non-zero key or value (no scale is ever 0, and vLLM reads a scale <= 0 as absent)."""
    if not math.isfinite(amax):
        raise Fp4kitError(f"{where}: calibration gave a non-finite amax ({amax})")
    return torch.tensor(amax, dtype=torch.float32) / FP8_MAX if amax > 0 else torch.tensor(1.0)


def fake_quantize_fp8_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Keys or values written to an FP8 E4M3 cache with per-tensor ``scale`` and read back (fp32), as vLLM 0.33's
    CUDA cache writes them (csrc/quantization/w8a8/fp8/nvidia/quant_utils.cuh, ``scaled_vec_conversion``: x / scale
    cast with ``__NV_SATFINITE``) and its attention kernels dequantize them (code x scale)."""
    scale = scale.float().reshape(())
    codes = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.float() * scale
