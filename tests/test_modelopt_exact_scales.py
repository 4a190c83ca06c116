"""Quantizing to ModelOpt and converting to compressed-tensors gives the global scales of quantizing to
compressed-tensors directly (llm-compressor's bytes), though not every fp32 multiplier G is the rounded reciprocal
of an fp32 divisor D (fp4kit/formats/modelopt.py, ``multiplier_behind``)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from fp4kit.convert import convert_checkpoint
from fp4kit.formats import modelopt as mo
from fp4kit.quantize import QuantizeOptions, quantize_checkpoint
from fp4kit.synthetic import write_synthetic_qwen3_moe

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


def test_quantize_modelopt_then_convert_equals_quantize_compressed_tensors(tmp_path) -> None:
    bf16 = write_synthetic_qwen3_moe(tmp_path / "bf16", num_layers=2, hidden=128, moe_intermediate=64, num_experts=8,
                                     top_k=2, num_heads=2, num_kv_heads=1, head_dim=32, vocab_size=64, threads=1)
    quantize_checkpoint(bf16, tmp_path / "ct")
    quantize_checkpoint(bf16, tmp_path / "mo", QuantizeOptions(format="modelopt"))
    convert_checkpoint(tmp_path / "mo", tmp_path / "back", "compressed-tensors")
    direct, back = read(tmp_path / "ct"), read(tmp_path / "back")
    scales = [n for n in direct if n.endswith("weight_global_scale")]
    assert scales and set(direct) == set(back)
    differ = [n for n in scales if not torch.equal(direct[n], back[n])]
    assert not differ, f"{len(differ)} of {len(scales)} global scales differ, e.g. {differ[0]}"
