"""`fp4kit convert`: lossless both ways on every family, W4A4 scales exact, llm-compressor input, bad input exits 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import EXPERT0, rewrite, run_cli, with_input_scales

from fp4kit.formats.compressed_tensors import NAME as CT
from fp4kit.formats.detect import open_checkpoint, stored_scale
from fp4kit.formats.modelopt import NAME as MO
from fp4kit.io.checkpoint import CheckpointReader
from fp4kit.testing.fixtures import FIXTURES
from fp4kit.tools.convert import convert_checkpoint


def tensor_bytes(path: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...], bytes]]:
    reader = CheckpointReader(path)
    return {n: (i.dtype, i.shape, reader.read(n).reshape(-1).view(torch.uint8).numpy().tobytes())
            for n, i in reader.tensors.items()}


@pytest.mark.parametrize("family", FIXTURES)
def test_compressed_tensors_modelopt_round_trip_is_byte_exact(family, tiny_nvfp4a16, tmp_path):
    src = tiny_nvfp4a16(family)
    to_mo = convert_checkpoint(src, tmp_path / "mo", MO)
    back = convert_checkpoint(tmp_path / "mo", tmp_path / "ct", CT)
    assert to_mo.quantized_modules == back.quantized_modules > 20
    assert tensor_bytes(src) == tensor_bytes(tmp_path / "ct")
    assert json.loads((src / "config.json").read_text()) == json.loads((tmp_path / "ct" / "config.json").read_text())
    assert not (tmp_path / "ct" / "hf_quant_config.json").exists()
    mo_names = CheckpointReader(tmp_path / "mo").names()
    assert not [n for n in mo_names if n.endswith((".weight_packed", "global_scale"))]
    hf = json.loads((tmp_path / "mo" / "hf_quant_config.json").read_text())["quantization"]
    assert hf["quant_algo"] == "W4A16_NVFP4" and hf["group_size"] == 16 and "kv_cache_quant_algo" in hf


def test_w4a4_round_trips_both_ways_byte_exact(tiny_nvfp4a16, tmp_path):
    src = with_input_scales(tiny_nvfp4a16("qwen3_moe"), tmp_path / "w4a4")
    convert_checkpoint(src, tmp_path / "mo", MO)
    convert_checkpoint(tmp_path / "mo", tmp_path / "ct", CT)
    assert tensor_bytes(src) == tensor_bytes(tmp_path / "ct")
    convert_checkpoint(tmp_path / "ct", tmp_path / "mo2", MO)
    assert tensor_bytes(tmp_path / "mo") == tensor_bytes(tmp_path / "mo2")
    with open_checkpoint(tmp_path / "mo") as ckpt:
        assert ckpt.dialect == MO and ckpt.scheme == "nvfp4"
        assert all(m.input_scale for m in ckpt.modules)


def test_llama4_experts_fuse_only_when_lossless(tiny_nvfp4a16, tmp_path):
    """fp4kit's Llama-4 experts carry per-expert scales: kept per-expert. With layer-wide scales they fuse."""
    src = tiny_nvfp4a16("llama4")
    report = convert_checkpoint(src, tmp_path / "per_expert", MO)
    assert report.fused_tensors == 0 and len(report.notes) == 4

    def share(tensors: dict) -> None:
        for name in [n for n in tensors if ".experts." in n and n.endswith("weight_global_scale")]:
            tensors[name] = tensors[name.split(".experts.")[0] + ".experts.0.down_proj.weight_global_scale"].clone()

    # Rescaling only the global scales changes the weights' values, not the layout under test.
    shared = rewrite(src, tmp_path / "shared", share)
    report = convert_checkpoint(shared, tmp_path / "fused", MO)
    assert report.fused_tensors == 4
    names = CheckpointReader(tmp_path / "fused").tensors
    assert names["language_model.model.layers.0.feed_forward.experts.gate_up_proj"].shape == (4, 32, 64)
    convert_checkpoint(tmp_path / "fused", tmp_path / "back", CT)
    assert tensor_bytes(shared) == tensor_bytes(tmp_path / "back")


