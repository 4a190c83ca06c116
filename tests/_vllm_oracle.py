"""vLLM's own pure-python weight preparation and loading code, imported for the oracle tests (tests/test_vllm_*.py).

vLLM is installed without its dependencies (`pip install --no-deps -r .ci/vllm-oracle.txt`: vllm==0.33.0 plus the
modules its imports need, as .ci/run does); ``vllm._C`` does not load on the CPU, so the only CUDA op these
functions call, ``gptq_marlin_repack``, is swapped for vLLM's own test reference (``marlin_utils_test``).
Without vLLM the tests skip with the reason; with FP4KIT_REQUIRE_ORACLES=1 (CI) they fail instead.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType, SimpleNamespace

import pytest
import torch

VLLM_VERSION = "0.33.0"
INSTALL = "pip install --no-deps -r .ci/vllm-oracle.txt (vLLM and the modules its imports need)"


def _unavailable(why: str) -> None:
    if os.environ.get("FP4KIT_REQUIRE_ORACLES"):
        pytest.fail(f"FP4KIT_REQUIRE_ORACLES is set but {why}", pytrace=False)
    pytest.skip(f"{why}; install it with {INSTALL}", allow_module_level=True)


def vllm_module(name: str) -> ModuleType:
    """``vllm.<name>``, or skip (fail in CI) when vLLM 0.33.0 cannot be imported."""
    if not torch.cuda.is_available():
        # vLLM imports triton: on the CPU the rest of the suite runs Triton's interpreter, which must be switched
        # on before triton is first imported (fp4kit/verify/backends.py)
        from fp4kit.verify.backends import enable_triton_interpreter

        enable_triton_interpreter()
    try:
        import vllm
    except ImportError as exc:
        _unavailable(f"vLLM is not installed ({exc})")
    if getattr(vllm, "__version__", None) != VLLM_VERSION:
        _unavailable(f"vLLM {getattr(vllm, '__version__', '?')} is installed, the oracles pin {VLLM_VERSION}")
    logging.getLogger("vllm").setLevel(logging.ERROR)
    try:
        return importlib.import_module(f"vllm.{name}")
    except ImportError as exc:
        _unavailable(f"vllm.{name} does not import ({exc})")
    raise AssertionError("unreachable")


def vllm_module_without_torchvision(name: str) -> ModuleType:
    """``vllm.<name>`` for a module that imports torchvision only for image preprocessing (mllama4.py, through
    transformers' Llama-4 image processor), where torchvision is not installed: torchvision's wheels are built
    against one torch build and CI keeps torch's CPU build. Empty stand-in modules satisfy the import and are
    removed again; the loading code under test never touches them."""
    import sys

    try:
        import torchvision  # noqa: F401
    except ImportError:
        pass
    else:
        return vllm_module(name)
    stubs = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
             "torchvision.transforms.v2.functional")
    for stub in stubs:
        sys.modules[stub] = ModuleType(stub)
    try:
        return vllm_module(name)
    finally:
        for stub in stubs:
            sys.modules.pop(stub, None)


def gptq_marlin_repack_reference(b_q_weight: torch.Tensor, size_k: int, size_n: int, num_bits: int,
                                 is_a_8bit: bool = False) -> torch.Tensor:
    """``ops.gptq_marlin_repack`` on the CPU: unpack GPTQ's [K/8, N] int32 (row 8r + i at bits 4i of row r) and run
    vLLM's reference ``marlin_weights`` with ``get_weight_perm`` (what vLLM's kernel test compares the op with)."""
    test_utils = vllm_module("model_executor.layers.quantization.utils.marlin_utils_test")
    assert num_bits == 4 and not is_a_8bit
    words = b_q_weight.view(torch.int32)
    codes = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=1).reshape(size_k, size_n)
    return test_utils.marlin_weights(codes, size_k, size_n, num_bits, test_utils.get_weight_perm(num_bits))


def patch_cuda_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    ops = vllm_module("_custom_ops")
    monkeypatch.setattr(ops, "gptq_marlin_repack", gptq_marlin_repack_reference, raising=False)


def marlin_layer(num_experts: int, hidden: int, intermediate: int, act_dtype: torch.dtype) -> SimpleNamespace:
    """The attributes of vLLM's RoutedExperts that ``prepare_nvfp4_moe_layer_for_marlin`` reads."""
    return SimpleNamespace(num_experts=num_experts, hidden_size=hidden, intermediate_size_per_partition=intermediate,
                           params_dtype=act_dtype)


