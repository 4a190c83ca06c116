"""GPTQ's asymmetric calibration (GPTAQ, --gptq-asymmetric): the float target's closed form against a direct
least-squares solution, the solve against plain GPTQ under the asymmetric objective, and the two-stream pass's
cross terms against full transformers forwards of the float and the perturbed model."""

from __future__ import annotations

import pytest
import torch
from helpers import qwen3_moe_layer_inputs

from fp4kit import nvfp4
from fp4kit.errors import Fp4kitError
from fp4kit.quantize import QuantizeOptions, quantize_checkpoint
from fp4kit.quantize.gptq import GptqOptions, _inverse_hessian_factor, float_target, gptq_quantize


def _streams(tokens: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float inputs x_f [T, K] (correlated channels) and quantized-model inputs x = x_f distorted systematically."""
    gen = torch.Generator().manual_seed(seed)
    x_float = torch.randn(tokens, k, generator=gen) @ (torch.eye(k) + 0.3 * torch.randn(k, k, generator=gen))
    x = x_float @ (torch.eye(k) + 0.08 * torch.randn(k, k, generator=gen)) + 0.05 * torch.randn(tokens, k,
                                                                                                 generator=gen)
    return x_float, x


def test_float_target_is_the_least_squares_solution():
    """alpha 1 and negligible damping: W' minimizes ||x_f W^T - x W'^T|| (torch.linalg.lstsq in float64)."""
    x_float, x = _streams(512, 48, 0)
    weight = torch.randn(24, 48, generator=torch.Generator().manual_seed(1))
    hessian = x.t() @ x
    cross = (x_float - x).t() @ x
    upper = _inverse_hessian_factor(hessian[None], 1e-7)
    target = float_target(weight[None], cross[None], upper, 1.0)[0]
    direct = torch.linalg.lstsq(x.double(), (x_float @ weight.t()).double()).solution.t()
    torch.testing.assert_close(target.double(), direct, rtol=2e-3, atol=2e-3)
    assert not torch.allclose(target, weight, atol=1e-2)  # the correction is not nothing here
    half = float_target(weight[None], cross[None], upper, 0.5)[0]
    torch.testing.assert_close(half, (weight + target) / 2, rtol=1e-4, atol=1e-4)


def test_asymmetric_gptq_matches_the_float_outputs_better():
    """Under the asymmetric objective ||x_f W^T - x Q^T||^2 the asymmetric solve beats plain GPTQ (which matches
    x W^T) on systematically distorted inputs, in the same NVFP4 format (one global scale, the weights')."""
    x_float, x = _streams(1024, 64, 2)
    weight = (torch.randn(32, 64, generator=torch.Generator().manual_seed(3)) * 0.05).to(torch.bfloat16)
    hessian, cross = x.t() @ x, (x_float - x).t() @ x
    global_mul = nvfp4.global_scale_mul(weight.abs().amax())[None]
    reference = x_float @ weight.float().t()

    def error(q: nvfp4.NVFP4Tensor) -> float:
        return float((reference - x @ q.dequantize()[0].t()).square().sum())

    plain = gptq_quantize(weight[None], hessian[None], global_mul)
    asymmetric = gptq_quantize(weight[None], hessian[None], global_mul, GptqOptions(asymmetric=1.0), cross=cross[None])
    assert error(asymmetric) < 0.7 * error(plain)
    assert torch.equal(asymmetric.global_scale_div, plain.global_scale_div)
    off = gptq_quantize(weight[None], hessian[None], global_mul, GptqOptions(asymmetric=0.0), cross=cross[None])
    assert torch.equal(off.packed, plain.packed)  # alpha 0: plain GPTQ's bytes


def test_two_stream_cross_terms_equal_the_float_and_quantized_models(tiny):
    """calibrate_quantized(float_targets=True): with layer 0 perturbed, layer 1's cross terms are (x_f - x)^T x of
    the float model's and the perturbed model's inputs, per expert over the tokens the perturbed router sent it;
    layer 0 (both streams read the embeddings) has none."""
    from transformers import Qwen3MoeForCausalLM

    from fp4kit.quantize.calibrate import calibrate_quantized

    src = tiny("qwen3_moe")
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(7))
    seen = {}
    prefix0 = "model.layers.0."

    def perturb(index, layer, stats):
        seen[index] = stats
        if index:
            return {}
        return {name: layer.weight(name) * 0.9 for name in stats.hessians if name.startswith(prefix0)}

    calibrate_quantized(src, ids, perturb, dtype=torch.float32, float_targets=True)
    assert all(float(c.abs().max()) == 0 for c in seen[0].cross.values())
    assert seen[0].cross.keys() == seen[0].hessians.keys()

    def layer1_inputs(scale: float) -> dict[str, torch.Tensor]:
        model = Qwen3MoeForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        with torch.no_grad():
            for module in model.model.layers[0].modules():
                for name in ("weight", "gate_up_proj", "down_proj"):
                    param = getattr(module, name, None)
                    if isinstance(param, torch.nn.Parameter) and param.dim() >= 2 and module is not \
                            model.model.layers[0].mlp.gate and not isinstance(module, torch.nn.Embedding):
                        param.mul_(scale)
        return qwen3_moe_layer_inputs(model, 1, ids)

    float_inputs, quantized_inputs = layer1_inputs(1.0), layer1_inputs(0.9)
    stats = seen[1]
    prefix = "model.layers.1."
    flat = {k: v.reshape(-1, v.shape[-1]) for k, v in (("attn_f", float_inputs["attn"]),
                                                       ("attn_q", quantized_inputs["attn"]),
                                                       ("hidden_f", float_inputs["hidden"]),
                                                       ("hidden_q", quantized_inputs["hidden"]))}
    q = stats.cross[f"{prefix}self_attn.q_proj"]
    assert q is stats.cross[f"{prefix}self_attn.v_proj"]
    expected = (flat["attn_f"] - flat["attn_q"]).t() @ flat["attn_q"]
    assert float(expected.abs().max()) > 0
    torch.testing.assert_close(q, expected, rtol=1e-3, atol=1e-4)
    experts = quantized_inputs["experts"]
    top_ids = quantized_inputs["router"][2]
    for e in range(experts.gate_up_proj.shape[0]):
        routed = (top_ids == e).any(dim=-1)
        x, x_float = flat["hidden_q"][routed], flat["hidden_f"][routed]
        torch.testing.assert_close(stats.cross[f"{prefix}mlp.experts.{e}.gate_proj"], (x_float - x).t() @ x,
                                   rtol=1e-3, atol=1e-4)
        inner = []
        for rows in (x, x_float):
            g, u = (rows @ experts.gate_up_proj[e].t()).chunk(2, dim=-1)
            inner.append(experts.act_fn(g) * u)
        torch.testing.assert_close(stats.cross[f"{prefix}mlp.experts.{e}.down_proj"],
                                   (inner[1] - inner[0]).t() @ inner[0], rtol=1e-3, atol=1e-4)


def test_asymmetric_option_quantizes_and_bad_values_are_one_line_errors(tiny, tmp_path):
    src = tiny("qwen3_moe")
    report = quantize_checkpoint(src, tmp_path / "out", QuantizeOptions(
        scheme="nvfp4a16", method="gptq", gptq_asymmetric=0.5, samples=4, seq_len=32))
    assert (tmp_path / "out" / "config.json").exists() and report is not None
    for options in (QuantizeOptions(method="gptq", gptq_asymmetric=-1.0),
                    QuantizeOptions(method="gptq", gptq_asymmetric=float("nan")),
                    QuantizeOptions(method="mse", gptq_asymmetric=0.5)):
        with pytest.raises(Fp4kitError):
            quantize_checkpoint(src, tmp_path / "bad", options)
        assert not (tmp_path / "bad").exists()


def _hessian(k: int, tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=gen) @ torch.randn(k, k, generator=gen) * 0.3
    x += torch.randn(tokens, k, generator=gen) * torch.rand(k, generator=gen) * 3
    return x.t() @ x


@pytest.mark.parametrize("mse_scales", [False, True])
def test_act_order_keeps_the_natural_groups_scales_and_a_plain_format(mse_scales):
    """--gptq-act-order: the block scales are those chosen up front from the natural-order 16-blocks (a diagonal
    Hessian spreads no error, so the codes are plain rounding under them), permuting columns inside their 16-blocks
    permutes the output the same way (the order lives only in the pass), and the objective drops below RTN's."""
    from fp4kit.quantize.gptq import gptq_objective
    from fp4kit.quantize.scale_search import GPTQ_CODE_OFFSETS, search_block_scales

    options = GptqOptions(mse_scales=mse_scales, act_order=True, block_size=32)
    weight = (torch.randn(24, 64, generator=torch.Generator().manual_seed(5)) * 0.05).to(torch.bfloat16)
    global_mul = nvfp4.global_scale_mul(weight.abs().amax())
    diagonal = torch.diag(torch.rand(64, generator=torch.Generator().manual_seed(6)) + 0.5)
    q = gptq_quantize(weight[None], diagonal[None], global_mul[None], options)
    if mse_scales:
        scales = search_block_scales(weight.float(), global_mul, diagonal.diagonal(), None, GPTQ_CODE_OFFSETS)
    else:
        scales = nvfp4.rtn_block_scale(weight.float().unflatten(-1, (-1, 16)).abs().amax(-1), global_mul)
    assert torch.equal(q.block_scale[0].float(), scales)
    expected = nvfp4.encode_blocks(weight.float().unflatten(-1, (-1, 16)), scales / global_mul)
    assert torch.equal(q.packed[0], expected)

    hessian = _hessian(64, 256, 7)
    q = gptq_quantize(weight[None], hessian[None], global_mul[None], options)
    within = torch.cat([b * 16 + torch.randperm(16, generator=torch.Generator().manual_seed(b)) for b in range(4)])
    shuffled = gptq_quantize(weight[:, within][None], hessian[within][:, within][None], global_mul[None], options)
    assert torch.equal(shuffled.dequantize()[0], q.dequantize()[0][:, within])
    rtn = nvfp4.quantize(weight, global_mul).dequantize()
    assert gptq_objective(weight, q.dequantize()[0], hessian) < 0.8 * gptq_objective(weight, rtn, hessian)


def test_act_order_option_is_validated(tiny, tmp_path):
    with pytest.raises(Fp4kitError):
        quantize_checkpoint(tiny("qwen3_moe"), tmp_path / "bad", QuantizeOptions(method="mse", gptq_act_order=True))
    assert not (tmp_path / "bad").exists()


def test_act_quant_statistics_are_the_fake_quantized_inputs_second_moments(tiny, tmp_path):
    """activation_divisors: a module's Hessian is fq(x)^T fq(x) of its inputs fake-quantized per 16-block with its
    divisor (fp4kit.nvfp4.fake_quantize_activation), the others' stay x^T x; the option runs end to end in W4A4."""
    from transformers import Qwen3MoeForCausalLM

    from fp4kit.quantize.calibrate import calibrate_quantized

    src = tiny("qwen3_moe")
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(9))
    q_name, o_name = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"
    seen = {}

    def keep(index, layer, stats):
        seen[index] = stats
        return {}

    model = Qwen3MoeForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    captured = {}
    model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda m, a: captured.setdefault("q", a[0]))
    with torch.no_grad():
        model(input_ids=ids)
    x = captured["q"].reshape(-1, captured["q"].shape[-1])
    divisor = torch.tensor(float(x.abs().amax()) / (448 * 6) * 4, dtype=torch.float64)  # coarse: visible rounding
    calibrate_quantized(src, ids, keep, dtype=torch.float32, activation_divisors={q_name: divisor})
    fq = nvfp4.fake_quantize_activation(x, divisor)
    assert not torch.allclose(fq, x, atol=1e-3)
    torch.testing.assert_close(seen[0].hessians[q_name], fq.t() @ fq, rtol=1e-4, atol=1e-4)
    calibrate_quantized(src, ids, keep, dtype=torch.float32)
    torch.testing.assert_close(seen[0].hessians[q_name], x.t() @ x, rtol=1e-4, atol=1e-4)
    assert o_name in seen[0].hessians

    out = tmp_path / "w4a4"
    quantize_checkpoint(src, out, QuantizeOptions(scheme="nvfp4", method="gptq", gptq_act_quant=True,
                                                  input_scales_from="source", samples=4, seq_len=32))
    assert (out / "config.json").exists()
    for options in (QuantizeOptions(scheme="nvfp4", method="gptq", gptq_act_quant=True),
                    QuantizeOptions(scheme="nvfp4a16", method="gptq", gptq_act_quant=True,
                                    input_scales_from="source")):
        with pytest.raises(Fp4kitError):
            quantize_checkpoint(src, tmp_path / "bad", options)