@pytest.fixture(scope="module")
def llm_compressor_outputs(tiny, tmp_path_factory):
    """llm-compressor 0.14.0.1 checkpoints of the tiny Qwen3-MoE: `oneshot` NVFP4 (W4A4, calibrated) and
    `model_free_ptq` NVFP4A16."""
    pytest.importorskip("llmcompressor")
    import transformers
    from datasets import Dataset
    from llmcompressor import model_free_ptq, oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    root = tmp_path_factory.mktemp("llmc")
    ignore = ["lm_head", "re:.*mlp.gate$"]
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(tiny("qwen3_moe"), dtype=torch.bfloat16)
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0)).tolist()
    data = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * 16] * 4})
    oneshot(model=model, dataset=data, recipe=QuantizationModifier(targets="Linear", scheme="NVFP4", ignore=ignore),
            num_calibration_samples=4, max_seq_length=16)
    model.save_pretrained(root / "oneshot", save_compressed=True)
    model_free_ptq(tiny("qwen3_moe"), root / "model_free", scheme="NVFP4A16", ignore=ignore)
    return {"oneshot": root / "oneshot", "model_free": root / "model_free"}


@pytest.mark.pinned
@pytest.mark.parametrize("producer", ["oneshot", "model_free"])
def test_llm_compressor_checkpoints_convert_to_equal_weights(producer, llm_compressor_outputs, tmp_path):
    src = llm_compressor_outputs[producer]
    convert_checkpoint(src, tmp_path / "mo", MO)
    with open_checkpoint(src) as a, open_checkpoint(tmp_path / "mo") as b:
        assert a.dialect == CT and b.dialect == MO and a.scheme == b.scheme
        assert a.scheme == ("nvfp4" if producer == "oneshot" else "nvfp4a16")
        theirs = {m.name: m for m in b.modules}
        for m in a.modules:
            wa, ia = a.read(m)
            wb, ib = b.read(theirs[m.name])
            assert torch.equal(wa.dequantize(), wb.dequantize()), m.name
            # Equal as either dialect stores them (the float64 divisors may differ below fp32 resolution).
            assert (ia is None and ib is None) or all(
                torch.equal(stored_scale(d, ia), stored_scale(d, ib)) for d in (CT, MO))
    convert_checkpoint(tmp_path / "mo", tmp_path / "ct", CT)
    ours = tensor_bytes(tmp_path / "ct")
    theirs_bytes = tensor_bytes(src)
    assert ours.keys() == theirs_bytes.keys()
    for name, (dtype, shape, data) in theirs_bytes.items():  # llm-compressor stores [1]-shaped scales as we do
        assert ours[name] == (dtype, shape, data), name


def test_cli_converts(monkeypatch, capsys, tiny_nvfp4a16, tmp_path):
    code, out, err = run_cli(monkeypatch, capsys, "convert", tiny_nvfp4a16("qwen3_moe"), tmp_path / "o", "--to",
                             "modelopt")
    assert code == 0 and "compressed-tensors -> modelopt" in out + err
    assert (tmp_path / "o" / "hf_quant_config.json").exists()


def drop(name: str):
    return lambda tensors: tensors.pop(name)


def retype(name: str, dtype: torch.dtype):
    def edit(tensors: dict) -> None:
        tensors[name] = tensors[name].view(torch.uint8).to(dtype) if dtype != torch.uint8 else \
            tensors[name].view(torch.uint8)
    return edit


