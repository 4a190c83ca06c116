"""The Qwen hybrids (Qwen3-Next, Qwen3.5/3.6-MoE and its text-only model) end to end on their tiny fixtures: routing
against transformers' MoE blocks, every source tensor in DST (kept byte-identical or quantized; the MTP block, the
Gated DeltaNet layers and the vision tower kept) for both dialects, both schemes and every method, inspect clean,
verify through Triton's interpreter and EP shards, `fp4kit eval`.

Oracles: transformers 5.17 `models/qwen3_next/modeling_qwen3_next.py` (Qwen3NextSparseMoeBlock) and
`models/qwen3_5_moe/modeling_qwen3_5_moe.py` (Qwen3_5MoeSparseMoeBlock).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

if not torch.cuda.is_available():  # before anything imports triton: on a CPU it runs under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fp4kit.families import detect  # noqa: E402
from fp4kit.families.routing import route  # noqa: E402
from fp4kit.formats.detect import open_checkpoint  # noqa: E402
from fp4kit.io.checkpoint import CheckpointReader  # noqa: E402
from fp4kit.quantize import QuantizeOptions, quantize_checkpoint  # noqa: E402
from fp4kit.testing.fixtures import fixture_spec  # noqa: E402
from fp4kit.tools.inspect import inspect_checkpoint  # noqa: E402
from fp4kit.verify.checks import VerifyOptions  # noqa: E402
from fp4kit.verify.reference import moe_reference  # noqa: E402
from fp4kit.verify.runner import verify_checkpoint  # noqa: E402

HYBRIDS = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _moe_block(family: str, overrides: dict):
    import transformers
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    spec = fixture_spec(family)
    config = getattr(transformers, spec["config_class"])(**spec["config"]).get_text_config()
    for key, value in overrides.items():
        setattr(config, key, value)
    block = (Qwen3NextSparseMoeBlock if family == "qwen3_next" else Qwen3_5MoeSparseMoeBlock)(config).float()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.3)
    return config, block.eval()


@pytest.mark.parametrize(("family", "overrides"), [("qwen3_next", {"norm_topk_prob": True}),
                                                   ("qwen3_next", {"norm_topk_prob": False}),
                                                   ("qwen3_5_moe", {})])
def test_routing_and_routed_output_equal_transformers_moe_block(family: str, overrides: dict) -> None:
    config, block = _moe_block(family, overrides)
    seen = {}
    block.gate.register_forward_hook(lambda module, args, output: seen.update(router=output))
    hidden = torch.randn(2, 37, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        output = block(hidden).reshape(-1, config.hidden_size)
        flat = hidden.reshape(-1, config.hidden_size)
        shared = torch.sigmoid(block.shared_expert_gate(flat)) * block.shared_expert(flat)
    logits, hf_weights, hf_ids = seen["router"]
    text = detect({"model_type": config.model_type}).text_config(config.to_dict())
    spec = detect({"model_type": config.model_type}).routing(text)
    weights, ids = route(logits, spec)
    assert torch.equal(ids.sort(dim=-1).values, hf_ids.sort(dim=-1).values)
    order_ours, order_hf = ids.argsort(dim=-1), hf_ids.argsort(dim=-1)
    torch.testing.assert_close(weights.gather(1, order_ours), hf_weights.float().gather(1, order_hf))
    routed = moe_reference(flat, weights, ids, block.experts.gate_up_proj, block.experts.down_proj, spec)
    torch.testing.assert_close(routed + shared, output, rtol=1e-4, atol=1e-5)


def _quantized_modules(root) -> set[str]:
    return {m.name for m in open_checkpoint(root).modules}


METHODS = [(dialect, scheme, method) for dialect in ("compressed-tensors", "modelopt")
           for scheme in ("nvfp4a16", "nvfp4") for method in ("rtn", "mse", "gptq")]


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
@pytest.mark.parametrize(("dialect", "scheme", "method"), METHODS)
def test_every_source_tensor_reaches_dst_and_the_mtp_block_is_kept(tiny, tmp_path, family, dialect, scheme,
                                                                    method) -> None:
    src = tiny(family)
    out = tmp_path / "out"
    quantize_checkpoint(src, out, QuantizeOptions(scheme=scheme, format=dialect, method=method, samples=4,
                                                  seq_len=16, batch_size=2))
    quantized = _quantized_modules(out)
    source, dst = CheckpointReader(src), CheckpointReader(out)
    kept = 0
    for name in source.names():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module in quantized:
            continue
        assert name in dst, name
        assert torch.equal(source.read(name).view(torch.uint8), dst.read(name).view(torch.uint8)), name
        kept += 1
    mtp = [n for n in source.names() if n.startswith("mtp.")]
    assert len(mtp) == 17 + 3 * 8  # fc, 3 norms, a full-attention MoE layer's 13 + 8 experts x 3
    assert not [m for m in quantized if m.startswith("mtp.") or ".linear_attn." in m or ".visual." in m
                or m.endswith(("mlp.gate", "shared_expert_gate"))]
    assert any(".experts." in m for m in quantized) and any(".self_attn.q_proj" in m for m in quantized)
    assert any(".shared_expert.down_proj" in m for m in quantized)
    assert kept > len(mtp)
    report = inspect_checkpoint(out, engine="vllm")
    assert report.problems == [], report.problems


def test_the_text_only_model_is_detected_and_kept_alike(tiny, tiny_nvfp4a16) -> None:
    config = json.loads((tiny("qwen3_5_moe_text") / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe_text" and detect(config).name == "qwen3_5_moe"
    quantized = _quantized_modules(tiny_nvfp4a16("qwen3_5_moe_text"))
    assert "model.layers.1.mlp.experts.7.down_proj" in quantized
    assert not [m for m in quantized if m.startswith("mtp.") or ".linear_attn." in m]


@pytest.mark.parametrize("family", HYBRIDS)
def test_triton_under_the_interpreter_and_ep_shards_verify(tiny, tmp_path, family: str) -> None:
    """Both layer kinds (Gated DeltaNet and full attention) carry an MoE block; W4A4 with activation scales."""
    from fp4kit.ep.shard import ShardOptions, shard_checkpoint

    out = tmp_path / "nvfp4"
    quantize_checkpoint(tiny(family), out, QuantizeOptions(scheme="nvfp4", samples=4, seq_len=16, batch_size=2))
    shard_checkpoint(out, tmp_path / "ep2", ShardOptions(ep=2))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report = verify_checkpoint(out, VerifyOptions(source=tiny(family), tokens=[1, 6], backend="triton",
                                                  ep_shards=tmp_path / "ep2", device=device))
    assert report.passed, [(r.layer, r.check, r.target, r.error, r.detail) for r in report.results if r.failed]
    assert report.mode == "w4a4"
    checks = {(r.layer, r.check) for r in report.results}
    for layer in (0, 1):
        assert {(layer, "kernel"), (layer, "routing"), (layer, "ep-sum"), (layer, "source-expert")} <= checks
    assert {r.target for r in report.results if r.check == "routing"} == {"route", "reference", "triton"}


@pytest.mark.parametrize("family", HYBRIDS)
def test_fp4kit_eval_runs_on_the_w4a4_checkpoint(monkeypatch, capsys, tiny, tmp_path, family: str) -> None:
    from fp4kit import cli

    out = tmp_path / "nvfp4"
    quantize_checkpoint(tiny(family), out, QuantizeOptions(scheme="nvfp4", samples=4, seq_len=16, batch_size=2))
    monkeypatch.setattr("sys.argv", ["fp4kit", "eval", str(tiny(family)), str(out), "--samples", "2", "--seq-len",
                                     "16", "--json", "-"])
    cli.main()  # exit 0: no SystemExit
    result = json.loads(capsys.readouterr().out)
    assert result["scheme"] == "nvfp4" and len(result["layers"]) == 2
    assert 0 < result["kl"] < 0.5 and 0 < result["top1"] <= 1


@pytest.mark.parametrize(("family", "dialect", "method"), [("qwen3_next", "compressed-tensors", "rtn"),
                                                           ("qwen3_5_moe", "modelopt", "gptq")])
def test_mtp_quantize_quantizes_the_mtp_experts_alone_and_verifies(tiny, tmp_path, family, dialect, method) -> None:
    from fp4kit.ep.shard import ShardOptions, shard_checkpoint

    src, out = tiny(family), tmp_path / "out"
    quantize_checkpoint(src, out, QuantizeOptions(format=dialect, method=method, mtp="quantize", samples=4,
                                                  seq_len=16, batch_size=2))
    quantized = _quantized_modules(out)
    mtp = {m for m in quantized if m.startswith("mtp.")}
    assert mtp == {f"mtp.layers.0.mlp.experts.{e}.{p}" for e in range(8) for p in ("gate_proj", "up_proj",
                                                                                      "down_proj")}
    source, dst = CheckpointReader(src), CheckpointReader(out)
    for name in source.names():
        if name.startswith("mtp.") and name.rsplit(".", 1)[0] not in mtp:
            assert torch.equal(source.read(name).view(torch.uint8), dst.read(name).view(torch.uint8)), name
    assert inspect_checkpoint(out, engine="vllm").problems == []
    shard_checkpoint(out, tmp_path / "ep2", ShardOptions(ep=2))
    report = verify_checkpoint(out, VerifyOptions(source=src, tokens=[1, 6], backend="reference",
                                                  ep_shards=tmp_path / "ep2"))
    assert report.passed, [(r.layer, r.check, r.target, r.error) for r in report.results if r.failed]
    # the MTP layer is numbered after the decoder layers, as vLLM's drafter numbers it
    assert {(2, "source-expert"), (2, "routing"), (2, "ep-sum")} <= {(r.layer, r.check) for r in report.results}


def test_mtp_quantize_refuses_w4a4_and_families_without_an_mtp_block(tiny, tmp_path) -> None:
    from fp4kit.errors import Fp4kitError

    with pytest.raises(Fp4kitError, match="no calibration forward reaches the MTP block"):
        quantize_checkpoint(tiny("qwen3_next"), tmp_path / "a", QuantizeOptions(scheme="nvfp4", mtp="quantize"))
    with pytest.raises(Fp4kitError, match="glm4_moe has no MTP block outside its decoder layers"):
        quantize_checkpoint(tiny("glm4_moe"), tmp_path / "b", QuantizeOptions(mtp="quantize"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# llm-compressor's ignores that are the hybrids' defaults (fp4kit.families.qwen3_next.HYBRID_KEPT, the vision tower)
LLMC_IGNORE = ["re:.*lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$", "re:.*linear_attn.*", "re:.*visual.*"]


@pytest.mark.pinned  # llm-compressor's pins (.ci/run)
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_w4a16_rtn_equals_llm_compressor_oneshot(tiny, tiny_nvfp4a16, tmp_path, family: str) -> None:
    """llm-compressor 0.14's `oneshot` NVFP4A16 (its MoE linearization of these families' fused experts:
    llmcompressor/modeling/moe/conversion_mappings.py) writes every tensor fp4kit writes, byte for byte, with two
    deliberate differences: Qwen3-Next's MTP block, which it drops (transformers' class does not hold it) and fp4kit
    keeps as stored; and the (1 + weight) RMSNorm weights, which its offset-norm calibration context
    (llmcompressor/modeling/offset_norm.py) turns into 1 + w and back in bf16, rounding them, where fp4kit keeps
    the source's bytes."""
    pytest.importorskip("llmcompressor")
    import transformers
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model = getattr(transformers, fixture_spec(family)["model_class"]).from_pretrained(tiny(family),
                                                                                       dtype=torch.bfloat16)
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="NVFP4A16", ignore=LLMC_IGNORE))
    model.save_pretrained(tmp_path / "llmc", save_compressed=True)
    ours, theirs = CheckpointReader(tiny_nvfp4a16(family)), CheckpointReader(tmp_path / "llmc")
    only_ours = set(ours.names()) - set(theirs.names())
    assert set(theirs.names()) <= set(ours.names())
    mtp = {n for n in ours.names() if n.startswith("mtp.")}
    # llm-compressor drops Qwen3-Next's MTP block and copies Qwen3.5's as stored (compared below)
    assert only_ours == (mtp if family == "qwen3_next" else set()), sorted(only_ours)[:3]
    source = CheckpointReader(tiny(family))
    compared = rounded = 0
    for name in theirs.names():
        a, b = ours.read(name), theirs.read(name)
        if name.endswith("norm.weight") and ".linear_attn." not in name:  # the offset norms (Qwen3NextRMSNorm)
            assert torch.equal(a.view(torch.uint8), source.read(name).view(torch.uint8)), name
            torch.testing.assert_close((1 + b.float()).bfloat16(), (1 + a.float()).bfloat16(), rtol=0, atol=0)
            rounded += not torch.equal(a, b)
            continue
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                          b.reshape(-1).view(torch.uint8)), name
        compared += name.endswith(".weight_packed")
    assert compared > 50 and rounded > 0


def test_a_recipe_quantizes_the_mtp_experts(tiny, tmp_path) -> None:
    from fp4kit.pipeline import run_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {tiny('qwen3_next')}\nfamily: qwen3_next\nquantize:\n  scheme: nvfp4a16\n"
                      "  mtp: quantize\nshard:\n  ep: 2\nverify:\n  backend: reference\n  tokens: [4]\n")
    summary = run_recipe(recipe, [], tmp_path / "work")
    assert summary.passed
    assert "mtp.layers.0.mlp.experts.5.up_proj" in _quantized_modules(tmp_path / "work" / "quantize")
