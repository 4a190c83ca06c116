"""Backend layouts: pure functions from one MoE layer's canonical NVFP4 weights to the tensors a kernel reads,
each with an exact inverse (docs/layouts.md).

Every backend module (registered in fp4kit/registry.py: ``cutlass``, ``trtllm``, ``marlin``) exposes the same
functions. The layout itself:

- ``check_shapes(E, H, I, ep=1, **options)`` raises :class:`~fp4kit.errors.Fp4kitError` when the kernel cannot run
  the shape;
- ``transform(w13, w2, input_scale_div13, input_scale_div2, **opts, out=None) -> dict[str, Tensor]``, named by
  the kernel's argument names; ``out`` (name -> contiguous tensor of the result's dtype and shape, for any subset of
  the names) receives those results in place, e.g. tensors mapped onto the output file (``ShardWriter.destination``);
- ``describe(...)`` (same arguments) -> :class:`LayoutMeta`, what ``undo`` needs that the kernel tensors do not
  carry: the true sizes and the float64 global scales (the kernel's fp32 products cannot give them back);
- ``undo(tensors, meta) -> (w13, w2, input_scale_div13, input_scale_div2)``, the canonical form bit for bit.
  ``undo`` also checks that the per-expert scalars and the padding in ``tensors`` are what ``transform`` writes,
  so it doubles as a verifier of a stored layout.

What fp4kit's commands ask of it:

- ``W4A4``: whether the kernel quantizes activations (it then needs the checkpoint's input scales);
- ``layout_options(act_dtype, flavor)`` -> the keyword options of its ``check_shapes`` / ``transform`` /
  ``describe`` for `fp4kit layout`'s options (an Fp4kitError for a combination it cannot run);
- ``shape_problems(hidden, intermediate)`` -> why the kernel cannot run these sizes (empty: it can), for verify;
- ``padded_sizes(hidden, intermediate)`` and ``manifest_kernel(options)`` -> what fp4kit_layout.json records
  (fp4kit/layouts/manifest.py): the kernel function, its library and description, how the gate/up input divisor is
  chosen, the formulas of its scalars, and (``options``, when any) the layout options that select the kernel;
- ``kernel_arguments(tensors, meta, document, entry, root, device)`` -> the layer's keyword arguments of the
  kernel call, from a stored layout (fp4kit/layouts/runtime.py).

w13 is [E, 2I, H] in [w1; w3] (gate first) row order, w2 is [E, H, I]; both stacked NVFP4Tensors with a float64
[E] divisor global scale. Input scales are float64 [E] divisors (or None for weight-only use).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch

from fp4kit.errors import Fp4kitError
from fp4kit.families.base import largest_amax
from fp4kit.nvfp4 import BLOCK, NVFP4Tensor


@dataclass(frozen=True)
class StackedExperts:
    """One MoE layer's routed experts in canonical form: what a layout transforms and undoes, and what verify
    computes with. Input divisors are None for a weight-only checkpoint."""

    w13: NVFP4Tensor  # [E, 2I, H], gate rows then up rows
    w2: NVFP4Tensor  # [E, H, I]
    input_scale_div13: torch.Tensor | None  # float64 [E]
    input_scale_div2: torch.Tensor | None  # float64 [E]

    @property
    def num_experts(self) -> int:
        return self.w13.packed.shape[0]

    def arguments(self) -> tuple[NVFP4Tensor, NVFP4Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The leading positional arguments of a backend's ``transform`` and ``describe``, in their order
        (``undo`` returns the same four)."""
        return self.w13, self.w2, self.input_scale_div13, self.input_scale_div2


@dataclass(frozen=True)
class LayoutMeta:
    backend: str
    hidden_size: int
    intermediate_size: int
    w13_global_scale_div: torch.Tensor  # float64 [E]
    w2_global_scale_div: torch.Tensor  # float64 [E]
    input_scale_div13: torch.Tensor | None  # float64 [E]
    input_scale_div2: torch.Tensor | None  # float64 [E]
    options: dict[str, object] = field(default_factory=dict)

    @property
    def num_experts(self) -> int:
        return self.w13_global_scale_div.shape[0]


