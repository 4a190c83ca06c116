"""vLLM's Marlin NVFP4 MoE (W4A16) as a verify backend: its own ops, fed the Marlin layout fp4kit writes.

The kernels are vLLM 0.33's CUDA ops, looked up where vLLM's Python code looks them up (``torch.ops._moe_C`` and
``torch.ops._C``). They get there in one of two ways:

- vLLM is installed with its compiled extensions: importing ``vllm._custom_ops`` loads them, and the runner calls
  vLLM's own ``fused_marlin_moe`` (vllm/model_executor/layers/fused_moe/experts/marlin_moe.py).
- ``scripts/device_build_vllm_marlin_moe.py`` built just these ops from vLLM 0.33's source (a machine without vLLM's
  wheel); the library it names in ``FP4KIT_VLLM_MARLIN_OPS`` is loaded, and the runner calls the ops in the order
  ``fused_marlin_moe`` calls them (:func:`marlin_moe_ops`): align, GEMM 1, SiLU-and-mul, GEMM 2, sum over top-k.
  A test runs both against one set of CPU ops and asserts the same bits, so the two paths stay one function.

Either way the runner allocates vLLM's lock workspace itself (``sms * MARLIN_MAX_BLOCKS_PER_SM`` int32 zeros, what
``marlin_make_workspace_new`` gives when no workspace manager is running) and passes the global scales of
``fp4kit.layouts.marlin`` (the weight divisor times 2^119 over the scale factor, for bf16 activations).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

OPS_LIBRARY_ENV = "FP4KIT_VLLM_MARLIN_OPS"
# what fused_marlin_moe calls, by namespace
OPS = (("_moe_C", "moe_wna16_marlin_gemm"), ("_moe_C", "moe_align_block_size"), ("_moe_C", "moe_sum"),
       ("_C", "silu_and_mul"))
MAX_BLOCKS_PER_SM = 4  # vLLM marlin_utils.MARLIN_MAX_BLOCKS_PER_SM: the kernel's lock count per multiprocessor
BLOCK_SIZES_M = (8, 16, 32, 48, 64)  # fused_marlin_moe's candidate M tiles, smallest first
MARLIN_TILE = 16


@dataclass(frozen=True)
class MarlinOps:
    """How the ops were found: ``source`` says where from, ``vllm`` whether vLLM's own Python entry point runs."""

    source: str
    vllm: bool


def registered(namespace: str, name: str) -> bool:
    try:
        getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def missing_ops() -> list[str]:
    return [f"{ns}::{name}" for ns, name in OPS if not registered(ns, name)]


def _vllm_entry_point() -> bool:
    try:
        from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe  # noqa: F401
    except Exception:  # vLLM absent, or installed without the modules its imports need
        return False
    return True


def find_ops() -> tuple[MarlinOps | None, str]:
    """The ops fused_marlin_moe needs, loading them if they can be loaded; (None, why not) otherwise."""
    if missing_ops():
        try:
            import vllm._custom_ops  # noqa: F401  (loads vllm._C and vllm._moe_C where they were built)
        except Exception:
            pass
    source = "vLLM's compiled extensions"
    library = os.environ.get(OPS_LIBRARY_ENV)
    if library and (missing_ops() or os.path.realpath(library) in map(os.path.realpath, torch.ops.loaded_libraries)):
        if not os.path.isfile(library):
            return None, f"{OPS_LIBRARY_ENV}={library}: no such file"
        try:
            torch.ops.load_library(library)  # a no-op when this process loaded it already
        except Exception as exc:
            return None, f"{OPS_LIBRARY_ENV}={library} does not load: {exc}"[:300]
        source = f"vLLM 0.33 ops built from source ({os.path.basename(library)})"
    missing = missing_ops()
    if missing:
        where = f"; {OPS_LIBRARY_ENV} names none" if not library else ""
        return None, f"vLLM's Marlin MoE ops are not registered ({', '.join(missing)}){where}"
    vllm = _vllm_entry_point()
    return MarlinOps(source, vllm), f"{source}, {'vLLM fused_marlin_moe' if vllm else 'fused_marlin_moe order'}"


def workspace(device: torch.device) -> Tensor:
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return torch.zeros(sms * MAX_BLOCKS_PER_SM, dtype=torch.int32, device=device)


def expert_map_of(local_to_global: list[int], num_experts: int, device: torch.device) -> Tensor:
    """vLLM's ``expert_map``: int32 [global E], the local index of each expert this rank holds, -1 elsewhere."""
    expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
    expert_map[torch.tensor(local_to_global, dtype=torch.long)] = torch.arange(len(local_to_global),
                                                                               dtype=torch.int32)
    return expert_map.to(device)


def block_size_m(num_tokens: int, top_k: int, local_experts: int, global_experts: int) -> int:
    """fused_marlin_moe's M tile: the smallest whose expected fill per local expert is under 0.9 tiles, using the
    tokens a rank expects to hold (M * E_local / E_global) under EP."""
    tokens = num_tokens if local_experts == global_experts else math.ceil(num_tokens * local_experts / global_experts)
    for size in BLOCK_SIZES_M:
        if tokens * top_k / local_experts / size < 0.9:
            return size
    return BLOCK_SIZES_M[-1]


