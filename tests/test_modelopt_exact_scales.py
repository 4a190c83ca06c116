"""Quantizing to ModelOpt and converting to compressed-tensors gives the global scales of quantizing to
compressed-tensors directly (llm-compressor's bytes), though not every fp32 multiplier G is the rounded reciprocal
of an fp32 divisor D (fp4kit/formats/modelopt.py, ``multiplier_behind``)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from fp4kit.formats import modelopt as mo
from fp4kit.quantize import QuantizeOptions, quantize_checkpoint
from fp4kit.tools.convert import convert_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_every_bf16_multiplier_comes_back_from_its_divisor() -> None:
    # every positive bf16 value of 2^4 .. 2^16 (the weight global scales 448*6 / amax of weights up to ~170)
    codes = torch.arange(0x4180, 0x4780, dtype=torch.int32).to(torch.int16)
    multipliers = codes.view(torch.bfloat16).float()
    unreachable = 0
    for g in multipliers:
        stored = mo.fp32_divisor(1.0 / g.double())
        unreachable += not torch.equal((1.0 / stored.double()).float(), g)
        behind = mo.multiplier_behind(stored)
        recovered = (1.0 / stored.double()).float() if behind is None else behind
        assert torch.equal(recovered, g), float(g)
    assert unreachable > 0  # the case this is about: the plain reciprocal is one ulp off for these


def read(root) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(root.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


@pytest.mark.parametrize("scheme", ["nvfp4a16", "nvfp4"])
def test_quantize_modelopt_then_convert_equals_quantize_compressed_tensors(tiny, tmp_path, scheme) -> None:
    # weight scales: the bf16 multiplier is recovered on reading; calibrated input scales (any fp32 multiplier) are
    # recorded exactly in the ModelOpt output's metadata where no fp32 divisor holds them
    bf16 = tiny("qwen3_moe")
    # the default calibration gives this fixture a down_proj input multiplier (1830.1277) no fp32 divisor holds
    quantize_checkpoint(bf16, tmp_path / "ct", QuantizeOptions(scheme=scheme))
    quantize_checkpoint(bf16, tmp_path / "mo", QuantizeOptions(scheme=scheme, format="modelopt"))
    if scheme == "nvfp4":  # the case stays exercised: at least one input scale needed the record
        from fp4kit.formats.detect import EXACT_SCALES_KEY
        from fp4kit.io.checkpoint import CheckpointReader

        with CheckpointReader(tmp_path / "mo") as reader:
            assert EXACT_SCALES_KEY in reader.metadata
    convert_checkpoint(tmp_path / "mo", tmp_path / "back", "compressed-tensors")
    direct, back = read(tmp_path / "ct"), read(tmp_path / "back")
    scales = [n for n in direct if n.endswith(("weight_global_scale", "input_global_scale"))]
    assert (scheme == "nvfp4") == any(n.endswith("input_global_scale") for n in scales)
    assert scales and set(direct) == set(back)
    differ = [n for n in scales if not torch.equal(direct[n], back[n])]
    assert not differ, f"{len(differ)} of {len(scales)} global scales differ, e.g. {differ[0]}"
