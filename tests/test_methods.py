"""The error-reducing quantization methods: the mse block-scale search (fp4kit/quantize/scale_search.py), GPTQ with
NVFP4 groups (fp4kit/quantize/gptq.py) and the calibrated layer pass behind `fp4kit quantize --method mse|gptq`."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import qwen3_moe_layer_inputs, token_calibration_file

from fp4kit import nvfp4
from fp4kit.io.checkpoint import CheckpointReader
from fp4kit.quantize import QuantizeOptions, quantize_checkpoint
from fp4kit.quantize.gptq import GptqOptions, gptq_objective, gptq_quantize
from fp4kit.quantize.scale_search import ScaleSearch, parse_scale_search, quantize_mse, round_e2m1_magnitude_

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _block_errors(weight: torch.Tensor, q: nvfp4.NVFP4Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """Weighted squared error per 16-block, from the dequantized tensor, in float64."""
    error = (q.dequantize().double() - weight.double()).square()
    if importance is not None:
        error = error * importance.double()
    return error.unflatten(-1, (-1, 16)).sum(-1)


def _adversarial_weights() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    normal = torch.randn(64, 256, generator=gen) * 0.02
    outliers = normal.clone()
    outliers[:, ::16] *= 50  # one outlier per block
    blocks = torch.randn(8, 256, generator=gen)
    blocks[0] = 0  # all-zero rows
    blocks[1, :16] = 0
    blocks[1, 16] = 3.0  # one non-zero value in a block
    blocks[2] *= 1e-30  # FP8-subnormal block scales
    blocks[3] = 1.0  # constant blocks
    heavy = torch.distributions.StudentT(1.5).sample((32, 256))
    return [w.to(torch.bfloat16) for w in (normal, outliers, blocks, heavy)]


def test_e2m1_rounding_matches_the_codes():
    grid = torch.linspace(0, 8, 2**18)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0])
    values = torch.cat([grid, ties, torch.nextafter(ties, torch.zeros(())), torch.nextafter(ties, ties + 1)])
    expected = nvfp4._E2M1_TABLE[nvfp4.e2m1_codes(values).long()]
    assert torch.equal(round_e2m1_magnitude_(values.clone()), expected)


@pytest.mark.parametrize("weighted", [False, True])
def test_mse_never_worse_than_rtn_per_block(weighted):
    gen = torch.Generator().manual_seed(1)
    for weight in _adversarial_weights():
        importance = torch.rand(weight.shape[-1], generator=gen) ** 4 if weighted else None
        global_mul = nvfp4.global_scale_mul(weight.abs().amax())
        rtn, mse = nvfp4.quantize(weight, global_mul), quantize_mse(weight, global_mul, importance)
        rtn_error, mse_error = _block_errors(weight, rtn, importance), _block_errors(weight, mse, importance)
        assert (mse_error <= rtn_error).all()
        assert torch.equal(mse.global_scale_div, rtn.global_scale_div)
        if weight.abs().amax() > 1e-20:
            assert mse_error.sum() < rtn_error.sum()
    zero = torch.zeros(4, 32, dtype=torch.bfloat16)
    q = quantize_mse(zero, nvfp4.global_scale_mul(zero.abs().amax()))
    assert (q.block_scale.float() == nvfp4.ZERO_BLOCK_SCALE).all() and (q.packed == 0).all()


@pytest.mark.parametrize("search", [None, ScaleSearch(), ScaleSearch(0.5, 3.0)])
@pytest.mark.parametrize("weighted", [False, True])
def test_native_mse_makes_the_torch_choices(weighted, search):
    """fp4kit's C search loop (fp4kit/native/nvfp4_cpu.c) picks the same scales, so writes the same bytes."""
    from fp4kit.native import nvfp4_cpu

    if not nvfp4_cpu.available():
        pytest.fail("no C compiler: the native mse loop cannot be compared")
    gen = torch.Generator().manual_seed(6)
    big = (torch.randn(300, 512, generator=gen) * 0.02).to(torch.bfloat16)  # split over threads
    for weight in [*_adversarial_weights(), big]:
        importance = torch.rand(weight.shape[-1], generator=gen) ** 4 if weighted else None
        global_mul = nvfp4.global_scale_mul(weight.abs().amax())
        torch_path = quantize_mse(weight, global_mul, importance, search=search)
        native = quantize_mse(weight, global_mul, importance, native=True, search=search)
        assert torch.equal(torch_path.packed, native.packed)
        assert torch.equal(torch_path.block_scale.view(torch.uint8), native.block_scale.view(torch.uint8))


