"""verify's ``marlin`` backend (vLLM's Marlin NVFP4 MoE) wired end to end on the CPU, against CPU ops.

vLLM's CUDA ops cannot run here, so this file registers CPU implementations of their contract where vLLM looks them
up (``torch.ops._moe_C.moe_wna16_marlin_gemm`` / ``moe_align_block_size`` / ``moe_sum``, ``torch.ops._C.silu_and_mul``),
written from what the kernels compute (csrc/moe/marlin_moe_wna16, csrc/moe/moe_align_sum_kernels.cu,
csrc/activation_kernels.cu of vLLM 0.33): the GEMM dequantizes the Marlin tiles fp4kit writes as E2M1 value x
S0E5M3 block scale x global scale x 2^-126 (bf16), and runs only the rows of each block's expert that
moe_align_block_size sorted there. Then:

- fp4kit's op sequence (fp4kit.verify.vllm_marlin.marlin_moe_ops, what runs on a GPU without vLLM's wheel) gives the
  same bits as vLLM's own ``fused_marlin_moe`` on the same ops, with and without an EP expert_map;
- `fp4kit verify --backend marlin` passes on sound checkpoints of several families, W4A16 and W4A4 served
  weight-only, and under EP 2 and 4 (``ep-kernel``), and fails on a planted defect: gate/up swapped, a global scale
  off by 2, an expert map shifted by one expert.
The real kernels run in scripts/device_vllm_marlin_moe.py (docs/verify.md).
"""

from __future__ import annotations

import pytest
import torch
from helpers import SQUARE, add_input_scales, vllm_module

from fp4kit.layouts import marlin
from fp4kit.nvfp4 import NVFP4Tensor, quantize_group, unpack_e2m1
from fp4kit.verify import backends, vllm_marlin
from fp4kit.verify.checks import VerifyOptions
from fp4kit.verify.runner import verify_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ACT_EXPONENT = {torch.bfloat16: 126, torch.float16: 14}  # 2^-bias the kernel's FP4 -> activation dtype trick leaves


# ---- CPU implementations of the ops' contract -------------------------------------------------------------------

