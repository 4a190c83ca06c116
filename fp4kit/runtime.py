"""Load one MoE layer of a layout checkpoint (`fp4kit layout`) as the keyword arguments of its kernel call.

``load_moe_layer`` returns every argument of the kernel that belongs to the layer; the per-call ones (hidden states
and their scales, router logits or top-k ids and weights, output buffers) are the caller's:

- ``trtllm``: FlashInfer ``trtllm_fp4_block_scale_moe``: the four weight / block-scale tensors and three per-expert
  scalars, ``num_experts``, ``intermediate_size`` (padded), ``valid_hidden_size``, ``valid_intermediate_size``,
  ``local_expert_offset``, ``local_num_experts``, the biases/alpha/beta/clamp (None), ``routing_bias`` (GLM's
  ``mlp.gate.e_score_correction_bias`` when the layer has one, else None) and, when config.json names a family
  fp4kit knows, the routing: ``top_k``, ``n_group``, ``topk_group``, ``routed_scaling_factor``,
  ``routing_method_type``.
- ``cutlass`` (flashinfer flavor): FlashInfer ``cutlass_fused_moe``: ``fc1_expert_weights``, ``fc2_expert_weights``,
  ``quant_scales`` (the six NVFP4 tensors in the binding's order) and ``output_dtype`` (the layout's act dtype).
  vllm flavor: the eight tensors of vLLM ``cutlass_moe_fp4`` under its parameter names.
- ``marlin``: vLLM ``fused_marlin_moe``: ``w1``, ``w2``, ``w1_scale``, ``w2_scale``, ``global_scale1``,
  ``global_scale2`` (fp32, as recent vLLM's ``moe_wna16_marlin_gemm`` checks), ``bias1`` / ``bias2`` (None),
  ``quant_type_id`` (vLLM's ``scalar_types.float4_e2m1f.id``) and ``global_num_experts``.

``read_layer`` gives the stored tensors and the LayoutMeta, for ``fp4kit.layouts.<backend>.undo``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from fp4kit.checkpoint import DTYPES, CheckpointReader, read_config
from fp4kit.errors import Fp4kitError
from fp4kit.layout_manifest import layer_meta, layer_record, read_manifest
from fp4kit.layouts import LayoutMeta, trtllm

# flashinfer.tllm_enums.RoutingMethodType, per fp4kit routing kind (and renormalize)
_ROUTING_METHOD = {("softmax_topk", True): 4, ("softmax_topk", False): 0, ("sigmoid_grouped_topk", True): 2,
                   ("llama4_sigmoid_top1", True): 3, ("llama4_sigmoid_top1", False): 3}
# FlashInfer's cutlass binding reads the NVFP4 quant_scales list in this order (flashinfer_cutlass_fused_moe_binding.cu)
CUTLASS_QUANT_SCALES = ("fc1_act_global_scale", "fc1_weight_block_scale", "fc1_dequant_scale",
                        "fc2_act_global_scale", "fc2_weight_block_scale", "fc2_dequant_scale")


def scalar_type_id(exponent: int, mantissa: int, signed: bool, bias: int, finite_values_only: bool,
                   nan_repr: int) -> int:
    """vLLM's ``ScalarType.id``: the fields packed into one int64 (vllm/scalar_type.py), as its custom ops take."""
    fields = ((exponent, 8), (mantissa, 8), (int(signed), 1), (bias, 32), (int(finite_values_only), 1), (nan_repr, 8))
    value = offset = 0
    for member, width in fields:
        value |= (member & ((1 << width) - 1)) << offset
        offset += width
    return value


# scalar_types.float4_e2m1f = ScalarType.float_(2, 1, finite_values_only=True, NanRepr.NONE = 0)
FLOAT4_E2M1F_ID = scalar_type_id(2, 1, True, 0, True, 0)


