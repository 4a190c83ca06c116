"""`fp4kit.testing.synthetic`: the checkpoint is one transformers and fp4kit both read as Qwen3-MoE."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from fp4kit.io.checkpoint import INDEX_NAME, CheckpointReader, read_config
from fp4kit.quantize.plan import build_plan
from fp4kit.testing.synthetic import write_synthetic_qwen3_moe

SMALL = dict(num_layers=2, hidden=64, moe_intermediate=32, num_experts=4, top_k=2, num_heads=4, num_kv_heads=2,
             head_dim=16, vocab_size=128)


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_qwen3_moe(tmp_path_factory.mktemp("synthetic"), **SMALL)


def test_transformers_config_accepts_it(small_checkpoint: Path) -> None:
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig

    config = AutoConfig.from_pretrained(small_checkpoint)
    assert isinstance(config, Qwen3MoeConfig)
    assert (config.num_experts, config.num_experts_per_tok, config.head_dim) == (4, 2, 16)


def test_tensors_match_the_transformers_model(small_checkpoint: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(small_checkpoint))
    with CheckpointReader(small_checkpoint) as reader:
        ours = {name: reader.info(name).shape for name in reader.names()}
    # transformers 5 fuses experts in memory; per-expert tensors on disk are what Qwen3 checkpoints ship.
    expected = {}
    for name, param in model.state_dict().items():
        if ".mlp.experts." not in name:
            expected[name] = tuple(param.shape)
    assert {n: s for n, s in ours.items() if ".mlp.experts." not in n} == expected
    assert ours["model.layers.1.mlp.experts.3.gate_proj.weight"] == (32, 64)
    assert ours["model.layers.1.mlp.experts.3.down_proj.weight"] == (64, 32)


def test_fp4kit_plans_it(small_checkpoint: Path) -> None:
    with CheckpointReader(small_checkpoint) as reader:
        plan = build_plan(reader, read_config(small_checkpoint))
    assert plan.family.name == "qwen3_moe"
    quantized = sum(len(g.members) for g in plan.groups)
    assert quantized == 2 * (4 + 3 * 4)  # per layer: q, k, v, o and 4 experts x gate, up, down
    assert "lm_head" in plan.ignored_modules


def test_sharded_with_index_and_seeded(tmp_path: Path) -> None:
    first = write_synthetic_qwen3_moe(tmp_path / "a", max_shard_bytes=100_000, **SMALL)
    again = write_synthetic_qwen3_moe(tmp_path / "b", max_shard_bytes=100_000, threads=1, **SMALL)
    index = json.loads((first / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) > 1
    with CheckpointReader(first) as a, CheckpointReader(again) as b:
        for name in a.names():
            assert a.info(name).dtype == torch.bfloat16
            assert torch.equal(a.read(name), b.read(name)), name


def test_single_shard_still_has_an_index(small_checkpoint: Path) -> None:
    index = json.loads((small_checkpoint / INDEX_NAME).read_text())
    assert set(index["weight_map"].values()) == {"model.safetensors"}


def test_repeat_first_layer_copies_layer_0_into_every_layer(tmp_path: Path) -> None:
    from fp4kit.testing.synthetic import repeat_first_layer

    one = write_synthetic_qwen3_moe(tmp_path / "one", **{**SMALL, "num_layers": 1})
    config = json.loads((one / "config.json").read_text())
    config["quantization_config"] = {"ignore": ["lm_head", "model.layers.0.mlp.gate"]}
    (one / "config.json").write_text(json.dumps(config))
    three = repeat_first_layer(one, tmp_path / "three", 3, max_shard_bytes=200_000)
    with CheckpointReader(one) as src, CheckpointReader(three) as out:
        assert len(out.names()) == 3 * len(src.names()) - 2 * sum(".layers." not in n for n in src.names())
        for name in out.names():
            assert torch.equal(out.read(name), src.read(re.sub(r"layers\.\d+\.", "layers.0.", name)))
    written = read_config(three)
    assert written["num_hidden_layers"] == 3
    assert written["quantization_config"]["ignore"] == ["lm_head"] + [f"model.layers.{i}.mlp.gate" for i in range(3)]
    assert (three / INDEX_NAME).exists()


@pytest.mark.parametrize("family", ["qwen3_5_moe", "glm_moe_dsa", "minimax_m2", "gpt_oss"])
def test_release_plan_is_what_save_pretrained_writes(tiny, family: str) -> None:
    """The plan for a config is the names and shapes transformers' class saves (the tiny fixture, which
    `save_pretrained` wrote, less the MTP tensors the fixture adds), bf16 but what the class keeps in fp32."""
    from fp4kit.families import detect
    from fp4kit.testing.synthetic import release_tensor_plan

    src = tiny(family)
    config = read_config(src)
    family_of = detect(config)
    text = family_of.text_config(config)
    mtp_layers = {str(text["num_hidden_layers"] + i) for i in range(family_of.extra_layers(text))}
    with CheckpointReader(src) as reader:
        saved = {n: reader.info(n).shape for n in reader.names()
                 if not n.startswith("mtp.") and not (re.search(r"layers\.(\d+)\.", n) and re.search(
                     r"layers\.(\d+)\.", n)[1] in mtp_layers)}
    plan = release_tensor_plan(config)
    assert {p.name: tuple(p.shape) for p in plan} == saved
    fp32 = {p.name for p in plan if p.dtype != torch.bfloat16}
    assert all(n.endswith("e_score_correction_bias") for n in fp32) and bool(fp32) == (family == "glm_moe_dsa")


@pytest.mark.parametrize("model", ["qwen3.6-35b-a3b", "glm-5"])
def test_published_shapes(model: str) -> None:
    """The published layer shapes reach the plan: Qwen3.6-35B-A3B's 256 experts of 512 x 2048 under
    model.language_model, a Gated DeltaNet layer and a gated full-attention layer; GLM-5's 2048 x 6144 experts (here
    16 of them), its MLA projections and DSA indexer."""
    from fp4kit.families import detect
    from fp4kit.testing.synthetic import published_config, release_tensor_plan

    if model == "glm-5":
        config = published_config(model, 2, n_routed_experts=16)
        layer, experts = "model.layers.1.", 16
        expected = {"mlp.experts.15.gate_proj.weight": (2048, 6144), "mlp.experts.15.down_proj.weight": (6144, 2048),
                    "self_attn.q_b_proj.weight": (64 * 256, 2048), "self_attn.kv_a_proj_with_mqa.weight": (576, 6144),
                    "self_attn.indexer.wq_b.weight": (32 * 128, 2048),
                    "mlp.shared_experts.up_proj.weight": (2048, 6144)}
    else:
        config = published_config(model, 2)
        layer, experts = "model.language_model.layers.1.", 256
        expected = {"mlp.experts.255.up_proj.weight": (512, 2048), "mlp.experts.0.down_proj.weight": (2048, 512),
                    "self_attn.q_proj.weight": (2 * 16 * 256, 2048), "self_attn.k_proj.weight": (2 * 256, 2048),
                    "mlp.shared_expert.gate_proj.weight": (512, 2048)}
        assert config["text_config"]["layer_types"] == ["linear_attention", "full_attention"]
    family = detect(config)
    assert family.num_experts(family.text_config(config)) == experts
    shapes = {p.name: tuple(p.shape) for p in release_tensor_plan(config)}
    for name, shape in expected.items():
        assert shapes[layer + name] == shape, name
    if model != "glm-5":
        assert shapes["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"] == (2 * 16 * 128 + 32 * 128, 2048)


def test_write_synthetic_is_a_checkpoint_fp4kit_quantizes(tiny, tmp_path: Path) -> None:
    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint
    from fp4kit.testing.synthetic import write_synthetic

    config = read_config(tiny("qwen3_5_moe"))
    src = write_synthetic(tmp_path / "src", config, max_shard_bytes=200_000)
    assert len(set(json.loads((src / INDEX_NAME).read_text())["weight_map"].values())) > 1
    report = quantize_checkpoint(src, tmp_path / "out", QuantizeOptions())
    with CheckpointReader(tmp_path / "out") as out:
        assert "model.language_model.layers.1.mlp.experts.7.down_proj.weight_packed" in out
        assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in out  # kept, as the default says
    assert report is not None