def test_recipe_method_reaches_quantize(tmp_path):
    from fp4kit.errors import Fp4kitError
    from fp4kit.pipeline.recipe import load_recipe

    path = tmp_path / "r.yaml"
    path.write_text(f"model: {tmp_path}\nfamily: qwen3_moe\nquantize:\n  scheme: nvfp4a16\n  method: gptq\n"
                    "  gptq_damp: 0.05\n")
    section = load_recipe(path).recipe.quantize
    assert section is not None and section.method == "gptq" and section.gptq_damp == 0.05
    path.write_text(f"model: {tmp_path}\nfamily: qwen3_moe\nquantize:\n  method: awq+gptq\n")
    assert load_recipe(path).recipe.quantize.method == "awq+gptq"
    path.write_text(f"model: {tmp_path}\nfamily: qwen3_moe\nquantize:\n  method: smoothquant\n")
    with pytest.raises(Fp4kitError, match="quantize.method"):
        load_recipe(path)


def test_mse_stack_and_group_share_the_rtn_global_scale():
    from fp4kit.quantize.scale_search import quantize_group_mse, quantize_stacked_mse

    gate, up = _adversarial_weights()[0].chunk(2)
    up = up * 3
    group = quantize_group_mse([gate, up])
    assert torch.equal(group[0].global_scale_div, group[1].global_scale_div)
    assert torch.equal(group[0].global_scale_div, nvfp4.quantize_group([gate, up])[0].global_scale_div)
    stacked = quantize_stacked_mse(torch.stack([torch.cat([gate, up]), torch.cat([gate, up]) * 0.5]))
    assert torch.equal(stacked.packed[0], torch.cat([group[0].packed, group[1].packed]))
    assert stacked.global_scale_div[0] == group[0].global_scale_div