def read_layer(path: str | os.PathLike, layer: int) -> tuple[dict[str, torch.Tensor], LayoutMeta, dict]:
    """(kernel argument name -> stored tensor, the layer's LayoutMeta, the whole manifest), checked against it."""
    document = read_manifest(path)
    entry = layer_record(document, layer)
    meta = layer_meta(document, entry)
    tensors = {}
    try:
        specs = {argument: (str(spec["name"]), spec["dtype"], list(spec["shape"]))
                 for argument, spec in entry["tensors"].items()}
    except (KeyError, TypeError, AttributeError):
        raise Fp4kitError(f"layout manifest: layer {layer}'s tensors table is malformed") from None
    with CheckpointReader(path) as reader:
        for argument, (name, dtype, shape) in specs.items():
            if name not in reader:
                raise Fp4kitError(f"{path}: tensor {name} of layer {layer} is missing from the shards")
            info = reader.info(name)
            if info.dtype != DTYPES.get(dtype) or list(info.shape) != shape:
                raise Fp4kitError(f"{name}: {info.dtype} {list(info.shape)} on disk, the manifest says {dtype} {shape}")
            tensors[argument] = reader.read(name)
    return tensors, meta, document


def _routing_bias(path: str | os.PathLike, experts: str) -> torch.Tensor | None:
    """GLM's selection bias (`<moe>.gate.e_score_correction_bias`), which the TRT-LLM-gen router takes."""
    name = f"{experts.rsplit('.', 1)[0]}.gate.e_score_correction_bias"
    with CheckpointReader(path) as reader:
        return reader.read(name) if name in reader else None


def _routing(path: str | os.PathLike) -> dict[str, object]:
    from fp4kit.families import detect

    config = read_config(path)
    try:
        family = detect(config)
        spec = family.routing(family.text_config(config))
    except (Fp4kitError, KeyError, TypeError, ValueError):
        return {}
    grouped = spec.kind == "sigmoid_grouped_topk"
    method = _ROUTING_METHOD.get((spec.kind, spec.renormalize))
    if method is None:
        raise Fp4kitError(f"TRT-LLM-gen routing has no method for {spec.kind} with renormalize={spec.renormalize}")
    return {"top_k": spec.top_k, "n_group": spec.n_group if grouped else None,
            "topk_group": spec.topk_group if grouped else None,
            "routed_scaling_factor": spec.routed_scaling_factor if grouped else None, "routing_method_type": method}


def _trtllm(path: str | os.PathLike, tensors: dict[str, torch.Tensor], meta: LayoutMeta, experts: str,
            device: str | torch.device) -> dict[str, object]:
    bias = _routing_bias(path, experts)
    return {
        **tensors,
        "routing_bias": None if bias is None else bias.to(device),
        "gemm1_bias": None, "gemm1_alpha": None, "gemm1_beta": None, "gemm1_clamp_limit": None, "gemm2_bias": None,
        "num_experts": meta.num_experts,
        **trtllm.call_arguments(meta, ep_rank=0),
        **_routing(path),
    }


def _cutlass(tensors: dict[str, torch.Tensor], document: dict) -> dict[str, object]:
    if "fc1_expert_weights" not in tensors:  # vLLM flavor: its parameter names are the tensor names
        return dict(tensors)
    return {
        "fc1_expert_weights": tensors["fc1_expert_weights"],
        "fc2_expert_weights": tensors["fc2_expert_weights"],
        "quant_scales": [tensors[name] for name in CUTLASS_QUANT_SCALES],
        "output_dtype": {"bfloat16": torch.bfloat16, "float16": torch.float16}[document["act_dtype"]],
    }


def _marlin(tensors: dict[str, torch.Tensor], meta: LayoutMeta) -> dict[str, object]:
    return {**tensors, "bias1": None, "bias2": None, "quant_type_id": FLOAT4_E2M1F_ID,
            "global_num_experts": meta.num_experts}


def load_moe_layer(path: str | os.PathLike, layer: int, backend: str, device: str | torch.device = "cpu"
                   ) -> dict[str, object]:
    """The layer's keyword arguments for ``backend``'s kernel (module docstring), tensors on ``device``."""
    path = Path(path)
    tensors, meta, document = read_layer(path, layer)
    if backend != document["backend"]:
        raise Fp4kitError(f"{path} holds a {document['backend']} layout, not {backend}")
    tensors = {name: t.to(device) for name, t in tensors.items()}
    if backend == "trtllm":
        return _trtllm(path, tensors, meta, layer_record(document, layer)["module"], device)
    return _cutlass(tensors, document) if backend == "cutlass" else _marlin(tensors, meta)
