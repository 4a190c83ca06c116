"""The ModelOpt NVFP4 dialect (fp4kit/formats/modelopt.py): fp32 divisor rule, encode/decode, fused Llama-4 layout,
and agreement with a real nvidia-modelopt 0.47 export (modelopt/torch/export/unified_export_hf.py and
convert_hf_config.py) of the tiny fixtures (nvidia-modelopt 0.47.0 comes with the test extra; without it those tests
skip, and pytest's -ra summary says so).
"""

from __future__ import annotations

import json

import pytest
import torch

from fp4kit.formats import modelopt as mo
from fp4kit.formats.compressed_tensors import NAME as CT
from fp4kit.formats.detect import decoded_scale, needs_exact_record, stored_scale
from fp4kit.formats.modelopt import NAME as MO
from fp4kit.io.checkpoint import CheckpointReader
from fp4kit.nvfp4 import NVFP4Tensor, quantize

TINY = torch.finfo(torch.float32).tiny


def all_bf16_multipliers() -> torch.Tensor:
    """Every positive finite bf16 value whose reciprocal is a normal fp32 number."""
    values = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    return values[(values >= TINY) & (1.0 / values.double() >= TINY) & (1.0 / values.double() < 3e38)]


def test_fp32_divisor_rule_exhaustive_over_bf16_multipliers():
    multipliers = all_bf16_multipliers()
    divisors = 1.0 / multipliers.double()
    written = mo.fp32_divisor(divisors)
    nearest = divisors.float()
    restores = (1.0 / written.double()).float() == multipliers
    # Where a divisor within DIVISOR_SEARCH_ULPS restores G, the closest such one is written.
    candidates = [nearest]
    up = down = nearest
    for _ in range(mo.DIVISOR_SEARCH_ULPS):
        up, down = torch.nextafter(up, torch.tensor(1e39)), torch.nextafter(down, torch.tensor(0.0))
        candidates += [up, down]
    stacked = torch.stack(candidates)
    ok = (1.0 / stacked.double()).float() == multipliers
    assert torch.equal(restores, ok.any(0))
    gap = torch.where(ok, (stacked.double() - divisors).abs(), torch.inf).amin(0)
    assert torch.equal((written.double() - divisors).abs()[restores], gap[restores])
    # Where none exists (fp32 D is too coarse for G's grid: ~20% of bf16 G), the nearest fp32 value is written.
    assert torch.equal(written[~restores], nearest[~restores])
    assert 0.15 < (~restores).float().mean() < 0.25
    # Exactly representable divisors are written as they are.
    exact = torch.tensor([2.0**-20, 0.5, 1 / 2688.0], dtype=torch.float32)
    assert torch.equal(mo.fp32_divisor(exact.double()), exact)


@pytest.mark.parametrize(("first", "second"), [(CT, MO), (MO, CT)])
def test_exact_scale_records_make_every_round_trip_byte_exact(first, second):
    """First dialect -> second -> first restores the stored fp32 scale for every bf16 multiplier (CT) and for a
    sweep of fp32 divisors (ModelOpt); the metadata record is written only where the fp32 value alone cannot."""
    if first == CT:
        canonical = 1.0 / all_bf16_multipliers().double()
    else:
        generator = torch.Generator().manual_seed(0)
        bits = torch.randint(0x30000000, 0x40000000, (200_000,), dtype=torch.int32, generator=generator)
        canonical = bits.view(torch.float32).double()
    original = stored_scale(first, canonical)
    read_first = decoded_scale(first, original)
    in_second = stored_scale(second, read_first)
    record = needs_exact_record(second, read_first)
    read_second = torch.where(record, read_first, decoded_scale(second, in_second))
    assert torch.equal(stored_scale(first, read_second), original)
    assert 0 < record.float().mean() < 0.3