@pytest.mark.parametrize(("case", "message"), [
    ("unknown", "unknown dialect"),
    ("mixed", "mixed dialects"),
    ("missing_global", "missing global scale"),
    ("missing_block", "missing block scale"),
    ("wrong_dtype", "dtype torch.uint8, expected torch.float8_e4m3fn"),
    ("missing_input", "missing input scale"),
    ("other_format", "is not NVFP4"),
])
def test_bad_input_exits_2_with_one_line(case, message, monkeypatch, capsys, tiny, tiny_nvfp4a16, tmp_path):
    good = tiny_nvfp4a16("qwen3_moe")
    src = {
        "unknown": lambda: tiny("qwen3_moe"),
        "mixed": lambda: rewrite(good, tmp_path / "bad", lambda t: t.update(
            {f"{EXPERT0}.gate_proj.weight_scale_2": torch.tensor(1.0)})),
        "missing_global": lambda: rewrite(good, tmp_path / "bad", drop(f"{EXPERT0}.up_proj.weight_global_scale")),
        "missing_block": lambda: rewrite(good, tmp_path / "bad", drop(f"{EXPERT0}.up_proj.weight_scale")),
        "wrong_dtype": lambda: rewrite(good, tmp_path / "bad", retype(f"{EXPERT0}.up_proj.weight_scale", torch.uint8)),
        "missing_input": lambda: rewrite(with_input_scales(good, tmp_path / "w4a4"), tmp_path / "bad",
                                         drop(f"{EXPERT0}.up_proj.input_global_scale")),
        "other_format": lambda: rewrite(good, tmp_path / "bad", lambda t: None,
                                        lambda c: c["quantization_config"].update(format="float-quantized")),
    }[case]()
    code, out, err = run_cli(monkeypatch, capsys, "convert", src, tmp_path / "out", "--to", "modelopt")
    assert code == 2 and not out, out + err
    assert message in err and err.startswith("error: ") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def dequantized_blocks(weight) -> torch.Tensor:
    from fp4kit.nvfp4 import BLOCK, unpack_e2m1

    values = unpack_e2m1(weight.packed).double().unflatten(-1, (-1, BLOCK))
    return values * (weight.block_scale.double() * weight.global_scale_div).unsqueeze(-1)


def test_repair_removes_every_mismatch_within_half_an_fp8_step(tiny_nvfp4a16, tmp_path):
    from fp4kit.tools.inspect import inspect_checkpoint

    w4a4 = with_input_scales(tiny_nvfp4a16("qwen3_moe"), tmp_path / "w4a4")  # per-expert input scales: spread
    bad = rewrite(w4a4, tmp_path / "bad", lambda t: t.update({  # gate/up and q/k/v mismatches, not powers of 2
        f"{EXPERT0}.up_proj.weight_global_scale": t[f"{EXPERT0}.up_proj.weight_global_scale"] * 1.37,
        "model.layers.1.self_attn.v_proj.weight_global_scale":
            t["model.layers.1.self_attn.v_proj.weight_global_scale"] * 0.61}))
    before = {p.check for p in inspect_checkpoint(bad).problems}
    assert {"fused_scale_mismatch", "expert_input_scale_spread"} <= before
    report = convert_checkpoint(bad, tmp_path / "fixed", MO, repair=True)
    assert report.repair.weight_groups_unified == 2 and report.repair.input_groups_unified >= 4
    assert inspect_checkpoint(tmp_path / "fixed").clean
    with open_checkpoint(bad) as a, open_checkpoint(tmp_path / "fixed") as b:
        fixed = {m.name: m for m in b.modules}
        for m in a.modules:
            old, new = a.read_weight(m), b.read_weight(fixed[m.name])
            # one FP8 E4M3 step of each new block scale: 2^(exponent - 3), subnormals 2^-9
            exponent = torch.floor(torch.log2(new.block_scale.double().clamp(min=2.0**-6)))
            step = 2.0 ** (exponent - 3) * float(new.global_scale_div)
            change = (dequantized_blocks(new) - dequantized_blocks(old)).abs().amax(-1)
            assert (change <= 6 * step / 2 * (1 + 1e-9)).all(), m.name
    assert 0 < report.repair.max_abs_change and f"{EXPERT0}.up_proj" in report.repair.modules_changed