def _dequantized_marlin(b_q_weight: torch.Tensor, b_scales: torch.Tensor, global_scale: torch.Tensor, size_n: int,
                        size_k: int, dtype: torch.dtype) -> torch.Tensor:
    """fp32 [E, N, K] weights the kernel multiplies with."""
    experts = b_q_weight.shape[0]
    values = unpack_e2m1(marlin.unpack_weights(b_q_weight, size_n, size_k)).float()  # [E, N, K]
    scale_bits = (b_scales.contiguous().view(torch.uint8).to(torch.int32) << 7).to(torch.int16)
    scales = scale_bits.view(torch.float16).float().reshape(experts, -1, 4)[..., [0, 2, 1, 3]]
    scales = scales.reshape(experts, -1, 64)[..., torch.argsort(marlin.scale_permutation())]
    scales = scales.reshape(experts, size_k // 16, size_n).transpose(1, 2)  # [E, N, K/16]
    factor = global_scale.float().reshape(-1, 1, 1) * 2.0 ** -ACT_EXPONENT[dtype]
    return (values.unflatten(-1, (-1, 16)) * scales.unsqueeze(-1)).flatten(-2) * factor


def fake_marlin_gemm(a, c, b_q_weight, b_bias, b_scales, a_scales, global_scale, b_zeros, workspace,
                     sorted_token_ids, expert_ids, num_tokens_past_padded, topk_weights, moe_block_size, top_k,
                     mul_topk_weights, b_type_id, size_m, size_n, size_k, use_atomic_add, use_fp32_reduce,
                     is_zp_float, thread_k, thread_n, blocks_per_sm):
    assert b_type_id == marlin.FLOAT4_E2M1F_ID and b_bias is None and b_zeros is None and a_scales is None
    assert a.shape == (size_m, size_k) and a.dtype in ACT_EXPONENT and global_scale.dtype == torch.float32
    weights = _dequantized_marlin(b_q_weight, b_scales, global_scale, size_n, size_k, a.dtype)
    out = c if c is not None else torch.empty(size_m * top_k, size_n, dtype=a.dtype)
    assert out.shape == (size_m * top_k, size_n)
    slots = int(num_tokens_past_padded[0])
    ids = sorted_token_ids[:slots].long()
    experts = expert_ids[:slots // moe_block_size].long().repeat_interleave(moe_block_size)
    valid = (ids < size_m * top_k) & (experts >= 0)
    for e in experts[valid].unique().tolist():
        rows = ids[valid & (experts == e)]
        result = a[rows // top_k].float() @ weights[e].T
        if mul_topk_weights:
            result = result * topk_weights.reshape(-1)[rows].unsqueeze(1)
        out[rows] = result.to(out.dtype)
    return out


def fake_align(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids, num_tokens_post_pad,
               maybe_expert_map, scatter_idx=None) -> None:
    flat = topk_ids.reshape(-1).long()
    local = torch.where((flat >= 0) & (flat < num_experts), flat, -1)
    if maybe_expert_map is not None:
        local = torch.where(local >= 0, maybe_expert_map.long()[local.clamp_min(0)], -1)
    sorted_token_ids.fill_(flat.numel())
    experts_ids.fill_(-1)
    position = 0
    for e in range(num_experts):
        slots = (local == e).nonzero().flatten()
        if not len(slots):
            continue
        sorted_token_ids[position:position + len(slots)] = slots.to(torch.int32)
        blocks = -(-len(slots) // block_size)
        experts_ids[position // block_size:position // block_size + blocks] = e
        position += blocks * block_size
    num_tokens_post_pad[0] = position
    if scatter_idx is not None:
        scatter_idx.copy_(torch.where(local >= 0, torch.arange(flat.numel()), -1).reshape(scatter_idx.shape))


def fake_moe_sum(input, output, topk_ids=None, expert_map=None) -> None:
    keep = torch.ones(input.shape[:2], dtype=torch.bool)
    if topk_ids is not None:
        keep = topk_ids >= 0
        if expert_map is not None:
            keep &= expert_map.long()[topk_ids.long().clamp_min(0)] >= 0
    output.copy_(torch.where(keep.unsqueeze(-1), input.float(), 0.0).sum(dim=1).to(output.dtype))  # skipped: garbage


def fake_silu_and_mul(result, input) -> None:
    gate, up = input.float().chunk(2, dim=-1)
    result.copy_((torch.nn.functional.silu(gate).to(input.dtype).float() * up).to(result.dtype))


SCHEMAS = {
    "_moe_C": {
        "moe_wna16_marlin_gemm": fake_marlin_gemm,
        "moe_align_block_size": fake_align,
        "moe_sum": fake_moe_sum,
    },
    "_C": {"silu_and_mul": fake_silu_and_mul},
}


@pytest.fixture(scope="module")
def cpu_ops():
    """The fake ops under vLLM's names and schemas (from the build script that registers the real ones)."""
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location(
        "device_build_vllm_marlin_moe", pathlib.Path(__file__).parents[1] / "scripts/device_build_vllm_marlin_moe.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    if not vllm_marlin.missing_ops():
        pytest.skip("vLLM's real Marlin MoE ops are registered in this process")
    libraries = []
    for namespace, ops in SCHEMAS.items():
        library = torch.library.Library(namespace, "FRAGMENT")
        for name, function in ops.items():
            library.define(build.SCHEMAS[namespace][name])
            library.impl(name, function, "CPU")
        libraries.append(library)
    assert not vllm_marlin.missing_ops()
    yield
    for library in libraries:
        library._destroy()


# ---- layers and checkpoints -------------------------------------------------------------------------------------

def random_layer(experts: int, hidden: int, intermediate: int, seed: int) -> tuple[NVFP4Tensor, NVFP4Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def stacked(rows: int, cols: int) -> NVFP4Tensor:
        parts = [quantize_group([(0.05 * torch.randn(rows, cols, generator=generator)).to(torch.bfloat16)])[0]
                 for _ in range(experts)]
        return NVFP4Tensor(torch.stack([p.packed for p in parts]), torch.stack([p.block_scale for p in parts]),
                           torch.stack([p.global_scale_div for p in parts]))

    return stacked(2 * intermediate, hidden), stacked(hidden, intermediate)


@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize("ep", [1, 2, 4])
def test_fp4kit_op_sequence_is_vllm_fused_marlin_moe(cpu_ops, tokens: int, ep: int) -> None:
    vllm_module("model_executor.layers.fused_moe.experts.marlin_moe")
    experts, top_k = 8, 2
    w13, w2 = random_layer(experts, 128, 64, seed=tokens + ep)
    generator = torch.Generator().manual_seed(ep)
    hidden = torch.randn(tokens, 128, generator=generator).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, top_k, generator=generator)
    ops = vllm_marlin.MarlinOps("CPU ops of the contract", vllm=True)
    cpu = torch.device("cpu")
    for rank in range(ep):
        local = list(range(rank * experts // ep, (rank + 1) * experts // ep))
        pick = torch.tensor(local)
        tensors = marlin.transform(NVFP4Tensor(w13.packed[pick], w13.block_scale[pick], w13.global_scale_div[pick]),
                                   NVFP4Tensor(w2.packed[pick], w2.block_scale[pick], w2.global_scale_div[pick]),
                                   None, None)
        expert_map = vllm_marlin.expert_map_of(local, experts, cpu) if ep > 1 else None
        outputs = [vllm_marlin.marlin_call(ops, tensors, marlin.FLOAT4_E2M1F_ID, experts, expert_map, False, cpu,
                                           use_vllm=use)(hidden, weights, ids) for use in (True, False)]
        assert torch.equal(outputs[0], outputs[1])
        assert bool(torch.isfinite(outputs[0]).all())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, object]:
    from fp4kit.ep.shard import ShardOptions, shard_checkpoint
    from fp4kit.quantize.checkpoint import QuantizeOptions, quantize_checkpoint
    from fp4kit.testing.fixtures import RECIPE_STAND_INS, build_fixture

    root = tmp_path_factory.mktemp("marlin-moe")
    paths: dict[str, object] = {}
    for family, overrides in (("qwen3_moe", SQUARE), ("glm4_moe", RECIPE_STAND_INS["glm4_moe"] | {"hidden_size": 128}),
                              ("llama4", RECIPE_STAND_INS["llama4"])):
        bf16 = build_fixture(family, root / f"{family}-bf16", overrides=overrides)
        for dialect in ("compressed-tensors", "modelopt"):
            out = root / f"{family}-{dialect}"
            quantize_checkpoint(bf16, out, QuantizeOptions(format=dialect))
            paths[(family, dialect)] = out
    paths["w4a4"] = add_input_scales(paths[("qwen3_moe", "compressed-tensors")], root / "w4a4")
    for ep in (2, 4):
        shard_checkpoint(paths[("qwen3_moe", "compressed-tensors")], root / f"ep{ep}", ShardOptions(ep=ep))
        paths[f"ep{ep}"] = root / f"ep{ep}"
    return paths


@pytest.fixture
def marlin_on_cpu(cpu_ops, monkeypatch):
    """The backend's availability answered as on a GPU that has the ops (here: the CPU ones)."""
    def available(device: torch.device) -> tuple[bool, str]:
        ops, reason = vllm_marlin.find_ops()
        return ops is not None, reason

    monkeypatch.setitem(backends._AVAILABLE, "marlin", available)


def marlin_results(report, check: str = "kernel") -> list:
    return [r for r in report.results if r.check == check and r.target.startswith("marlin")]


def _failures(report) -> list[str]:
    return [f"layer {r.layer} {r.check} {r.target}: {r.error} {r.detail}" for r in report.results if r.failed]


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe", "llama4"])
@pytest.mark.parametrize("dialect", ["compressed-tensors", "modelopt"])
def test_marlin_backend_agrees_with_the_reference(marlin_on_cpu, checkpoints, family: str, dialect: str) -> None:
    report = verify_checkpoint(checkpoints[(family, dialect)], VerifyOptions(tokens=[1, 16, 64], backend="marlin",
                                                                             layers=[1]))
    assert report.passed, _failures(report)
    kernel = marlin_results(report)
    assert len(kernel) == 3 and all(0 < r.error < 1e-2 for r in kernel)  # bf16 intermediates: not bit-exact
    assert [r.passed for r in marlin_results(report, "routing")] == [True]  # NaN/Inf router rows


def test_w4a4_checkpoint_served_weight_only(marlin_on_cpu, checkpoints) -> None:
    report = verify_checkpoint(checkpoints["w4a4"], VerifyOptions(tokens=[16], backend="marlin", mode="w4a16",
                                                                  layers=[1]))
    assert report.passed and report.mode == "w4a16", _failures(report)
    assert [r.passed for r in marlin_results(report)] == [True]


@pytest.mark.parametrize("ep", [2, 4])
def test_each_rank_with_its_expert_map_sums_to_the_reference(marlin_on_cpu, checkpoints, ep: int) -> None:
    options = VerifyOptions(tokens=[16], backend="marlin", ep_shards=checkpoints[f"ep{ep}"])
    report = verify_checkpoint(checkpoints[("qwen3_moe", "compressed-tensors")], options)
    assert report.passed, _failures(report)
    ep_kernel = marlin_results(report, "ep-kernel")
    assert len(ep_kernel) == 2 and all(r.passed and f"({ep} ranks)" in r.target for r in ep_kernel)


def _swap_gate_up(tensor: NVFP4Tensor) -> NVFP4Tensor:
    half = tensor.packed.shape[1] // 2
    order = torch.cat([torch.arange(half, 2 * half), torch.arange(half)])
    return NVFP4Tensor(tensor.packed[:, order], tensor.block_scale[:, order], tensor.global_scale_div)


def _plant(monkeypatch, defect: str) -> None:
    transform = marlin.transform
    if defect == "gate/up swapped":
        monkeypatch.setattr(marlin, "transform", lambda w13, w2, *a, **k: transform(_swap_gate_up(w13), w2, *a, **k))
    elif defect == "global scale off by 2":
        def doubled(*args, **kwargs):
            tensors = transform(*args, **kwargs)
            return {**tensors, "global_scale2": tensors["global_scale2"] * 2}

        monkeypatch.setattr(marlin, "transform", doubled)
    else:
        expert_map_of = vllm_marlin.expert_map_of
        monkeypatch.setattr(vllm_marlin, "expert_map_of", lambda *a: expert_map_of(*a).roll(1))


@pytest.mark.parametrize("defect", ["gate/up swapped", "global scale off by 2", "expert map shifted"])
def test_a_planted_defect_is_caught(marlin_on_cpu, checkpoints, monkeypatch, defect: str) -> None:
    _plant(monkeypatch, defect)
    options = VerifyOptions(tokens=[16], backend="marlin", layers=[1], ep_shards=checkpoints["ep2"])
    report = verify_checkpoint(checkpoints[("qwen3_moe", "compressed-tensors")], options)
    check = "ep-kernel" if defect == "expert map shifted" else "kernel"
    caught = marlin_results(report, check)
    assert caught and all(r.failed and r.error > 0.1 for r in caught), [(r.status, r.error) for r in caught]
    if defect == "expert map shifted":
        assert all(r.passed for r in marlin_results(report))  # the unsharded kernel is still right


def test_the_backend_says_why_it_cannot_run(monkeypatch, tmp_path) -> None:
    ok, why = backends.BACKENDS["marlin"].available(torch.device("cpu"))
    assert not ok and why.startswith("no GPU")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(backends, "_importable", lambda module: False)
    monkeypatch.delenv(vllm_marlin.OPS_LIBRARY_ENV, raising=False)
    ok, why = backends.BACKENDS["marlin"].available(torch.device("cuda"))
    assert not ok and vllm_marlin.OPS_LIBRARY_ENV in why
    if vllm_marlin.missing_ops():
        monkeypatch.setenv(vllm_marlin.OPS_LIBRARY_ENV, str(tmp_path / "missing.so"))
        ok, why = backends.BACKENDS["marlin"].available(torch.device("cuda"))
        assert not ok and "no such file" in why


def test_shapes_the_marlin_tiles_cannot_take_are_skipped(marlin_on_cpu, tmp_path) -> None:
    from fp4kit.quantize.checkpoint import quantize_checkpoint
    from fp4kit.testing.fixtures import build_fixture

    ckpt = tmp_path / "h64"
    quantize_checkpoint(build_fixture("qwen3_moe", tmp_path / "bf16"), ckpt)  # H = 64
    report = verify_checkpoint(ckpt, VerifyOptions(tokens=[4], backend="marlin", layers=[1]))
    kernel = marlin_results(report)
    assert kernel and all(r.skipped and "H=64" in r.detail for r in kernel)