def align(topk_ids: Tensor, block: int, num_experts: int, expert_map: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """``moe_align_block_size`` with vLLM's buffer sizes (ignore_invalid_experts: a rank's foreign experts are left
    out of the sorted ids, not marked -1)."""
    slots = topk_ids.numel()
    padded = slots + num_experts * (block - 1)
    if slots < num_experts:
        padded = min(slots * block, padded)
    sorted_ids = torch.empty(padded, dtype=torch.int32, device=topk_ids.device)
    expert_ids = torch.empty(-(-padded // block), dtype=torch.int32, device=topk_ids.device)
    total = torch.empty(1, dtype=torch.int32, device=topk_ids.device)
    torch.ops._moe_C.moe_align_block_size(topk_ids, num_experts, block, sorted_ids, expert_ids, total, expert_map,
                                          None)
    return sorted_ids, expert_ids, total


def marlin_moe_ops(hidden: Tensor, weights: dict[str, Tensor], topk_weights: Tensor, topk_ids: Tensor,
                   quant_type_id: int, global_num_experts: int, expert_map: Tensor | None,
                   apply_router_weight_on_input: bool, lock_workspace: Tensor) -> Tensor:
    """vLLM's fused_marlin_moe for bf16/fp16 activations, SiLU, no bias or zero points, as a sequence of its ops."""
    num_tokens, hidden_size = hidden.shape
    w1, w2 = weights["w1"], weights["w2"]
    local_experts, top_k = w1.shape[0], topk_ids.shape[1]
    intermediate = w2.shape[1] * MARLIN_TILE
    block = block_size_m(num_tokens, top_k, local_experts, global_num_experts)
    sorted_ids, expert_ids, total = align(topk_ids, block, global_num_experts, expert_map)
    rows = num_tokens * top_k
    gemm = torch.ops._moe_C.moe_wna16_marlin_gemm

    def matmul(a: Tensor, c: Tensor, w: Tensor, scale: Tensor, global_scale: Tensor, k: int, mul_weights: bool,
               size_m: int, size_n: int, size_k: int) -> Tensor:
        # positional, in the op schema's order: a, c, b_q_weight, b_bias, b_scales, a_scales, global_scale,
        # b_zeros, workspace, sorted_token_ids, expert_ids, num_tokens_past_padded, topk_weights, moe_block_size,
        # top_k, mul_topk_weights, b_type_id, size_m, size_n, size_k, use_atomic_add, use_fp32_reduce,
        # is_zp_float, thread_k, thread_n, blocks_per_sm
        return gemm(a, c, w, None, scale, None, global_scale, None, lock_workspace, sorted_ids, expert_ids, total,
                    topk_weights, block, k, mul_weights, quant_type_id, size_m, size_n, size_k, False, True, False,
                    -1, -1, -1)

    gate_up = torch.empty(rows, 2 * intermediate, dtype=hidden.dtype, device=hidden.device)
    gate_up = matmul(hidden, gate_up, w1, weights["w1_scale"], weights["global_scale1"], top_k,
                     apply_router_weight_on_input, num_tokens, 2 * intermediate, hidden_size)
    activated = torch.empty(rows, intermediate, dtype=hidden.dtype, device=hidden.device)
    torch.ops._C.silu_and_mul(activated, gate_up)
    down = torch.empty(rows, hidden_size, dtype=hidden.dtype, device=hidden.device)
    down = matmul(activated, down, w2, weights["w2_scale"], weights["global_scale2"], 1,
                  not apply_router_weight_on_input, rows, hidden_size, intermediate)
    out = torch.empty_like(hidden)
    if expert_map is None:
        return torch.sum(down.view(num_tokens, top_k, hidden_size), dim=1, out=out)
    torch.ops._moe_C.moe_sum(down.view(num_tokens, top_k, hidden_size), out, topk_ids, expert_map)
    return out


MarlinCall = Callable[[Tensor, Tensor, Tensor], Tensor]


def marlin_call(ops: MarlinOps, weights: dict[str, Tensor], quant_type_id: int, global_num_experts: int,
                expert_map: Tensor | None, apply_router_weight_on_input: bool, device: torch.device,
                use_vllm: bool | None = None) -> MarlinCall:
    """``(hidden bf16 [T, H], topk_weights fp32, topk_ids int32) -> [T, H]`` through vLLM's fused_marlin_moe when
    its Python code imports (``use_vllm`` forces a path), else through :func:`marlin_moe_ops`."""
    locks = workspace(device)
    arguments = dict(quant_type_id=quant_type_id, global_num_experts=global_num_experts, expert_map=expert_map,
                     apply_router_weight_on_input=apply_router_weight_on_input)
    if ops.vllm if use_vllm is None else use_vllm:
        from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe

        def run_vllm(hidden: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
            return fused_marlin_moe(hidden, bias1=None, bias2=None, topk_weights=topk_weights, topk_ids=topk_ids,
                                    workspace=locks, **weights, **arguments)

        return run_vllm

    def run_ops(hidden: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        return marlin_moe_ops(hidden, weights, topk_weights, topk_ids, lock_workspace=locks, **arguments)

    return run_ops
