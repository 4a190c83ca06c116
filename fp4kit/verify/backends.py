"""The MoE backends `fp4kit verify` can run, each dispatched by what the device can do (docs/verify.md).

A backend is ``available(device) -> (ok, reason)`` plus ``prepare(moe, activation_div, device)``, which returns a
runner ``(hidden, weights, ids, logits) -> fp32 [T, H]`` over one layer's weights (prepared once per layer). Routing
is always fp4kit's (`fp4kit.families.routing.route`), except for TRT-LLM-gen, which routes inside the kernel from the
logits.

- ``reference``: `fp4kit.verify.reference.moe_reference` on the dequantized weights, fp32, any device.
- ``triton``: fp4kit's fused NVFP4 MoE on any CUDA GPU; on a CPU under TRITON_INTERPRET=1 for tiny shapes only.
- ``flashinfer-cutlass``: FlashInfer ``cutlass_fused_moe`` (NVFP4 W4A4), sm100 / sm120 with flashinfer installed.
- ``flashinfer-trtllm``: FlashInfer ``trtllm_fp4_block_scale_moe``, sm100 family only.
- ``marlin``: vLLM's Marlin NVFP4 MoE (W4A16), sm75+ with vLLM's ops registered (`fp4kit.verify.vllm_marlin`).
The FlashInfer and Marlin runners take their weights from `fp4kit.layouts` transforms of the canonical layer; no
machine here has run the FlashInfer ones (they need sm100), so a failure of theirs is reported, not hidden.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from fp4kit.families.routing import RoutingSpec
from fp4kit.nvfp4 import NVFP4Tensor
from fp4kit.verify.ambiguity import RECIPROCAL_EPS
from fp4kit.verify.moe_layer import QuantizedMoe
from fp4kit.verify.triton_moe import triton_interpreter_active

Runner = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
ActivationDiv = tuple[Tensor, Tensor] | None
# Under the interpreter every Triton program runs in Python: keep CPU runs to a few hundred (token, expert) pairs.
INTERPRETER_MAX_PAIRS = 64
INTERPRETER_MAX_DIM = 512


def _capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def enable_triton_interpreter() -> None:
    """Set TRITON_INTERPRET=1 for CPU runs. Triton decides when a @triton.jit function is defined whether it is
    compiled or interpreted, for its own standard library (tl.zeros and the like) as for fp4kit's kernels, so the
    switch only works before triton.language is first imported: set later, it would mix the two modes and the
    interpreted kernels would crash calling the compiled tl.zeros."""
    if "triton.language" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")


@dataclass(frozen=True)
class Backend:
    name: str
    description: str
    modes: tuple[str, ...] = ("w4a16", "w4a4")  # the arithmetic the kernel runs
    # W4A4: relative uncertainty of the GEMM1 input values it rounds, against the reference's (fp4kit.verify.ambiguity)
    input_rounding_eps: float = RECIPROCAL_EPS

    def available(self, device: torch.device) -> tuple[bool, str]:
        return _AVAILABLE[self.name](device)

    def fits(self, device: torch.device, num_tokens: int, moe: QuantizedMoe, spec: RoutingSpec) -> tuple[bool, str]:
        """Whether this token count and layer shape can run here (the interpreter is only for tiny shapes)."""
        if self.name == "flashinfer-cutlass" and spec.scales_input:
            return False, "Llama-4's input-side routing weight is not wired to cutlass_fused_moe"
        if self.name not in ("reference", "triton") and (moe.biases is not None or moe.activation.kind != "silu"):
            return False, f"expert biases and {moe.activation.kind} are not wired to this kernel"
        if self.name == "marlin":
            from fp4kit.layouts.marlin import shape_problems

            problems = shape_problems(moe.w13.shape[2], moe.w2.shape[2])
            if problems:
                return False, f"Marlin MoE tiles: {'; '.join(problems)}"
        if self.name == "triton" and device.type == "cpu":
            hidden, inter = moe.w13.shape[2], moe.w2.shape[2]
            if num_tokens * spec.top_k > INTERPRETER_MAX_PAIRS or max(hidden, inter) > INTERPRETER_MAX_DIM:
                return False, "too large for the Triton interpreter on a CPU"
        return True, ""

    def prepare(
        self, moe: QuantizedMoe, spec: RoutingSpec, activation_div: ActivationDiv, device: torch.device
    ) -> Runner:
        return _PREPARE[self.name](moe, spec, activation_div, device)


def _reference_available(device: torch.device) -> tuple[bool, str]:
    return True, f"fp32 torch on {device.type}"


def _triton_available(device: torch.device) -> tuple[bool, str]:
    if not _importable("triton"):
        return False, "triton not installed"
    if device.type == "cuda":
        major, minor = _capability(device) or (0, 0)
        return (True, f"compiled, sm{major}{minor}") if major >= 8 else (False, f"sm{major}{minor}: Triton needs sm80+")
    if not triton_interpreter_active():
        return False, "no GPU, and Triton was imported before TRITON_INTERPRET=1 could be set"
    return True, "TRITON_INTERPRET=1 on the CPU (tiny shapes only)"


def _flashinfer_available(families: tuple[int, ...], what: str) -> Callable[[torch.device], tuple[bool, str]]:
    def available(device: torch.device) -> tuple[bool, str]:
        capability = _capability(device)
        if capability is None:
            return False, "no GPU: needs an NVFP4 tensor-core GPU"
        major, minor = capability
        if major not in families:
            return False, f"sm{major}{minor}: no NVFP4 tensor cores ({what})"
        if not _importable("flashinfer"):
            return False, "flashinfer not installed"
        return True, f"sm{major}{minor}"

    return available


def _marlin_available(device: torch.device) -> tuple[bool, str]:
    from fp4kit.verify.vllm_marlin import OPS_LIBRARY_ENV, find_ops

    capability = _capability(device)
    if capability is None:
        return False, "no GPU: Marlin needs CUDA sm75+"
    if capability < (7, 5):
        return False, f"sm{capability[0]}{capability[1]}: Marlin needs sm75+"
    if not _importable("vllm") and not os.environ.get(OPS_LIBRARY_ENV):
        return False, (f"vllm not installed, and {OPS_LIBRARY_ENV} names no library of its ops "
                       "(scripts/device_build_vllm_marlin_moe.py builds one)")
    ops, reason = find_ops()
    return ops is not None, f"sm{capability[0]}{capability[1]}, {reason}" if ops else reason


def dequantized(moe: QuantizedMoe, device: torch.device) -> tuple[Tensor, Tensor]:
    from fp4kit.verify.reference import dequantize_experts

    w13 = dequantize_experts(_to(moe.w13, device))
    w2 = dequantize_experts(_to(moe.w2, device))
    return w13, w2


def _to(tensor, device: torch.device):
    from fp4kit.nvfp4 import NVFP4Tensor

    return NVFP4Tensor(tensor.packed.to(device), tensor.block_scale.to(device), tensor.global_scale_div.to(device))


def _prepare_reference(
    moe: QuantizedMoe, spec: RoutingSpec, activation_div: ActivationDiv, device: torch.device
) -> Runner:
    from fp4kit.verify.reference import moe_reference

    w13, w2 = dequantized(moe, device)

    def run(hidden: Tensor, weights: Tensor, ids: Tensor, logits: Tensor) -> Tensor:
        return moe_reference(hidden, weights, ids, w13, w2, spec, activation_global_div=activation_div,
                             activation=moe.activation, biases=moe.biases)

    return run


def _prepare_triton(
    moe: QuantizedMoe, spec: RoutingSpec, activation_div: ActivationDiv, device: torch.device
) -> Runner:
    from fp4kit.verify.triton_moe import KernelConfig, TritonMoeWeights, fused_moe

    weights_on_device = TritonMoeWeights.from_nvfp4(moe.w13, moe.w2, activation_div, device=device,
                                                    activation=moe.activation, biases=moe.biases)
    # interpreted, every program costs Python time: few large tiles (compiled, the kernel picks its own)
    config = KernelConfig(block_n1=64, block_n2=128, block_k=128, num_stages=2) if device.type == "cpu" else None

    def run(hidden: Tensor, weights: Tensor, ids: Tensor, logits: Tensor) -> Tensor:
        return fused_moe(hidden.to(torch.bfloat16), weights, ids, weights_on_device, spec, config=config)

    return run


def _prepare_flashinfer_cutlass(
    moe: QuantizedMoe, spec: RoutingSpec, activation_div: ActivationDiv, device: torch.device
) -> Runner:
    from flashinfer import fp4_quantize
    from flashinfer.fused_moe import cutlass_fused_moe

    from fp4kit.layouts import cutlass

    assert activation_div is not None
    tensors = {k: v.to(device) for k, v in cutlass.transform(moe.w13, moe.w2, *activation_div).items()}
    quant_scales = [tensors[name] for name in cutlass.QUANT_SCALES]
    input_gscale = tensors["fc1_act_global_scale"].min()  # one activation scale for the whole input, as engines do

    def run(hidden: Tensor, weights: Tensor, ids: Tensor, logits: Tensor) -> Tensor:
        hidden_fp4, hidden_sf = fp4_quantize(hidden.to(torch.bfloat16), input_gscale, 16, False, True)
        out = cutlass_fused_moe(
            hidden_fp4,
            ids.to(torch.int32),
            weights.float(),
            tensors["fc1_expert_weights"],
            tensors["fc2_expert_weights"],
            torch.bfloat16,
            quant_scales=quant_scales,
            input_sf=hidden_sf,
        )
        return (out[0] if isinstance(out, list | tuple) else out).float()

    return run


def _prepare_flashinfer_trtllm(
    moe: QuantizedMoe, spec: RoutingSpec, activation_div: ActivationDiv, device: torch.device
) -> Runner:
    from flashinfer import fp4_quantize
    from flashinfer.fused_moe import trtllm_fp4_block_scale_moe

    from fp4kit.layouts import trtllm

    assert activation_div is not None
    tensors = {k: v.to(device) for k, v in trtllm.transform(moe.w13, moe.w2, *activation_div).items()}
    meta = trtllm.describe(moe.w13, moe.w2, *activation_div)
    grouped = spec.kind == "sigmoid_grouped_topk"
    bias = moe.router.correction_bias
    input_gscale = (1.0 / activation_div[0].max()).float().to(device)

    def run(hidden: Tensor, weights: Tensor, ids: Tensor, logits: Tensor) -> Tensor:
        hidden_fp4, hidden_sf = fp4_quantize(hidden.to(torch.bfloat16), input_gscale, 16, False, False)
        out = trtllm_fp4_block_scale_moe(
            routing_logits=logits.float() if grouped else logits.to(torch.bfloat16),
            routing_bias=None if bias is None else bias.to(device, torch.bfloat16),
            hidden_states=hidden_fp4,
            hidden_states_scale=hidden_sf.view(torch.float8_e4m3fn).reshape(hidden_fp4.shape[0], -1),
            **tensors,
            gemm1_bias=None,
            gemm1_alpha=None,
            gemm1_beta=None,
            gemm1_clamp_limit=None,
            gemm2_bias=None,
            num_experts=moe.num_experts,
            top_k=spec.top_k,
            n_group=spec.n_group if grouped else None,
            topk_group=spec.topk_group if grouped else None,
            routed_scaling_factor=spec.routed_scaling_factor if grouped else None,
            routing_method_type=trtllm.ROUTING_METHOD[(spec.kind, spec.renormalize)],
            **trtllm.call_arguments(meta),
        )
        return (out[0] if isinstance(out, list | tuple) else out).float()

    return run


def _prepare_marlin(
    moe: QuantizedMoe, spec: RoutingSpec, activation_div: ActivationDiv, device: torch.device
) -> Runner:
    from fp4kit.layouts.marlin import shape_problems

    problems = shape_problems(moe.w13.shape[2], moe.w2.shape[2])
    if problems:  # `fits` skips every batch of this layer: the runner is never called

        def unfit(hidden: Tensor, weights: Tensor, ids: Tensor, logits: Tensor) -> Tensor:
            raise RuntimeError(f"Marlin MoE tiles: {'; '.join(problems)}")

        return unfit
    return marlin_runner(moe.w13, moe.w2, list(range(moe.num_experts)), moe.num_experts, spec, device)


def marlin_runner(w13: NVFP4Tensor, w2: NVFP4Tensor, local_to_global: list[int], num_experts: int,
                  spec: RoutingSpec, device: torch.device, expert_map: bool = False) -> Runner:
    """vLLM's Marlin MoE over the experts ``local_to_global`` (global ids of w13/w2's rows, in order) of a layer
    of ``num_experts``; with ``expert_map``, as one EP rank: vLLM's expert_map, and foreign experts' rows left out
    of the sum. Weights in the Marlin layout fp4kit writes (`fp4kit.layouts.marlin`, bf16 activations)."""
    from fp4kit.layouts import marlin
    from fp4kit.verify.vllm_marlin import expert_map_of, find_ops, marlin_call

    ops, reason = find_ops()
    if ops is None:
        raise RuntimeError(reason)
    tensors = {k: v.to(device) for k, v in marlin.transform(w13, w2, None, None, act_dtype=torch.bfloat16).items()}
    mapping = expert_map_of(local_to_global, num_experts, device) if expert_map else None
    call = marlin_call(ops, tensors, marlin.FLOAT4_E2M1F_ID, num_experts, mapping, spec.scales_input, device)

    def run(hidden: Tensor, weights: Tensor, ids: Tensor, logits: Tensor) -> Tensor:
        return call(hidden.to(torch.bfloat16).contiguous(), weights.float().contiguous(),
                    ids.to(torch.int32).contiguous()).float()

    return run


_AVAILABLE: dict[str, Callable[[torch.device], tuple[bool, str]]] = {
    "reference": _reference_available,
    "triton": _triton_available,
    "flashinfer-cutlass": _flashinfer_available((10, 12), "FlashInfer CUTLASS NVFP4 needs sm100 or sm120"),
    "flashinfer-trtllm": _flashinfer_available((10,), "TRT-LLM-gen needs the sm100 family"),
    "marlin": _marlin_available,
}
_PREPARE = {
    "reference": _prepare_reference,
    "triton": _prepare_triton,
    "flashinfer-cutlass": _prepare_flashinfer_cutlass,
    "flashinfer-trtllm": _prepare_flashinfer_trtllm,
    "marlin": _prepare_marlin,
}

BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("reference", "fp32 torch reference on the dequantized weights"),
        # the Triton kernel rounds its input with the reference's IEEE operations (div_rn): bit-identical
        Backend("triton", "fp4kit's Triton fused NVFP4 MoE", input_rounding_eps=0.0),
        Backend("flashinfer-cutlass", "FlashInfer cutlass_fused_moe (NVFP4)", modes=("w4a4",)),
        Backend("flashinfer-trtllm", "FlashInfer trtllm_fp4_block_scale_moe", modes=("w4a4",)),
        Backend("marlin", "vLLM fused_marlin_moe (FP4 W4A16)", modes=("w4a16",)),
    )
}

# the backend that runs one EP rank the way the engine does, with its expert_map
EXPERT_MAP_BACKEND = "marlin"