def _brute_force_range_search(weight: torch.Tensor, global_mul: torch.Tensor, importance: torch.Tensor | None,
                              search: ScaleSearch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block, in float64: the smallest sum w |dq - x|^norm over the RTN scale and every E4M3 code 1..0x7E whose
    value lies within [low, high] x G * amax / 6, and the codes' values allowed."""
    blocks = weight.double().unflatten(-1, (-1, 16))
    amax = nvfp4.block_amax(weight)
    rtn = nvfp4.rtn_block_scale(amax, global_mul)
    exact = (global_mul * (amax.float() / 6)).double()
    weights = torch.ones(weight.shape[-1], dtype=torch.float64) if importance is None else importance.double()
    weights = weights.unflatten(-1, (-1, 16))

    def error(scale: torch.Tensor) -> torch.Tensor:
        divisor = (scale.float() / global_mul).unsqueeze(-1)
        values = nvfp4._E2M1_TABLE[nvfp4.e2m1_codes(blocks.abs().float() / divisor).long() & 7].double()
        return ((values * divisor.double() - blocks.abs()).abs() ** search.norm * weights).sum(-1)

    best_error = error(rtn)
    for value in torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float():
        candidate = torch.full_like(rtn, float(value))
        inside = (candidate >= search.low * exact) & (candidate <= search.high * exact)
        best_error = torch.where(inside, torch.minimum(best_error, error(candidate)), best_error)
    return best_error, exact


@pytest.mark.parametrize("search", [ScaleSearch(), ScaleSearch(0.8, 1.8, 2.4), ScaleSearch(0.5, 3.0, 1.0)])
@pytest.mark.parametrize("weighted", [False, True])
def test_range_search_is_the_best_code_in_range(search, weighted):
    gen = torch.Generator().manual_seed(3)
    for weight in _adversarial_weights():
        weight = weight[:16]
        importance = torch.rand(weight.shape[-1], generator=gen) ** 4 if weighted else None
        global_mul = nvfp4.global_scale_mul(weight.abs().amax())
        q = quantize_mse(weight, global_mul, importance, search=search)
        rtn = nvfp4.quantize(weight, global_mul)
        expected_error, exact = _brute_force_range_search(weight, global_mul, importance, search)
        got_error = _norm_errors(weight, q, importance, search.norm)
        # the exhaustive search's error (fp32 sums against float64: a near-tie may pick the other code)
        assert torch.allclose(got_error, expected_error, rtol=1e-4, atol=1e-30)
        assert (got_error <= _norm_errors(weight, rtn, importance, search.norm) * (1 + 1e-5) + 1e-30).all()
        chosen = q.block_scale.float().double()
        in_range = (chosen >= search.low * exact) & (chosen <= search.high * exact)
        assert (in_range | (q.block_scale.view(torch.uint8) == rtn.block_scale.view(torch.uint8))).all()
        assert torch.equal(q.global_scale_div, rtn.global_scale_div)
    assert ScaleSearch().offsets == (-3, -2, -1, 1, 2, 3, 4, 5, 6, 7)


def _norm_errors(weight: torch.Tensor, q: nvfp4.NVFP4Tensor, importance: torch.Tensor | None,
                 norm: float) -> torch.Tensor:
    error = (q.dequantize().double() - weight.double()).abs() ** norm
    if importance is not None:
        error = error * importance.double()
    return error.unflatten(-1, (-1, 16)).sum(-1)


def test_scale_search_options():
    data_free = QuantizeOptions(method="mse", scheme="nvfp4a16")
    assert data_free.scale_search == ScaleSearch(0.8, 1.8, 2.0)  # llm-compressor's span
    for calibrated in (QuantizeOptions(method="gptq"), QuantizeOptions(method="mse", scheme="nvfp4"),
                       QuantizeOptions(method="mse", scheme="nvfp4a16", calib="calib.jsonl")):
        assert calibrated.scale_search is None  # the RTN code's neighbours
    assert QuantizeOptions(method="gptq", mse_range="0.7:2", mse_norm=2.4).scale_search == ScaleSearch(0.7, 2, 2.4)
    assert parse_scale_search("codes", 2.0) is None
    assert parse_scale_search("0.8:1.8", 2.4) == ScaleSearch(0.8, 1.8, 2.4)
    from fp4kit.errors import Fp4kitError

    for span, norm in (("1.8", 2.0), ("1.2:1.8", 2.0), ("0.8:0.9", 2.0), ("x:y", 2.0), ("codes", 2.4),
                       ("0.8:1.8", 0.0), ("0.8:1.8", float("nan"))):
        with pytest.raises(Fp4kitError):
            parse_scale_search(span, norm)


def _correlated_hessian(k: int, tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=gen) @ torch.randn(k, k, generator=gen) * 0.3
    x += torch.randn(tokens, k, generator=gen) * torch.rand(k, generator=gen) * 3
    return x.t() @ x


@pytest.mark.parametrize("search", [None, ScaleSearch(0.8, 1.8, 2.4)])
@pytest.mark.parametrize("mse_scales", [False, True])
def test_gptq_lowers_its_objective_below_rtn_and_mse(mse_scales, search):
    hessian = _correlated_hessian(128, 512, 0)
    weight = (torch.randn(48, 128, generator=torch.Generator().manual_seed(2)) * 0.02).to(torch.bfloat16)
    global_mul = nvfp4.global_scale_mul(weight.abs().amax())
    q = gptq_quantize(weight[None], hessian[None], global_mul[None], GptqOptions(mse_scales=mse_scales, search=search))
    gptq = gptq_objective(weight, q.dequantize()[0], hessian)
    rtn = gptq_objective(weight, nvfp4.quantize(weight, global_mul).dequantize(), hessian)
    mse = gptq_objective(weight, quantize_mse(weight, global_mul, hessian.diagonal()).dequantize(), hessian)
    assert gptq < 0.8 * rtn and gptq < mse
    assert torch.equal(q.global_scale_div, (1.0 / global_mul.double()).reshape(1))


def test_gptq_batched_equals_one_by_one_and_reference():
    """A stack of experts with their own Hessians gives each one's own result; a diagonal Hessian gives plain
    rounding (no error to spread), i.e. RTN's codes for RTN scales."""
    hessians = torch.stack([_correlated_hessian(64, 256, s) for s in range(3)])
    weights = (torch.randn(3, 32, 64, generator=torch.Generator().manual_seed(3)) * 0.05).to(torch.bfloat16)
    global_mul = torch.stack([nvfp4.global_scale_mul(w.abs().amax()) for w in weights])
    options = GptqOptions(block_size=32, mse_scales=False)
    batched = gptq_quantize(weights, hessians, global_mul, options)
    for b in range(3):
        alone = gptq_quantize(weights[b : b + 1], hessians[b : b + 1], global_mul[b : b + 1], options)
        assert torch.equal(alone.packed[0], batched.packed[b])
        assert torch.equal(alone.block_scale[0].view(torch.uint8), batched.block_scale[b].view(torch.uint8))
    diagonal = torch.diag(torch.rand(64) + 0.5)[None]
    plain = gptq_quantize(weights[:1], diagonal, global_mul[:1], options)
    rtn = nvfp4.quantize(weights[0].float(), global_mul[0])
    assert torch.equal(plain.packed[0], rtn.packed)


def test_dead_input_channels_keep_their_weights():
    hessian = _correlated_hessian(32, 128, 4)
    hessian[5, :] = 0
    hessian[:, 5] = 0
    weight = torch.full((4, 32), 0.5, dtype=torch.bfloat16)
    q = gptq_quantize(weight[None], hessian[None], nvfp4.global_scale_mul(weight.abs().amax())[None])
    assert torch.allclose(q.dequantize()[0][:, 5], weight[:, 5].float())


def _dequantized_model(src, out, family_cls):
    """transformers' model of SRC with the quantized checkpoint's weights, decompressed by compressed-tensors."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig

    qconfig = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    scheme = qconfig.config_groups["group_0"]
    model = family_cls.from_pretrained(src, dtype=torch.float32).eval()
    reader = CheckpointReader(out)
    modules = {n[: -len(".weight_packed")] for n in reader.names() if n.endswith(".weight_packed")}

    def dense(module: str) -> torch.Tensor:
        local = {k: reader.read(f"{module}.{k}") for k in ("weight_packed", "weight_scale", "weight_global_scale")}
        return NVFP4PackedCompressor.decompress(local, scheme)["weight"].float()

    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name in modules:
                module.weight.copy_(dense(name))
            if isinstance(getattr(module, "gate_up_proj", None), torch.Tensor):
                for e in range(module.gate_up_proj.shape[0]):
                    gate_up = torch.cat([dense(f"{name}.{e}.gate_proj"), dense(f"{name}.{e}.up_proj")])
                    module.gate_up_proj[e].copy_(gate_up)
                    module.down_proj[e].copy_(dense(f"{name}.{e}.down_proj"))
    return model


@pytest.fixture(scope="module")
def qwen_methods(tiny, tmp_path_factory):
    """The qwen3_moe fixture quantized with each method (compressed-tensors, W4A16) from one calibration file."""
    tmp = tmp_path_factory.mktemp("methods")
    src = tiny("qwen3_moe")
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    calib, ids = token_calibration_file(tmp, vocab)
    outs, reports = {}, {}
    for method in ("rtn", "mse", "gptq"):
        outs[method] = tmp / method
        options = QuantizeOptions(method=method, calib=calib if method == "gptq" else None, samples=12, seq_len=48,
                                  gptq_min_tokens=8)
        reports[method] = quantize_checkpoint(src, outs[method], options)
    return src, ids, outs, reports


def test_methods_reduce_the_model_output_error(qwen_methods):
    """Through compressed-tensors' decompression (the format's oracle) and transformers' model: on the calibration
    tokens, gptq's logits are closer to the source's than rtn's, and data-free mse's are too."""
    from transformers import Qwen3MoeForCausalLM

    src, ids, outs, reports = qwen_methods
    with torch.no_grad():
        reference = Qwen3MoeForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(input_ids=ids).logits
        errors = {}
        for method, out in outs.items():
            logits = _dequantized_model(src, out, Qwen3MoeForCausalLM)(input_ids=ids).logits
            errors[method] = (logits - reference).square().mean().item()
    assert errors["gptq"] < 0.8 * errors["rtn"], errors
    assert errors["mse"] < errors["rtn"], errors
    assert reports["rtn"].fallback_modules == [] and reports["mse"].fallback_modules == []


def test_fused_groups_share_one_global_scale(qwen_methods):
    _, _, outs, _ = qwen_methods
    for method in ("mse", "gptq"):
        reader = CheckpointReader(outs[method])
        scales = {n[: -len(".weight_global_scale")]: reader.read(n) for n in reader.names()
                  if n.endswith("weight_global_scale")}
        pairs = 0
        for module, scale in scales.items():
            if module.endswith("gate_proj"):
                assert torch.equal(scale, scales[module.replace("gate_proj", "up_proj")])
                pairs += 1
            if module.endswith("q_proj"):
                for other in ("k_proj", "v_proj"):
                    assert torch.equal(scale, scales[module.replace("q_proj", other)])
                pairs += 1
        assert pairs >= 4


def test_rtn_bytes_are_unchanged_by_the_methods(qwen_methods, tiny_nvfp4a16):
    _, _, outs, _ = qwen_methods
    ours, reference = CheckpointReader(outs["rtn"]), CheckpointReader(tiny_nvfp4a16("qwen3_moe"))
    assert sorted(ours.names()) == sorted(reference.names())
    assert all(torch.equal(ours.read(n).view(torch.uint8), reference.read(n).view(torch.uint8))
               for n in ours.names() if "weight_" in n)


def test_experts_without_enough_tokens_fall_back_and_are_reported(tiny, tmp_path):
    src = tiny("qwen3_moe")
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    calib, _ = token_calibration_file(tmp_path, vocab, samples=2, seq_len=16)
    report = quantize_checkpoint(src, tmp_path / "out", QuantizeOptions(
        method="gptq", calib=calib, samples=2, seq_len=16, gptq_min_tokens=10**6))
    reader = CheckpointReader(tmp_path / "out")
    experts = sorted({n[: -len(".weight_packed")] for n in reader.names() if ".experts." in n and "packed" in n})
    assert sorted(report.fallback_modules) == experts and experts
    assert not [m for m in report.fallback_modules if "self_attn" in m]


@pytest.mark.parametrize("scheme", ["nvfp4a16", "nvfp4"])
def test_modelopt_dialect_and_w4a4(tiny, tmp_path, scheme):
    """Both dialects carry the same gptq weights; W4A4 adds input scales for every quantized module (from the source
    pass: ModelOpt output cannot take them from the quantized pass, and by default takes them from the source)."""
    from fp4kit.formats import compressed_tensors as ct
    from fp4kit.formats import modelopt as mo
    from fp4kit.quantize.checkpoint import input_scale_source

    assert input_scale_source(QuantizeOptions(format="modelopt")) == "source"
    assert input_scale_source(QuantizeOptions()) == "quantized"
    src = tiny("qwen3_moe")
    common = dict(method="gptq", scheme=scheme, samples=4, seq_len=32, gptq_min_tokens=4, input_scales_from="source")
    quantize_checkpoint(src, tmp_path / "ct", QuantizeOptions(**common))
    quantize_checkpoint(src, tmp_path / "mo", QuantizeOptions(format="modelopt", **common))
    ct_reader, mo_reader = CheckpointReader(tmp_path / "ct"), CheckpointReader(tmp_path / "mo")
    modules = [n[: -len(".weight_packed")] for n in ct_reader.names() if n.endswith(".weight_packed")]
    for module in modules:
        a, a_input = ct.decode(module, {n: ct_reader.read(n) for n in ct_reader.names() if n.startswith(module + ".")})
        b, b_input = mo.decode(module, {n: mo_reader.read(n) for n in mo_reader.names() if n.startswith(module + ".")})
        assert torch.equal(a.packed, b.packed) and torch.equal(a.block_scale.view(torch.uint8),
                                                              b.block_scale.view(torch.uint8))
        assert torch.isclose(a.global_scale_div, b.global_scale_div, rtol=1e-6)  # each dialect's fp32 form
        assert (a_input is None) == (scheme == "nvfp4a16")
        if a_input is not None:
            assert b_input is not None and float(a_input) > 0 and torch.isclose(a_input, b_input, rtol=1e-6)


def test_bad_method_options_are_one_line_errors(tiny, tmp_path):
    from fp4kit.errors import Fp4kitError

    for options in (QuantizeOptions(method="smoothquant"), QuantizeOptions(method="gptq", gptq_damp=0),
                    QuantizeOptions(method="gptq", gptq_min_tokens=0), QuantizeOptions(method="mse", mse_range="2:3"),
                    QuantizeOptions(method="mse", mse_range="codes", mse_norm=2.4)):
        with pytest.raises(Fp4kitError):
            quantize_checkpoint(tiny("qwen3_moe"), tmp_path / "out", options)


def test_pass_statistics_are_the_routed_tokens_second_moments(tiny):
    """calibrate_quantized's Hessians against a full transformers forward: per expert X^T X of exactly the tokens
    its router sent it (gate/up one shared tensor, down from act(gate) * up of those tokens), q/k/v one tensor."""
    from transformers import Qwen3MoeForCausalLM

    from fp4kit.quantize.calibrate import calibrate_quantized

    src = tiny("qwen3_moe")
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(7))
    seen = {}

    def keep(index, layer, stats):
        seen[index] = stats
        return {}  # the layer stays unquantized: the next layer sees the source's hidden states

    calibrate_quantized(src, ids, keep, dtype=torch.float32)
    model = Qwen3MoeForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    captured = qwen3_moe_layer_inputs(model, 1, ids)
    stats = seen[1]
    prefix = "model.layers.1."
    hidden = captured["hidden"].reshape(-1, captured["hidden"].shape[-1])
    top_ids = captured["router"][2]
    experts = captured["experts"]
    for e in range(experts.gate_up_proj.shape[0]):
        x = hidden[(top_ids == e).any(dim=-1)]
        gate = stats.hessians[f"{prefix}mlp.experts.{e}.gate_proj"]
        assert gate is stats.hessians[f"{prefix}mlp.experts.{e}.up_proj"]
        assert stats.tokens[f"{prefix}mlp.experts.{e}.gate_proj"] == x.shape[0]
        torch.testing.assert_close(gate, x.t() @ x, rtol=1e-4, atol=1e-4)
        g, u = (x @ experts.gate_up_proj[e].t()).chunk(2, dim=-1)
        inner = experts.act_fn(g) * u
        torch.testing.assert_close(stats.hessians[f"{prefix}mlp.experts.{e}.down_proj"], inner.t() @ inner,
                                   rtol=1e-4, atol=1e-4)
    attn = captured["attn"].reshape(-1, captured["attn"].shape[-1])
    q = stats.hessians[f"{prefix}self_attn.q_proj"]
    assert q is stats.hessians[f"{prefix}self_attn.k_proj"] is stats.hessians[f"{prefix}self_attn.v_proj"]
    torch.testing.assert_close(q, attn.t() @ attn, rtol=1e-4, atol=1e-4)
    assert stats.tokens[f"{prefix}self_attn.v_proj"] == ids.numel()


def test_modules_outside_the_decoder_layers_fall_back(tiny, tmp_path):
    """Without the default ignore list GLM's lm_head and MTP layer (which transformers does not build) are quantized
    too: by data-free mse, and reported."""
    report = quantize_checkpoint(tiny("glm4_moe"), tmp_path / "out", QuantizeOptions(
        method="gptq", samples=4, seq_len=32, default_ignore=False, gptq_min_tokens=1))
    reader = CheckpointReader(tmp_path / "out")
    assert "lm_head.weight_packed" in reader and "model.layers.3.eh_proj.weight_packed" in reader
    assert {"lm_head", "model.layers.3.eh_proj", "model.layers.3.self_attn.q_proj"} <= set(report.fallback_modules)
    assert not [m for m in report.fallback_modules if m.startswith("model.layers.0.self_attn")]


def test_w4a4_input_scales_come_from_the_quantized_pass_or_the_source(tiny, tmp_path):
    """By default gptq's activation scales come from its own forward of the quantized layers: they differ from rtn's
    (the source model's calibration) from layer 1 on at the latest; ``source`` gives rtn's exactly."""
    src = tiny("qwen3_moe")
    common = dict(scheme="nvfp4", samples=4, seq_len=32)
    quantize_checkpoint(src, tmp_path / "rtn", QuantizeOptions(**common))
    quantize_checkpoint(src, tmp_path / "gptq", QuantizeOptions(method="gptq", input_scales_from="source", **common))
    quantize_checkpoint(src, tmp_path / "q", QuantizeOptions(method="gptq", **common))
    readers = {name: CheckpointReader(tmp_path / name) for name in ("rtn", "gptq", "q")}
    names = [n for n in readers["rtn"].names() if n.endswith("input_global_scale")]
    assert names and all(torch.equal(readers["rtn"].read(n), readers["gptq"].read(n)) for n in names)
    later = [n for n in names if ".layers.1." in n]
    assert any(not torch.equal(readers["rtn"].read(n), readers["q"].read(n)) for n in later)


def test_quantized_sources_take_data_free_mse_and_calibrated_methods(tiny, tmp_path):
    """From an FP8-block source: data-free mse, and gptq, whose layer pass runs the source's dequantized layers;
    with dequant_dtype bf16 its output is the output of gptq on compressed-tensors' bf16 copy of the source."""
    from helpers import dequantized_bf16_copy

    from fp4kit.testing.fixtures import write_fp8_block_source

    fp8 = write_fp8_block_source(tiny("qwen3_moe"), tmp_path / "fp8")
    report = quantize_checkpoint(fp8, tmp_path / "mse", QuantizeOptions(method="mse"))
    assert report.quantized_linears > 0 and "model.layers.0.self_attn.q_proj.weight_packed" in CheckpointReader(
        tmp_path / "mse")
    gptq = dict(method="gptq", samples=4, seq_len=16)
    quantize_checkpoint(fp8, tmp_path / "gptq", QuantizeOptions(dequant_dtype="bf16", **gptq))
    quantize_checkpoint(dequantized_bf16_copy(fp8, tmp_path / "copy"), tmp_path / "gptq-copy", QuantizeOptions(**gptq))
    found, expected = (CheckpointReader(tmp_path / name) for name in ("gptq", "gptq-copy"))
    assert found.names() == expected.names()
    assert all(torch.equal(found.read(n).view(torch.uint8), expected.read(n).view(torch.uint8))
               for n in expected.names())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gptq_cuda_graph_replays_give_the_eager_bytes():
    """Lazy blocks replayed from CUDA graphs (every shape after its second call) equal the eager pass, also when
    one runner serves stacks of other shapes in between."""
    from fp4kit.quantize.gptq import LazyBlocks

    device = torch.device("cuda")
    graphed = LazyBlocks()
    for seed, (batch, rows, k) in enumerate([(4, 96, 512), (3, 64, 256), (4, 96, 512)]):
        hessians = torch.stack([_correlated_hessian(k, 2 * k, 10 * seed + b) for b in range(batch)]).to(device)
        weights = (torch.randn(batch, rows, k, generator=torch.Generator().manual_seed(seed)) * 0.05).to(device)
        global_mul = torch.stack([nvfp4.global_scale_mul(w.abs().amax()) for w in weights])
        for mse_scales in (True, False):
            options = GptqOptions(block_size=64, mse_scales=mse_scales)
            eager = gptq_quantize(weights, hessians, global_mul, options, LazyBlocks(graphs=False))
            replayed = gptq_quantize(weights, hessians, global_mul, options, graphed)
            assert torch.equal(eager.packed, replayed.packed)
            assert torch.equal(eager.block_scale.view(torch.uint8), replayed.block_scale.view(torch.uint8))
    assert graphed._graphs  # the replays above did come from graphs


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe", "llama4", "deepseek_v3"])
def test_statistics_forward_without_the_routed_experts_gives_the_same_statistics(tiny, family, monkeypatch):
    """The statistics forward skips transformers' routed-expert computation (its output is dropped): every Hessian
    and token count, shared experts' and later modules' included, is what the full forward gives."""
    from fp4kit.quantize import calibrate

    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(3))
    runs = []
    for skip in (False, True):
        if not skip:  # the full forward: transformers' routed experts run too
            monkeypatch.setattr(calibrate._SecondMomentRecorder, "_skip_routed_experts", lambda self: None)
        else:
            monkeypatch.undo()
        seen: dict[str, torch.Tensor] = {}
        tokens: dict[str, int] = {}

        def keep(index, layer, stats, seen=seen, tokens=tokens):
            seen.update(stats.hessians)
            tokens.update(stats.tokens)
            return {}

        calibrate.calibrate_quantized(tiny(family), ids, keep, dtype=torch.float32)
        runs.append((seen, tokens))
    (full, full_tokens), (skipped, skipped_tokens) = runs
    assert full.keys() == skipped.keys() and full_tokens == skipped_tokens
    assert any(".shared" in name for name in full) or family in ("qwen3_moe",)
    for name in full:
        assert torch.equal(full[name], skipped[name]), name