def moe_sizes(w13: NVFP4Tensor, w2: NVFP4Tensor) -> tuple[int, int, int]:
    """(E, H, I) of a stacked layer, after checking that every canonical tensor has the shape and dtype it must."""
    if w13.packed.dim() != 3 or w2.packed.dim() != 3:
        raise Fp4kitError("layouts take stacked experts: w13 and w2 must be [E, N, K/2] tensors.")
    num_experts, twice_i, half_h = w13.packed.shape
    hidden, intermediate = half_h * 2, twice_i // 2
    expected = {
        "w13.packed": (w13.packed, torch.uint8, (num_experts, 2 * intermediate, hidden // 2)),
        "w13.block_scale": (w13.block_scale, torch.float8_e4m3fn, (num_experts, 2 * intermediate, hidden // BLOCK)),
        "w13.global_scale_div": (w13.global_scale_div, torch.float64, (num_experts,)),
        "w2.packed": (w2.packed, torch.uint8, (num_experts, hidden, intermediate // 2)),
        "w2.block_scale": (w2.block_scale, torch.float8_e4m3fn, (num_experts, hidden, intermediate // BLOCK)),
        "w2.global_scale_div": (w2.global_scale_div, torch.float64, (num_experts,)),
    }
    if twice_i % 2 or hidden % BLOCK or intermediate % BLOCK:
        raise Fp4kitError(f"w13 rows {twice_i} must be even and H={hidden}, I={intermediate} multiples of {BLOCK}.")
    for name, (tensor, dtype, shape) in expected.items():
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise Fp4kitError(f"{name} is {tensor.dtype} {tuple(tensor.shape)}, expected {dtype} {shape}.")
    return num_experts, hidden, intermediate


def check_input_scales(num_experts: int, *scales: torch.Tensor | None) -> None:
    for scale in scales:
        if scale is not None and (scale.dtype != torch.float64 or tuple(scale.shape) != (num_experts,)):
            raise Fp4kitError(f"input scales must be float64 [{num_experts}] divisors, got {scale.dtype} "
                              f"{tuple(scale.shape)}.")


def check_divisible(what: str, value: int, multiple: int, why: str) -> None:
    if value <= 0 or value % multiple:
        raise Fp4kitError(f"{what} = {value} must be a positive multiple of {multiple}: {why}.")


def check_expert_parallel(num_experts: int, ep: int, kernel: str) -> None:
    if ep < 1 or num_experts % ep:
        raise Fp4kitError(f"{kernel} places E/ep experts on each rank (offset = rank * E/ep), so E = {num_experts} "
                          f"must be divisible by ep = {ep}.")


def alignment_problems(checks: list[tuple[str, int, int]]) -> list[str]:
    """``"I=96 not a multiple of 64"`` for each (name, value, multiple) that fails."""
    return [f"{what}={value} not a multiple of {multiple}" for what, value, multiple in checks if value % multiple]



def layout_refusal(backend: ModuleType, num_experts: int, hidden: int, intermediate: int, weight_only: bool,
                   **options: object) -> str | None:
    """Why `fp4kit layout --backend` refuses one MoE layer (None: it lays it out): the backend's ``check_shapes``,
    then a W4A4 kernel asked to run a weight-only checkpoint. inspect's backend table asks the same."""
    try:
        backend.check_shapes(num_experts, hidden, intermediate, **options)
    except Fp4kitError as exc:
        return str(exc)
    if backend.W4A4 and weight_only:
        from fp4kit.registry import backends

        weight_only_backends = " or ".join(f"--backend {name}" for name, m in backends().items() if not m.W4A4)
        return (f"--backend {backend.BACKEND} runs a W4A4 kernel, which needs activation (input) scales, and this "
                f"checkpoint is weight-only: use {weight_only_backends}")
    return None

# Scalar formulas the manifests record (fp4kit/layouts/manifest.py, FORMULA_NOTATION says how to read them)
W4A4_FORMULAS = {"w13_alpha": "fp32(D_w13) * fp32(D_a13)", "a13_gscale": "1 / fp32(D_a13)",
                 "w2_alpha": "fp32(D_w2) * fp32(D_a2)", "a2_gscale": "1 / fp32(D_a2)"}
# FlashInfer's kernels quantize the hidden states once, before routing: one gate/up input scale for all experts
SHARED_A13 = ("max over the layer's experts of input_scale_div13 (the kernel quantizes the hidden states once for "
              "all experts; options.collapsed_input_scales13 counts the experts whose own scale this replaces)")
PER_EXPERT_A13 = "input_scale_div13[e]"


def fp32(scale: torch.Tensor) -> torch.Tensor:
    """A float64 divisor rounded once to fp32, as engines hold it (ModelOpt's weight_scale_2 / input_scale)."""
    return scale.to(torch.float32)


def shared_input_divisor(input_scale_div13: torch.Tensor) -> torch.Tensor:
    """The gate/up input divisor a FlashInfer kernel (TRT-LLM-gen, CUTLASS) applies to every expert: it quantizes the
    hidden states once, before routing, so one scale serves all experts. Like vLLM 0.33
    (``flashinfer_fp4_moe.py::prepare_nvfp4_moe_layer_for_fi_or_cutlass``, ``amax_for_moe_activation_quant``), the
    layer's largest divisor (largest calibrated amax: nothing clips), repeated over the experts."""
    return largest_amax("divisor")(input_scale_div13, key=float).expand_as(input_scale_div13).clone()


def collapsed_input_scales(input_scale_div13: torch.Tensor | None) -> int:
    """How many experts' own gate/up input scales :func:`shared_input_divisor` replaces (0 when they agree)."""
    if input_scale_div13 is None:
        return 0
    return int((input_scale_div13 != shared_input_divisor(input_scale_div13)).sum())


def describe(backend: str, w13: NVFP4Tensor, w2: NVFP4Tensor, input_scale_div13: torch.Tensor | None,
             input_scale_div2: torch.Tensor | None, **options: object) -> LayoutMeta:
    num_experts, hidden, intermediate = moe_sizes(w13, w2)
    check_input_scales(num_experts, input_scale_div13, input_scale_div2)
    return LayoutMeta(backend, hidden, intermediate, w13.global_scale_div.clone(), w2.global_scale_div.clone(),
                      None if input_scale_div13 is None else input_scale_div13.clone(),
                      None if input_scale_div2 is None else input_scale_div2.clone(), dict(options))


def require_shape(name: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if name not in tensors:
        raise Fp4kitError(f"the layout has no tensor named {name}.")
    if tensors[name].dtype != dtype or tuple(tensors[name].shape) != shape:
        raise Fp4kitError(f"{name} is {tensors[name].dtype} {tuple(tensors[name].shape)}, expected {dtype} {shape}.")


def require_equal(name: str, stored: torch.Tensor, expected: torch.Tensor) -> None:
    """Bitwise equality of a stored kernel tensor with what transform writes, else one clear error."""
    if stored.dtype != expected.dtype or stored.shape != expected.shape:
        raise Fp4kitError(f"{name} is {stored.dtype} {tuple(stored.shape)}, expected {expected.dtype} "
                          f"{tuple(expected.shape)}.")
    if not torch.equal(stored.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8)):
        raise Fp4kitError(f"{name} does not match the scales this layout's metadata records.")


def require_zero(name: str, padding: torch.Tensor) -> None:
    if padding.numel() and bool((padding.contiguous().view(torch.uint8) != 0).any()):
        raise Fp4kitError(f"{name} has non-zero bytes in its padding; the kernel would read them as weights.")


def placed(out: dict[str, torch.Tensor] | None, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` copied into ``out[name]`` when the caller gave one, else ``tensor`` itself."""
    if out is None or name not in out:
        return tensor
    if tensor.data_ptr() == out[name].data_ptr():  # already computed in place
        return out[name]
    return out[name].copy_(tensor)


def destination(out: dict[str, torch.Tensor] | None, name: str) -> torch.Tensor | None:
    """The caller's buffer for ``name`` (checked contiguous), or None: the transform allocates its own."""
    if out is None or name not in out:
        return None
    if not out[name].is_contiguous():
        raise Fp4kitError(f"internal: the output buffer for {name} is not contiguous.")
    return out[name]


def canonical(packed: torch.Tensor, block_scale: torch.Tensor, global_scale_div: torch.Tensor) -> NVFP4Tensor:
    return NVFP4Tensor(packed.contiguous(), block_scale.contiguous(), global_scale_div.clone())
