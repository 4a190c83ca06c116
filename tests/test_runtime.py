"""fp4kit.layouts.runtime: layout files undo to the source's canonical tensors bit for bit, and load_moe_layer returns
the arguments of the installed kernels (FlashInfer 0.7.2.post1, read by introspection) with the dtypes and shapes their
bindings check."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from helpers import shared_source

from fp4kit.errors import Fp4kitError
from fp4kit.formats.detect import open_checkpoint
from fp4kit.layouts import cutlass, marlin, trtllm
from fp4kit.layouts.directory import LayoutOptions, layout_checkpoint
from fp4kit.layouts.manifest import MANIFEST
from fp4kit.layouts.marlin import FLOAT4_E2M1F_ID
from fp4kit.layouts.runtime import load_moe_layer, read_layer
from fp4kit.tools.convert import convert_checkpoint

UNDO = {"trtllm": trtllm.undo, "cutlass": cutlass.undo, "marlin": marlin.undo}
CASES = {  # name -> (backend, LayoutOptions extras)
    "trtllm": ("trtllm", {}),
    "cutlass-flashinfer": ("cutlass", {"cutlass_flavor": "flashinfer"}),
    "cutlass-vllm": ("cutlass", {"cutlass_flavor": "vllm"}),
    "marlin-bf16": ("marlin", {}),
    "marlin-fp16": ("marlin", {"act_dtype": "fp16"}),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("layout-sources")
    ct_source = shared_source(tmp_path_factory, hidden=256, intermediate=64)
    convert_checkpoint(ct_source, root / "modelopt", "modelopt")
    padded = shared_source(tmp_path_factory, hidden=96, intermediate=48)  # TRT-LLM pads H and I
    return {"ct": ct_source, "modelopt": root / "modelopt", "ct-padded": padded}


@pytest.fixture(scope="module")
def layouts(sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    built: dict[tuple[str, str], object] = {}

    def get(source: str, case: str):
        if (source, case) not in built:
            backend, extra = CASES[case]
            built[(source, case)] = root / f"{source}-{case}"
            layout_checkpoint(sources[source], built[(source, case)], LayoutOptions(backend=backend, **extra))
        return built[(source, case)]

    return get


def canonical_layer(source, layer: int):
    """w13 / w2 / input divisors of one layer straight from the source's per-expert modules (gate rows first)."""
    with open_checkpoint(source) as ckpt:
        by_name = {m.name: m for m in ckpt.modules}
        prefix = f"model.layers.{layer}.mlp.experts"
        num_experts = ckpt.family.num_experts(ckpt.config)
        read = {(e, p): ckpt.read(by_name[f"{prefix}.{e}.{p}"]) for e in range(num_experts)
                for p in ("gate_proj", "up_proj", "down_proj")}
    experts = range(num_experts)

    def gate_up(field: str) -> torch.Tensor:
        return torch.stack([torch.cat([getattr(read[(e, p)][0], field) for p in ("gate_proj", "up_proj")])
                            for e in experts])

    w13 = [gate_up("packed"), gate_up("block_scale"), torch.stack([read[(e, "gate_proj")][0].global_scale_div
                                                                   for e in experts])]
    w2 = [torch.stack([read[(e, "down_proj")][0].packed for e in experts]),
          torch.stack([read[(e, "down_proj")][0].block_scale for e in experts]),
          torch.stack([read[(e, "down_proj")][0].global_scale_div for e in experts])]
    inputs = [torch.stack([read[(e, p)][1] for e in experts]) for p in ("gate_proj", "down_proj")]
    return w13, w2, inputs


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


ROUND_TRIPS = [("ct", c) for c in CASES] + [("modelopt", "trtllm"), ("modelopt", "marlin-bf16"),
                                            ("ct-padded", "trtllm")]