@pytest.mark.parametrize(("family", "square"), [("qwen3_moe", False), ("qwen3_vl_moe", False), ("llama4", False),
                                                ("deepseek_v3", False), ("qwen3_vl_moe", True)])
def test_the_quantizer_takes_the_loaded_layers_weights_only_where_they_are_the_checkpoints(tiny, tmp_path, family,
                                                                                          square):
    """LayerQuantizer quantizes the loaded layer's own weights instead of reading the layer again: every weight the
    layer is said to hold equals the checkpoint's [N, K] weight; a fused expert tensor stored transposed whose last
    two dimensions are equal is loaded as stored (as transformers' loader does), so there the layer does not."""
    from fp4kit.io.checkpoint import CheckpointReader, read_config
    from fp4kit.pipeline.demo import demo_overrides
    from fp4kit.quantize.calibrate import calibrate_quantized
    from fp4kit.quantize.plan import build_plan, read_group_weights
    from fp4kit.testing.fixtures import build_fixture

    src = build_fixture(family, tmp_path / "square", overrides=demo_overrides(family)) if square else tiny(family)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    counts = {"held": 0, "read": 0}
    with CheckpointReader(src) as reader:
        groups = build_plan(reader, read_config(src)).groups

        def check(index, layer, stats):
            for group in (g for g in groups if g.layer == index):
                for c, expected in zip(group.members, read_group_weights(reader, group), strict=True):
                    held = layer.source_weight(c.linear.module, c.linear.source, reader.info(c.linear.source.tensor))
                    counts["read" if held is None else "held"] += 1
                    assert held is None or torch.equal(held, expected), c.linear.module
            return {}

        calibrate_quantized(src, ids, check)
    assert counts["held"] > 0
    assert (counts["read"] > 0) == square, counts