def fi_layer(num_experts: int, hidden: int) -> SimpleNamespace:
    """The attributes of vLLM's RoutedExperts that ``prepare_nvfp4_moe_layer_for_fi_or_cutlass`` reads."""
    activation = SimpleNamespace(is_gated=True)
    moe_config = SimpleNamespace(moe_parallel_config=SimpleNamespace(enable_eplb=False), hidden_dim_unpadded=None,
                                 hidden_dim=hidden, intermediate_size_per_partition=None)
    return SimpleNamespace(activation=activation, moe_config=moe_config, num_experts=num_experts)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _load_all(root) -> dict[str, torch.Tensor]:
    from pathlib import Path

    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(root).glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def vllm_expert_inputs(root, experts: str, num_experts: int) -> dict[str, torch.Tensor | None]:
    """One MoE layer's tensors as vLLM 0.33's MoE methods hand them to ``convert_to_nvfp4_moe_kernel_format``.

    The parameters are filled as vLLM's loaders fill them (w13 rows [w1; w3], per-expert scales [E, 2] / [E], a
    fused ModelOpt Llama-4 tensor transposed and a layer scalar broadcast to every expert as mllama4.py does), then
    turned into the divisors ``process_weights_after_loading`` passes on: compressed-tensors
    (compressed_tensors_moe_w4a4_nvfp4.py) 1 / w13_weight_global_scale[:, 0], 1 / input_global_scale; ModelOpt
    (modelopt.py, ModelOptNvFp4FusedMoE) w13_weight_scale_2[:, 0] and the input scales as stored.
    """
    tensors = _load_all(root)
    ct = any(name.endswith(".weight_packed") for name in tensors)
    suffix = {"packed": ".weight_packed", "block": ".weight_scale", "global": ".weight_global_scale",
              "input": ".input_global_scale"} if ct else {"packed": ".weight", "block": ".weight_scale",
                                                          "global": ".weight_scale_2", "input": ".input_scale"}
    fused = f"{experts}.gate_up_proj" in tensors

    def per_expert(proj: str, kind: str) -> list[torch.Tensor | None]:
        if fused:
            leaf = "down_proj" if proj == "down_proj" else "gate_up_proj"
            name = {"packed": "", "block": "_weight_scale", "global": "_weight_scale_2", "input": "_input_scale"}[kind]
            value = tensors.get(f"{experts}.{leaf}{name}")
            if value is None:
                return [None] * num_experts
            if kind in ("packed", "block"):
                value = value.transpose(-1, -2)  # [E, K, N] on disk -> [E, N, K]
                if leaf == "gate_up_proj":
                    value = value.chunk(2, dim=-2)[0 if proj == "gate_proj" else 1]
                return list(value)
            return [value.reshape(())] * num_experts
        return [tensors.get(f"{experts}.{e}.{proj}{suffix[kind]}") for e in range(num_experts)]

    def stack(proj: str, kind: str) -> torch.Tensor | None:
        values = per_expert(proj, kind)
        if values[0] is None:
            return None
        return torch.stack([v.reshape(v.shape if kind in ("packed", "block") else ()) for v in values])

    w13 = torch.cat([stack("gate_proj", "packed"), stack("up_proj", "packed")], dim=1).contiguous()
    w13_scale = torch.cat([stack("gate_proj", "block"), stack("up_proj", "block")], dim=1).contiguous()
    w13_global = torch.stack([stack("gate_proj", "global"), stack("up_proj", "global")], dim=1).float()
    w2_global = stack("down_proj", "global").float()
    gate_in, up_in, down_in = stack("gate_proj", "input"), stack("up_proj", "input"), stack("down_proj", "input")
    a13 = None if gate_in is None else torch.stack([gate_in, up_in], dim=1).float()
    a2 = None if down_in is None else down_in.float()
    if ct:
        w13_scale_2, w2_scale_2 = 1.0 / w13_global[:, 0].contiguous(), 1.0 / w2_global
        a13, a2 = (None if a13 is None else 1.0 / a13), (None if a2 is None else 1.0 / a2)
    else:
        w13_scale_2, w2_scale_2 = w13_global[:, 0].contiguous(), w2_global
    return {"w13": w13, "w13_scale": w13_scale, "w13_scale_2": w13_scale_2, "a13_scale": a13,
            "w2": stack("down_proj", "packed").contiguous(), "w2_scale": stack("down_proj", "block").contiguous(),
            "w2_scale_2": w2_scale_2, "a2_scale": a2}
