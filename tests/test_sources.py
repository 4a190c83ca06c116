"""Quantized sources (fp4kit.io.sources): dequantized values bit-exact against the libraries that define the formats,
and quantize end to end from FP8-block and INT4 pack-quantized tiny sources.

Oracles: compressed-tensors 0.19 `entrypoints/convert/converters/fp8block_dequantizer.py` (FP8BlockDequantizer, pads
partial blocks), `converters/ct_dequantizer.py` (CompressedTensorsDequantizer) and
`compressors/pack_quantized/base.py` (PackedQuantizationCompressor); transformers 5.17
`integrations/finegrained_fp8.py` (Fp8Dequantize; it refuses shapes that are not whole blocks, so it sees only
those).
"""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers import dequantized_bf16_copy
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fp4kit import cli
from fp4kit.errors import Fp4kitError
from fp4kit.io.checkpoint import CheckpointReader
from fp4kit.io.sources import (
    dequantize_fp8_block,
    dequantize_pack_quantized,
    detect_source,
    quantize_fp8_block,
)
from fp4kit.quantize import plan as plan_module
from fp4kit.testing.fixtures import write_fp8_block_source, write_pack_quantized_source

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SHAPES = [(256, 384), (300, 200), (576, 128), (80, 64)]  # whole blocks, partial both ways, MLA's 576 rows, < 1 block


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def fp8_weight(shape: tuple[int, int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(shape, generator=generator) * torch.logspace(-3, 0, shape[1])  # blocks of unequal range
    return quantize_fp8_block(weight)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("native", [True, False], ids=["c-loop", "torch"])
def test_fp8_block_matches_compressed_tensors(shape, dtype, native, monkeypatch):
    """Both CPU paths: fp4kit's C loop (fp4kit/native/nvfp4_cpu.c) and, where it is not built, torch ops."""
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer

    from fp4kit.native import nvfp4_cpu

    assert nvfp4_cpu.available()
    if not native:
        monkeypatch.setattr(nvfp4_cpu, "available", lambda: False)
    weight, scale_inv = fp8_weight(shape)
    expected = FP8BlockDequantizer(dtype=dtype)._create_dequantized_weight(weight, scale_inv)
    assert torch.equal(bits(dequantize_fp8_block(weight, scale_inv, (128, 128), dtype)), bits(expected))


@pytest.mark.parametrize("shape", [(256, 384), (128, 128)])
def test_fp8_block_matches_transformers(shape):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    weight, scale_inv = fp8_weight(shape, seed=1)
    expected = Fp8Dequantize(None)._dequantize_one(weight, scale_inv, output_dtype=torch.float32)
    assert torch.equal(bits(dequantize_fp8_block(weight, scale_inv, (128, 128))), bits(expected))


@pytest.mark.parametrize("num_bits", [4, 8, 3])
@pytest.mark.parametrize("strategy", ["group", "channel"])
def test_pack_quantized_matches_compressed_tensors(num_bits, strategy):
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    group = 32 if strategy == "group" else None
    args = QuantizationArgs(num_bits=num_bits, type="int", symmetric=True, strategy=strategy, group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    weight = torch.randn(96, 160, generator=torch.Generator().manual_seed(num_bits))
    amax = weight.view(96, -1, group).abs().amax(-1) if group else weight.abs().amax(-1, keepdim=True)
    scale = (amax / (2 ** (num_bits - 1) - 0.5)).bfloat16()
    packed = PackedQuantizationCompressor.compress({"weight": weight.bfloat16(), "weight_scale": scale}, scheme)
    # bf16: compressed-tensors multiplies in the scale's dtype, one rounding of the exact product, as we do
    expected = PackedQuantizationCompressor.decompress(packed, scheme)["weight"]
    found = dequantize_pack_quantized(packed["weight_packed"], scale, (96, 160), num_bits, group, torch.bfloat16)
    assert torch.equal(bits(found), bits(expected))
    # fp32: the exact product (compressed-tensors given fp32 scales computes in fp32)
    expected = PackedQuantizationCompressor.decompress({**packed, "weight_scale": scale.float()}, scheme)["weight"]
    found = dequantize_pack_quantized(packed["weight_packed"], scale, (96, 160), num_bits, group)
    assert torch.equal(bits(found), bits(expected))


def headers(path: Path) -> dict:
    with CheckpointReader(path) as reader:
        return {n: (i.dtype, i.shape) for n, i in reader.tensors.items()}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """sources(family, kind) -> a tiny checkpoint: kind bf16, fp8 (DeepSeek's FP8-block files, every Linear but
    lm_head and the routers) or int4 (Kimi-K2-Thinking's pack-quantized routed experts; Kimi has no MTP layer, so
    the decoder layers' experts only)."""
    from fp4kit.testing.fixtures import build_fixture

    built: dict[tuple[str, str], Path] = {}

    def get(family: str, kind: str) -> Path:
        if (family, kind) not in built:
            root = tmp_path_factory.mktemp(f"{family}-{kind}")
            bf16 = built.setdefault((family, "bf16"), build_fixture(family, root / "bf16"))
            writers = {"fp8": write_fp8_block_source,
                       "int4": partial(write_pack_quantized_source, targets=r"layers\.[012]\.mlp\.experts\.")}
            built[(family, kind)] = bf16 if kind == "bf16" else writers[kind](bf16, root / kind)
        return built[(family, kind)]

    return get


def bf16_plan(*args, **kwargs):
    """build_plan in dequant_dtype bf16 whatever its caller asks (quantize has no option for it yet)."""
    return plan_module.build_plan(*args, **{**kwargs, "dequant_dtype": "bf16"})


@pytest.fixture
def passthrough_through_plan():
    """quantize.py reads jobs and counts their bytes through fp4kit.quantize.plan (read_job, job_bytes)."""


def test_int4_source_matches_compressed_tensors_dequantizer(sources):
    """Every weight the plan reads from the INT4 source, in bf16 mode, equals CompressedTensorsDequantizer's."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    src = sources("deepseek_v3", "int4")
    expected = CompressedTensorsDequantizer(src, dtype=torch.bfloat16).process(load_file(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    with CheckpointReader(src) as reader:
        plan = plan_module.build_plan(reader, config, default_ignore=False, dequant_dtype="bf16")
        quantized = [g for g in plan.groups if any(c.linear.source.quantized for c in g.members)]
        assert len(quantized) == 2 * 8 * 2  # 2 MoE layers, 8 experts, (gate, up) and down
        for group in plan.groups:
            for c, weight in zip(group.members, plan_module.read_group_weights(reader, group), strict=True):
                assert torch.equal(bits(weight), bits(expected[c.linear.module + ".weight"])), c.linear.module


def test_detect_checks_headers():
    weight = (torch.float8_e4m3fn, (300, 200))
    qc = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    good = detect_source(qc, {"a.weight": weight, "a.weight_scale_inv": (torch.float32, (3, 2))})
    assert good.name == "fp8-block 128x128" and good.linears["a"].in_features == 200
    bad = {
        "a.weight_scale_inv: torch.float32[2, 2], the [300, 200] weight in 128x128 blocks needs float32[3, 2]":
            {"a.weight": weight, "a.weight_scale_inv": (torch.float32, (2, 2))},
        "a.weight: float8_e4m3fn[300, 200] without a weight_scale_inv": {"a.weight": weight},
    }
    for message, tensors in bad.items():
        with pytest.raises(Fp4kitError, match="^" + message.replace("[", r"\[").replace("]", r"\]")):
            detect_source(qc, tensors)
    with pytest.raises(Fp4kitError, match="weight_block_size None"):
        detect_source({"quantization_config": {"quant_method": "fp8"}}, {})
    assert not detect_source({}, {"a.weight": (torch.bfloat16, (4, 4))}).quantized


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize(("kind", "dialect"), [("bf16", "compressed-tensors"), ("fp8", "compressed-tensors"),
                                               ("int4", "compressed-tensors"), ("fp8", "modelopt")])
def test_quantize_quantized_source_end_to_end(family, kind, dialect, sources, tmp_path, passthrough_through_plan):
    src = sources(family, kind)
    dst = tmp_path / "out"
    cli._register_commands()
    assert cli.run(["quantize", str(src), str(dst), "--format", dialect]) == 0
    assert cli.run(["inspect", str(dst)]) == 0
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == dialect
    assert "weight_block_size" not in config["quantization_config"]
    with safe_open(dst / "model.safetensors", "pt") as out:
        names = set(out.keys())
        assert not any(n.endswith(("weight_scale_inv", "weight_shape")) for n in names)
        kept = {n: out.get_slice(n).get_dtype() for n in names if n.endswith(".weight")}
    packed = "U8" if dialect == "modelopt" else None  # ModelOpt's packed NVFP4 weights are <m>.weight too
    assert all(dtype in ("BF16", "F32", packed) for dtype in kept.values()), kept  # kept ones come out dequantized
    if family == "deepseek_v3":
        assert kept["model.layers.3.mlp.experts.0.up_proj.weight"] == "BF16"  # the MTP layer is not quantized


def test_bf16_mode_equals_quantizing_the_peers_bf16_copy(sources, tmp_path, monkeypatch, passthrough_through_plan):
    """dequant_dtype bf16 reproduces the two-rounding path: write the FP8 source dequantized by
    compressed-tensors' FP8BlockDequantizer to bf16, quantize that; the output bytes are the same."""
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer

    from fp4kit.quantize import checkpoint as quantize

    src = sources("deepseek_v3", "fp8")
    copy = tmp_path / "bf16-copy"
    copy.mkdir()
    tensors = load_file(src / "model.safetensors")
    blocked = [n.removesuffix(".weight_scale_inv") for n in tensors if n.endswith(".weight_scale_inv")]
    tensors = FP8BlockDequantizer(targets=blocked, dtype=torch.bfloat16).process(tensors)
    save_file({n: t.contiguous() for n, t in tensors.items()}, copy / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (copy / "config.json").write_text(json.dumps(config))
    assert quantize.quantize_checkpoint(copy, tmp_path / "from-copy").quantized_linears > 0
    monkeypatch.setattr(quantize, "build_plan", bf16_plan)
    quantize.quantize_checkpoint(src, tmp_path / "two-roundings")
    monkeypatch.setattr(quantize, "build_plan", plan_module.build_plan)
    expected = load_file(tmp_path / "from-copy" / "model.safetensors")
    found = load_file(tmp_path / "two-roundings" / "model.safetensors")
    assert found.keys() == expected.keys()
    assert all(torch.equal(found[n].view(torch.uint8), expected[n].view(torch.uint8)) for n in expected)
    # the default (one rounding, from fp32) is a different checkpoint
    quantize.quantize_checkpoint(src, tmp_path / "one-rounding")
    one = load_file(tmp_path / "one-rounding" / "model.safetensors")
    assert any(not torch.equal(one[n].view(torch.uint8), found[n].view(torch.uint8)) for n in one)


@pytest.mark.parametrize(("family", "kind", "method"), [("qwen3_moe", "fp8", "rtn"), ("qwen3_moe", "int4", "rtn"),
                                                        ("deepseek_v3", "fp8", "rtn"), ("qwen3_moe", "fp8", "gptq"),
                                                        ("deepseek_v3", "int4", "mse")])
def test_w4a4_of_a_quantized_source_calibrates_its_dequantized_layers(family, kind, method, sources, tmp_path):
    """W4A4 from an FP8-block or INT4 source: calibration runs the source's layers with their weights dequantized
    (fp32 products cast to the model's bf16), so every input scale calibrated on the source model equals the one
    calibrated from compressed-tensors' bf16 dequantized copy of the same source; gptq and activation-weighted mse
    run through the same layer loader (and read the weights they quantize dequantized, so with dequant_dtype bf16
    every tensor, their own pass's input scales included, is the copy's)."""
    src = sources(family, kind)
    copy = dequantized_bf16_copy(src, tmp_path / "bf16-copy")
    calib = ["--scheme", "nvfp4", "--samples", "4", "--seq-len", "16", "--method", method]
    if method != "rtn":  # input scales from the source model's pass, not from the quantized layers' (the default)
        calib += ["--input-scales-from", "source"]
    cli._register_commands()
    assert cli.run(["quantize", str(src), str(tmp_path / "out"), *calib]) == 0
    assert cli.run(["quantize", str(copy), str(tmp_path / "from-copy"), *calib]) == 0
    assert cli.run(["inspect", str(tmp_path / "out")]) == 0
    found = load_file(tmp_path / "out" / "model.safetensors")
    expected = load_file(tmp_path / "from-copy" / "model.safetensors")
    assert found.keys() == expected.keys()
    inputs = [n for n in expected if n.endswith(".input_global_scale")]
    quantized = [n for n in expected if n.endswith(".weight_packed")]
    assert len(inputs) == len(quantized) > 0
    for name in inputs:
        assert torch.equal(found[name], expected[name]), name
    if method != "rtn":  # the default: input scales from the quantized layers, equal where the weights are
        default = calib[:-2]
        assert cli.run(["quantize", str(src), str(tmp_path / "bf16-mode"), *default, "--dequant-dtype", "bf16"]) == 0
        assert cli.run(["quantize", str(copy), str(tmp_path / "copy-default"), *default]) == 0
        two = load_file(tmp_path / "bf16-mode" / "model.safetensors")
        expected = load_file(tmp_path / "copy-default" / "model.safetensors")
        assert two.keys() == expected.keys()
        assert all(torch.equal(two[n].view(torch.uint8), expected[n].view(torch.uint8)) for n in expected)


@pytest.mark.pinned
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_bf16_mode_equals_model_free_ptq_with_its_fp8_converter(family, sources, tmp_path, monkeypatch,
                                                               passthrough_through_plan):
    """llm-compressor's model_free_ptq(NVFP4A16, converter=FP8BlockDequantizer) against dequant_dtype bf16: every
    tensor byte-identical, except that model_free_ptq gives some fused siblings each its own weight global scale
    (routed experts' gate/up, MLA's q_a/kv_a) where fp4kit shares one (as oneshot does and vLLM's fused kernels
    assume); there the members whose scale happens to agree are byte-identical too."""
    pytest.importorskip("llmcompressor")
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer
    from llmcompressor import model_free_ptq

    from fp4kit.families.base import weight_scale_group
    from fp4kit.quantize import checkpoint as quantize

    src = write_fp8_block_source(sources(family, "bf16"), tmp_path / "fp8-16x16", block=(16, 16))
    blocked = [n.removesuffix(".weight_scale_inv") for n in load_file(src / "model.safetensors")
               if n.endswith(".weight_scale_inv")]
    ignore = ["lm_head", "re:.*mlp.gate$", "re:.*embed_tokens$"] + (["re:.*layers\\.3\\..*"] if family ==
                                                                    "deepseek_v3" else [])
    model_free_ptq(src, tmp_path / "llmc", scheme="NVFP4A16", ignore=ignore,
                   converter=FP8BlockDequantizer(targets=blocked, weight_block_size=(16, 16)))
    monkeypatch.setattr(quantize, "build_plan", bf16_plan)
    quantize.quantize_checkpoint(src, tmp_path / "ours")
    theirs = {n: t for f in sorted((tmp_path / "llmc").glob("*.safetensors")) for n, t in load_file(f).items()}
    ours = load_file(tmp_path / "ours" / "model.safetensors")
    assert theirs.keys() == ours.keys()
    modules = {n.removesuffix(".weight_global_scale") for n in ours if n.endswith(".weight_global_scale")}
    agreeing_fused = 0
    for module in sorted(modules):
        names = [f"{module}.{leaf}" for leaf in ("weight_packed", "weight_scale", "weight_global_scale")]
        same = all(torch.equal(ours[n].view(torch.uint8), theirs[n].view(torch.uint8)) for n in names)
        if weight_scale_group(module) == module:
            assert same, module
        elif torch.equal(ours[names[2]], theirs[names[2]]):
            assert same, module
            agreeing_fused += 1
    assert agreeing_fused > 0
    for name in set(ours) - {f"{m}.{leaf}" for m in modules for leaf in ("weight_packed", "weight_scale",
                                                                          "weight_global_scale")}:
        assert torch.equal(ours[name].view(torch.uint8), theirs[name].view(torch.uint8)), name


@pytest.mark.parametrize(("family", "block", "dialect"), [("deepseek_v3", (128, 128), "compressed-tensors"),
                                                        ("qwen3_moe", (48, 80), "modelopt"),
                                                        ("qwen3_moe", (32, 40), "compressed-tensors")])
def test_fp8_source_from_its_codes_equals_quantizing_its_fp32_values(family, block, dialect, sources, tmp_path,
                                                                     monkeypatch):
    """On the CPU the C loop quantizes an FP8-block weight from its stored codes (fp4kit.io.sources.stored_fp8_block);
    the output equals the torch ops' quantization of the fp32 dequantized weights, byte for byte. A block width that
    is not a multiple of 16 (16-blocks across two multipliers) takes the fp32 path."""
    from fp4kit.quantize import checkpoint as quantize

    src = write_fp8_block_source(sources(family, "bf16"), tmp_path / "fp8", block)
    stored, original = [], plan_module.stored_fp8_block

    def counted(reader, linear):
        stored.append(original(reader, linear))
        return stored[-1]

    monkeypatch.setattr(plan_module, "stored_fp8_block", counted)
    quantize.quantize_checkpoint(src, tmp_path / "codes", quantize.QuantizeOptions(format=dialect))
    assert stored and all((s is not None) == (block[1] % 16 == 0) for s in stored)
    stored.clear()
    quantize.quantize_checkpoint(src, tmp_path / "torch", quantize.QuantizeOptions(format=dialect, native_cpu=False))
    assert not stored  # the torch path reads dequantized weights
    expected = load_file(tmp_path / "torch" / "model.safetensors")
    found = load_file(tmp_path / "codes" / "model.safetensors")
    assert found.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(found[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


def test_source_candidates_and_linear_weights_read_dequantized(sources):
    """What verify --source reads from a quantized source: one layer's experts and its shared expert, in fp32 as
    compressed-tensors' FP8BlockDequantizer computes them."""
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer

    src = sources("deepseek_v3", "fp8")
    tensors = load_file(src / "model.safetensors")
    blocked = [n.removesuffix(".weight_scale_inv") for n in tensors if n.endswith(".weight_scale_inv")]
    expected = FP8BlockDequantizer(targets=blocked, dtype=torch.float32).process(tensors)
    config = json.loads((src / "config.json").read_text())
    with CheckpointReader(src) as reader:
        members = plan_module.source_candidates(reader, config, "model.layers.1.mlp.experts.")
        assert len(members) == 8 * 3
        for c, weight in zip(members, plan_module.read_group_weights(reader, plan_module.QuantGroup(members)),
                             strict=True):
            assert torch.equal(bits(weight), bits(expected[c.linear.module + ".weight"])), c.linear.module
        source = plan_module.source_view(reader, config)[0]
        for module in ("model.layers.1.mlp.shared_experts.up_proj", "model.layers.1.mlp.gate"):
            found = plan_module.read_linear_weight(reader, source, module)
            assert torch.equal(found.view(torch.uint8), expected[module + ".weight"].view(torch.uint8)), module


def test_broken_fp8_source_exits_2_in_one_line(sources, tmp_path, capsys):
    """A block-scale grid that does not fit its weight: one line naming the tensor, exit 2, no output."""
    src = tmp_path / "broken"
    shutil.copytree(sources("qwen3_moe", "fp8"), src)
    tensors = load_file(src / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    tensors[name] = torch.ones(2, 1)
    save_file(tensors, src / "model.safetensors")
    cli._register_commands()
    assert cli.run(["quantize", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {name}: torch.float32[2, 1], the [64, 64] weight in 128x128 blocks needs float32[1, 1]"]
    assert not (tmp_path / "out").exists()