@pytest.mark.parametrize("source,case", ROUND_TRIPS)
def test_undo_through_the_files_gives_the_canonical_tensors(sources, layouts, source, case):
    out = layouts(source, case)
    for layer in (0, 1):
        tensors, meta, _ = read_layer(out, layer)
        w13, w2, input13, input2 = UNDO[CASES[case][0]](tensors, meta)
        want13, want2, want_inputs = canonical_layer(sources[source], layer)
        for got, want in zip((w13.packed, w13.block_scale, w13.global_scale_div, w2.packed, w2.block_scale,
                              w2.global_scale_div, input13, input2), (*want13, *want2, *want_inputs), strict=True):
            assert same_bits(got, want)


def test_manifest_scales_are_the_exact_float64_divisors(sources, layouts):
    document = json.loads((layouts("ct", "trtllm") / MANIFEST).read_text())
    want13, want2, (input13, input2) = canonical_layer(sources["ct"], 1)
    scales = document["layers"]["1"]["scales"]
    for key, want in (("w13_global_scale_div", want13[2]), ("w2_global_scale_div", want2[2]),
                      ("input_scale_div13", input13), ("input_scale_div2", input2)):
        assert [float.fromhex(v) for v in scales[key]] == want.tolist()


def kernel_parameters(function) -> tuple[set[str], set[str]]:
    parameters = inspect.signature(function).parameters
    required = {n for n, p in parameters.items() if p.default is inspect.Parameter.empty}
    return set(parameters), required


