"""Per-module schemes: the --scheme-for map, and FP8 weights byte-identical to llm-compressor's."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from fp4kit.errors import Fp4kitError
from fp4kit.fp8 import quantize_fp8
from fp4kit.quantize.schemes import SchemeMap


def _tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_first_matching_rule_wins_and_default_applies():
    smap = SchemeMap.parse("nvfp4", [r"re:.*self_attn\..*=fp8-dynamic", r"self_attn\.o_proj=bf16",
                                     r"shared_expert=fp8-block"])
    assert smap.scheme_of("model.layers.0.self_attn.o_proj") == "fp8-dynamic"  # the first rule, not the second
    assert smap.scheme_of("model.layers.0.mlp.shared_expert.down_proj") == "fp8-block"
    assert smap.scheme_of("model.layers.0.mlp.experts.3.up_proj") == "nvfp4"
    assert smap.mixed and not SchemeMap.parse("nvfp4", ["attn=nvfp4"]).mixed
    assert smap.unused_rules(["model.layers.0.self_attn.o_proj"]) == [r"self_attn\.o_proj=bf16",
                                                                       "shared_expert=fp8-block"]


def test_fused_group_must_share_one_scheme():
    smap = SchemeMap.parse("nvfp4", [r"q_proj=fp8-dynamic"])
    qkv = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    with pytest.raises(Fp4kitError, match="q_proj gets fp8-dynamic but .*k_proj gets nvfp4"):
        smap.group_scheme(qkv)
    assert SchemeMap.parse("nvfp4", [r"self_attn=fp8-block"]).group_scheme(qkv) == "fp8-block"


@pytest.mark.parametrize("rule,message", [
    ("attn", "expected REGEX=SCHEME"),
    ("attn=fp6", "unknown scheme 'fp6'"),
    ("(attn=bf16", "not a valid regex"),
])
def test_bad_rules_are_one_line_errors(rule, message):
    with pytest.raises(Fp4kitError, match=message) as info:
        SchemeMap.parse("nvfp4", [rule])
    assert "\n" not in str(info.value)


def _checkpoint(path, shapes: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    path.mkdir()
    gen = torch.Generator().manual_seed(0)
    tensors = {f"{m}.weight": (torch.randn(*s, generator=gen) * 0.05).to(torch.bfloat16) for m, s in shapes.items()}
    tensors["model.layers.0.self_attn.q_proj.weight"][3] = 0  # an all-zero channel: the eps scale
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text("{}")
    return tensors


def test_fp8_weights_match_llm_compressor_model_free_ptq(tmp_path):
    """llm-compressor 0.14's model_free_ptq with a two-group config (FP8_DYNAMIC attention, FP8_BLOCK experts, first
    match wins for o_proj): every FP8 weight and scale equal byte for byte to ours. (Its FP8_BLOCK path fails to
    save a weight whose dimensions are not multiples of 128, so the block shapes here divide.)"""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from llmcompressor import model_free_ptq

    shapes = {"model.layers.0.self_attn.q_proj": (256, 384), "model.layers.0.self_attn.o_proj": (384, 200),
              "model.layers.0.self_attn.k_proj": (130, 384),
              "model.layers.0.mlp.experts.0.gate_proj": (256, 384),
              "model.layers.0.mlp.experts.0.down_proj": (384, 128),
              "model.layers.0.mlp.shared_expert.up_proj": (128, 384)}
    source = _checkpoint(tmp_path / "src", shapes)
    config = QuantizationConfig(config_groups={
        "group_0": preset_name_to_scheme("FP8_DYNAMIC", [r"re:.*self_attn\..*"]),
        "group_1": preset_name_to_scheme("FP8_BLOCK", [r"re:.*mlp\..*"]),
    })
    model_free_ptq(tmp_path / "src", tmp_path / "ref", config=config)
    ref = _tensors(tmp_path / "ref")
    smap = SchemeMap.parse("bf16", [r"re:.*self_attn\..*=fp8-dynamic", r"re:.*mlp\..*=fp8-block"])
    assert smap.mixed
    for module in shapes:
        scheme = smap.scheme_of(module)
        ours = quantize_fp8(source[f"{module}.weight"], scheme, module)
        assert ref[f"{module}.weight"].dtype == torch.float8_e4m3fn
        assert torch.equal(ours.codes.view(torch.uint8), ref[f"{module}.weight"].view(torch.uint8)), module
        theirs = ref[f"{module}.weight_scale"]
        assert ours.scale.dtype == theirs.dtype and torch.equal(ours.scale, theirs), module
    assert set(ref) == {f"{m}.{s}" for m in shapes for s in ("weight", "weight_scale")}


def test_fp8_zero_channel_and_saturation():
    weight = torch.zeros(130, 300, dtype=torch.bfloat16)
    weight[1, :] = 1.0
    weight[2, 5] = -3.0
    for scheme in ("fp8-dynamic", "fp8-block"):
        q = quantize_fp8(weight, scheme)
        assert torch.isfinite(q.dequantize()).all()
        torch.testing.assert_close(q.dequantize(), weight.float(), rtol=0.07, atol=0)
    with pytest.raises(Fp4kitError, match="non-finite"):
        quantize_fp8(torch.full((4, 4), float("inf")), "fp8-dynamic", "m")


def test_mixed_config_and_tensors_match_llm_compressor(tmp_path):
    """A three-group recipe (NVFP4A16 experts, FP8_DYNAMIC attention, FP8_BLOCK shared expert) through
    model_free_ptq: our quantization_config equals its config.json's, and our FP8 tensors, named and encoded by
    the dialect, equal its bytes."""
    import json

    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from llmcompressor import model_free_ptq

    from fp4kit.formats import compressed_tensors as ct

    attn = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    experts = ["model.layers.0.mlp.experts.0.gate_proj", "model.layers.0.mlp.experts.0.up_proj"]
    shared = ["model.layers.0.mlp.shared_expert.up_proj"]
    source = _checkpoint(tmp_path / "src", {m: (128, 256) for m in attn + experts + shared})
    recipe = [("nvfp4a16", [r"re:.*mlp\.experts\..*"]), ("fp8-dynamic", [r"re:.*self_attn\..*"]),
              ("fp8-block", [r"re:.*shared_expert.*"])]
    presets = {"nvfp4a16": "NVFP4A16", "fp8-dynamic": "FP8_DYNAMIC", "fp8-block": "FP8_BLOCK"}
    config = QuantizationConfig(config_groups={
        f"group_{i}": preset_name_to_scheme(presets[s], t) for i, (s, t) in enumerate(recipe)})
    model_free_ptq(tmp_path / "src", tmp_path / "ref", config=config)
    theirs = json.loads((tmp_path / "ref" / "config.json").read_text())["quantization_config"]
    ours = ct.build_mixed_quantization_config(recipe, [])
    assert ours["format"] == "mixed-precision"
    assert theirs.pop("transform_config") == {}  # llm-compressor's only extra key (as in test_llmcompressor_parity)
    assert ours == theirs
    ref = _tensors(tmp_path / "ref")
    smap = SchemeMap.parse("bf16", [f"{t[0]}={s}" for s, t in recipe])
    for module in attn + shared:
        q = quantize_fp8(source[f"{module}.weight"], smap.scheme_of(module), module)
        scheme = smap.scheme_of(module)
        planned = ct.fp8_planned(module, scheme, 128, 256, torch.bfloat16, False)
        encoded = ct.fp8_encode(module, scheme, q)
        assert [p.name for p in planned] == list(encoded)
        for p in planned:
            assert (encoded[p.name].dtype, tuple(encoded[p.name].shape)) == (p.dtype, tuple(p.shape))
            assert torch.equal(encoded[p.name].view(torch.uint8), ref[p.name].view(torch.uint8)), p.name


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_plan_groups_get_one_scheme_each(tiny, family):
    """On a family's planned groups: experts NVFP4, attention FP8, the fused q/k/v (or MLA's) and gate/up groups
    whole; splitting a fused group, or a rule that matches nothing planned, is one line."""
    import json

    from fp4kit.io.checkpoint import CheckpointReader
    from fp4kit.quantize.plan import build_plan
    from fp4kit.quantize.schemes import assign

    src = tiny(family)
    plan = build_plan(CheckpointReader(src), json.loads((src / "config.json").read_text()))
    dense = [r"mlp\.(shared_experts|gate_proj|up_proj|down_proj)=fp8-block"] if family == "deepseek_v3" else []
    schemes = assign(plan.groups, SchemeMap.parse("nvfp4", [r"self_attn=fp8-dynamic", *dense]))
    by_module = {c.linear.module: schemes[i] for i, g in enumerate(plan.groups) for c in g.members}
    assert {s for m, s in by_module.items() if ".self_attn." in m} == {"fp8-dynamic"}
    assert {s for m, s in by_module.items() if ".experts." in m} == {"nvfp4"}
    assert {s for m, s in by_module.items() if ".self_attn." not in m and ".experts." not in m} <= {"fp8-block"}
    assert any(".self_attn." in m for m in by_module) and any(".experts." in m for m in by_module)
    fused = next(g for g in plan.groups if len(g.members) > 1 and ".experts." in g.members[0].linear.module)
    first = fused.members[0].linear.module.rsplit(".", 1)[1]
    with pytest.raises(Fp4kitError, match="must share one scheme"):
        assign(plan.groups, SchemeMap.parse("nvfp4", [rf"experts\.\d+\.{first}$=fp8-block"]))
    with pytest.raises(Fp4kitError, match="matches no module"):
        assign(plan.groups, SchemeMap.parse("nvfp4", ["lm_head=fp8-dynamic"]))
