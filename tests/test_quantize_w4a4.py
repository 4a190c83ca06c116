"""`fp4kit quantize --scheme nvfp4`: calibrated input scales written per the sharing policy, weights unchanged."""

import json

import pytest
import torch

from fp4kit.io.checkpoint import CheckpointReader
from fp4kit.quantize import QuantizeOptions, quantize_checkpoint

CALIB = dict(samples=4, seq_len=32, batch_size=4)


def input_scales(path) -> dict[str, float]:
    reader = CheckpointReader(path)
    suffix = ".input_global_scale"
    return {n[: -len(suffix)]: reader.read(n).item() for n in reader.names() if n.endswith(suffix)}


@pytest.fixture(scope="module")
def glm_w4a4(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("w4a4")
    shared = quantize_checkpoint(tiny("glm4_moe"), root / "shared", QuantizeOptions(scheme="nvfp4", **CALIB))
    per_expert = quantize_checkpoint(tiny("glm4_moe"), root / "per-expert",
                                     QuantizeOptions(scheme="nvfp4", moe_input_scales="per-expert", **CALIB))
    assert shared.quantized_linears == per_expert.quantized_linears
    return root / "shared", root / "per-expert"


def test_shared_policy_gives_every_expert_one_scale_per_projection(glm_w4a4):
    shared, per_expert = (input_scales(p) for p in glm_w4a4)
    assert set(shared) == set(per_expert) and len(shared) > 50
    for layer in (1, 2):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            values = {shared[f"model.layers.{layer}.mlp.experts.{e}.{proj}"] for e in range(8)}
            own = [per_expert[f"model.layers.{layer}.mlp.experts.{e}.{proj}"] for e in range(8)]
            assert len(values) == 1
            assert values.pop() == min(own)  # the largest amax: the smallest multiplier
        assert len({per_expert[f"model.layers.{layer}.mlp.experts.{e}.down_proj"] for e in range(8)}) > 1
    for name, value in shared.items():
        assert torch.isfinite(torch.tensor(value)) and value > 0, name
        if ".experts." not in name:
            assert value == per_expert[name]


def test_input_scales_are_the_calibrated_amax(tiny, glm_w4a4):
    from fp4kit.quantize.calib_data import load_calibration
    from fp4kit.quantize.calibrate import calibrate

    src = tiny("glm4_moe")
    ids = load_calibration(None, src, 256, CALIB["samples"], CALIB["seq_len"])
    amax = calibrate(src, ids, batch_size=CALIB["batch_size"]).input_amax
    per_expert = input_scales(glm_w4a4[1])
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.o_proj",
                 "model.layers.1.mlp.shared_experts.down_proj", "model.layers.2.mlp.experts.5.down_proj"):
        assert per_expert[name] == pytest.approx(448 * 6 / amax[name], rel=2**-23)


def test_weights_and_config_as_weight_only_path(glm_w4a4, tiny_nvfp4a16):
    from compressed_tensors.quantization import QuantizationConfig

    shared = glm_w4a4[0]
    qconfig = QuantizationConfig.model_validate(json.loads((shared / "config.json").read_text())["quantization_config"])
    assert qconfig.config_groups["group_0"].input_activations is not None
    ours, weight_only = CheckpointReader(shared), CheckpointReader(tiny_nvfp4a16("glm4_moe"))
    for name in weight_only.names():
        if name.endswith(("weight_packed", "weight_scale", "weight_global_scale")):
            assert torch.equal(ours.read(name).view(torch.uint8), weight_only.read(name).view(torch.uint8)), name
    stats = json.loads((shared / "fp4kit_routing_stats.json").read_text())
    assert stats["num_experts"] == 8 and sum(stats["layers"]["1"]) == CALIB["samples"] * CALIB["seq_len"] * 2