def test_trtllm_arguments_match_flashinfer_signature_and_launcher_checks(layouts):
    """flashinfer/fused_moe/core.py::trtllm_fp4_block_scale_moe and data/csrc/trtllm_fused_moe_kernel_launcher.cu
    (FP4BlockScaleLauncher: uint8 weights, float8_e4m3fn scales, fp32 [local_num_experts] scalars)."""
    fused_moe = pytest.importorskip("flashinfer.fused_moe")
    kwargs = load_moe_layer(layouts("ct", "trtllm"), 0, "trtllm", "cpu")
    parameters, required = kernel_parameters(fused_moe.trtllm_fp4_block_scale_moe)
    assert set(kwargs) <= parameters
    assert required - set(kwargs) == {"routing_logits", "hidden_states", "hidden_states_scale"}
    experts, inter, hidden = kwargs["local_num_experts"], kwargs["intermediate_size"], kwargs["valid_hidden_size"]
    padded_hidden = kwargs["gemm1_weights"].shape[2] * 2
    assert (experts, inter, hidden, padded_hidden) == (8, 64, 256, 256)
    expected = {"gemm1_weights": (torch.uint8, (experts, 2 * inter, padded_hidden // 2)),
                "gemm1_weights_scale": (torch.float8_e4m3fn, (experts, 2 * inter, padded_hidden // 16)),
                # FC2 rows are GEMM2's N: roundUp(valid_hidden_size, 128) (launcher's gemm2_output_hidden_size)
                "gemm2_weights": (torch.uint8, (experts, -(-hidden // 128) * 128, inter // 2)),
                "gemm2_weights_scale": (torch.float8_e4m3fn, (experts, -(-hidden // 128) * 128, inter // 16)),
                **{name: (torch.float32, (experts,)) for name in
                   ("output1_scale_scalar", "output1_scale_gate_scalar", "output2_scale_scalar")}}
    for name, (dtype, shape) in expected.items():
        assert (kwargs[name].dtype, tuple(kwargs[name].shape)) == (dtype, shape), name
    assert kwargs["num_experts"] == experts and kwargs["local_expert_offset"] == 0
    assert kwargs["valid_intermediate_size"] == 64 and kwargs["top_k"] == 2
    from flashinfer.tllm_enums import RoutingMethodType

    assert kwargs["routing_method_type"] == RoutingMethodType.RenormalizeNaive  # Qwen3: softmax, top-k, renormalize


def test_cutlass_arguments_match_flashinfer_signature_and_binding_checks(layouts):
    """flashinfer/fused_moe/core.py::cutlass_fused_moe and flashinfer_cutlass_fused_moe_binding.cu (NVFP4
    quant_scales: fp32 act globals 0-d or [E], int32 block scales [E, alignToSfDim(N), alignToSfDim(K, 64) / 64],
    fp32 [E] dequant scales; gated fc1 rows alignToSfDim(I, 64) * 2, fc2 rows alignToSfDim(H, 128))."""
    fused_moe = pytest.importorskip("flashinfer.fused_moe")
    kwargs = load_moe_layer(layouts("ct", "cutlass-flashinfer"), 1, "cutlass", "cpu")
    parameters, required = kernel_parameters(fused_moe.cutlass_fused_moe)
    assert set(kwargs) <= parameters
    assert required - set(kwargs) == {"input", "token_selected_experts", "token_final_scales"}
    experts, hidden, inter = 8, 256, 64

    def align(value: int, to: int) -> int:
        return -(-value // to) * to

    assert (kwargs["fc1_expert_weights"].dtype, tuple(kwargs["fc1_expert_weights"].shape)) == \
        (torch.int64, (experts, 2 * inter, hidden // 16))
    assert (kwargs["fc2_expert_weights"].dtype, tuple(kwargs["fc2_expert_weights"].shape)) == \
        (torch.int64, (experts, hidden, inter // 16))
    act1, block1, dequant1, act2, block2, dequant2 = kwargs["quant_scales"]
    assert block1.dtype == block2.dtype == torch.int32
    assert tuple(block1.shape) == (experts, align(inter, 64) * 2, align(hidden, 64) // 64)
    assert tuple(block2.shape) == (experts, align(hidden, 128), align(inter, 64) // 64)
    for scale in (act1, dequant1, act2, dequant2):
        assert scale.dtype == torch.float32 and tuple(scale.shape) == (experts,)
    assert kwargs["output_dtype"] == torch.bfloat16


# vLLM fused_marlin_moe (vllm/model_executor/layers/fused_moe/fused_marlin_moe.py): parameters without a default
MARLIN_REQUIRED = {"hidden_states", "w1", "w2", "bias1", "bias2", "w1_scale", "w2_scale", "gating_output",
                   "topk_weights", "topk_ids", "quant_type_id"}
MARLIN_OPTIONAL = {"apply_router_weight_on_input", "global_num_experts", "activation", "activation_func", "moe_sum",
                   "expert_map", "input_global_scale1", "input_global_scale2", "global_scale1", "global_scale2",
                   "g_idx1", "g_idx2", "sort_indices1", "sort_indices2", "w1_zeros", "w2_zeros", "workspace",
                   "intermediate_cache13", "intermediate_cache2", "is_k_full", "output", "input_dtype", "inplace"}


def test_marlin_arguments_match_vllm_fused_marlin_moe(layouts):
    """vLLM isn't installed here: its parameter names are listed above, and the shapes are the asserts at the top of
    fused_marlin_moe (w1.size(1) * 16 == K, w2.size(2) // 2 == K) plus the repack's [E, K/16, 2N] int32."""
    kwargs = load_moe_layer(layouts("ct", "marlin-bf16"), 0, "marlin", "cpu")
    assert set(kwargs) <= MARLIN_REQUIRED | MARLIN_OPTIONAL
    assert MARLIN_REQUIRED - set(kwargs) == {"hidden_states", "gating_output", "topk_weights", "topk_ids"}
    hidden, inter, experts = 256, 64, 8
    assert kwargs["w1"].shape[1] * 16 == hidden and kwargs["w2"].shape[2] // 2 == hidden
    assert (kwargs["w1"].dtype, tuple(kwargs["w1"].shape)) == (torch.int32, (experts, hidden // 16, 2 * 2 * inter))
    assert (kwargs["w2"].dtype, tuple(kwargs["w2"].shape)) == (torch.int32, (experts, inter // 16, 2 * hidden))
    assert kwargs["w1_scale"].dtype == kwargs["w2_scale"].dtype == torch.float8_e4m3fn
    assert kwargs["global_scale1"].dtype == torch.float32 and tuple(kwargs["global_scale1"].shape) == (experts,)
    # ScalarType.float_(2, 1, True, NanRepr.NONE): exponent 2, mantissa 1 << 8, signed 1 << 16, finite-only 1 << 49
    assert kwargs["quant_type_id"] == FLOAT4_E2M1F_ID == 2 + (1 << 8) + (1 << 16) + (1 << 49)
    assert kwargs["global_num_experts"] == experts


def test_trtllm_gemm2_rows_when_hidden_is_not_a_multiple_of_256(layouts):
    """H = 96: hidden states (GEMM1's K) padded to 256, FC2 rows to roundUp(valid_hidden_size, 128) = 128, the N
    FlashInfer 0.7.2 sizes GEMM2 and its weights at (and requires to be <= the padded hidden size)."""
    core = pytest.importorskip("flashinfer.fused_moe.core")
    out = layouts("ct-padded", "trtllm")
    kwargs = load_moe_layer(out, 0, "trtllm", "cpu")
    padded_hidden = json.loads((out / MANIFEST).read_text())["layers"]["0"]["padded_hidden_size"]
    gemm2_n = core._infer_trtllm_moe_output_hidden_size(padded_hidden, kwargs["valid_hidden_size"])
    assert (kwargs["valid_hidden_size"], padded_hidden, gemm2_n) == (96, 256, 128)
    assert kwargs["gemm1_weights"].shape[2] * 2 == padded_hidden
    assert kwargs["gemm2_weights"].shape[1] == kwargs["gemm2_weights_scale"].shape[1] == gemm2_n


def test_load_errors_are_one_clear_line(layouts, tmp_path):
    out = layouts("ct", "marlin-bf16")
    with pytest.raises(Fp4kitError, match="holds a marlin layout, not trtllm"):
        load_moe_layer(out, 0, "trtllm")
    with pytest.raises(Fp4kitError, match=r"no MoE layer 7 in this layout \(layers: 0, 1\)"):
        load_moe_layer(out, 7, "marlin")
    with pytest.raises(Fp4kitError, match="no fp4kit_layout.json"):
        load_moe_layer(tmp_path, 0, "marlin")


@pytest.mark.parametrize("corrupt,message", [
    (lambda doc: "{not json", "not valid JSON"),
    (lambda doc: json.dumps({**doc, "format": "other"}), "not an fp4kit layout manifest"),
    (lambda doc: json.dumps({**doc, "version": 99}), "manifest version 99"),
    (lambda doc: json.dumps({**doc, "layers": []}), "lacks a valid backend, act_dtype or layers"),
    (lambda doc: json.dumps({**doc, "act_dtype": "float8"}), "lacks a valid backend, act_dtype or layers"),
    (lambda doc: json.dumps(_set_tensor(doc, 5)), "tensors table is malformed"),
    (lambda doc: json.dumps(_set_scale(doc, ["zz"] * 8)), "not a hex float"),
    (lambda doc: json.dumps(_set_scale(doc, ["0x1p-10"])), "must be a list of 8 hex floats"),
    (lambda doc: json.dumps(_set_shape(doc, [8, 1, 1])), "the manifest says"),
])
def test_malformed_manifests_are_refused(layouts, tmp_path, corrupt, message):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(layouts("ct", "cutlass-vllm"), out)
    document = json.loads((out / MANIFEST).read_text())
    (out / MANIFEST).write_text(corrupt(document))
    with pytest.raises(Fp4kitError, match=message):
        load_moe_layer(out, 0, "cutlass")


def _set_scale(document: dict, values: list) -> dict:
    document["layers"]["0"]["scales"]["w2_global_scale_div"] = values
    return document


def _set_tensor(document: dict, spec: object) -> dict:
    document["layers"]["0"]["tensors"]["w2_fp4"] = spec
    return document


def _set_shape(document: dict, shape: list) -> dict:
    document["layers"]["0"]["tensors"]["w2_fp4"]["shape"] = shape
    return document
