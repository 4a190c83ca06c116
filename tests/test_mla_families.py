"""The MLA families after DeepSeek-V3: GLM-4.7-Flash (glm4_moe_lite), DeepSeek-V3.2 (deepseek_v32) and GLM-5.x
(glm_moe_dsa), on their tiny fixtures (transformers 5.17's classes, saved as the releases are, MTP layer added).

Routing and the source view of each MoE layer against transformers' own MoE block (`Glm4MoeLiteMoE`,
`DeepseekV32MoE`, `GlmMoeDsaMoE`) on random hidden states with NaN rows; the default plan (MLA projections quantized,
q_a_proj + kv_a_proj_with_mqa sharing one global scale as vLLM's fused_qkv_a_proj; router, DSA indexer and MTP layer
kept); quantize in both dialects, both schemes and every method, with every source tensor in DST (kept byte-identical
or quantized), inspect clean; every verify check (reference, Triton under the interpreter, layouts, EP shards, NaN
routing rows) on the stand-in sizes, DeepSeek-V3.2 from its FP8-block form; GLM-5's shared-indexer layers streamed one
at a time equal to the full model.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

# Before anything imports fp4kit's Triton kernels: on a CPU they can only run under the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fp4kit.families import detect  # noqa: E402
from fp4kit.io.checkpoint import CheckpointReader  # noqa: E402
from fp4kit.quantize.plan import build_plan  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MLA = ("glm4_moe_lite", "deepseek_v32", "glm_moe_dsa")
DSA = ("deepseek_v32", "glm_moe_dsa")  # the families with a lightning indexer
MTP = "model.layers.3."  # the fixtures' 3 decoder layers, then the MTP layer
QUANTIZED_LEAVES = (".weight_packed", ".weight_scale", ".weight_global_scale", ".input_global_scale",
                    ".weight_scale_2", ".input_scale")


def _tensors(root: Path) -> dict[str, torch.Tensor]:
    from fp4kit.io.checkpoint import CheckpointReader

    with CheckpointReader(root) as reader:
        return {name: reader.read(name, check_finite=False) for name in reader.names()}


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                    b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("family", MLA)
def test_default_plan_quantizes_mla_and_experts_and_keeps_router_indexer_mtp(tiny, family):
    src = tiny(family)
    config = json.loads((src / "config.json").read_text())
    assert detect(config).name == family
    with CheckpointReader(src) as reader:
        plan = build_plan(reader, config)
    quantized = {c.linear.module for g in plan.groups for c in g.members}
    layer1 = "model.layers.1."
    for module in ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.q_b_proj", "self_attn.kv_b_proj",
                   "self_attn.o_proj", "mlp.shared_experts.gate_proj", "mlp.experts.7.down_proj"):
        assert layer1 + module in quantized, module
    assert "model.layers.0.mlp.gate_proj" in quantized  # the dense first layer
    assert not any(m.endswith("mlp.gate") or m.startswith(MTP) or m == "lm_head" or ".indexer." in m
                   for m in quantized)
    if family in DSA:
        assert {f"{layer1}self_attn.indexer.{p}" for p in ("wq_b", "wk", "weights_proj")} <= set(plan.ignored_modules)
    fused = [sorted(c.linear.module.rsplit(".", 1)[1] for c in g.members) for g in plan.groups
             if g.members[0].linear.module.startswith(layer1 + "self_attn.")]
    assert ["kv_a_proj_with_mqa", "q_a_proj"] in fused


@pytest.mark.parametrize("family", MLA)
def test_source_layer_and_routing_match_transformers_moe_block(tiny, family):
    """verify's view of each MoE layer (router weight and fp32 correction bias, sigmoid top-k, routed scaling,
    shared expert), read from the fixture, against transformers' MoE block of the same checkpoint; NaN rows (padding)
    leave the other rows alone and still route to k distinct experts."""
    from transformers import AutoModelForCausalLM

    from fp4kit.verify.checks import route_batch, shared_output
    from fp4kit.verify.moe_layer import model_spec, read_source_layer
    from fp4kit.verify.reference import moe_reference

    src = tiny(family)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, experts_implementation="eager").eval()
    config = json.loads((src / "config.json").read_text())
    _, spec = model_spec(config)
    assert spec.kind == "sigmoid_grouped_topk" and spec.routed_scaling_factor == config["routed_scaling_factor"]
    assert spec.n_group == config["n_group"]
    for layer in (1, 2):
        block = model.model.layers[layer].mlp
        assert type(block).__name__.endswith("MoE")
        source = read_source_layer(src, f"model.layers.{layer}.mlp.experts", spec.num_experts)
        hidden = torch.randn(64, config["hidden_size"], generator=torch.Generator().manual_seed(layer))
        hidden[[3, 17]] = float("nan")
        with torch.no_grad():
            expected = block(hidden)
        _, weights, ids = route_batch(source, hidden, spec)
        got = moe_reference(hidden, weights, ids, source.w13, source.w2, spec) + shared_output(source.shared, hidden)
        valid = torch.isfinite(hidden).all(dim=1)
        torch.testing.assert_close(got[valid], expected[valid], rtol=1e-5, atol=1e-6)
        assert all(len(set(row.tolist())) == spec.top_k for row in ids[~valid])
        assert bool(((ids >= 0) & (ids < spec.num_experts)).all())


@pytest.fixture(scope="module")
def outputs(tiny, tmp_path_factory):
    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint

    built: dict[tuple, Path] = {}

    def get(family: str, dialect: str, scheme: str, method: str) -> Path:
        key = (family, dialect, scheme, method)
        if key not in built:
            out = tmp_path_factory.mktemp("-".join(key)) / "out"
            quantize_checkpoint(tiny(family), out, QuantizeOptions(scheme=scheme, format=dialect, method=method,
                                                                   samples=8, seq_len=16, batch_size=4))
            built[key] = out
        return built[key]

    return get


@pytest.mark.parametrize("method", ["rtn", "mse", "gptq"])
@pytest.mark.parametrize("scheme", ["nvfp4a16", "nvfp4"])
@pytest.mark.parametrize("dialect", ["compressed-tensors", "modelopt"])
@pytest.mark.parametrize("family", MLA)
def test_quantize_keeps_every_source_tensor_and_inspects_clean(tiny, outputs, family, dialect, scheme, method):
    from fp4kit.tools.inspect import inspect_checkpoint

    out = outputs(family, dialect, scheme, method)
    report = inspect_checkpoint(out)
    assert report.clean, report.problems
    assert (report.family, report.dialect, report.scheme) == (family, dialect, scheme)
    src, dst = _tensors(tiny(family)), _tensors(out)
    with CheckpointReader(tiny(family)) as reader:
        plan = build_plan(reader, json.loads((tiny(family) / "config.json").read_text()))
    quantized = {c.linear.module for g in plan.groups for c in g.members}
    for name, tensor in src.items():
        module = name.removesuffix(".weight")
        if module in quantized:
            assert any(module + leaf in dst for leaf in (".weight_packed", ".weight")), name
            assert dst.get(module + ".weight", torch.empty(0, dtype=torch.uint8)).dtype == torch.uint8, name
            continue
        assert name in dst and _same_bytes(dst[name], tensor), name  # kept: byte-identical
    kept = [n for n in src if n.startswith(MTP) or ".indexer." in n]
    assert kept and all(_same_bytes(dst[n], src[n]) for n in kept)
    if family in DSA:
        assert any(".indexer.wq_b." in n for n in kept)
    extra = {n for n in dst if n not in src and not n.endswith(QUANTIZED_LEAVES)}
    assert not extra, sorted(extra)[:5]


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """family -> the stand-in (H 128, I 64, 8 experts: every backend's shape rules) quantized to W4A4 (calibrated)
    and W4A16, laid out for TRT-LLM-gen / CUTLASS / Marlin and split for EP 2; DeepSeek-V3.2 from its FP8-block form."""
    from fp4kit.ep.shard import ShardOptions, shard_checkpoint
    from fp4kit.layouts.directory import LayoutOptions, layout_checkpoint
    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint
    from fp4kit.testing.fixtures import RECIPE_STAND_INS, build_fixture, write_fp8_block_source

    built: dict[str, dict[str, Path]] = {}

    def get(family: str) -> dict[str, Path]:
        if family in built:
            return built[family]
        root = tmp_path_factory.mktemp(f"stand-in-{family}")
        paths = {"bf16": build_fixture(family, root / "bf16", overrides=RECIPE_STAND_INS[family])}
        paths["source"] = paths["bf16"]
        if family == "deepseek_v32":  # the official release is FP8-block
            paths["source"] = write_fp8_block_source(paths["bf16"], root / "fp8")
        quantize_checkpoint(paths["source"], root / "nvfp4", QuantizeOptions(scheme="nvfp4", samples=4, seq_len=16))
        quantize_checkpoint(paths["source"], root / "nvfp4a16")
        for backend, base in (("trtllm", "nvfp4"), ("cutlass", "nvfp4"), ("marlin", "nvfp4a16")):
            layout_checkpoint(root / base, root / backend, LayoutOptions(backend=backend))
        shard_checkpoint(root / "nvfp4", root / "ep2", ShardOptions(ep=2))
        built[family] = {**paths, **{n: root / n for n in ("nvfp4", "nvfp4a16", "trtllm", "cutlass", "marlin", "ep2")}}
        return built[family]

    return get


def _failures(report) -> list[str]:
    return [f"layer {r.layer} {r.check} {r.target}: {r.error} {r.detail}" for r in report.results if r.failed]


@pytest.mark.parametrize(("checkpoint", "layouts", "shards"), [("nvfp4", ["trtllm", "cutlass"], "ep2"),
                                                               ("nvfp4a16", ["marlin"], None)])
@pytest.mark.parametrize("family", MLA)
def test_every_reference_check_passes_against_the_source(stand_in, family, checkpoint, layouts, shards):
    from fp4kit.verify.checks import VerifyOptions
    from fp4kit.verify.runner import verify_checkpoint

    paths = stand_in(family)
    options = VerifyOptions(source=paths["source"], tokens=[1, 16, 256], backend="reference",
                            layouts=[paths[name] for name in layouts], ep_shards=paths[shards] if shards else None)
    report = verify_checkpoint(paths[checkpoint], options)
    assert report.passed, _failures(report)
    assert report.mode == ("w4a4" if checkpoint == "nvfp4" else "w4a16")
    assert {r.layer for r in report.results} == {1, 2}  # the MoE layers; layer 0 is dense, layer 3 the MTP layer
    assert {"source", "source-expert", "routing", "layout", "layout-source"} <= {r.check for r in report.results}
    if family == "deepseek_v32":
        assert {r.target for r in report.results if r.check == "source"} == {"fp8-block 128x128"}
    assert [r.detail for r in report.results if r.check == "layout"] == ["bit exact"] * 2 * len(layouts)
    if shards:
        ep_sum = [r for r in report.results if r.check == "ep-sum"]
        assert len(ep_sum) == 2 and all(r.error < 1e-5 for r in ep_sum)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("family", MLA)
def test_triton_matches_the_reference_nan_rows_included(stand_in, family):
    """The interpreter on a CPU; compiled where a GPU is (the interpreter cannot run once triton is imported)."""
    from fp4kit.verify.checks import VerifyOptions
    from fp4kit.verify.runner import verify_checkpoint

    device = "cuda" if torch.cuda.is_available() else "cpu"
    report = verify_checkpoint(stand_in(family)["nvfp4"], VerifyOptions(tokens=[1, 6], backend="triton", layers=[1],
                                                                       device=device))
    assert report.passed, _failures(report)
    kernel = [r for r in report.results if r.check == "kernel" and r.target == "triton"]
    assert len(kernel) == 2 and all(r.error is not None and r.error < 1e-2 for r in kernel)
    assert {r.target for r in report.results if r.check == "routing"} == {"route", "reference", "triton"}


def test_deepseek_v32_fp8_source_keeps_the_indexer_in_the_model_dtype(stand_in):
    """The FP8 release's indexer (wq_b and wk e4m3 with block scales, weights_proj bf16) is written as the kept
    Linears of a quantized source are: dequantized to bf16, no FP8 scale left behind (vLLM's unquantized indexer
    Linears take a plain weight)."""
    paths = stand_in("deepseek_v32")
    fp8, dst = _tensors(paths["source"]), _tensors(paths["nvfp4a16"])
    wq_b = "model.layers.1.self_attn.indexer.wq_b.weight"
    weights_proj = "model.layers.1.self_attn.indexer.weights_proj.weight"
    assert fp8[wq_b].dtype == torch.float8_e4m3fn and fp8[weights_proj].dtype == torch.bfloat16
    assert dst[wq_b].dtype == torch.bfloat16 and not any(n.endswith("weight_scale_inv") for n in dst)


def test_glm5_shared_indexer_layers_stream_like_the_full_model(tmp_path):
    """With ``index_topk_freq`` 2 the last decoder layer is "shared": it builds no indexer and reuses layer 1's
    top-k. Calibration, one layer at a time, carries it across and gives every layer the full model's output."""
    import transformers

    from fp4kit.quantize.calibrate import calibrate
    from fp4kit.testing.fixtures import build_fixture

    src = build_fixture("glm_moe_dsa", tmp_path / "src", overrides={"index_topk_freq": 2})
    assert json.loads((src / "config.json").read_text())["indexer_types"] == ["full", "full", "shared"]
    model = transformers.GlmMoeDsaForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    assert model.model.layers[2].self_attn.indexer is None
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model.model(input_ids=ids, output_hidden_states=True).hidden_states
    streamed: dict[int, torch.Tensor] = {}
    calibrate(src, ids, batch_size=2, dtype=torch.float32,
              on_layer=lambda i, batches: streamed.__setitem__(i, torch.cat(batches)))
    for index in range(2):  # the last of hidden_states is after the final norm
        torch.testing.assert_close(streamed[index], expected[index + 1], rtol=0, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(model.model.norm(streamed[2]), expected[3], rtol=0, atol=1e-5)


def test_glm5_shared_indexer_layers_evaluate(tmp_path):
    """`fp4kit eval`'s streaming forward carries the top-k as calibration does: W4A4 of the shared-indexer model
    against its source, every layer close, the last (shared) one included."""
    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint
    from fp4kit.testing.fixtures import build_fixture
    from fp4kit.tools.evaluate import evaluate

    src = build_fixture("glm_moe_dsa", tmp_path / "src", overrides={"index_topk_freq": 2})
    quantize_checkpoint(src, tmp_path / "w4a4", QuantizeOptions(scheme="nvfp4", samples=4, seq_len=16))
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    result = evaluate(src, tmp_path / "w4a4", ids, batch_size=2)
    assert result.scheme == "nvfp4" and len(result.layers) == 3 and all(0 < e < 1 for e in result.layers)
    assert 0 < result.kl < 1 and result.tokens == 4 * 15


def test_glm5_shared_first_layer_is_one_line(tmp_path, monkeypatch, capsys):
    """An index_topk_pattern whose first layer shares a top-k no layer computed: exit 2 with one line."""
    from fp4kit.cli import main
    from fp4kit.testing.fixtures import build_fixture

    src = build_fixture("glm_moe_dsa", tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "indexer_types": ["shared", "full", "full"]}))
    monkeypatch.setattr("sys.argv", ["fp4kit", "quantize", str(src), str(tmp_path / "out"), "--scheme", "nvfp4",
                                     "--samples", "4", "--seq-len", "16"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    err = capsys.readouterr().err.strip().splitlines()  # the progress lines, then the error
    errors = [line for line in err if line.startswith("error:")]
    assert exit_info.value.code == 2 and errors == err[-1:] and not any("Traceback" in line for line in err), err
    assert "layer 0 share" in errors[0] and not (tmp_path / "out").exists()
