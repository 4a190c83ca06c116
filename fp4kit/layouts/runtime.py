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

Each backend module builds its own arguments (``kernel_arguments``). ``read_layer`` gives the stored tensors
and the LayoutMeta, for ``fp4kit.layouts.<backend>.undo``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from fp4kit.errors import Fp4kitError
from fp4kit.io.checkpoint import DTYPES, CheckpointReader
from fp4kit.layouts import LayoutMeta
from fp4kit.layouts.manifest import layer_meta, layer_record, read_manifest
from fp4kit.layouts.marlin import FLOAT4_E2M1F_ID  # noqa: F401  (re-exported: callers of the Marlin arguments)
from fp4kit.registry import backend as registered_backend


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


def load_moe_layer(path: str | os.PathLike, layer: int, backend: str, device: str | torch.device = "cpu"
                   ) -> dict[str, object]:
    """The layer's keyword arguments for ``backend``'s kernel (module docstring), tensors on ``device``."""
    path = Path(path)
    tensors, meta, document = read_layer(path, layer)
    if backend != document["backend"]:
        raise Fp4kitError(f"{path} holds a {document['backend']} layout, not {backend}")
    tensors = {name: t.to(device) for name, t in tensors.items()}
    return registered_backend(backend).kernel_arguments(tensors, meta, document, layer_record(document, layer), path,
                                                        device)