def test_encode_decode_and_planned_agree():
    weight = quantize(torch.randn(48, 64, dtype=torch.bfloat16), torch.tensor(1000.0))
    input_div = torch.tensor(1 / 3.0, dtype=torch.float64)
    tensors = mo.encode("m", weight, input_div)
    plan = {(t.name, t.dtype, t.shape) for t in mo.planned("m", 48, 64, True)}
    assert plan == {(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()}
    back, back_input = mo.decode("m", tensors)
    assert torch.equal(back.packed, weight.packed) and torch.equal(back.block_scale.view(torch.uint8),
                                                                   weight.block_scale.view(torch.uint8))
    assert tensors["m.weight_scale_2"].shape == () and tensors["m.input_scale"].dtype == torch.float32
    assert float(back_input) == float(mo.fp32_divisor(input_div))


def test_fused_layout_is_the_per_expert_transpose():
    generator = torch.Generator().manual_seed(1)
    weights = [quantize(torch.randn(2 * 32, 64, generator=generator).bfloat16(), torch.tensor(512.0))
               for _ in range(3)]
    tensors = mo.encode_fused("x.experts", "gate_up_proj", weights, [None] * 3)
    plan = {(t.name, t.dtype, t.shape) for t in mo.fused_planned("x.experts", "gate_up_proj", 3, 64, 64, False)}
    assert plan == {(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()}
    assert tensors["x.experts.gate_up_proj"].shape == (3, 32, 64)  # [E, H/2, 2I]
    assert tensors["x.experts.gate_up_proj_weight_scale"].shape == (3, 4, 64)  # [E, H/16, 2I]
    back, input_div = mo.decode_fused("x.experts", "gate_up_proj", tensors)
    assert input_div is None
    for w, b in zip(weights, back, strict=True):
        assert torch.equal(w.packed, b.packed) and torch.equal(w.dequantize(), b.dequantize())
    other_scale = NVFP4Tensor(weights[0].packed, weights[0].block_scale, weights[0].global_scale_div * 2)
    assert not mo.fused_lossless([weights[1], other_scale], [None, None])


def test_configs_have_the_keys_vllm_requires():
    hf = mo.hf_quant_config("nvfp4", ["lm_head"])
    assert set(hf["quantization"]) == {"quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules"}
    assert mo.hf_quant_config("nvfp4a16", [])["quantization"]["quant_algo"] == "W4A16_NVFP4"
    qc = mo.quantization_config("nvfp4a16", ["lm_head"])
    assert qc["quant_method"] == "modelopt" and "input_activations" not in qc["config_groups"]["group_0"]
    assert "input_activations" in mo.quantization_config("nvfp4", [])["config_groups"]["group_0"]


# ---- against a real nvidia-modelopt export -------------------------------------------------------------------


@pytest.fixture(scope="module")
def modelopt_export(tmp_path_factory):
    """modelopt_export(family, cfg) -> directory of nvidia-modelopt's HF export of the tiny fixture."""
    pytest.importorskip("modelopt.torch.quantization")
    import warnings

    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    from fp4kit.testing.fixtures import build_model, fixture_spec

    built = {}

    def get(family: str, cfg: str):
        if (family, cfg) not in built:
            out = tmp_path_factory.mktemp(f"modelopt-{family}-{cfg}")
            model = build_model(family).to(torch.bfloat16)
            model.config.architectures = [fixture_spec(family)["model_class"]]
            ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = mtq.quantize(model, getattr(mtq, cfg), lambda m: m(input_ids=ids))
                export_hf_checkpoint(model, export_dir=out)
            built[(family, cfg)] = out
        return built[(family, cfg)]

    return get


def header(path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    reader = CheckpointReader(path)
    return {n: (i.dtype, i.shape) for n, i in reader.tensors.items()}


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_fp4kit_modelopt_output_matches_a_modelopt_export(family, modelopt_export, tiny_nvfp4a16, tmp_path):
    from fp4kit.tools.convert import convert_checkpoint

    theirs = modelopt_export(family, "W4A16_NVFP4_CFG")
    convert_checkpoint(tiny_nvfp4a16(family), tmp_path / "ours", MO)
    ours_h, theirs_h = header(tmp_path / "ours"), header(theirs)
    mtp = f"model.layers.{json.loads((theirs / 'config.json').read_text())['num_hidden_layers']}."
    ours_h = {n: v for n, v in ours_h.items() if not n.startswith(mtp)}
    assert {n: s for n, (_, s) in ours_h.items()} == {n: s for n, (_, s) in theirs_h.items()}
    # GLM's router is fp32 in real checkpoints (and fp4kit's fixture); the export's model was cast to bf16 whole.
    fp32_router = ("mlp.gate.weight", "e_score_correction_bias")
    assert {n: d for n, (d, _) in ours_h.items() if not n.endswith(fp32_router)} == {
        n: d for n, (d, _) in theirs_h.items() if not n.endswith(fp32_router)}
    ours_q = json.loads((tmp_path / "ours" / "hf_quant_config.json").read_text())
    theirs_q = json.loads((theirs / "hf_quant_config.json").read_text())
    assert ours_q.keys() == theirs_q.keys() and ours_q["quantization"].keys() == theirs_q["quantization"].keys()
    for key in ("quant_algo", "group_size", "kv_cache_quant_algo"):
        assert ours_q["quantization"][key] == theirs_q["quantization"][key]
    routers = {m for m in theirs_q["quantization"]["exclude_modules"] if m.endswith("mlp.gate")}
    assert routers <= set(ours_q["quantization"]["exclude_modules"])
    ours_c = json.loads((tmp_path / "ours" / "config.json").read_text())["quantization_config"]
    theirs_c = json.loads((theirs / "config.json").read_text())["quantization_config"]
    assert ours_c.keys() == theirs_c.keys() and ours_c["config_groups"] == theirs_c["config_groups"]


@pytest.mark.parametrize(("family", "cfg"), [("llama4", "NVFP4_DEFAULT_CFG"), ("qwen3_moe", "NVFP4_DEFAULT_CFG")])
def test_modelopt_export_round_trips_through_compressed_tensors(family, cfg, modelopt_export, tmp_path):
    """ModelOpt -> compressed-tensors -> ModelOpt gives back every tensor byte for byte (Llama-4: the fused
    [E, H/2, 2I] experts included), and the compressed-tensors step dequantizes to the same weights."""
    from fp4kit.formats.detect import open_checkpoint
    from fp4kit.tools.convert import convert_checkpoint

    theirs = modelopt_export(family, cfg)
    convert_checkpoint(theirs, tmp_path / "ct", CT)
    report = convert_checkpoint(tmp_path / "ct", tmp_path / "mo", MO)
    assert report.fused_tensors == (4 if family == "llama4" else 0)
    a, b = CheckpointReader(theirs), CheckpointReader(tmp_path / "mo")
    assert header(theirs) == header(tmp_path / "mo")
    for name in a.names():
        assert torch.equal(a.read(name).reshape(-1).view(torch.uint8), b.read(name).reshape(-1).view(torch.uint8)), name
    with open_checkpoint(theirs) as src, open_checkpoint(tmp_path / "ct") as mid:
        assert src.scheme == mid.scheme == "nvfp4"
        mid_modules = {m.name: m for m in mid.modules}
        for m in src.modules:
            assert torch.equal(src.read_weight(m).dequantize(), mid.read_weight(mid_modules[m.name]).dequantize())
