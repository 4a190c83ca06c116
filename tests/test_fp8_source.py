"""quantize --scheme-for REGEX=fp8-source: an FP8 source's modules kept as stored (weight and scale bytes) beside
NVFP4 experts, in both dialects, also where the ignores keep them out of NVFP4 (DeepSeek's MTP layer); vLLM 0.33's
config parsers give them its FP8 block method; open_checkpoint and eval read them; forms a dialect cannot hold are
refused in one line. And the ue8m0 (power-of-two) FP8-block scales DeepSeek-V3.1 ships, read bit for bit as
transformers' FP8 dequantization reads them, and kept as powers of two."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import cli_result, load_all
from safetensors.torch import save_file

from fp4kit.errors import Fp4kitError
from fp4kit.formats.detect import open_checkpoint
from fp4kit.quantize.checkpoint import QuantizeOptions, quantize_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DIALECTS = ("compressed-tensors", "modelopt")
# decoder-layer attention (planned for NVFP4, kept as stored instead) and the MTP layer's attention (default-ignored)
RULES = (r"self_attn\.=fp8-source",)
# vLLM's packed_modules_mapping (deepseek_v2.py), and the name it serves q_a / kv_a under
PACKED = {"gate_up_proj": ["gate_proj", "up_proj"]}


@pytest.fixture(scope="module")
def fp8_source(tiny, tmp_path_factory):
    """The tiny DeepSeek-V3 (3 decoder layers and an MTP layer) written as its FP8-block release stores it."""
    from fp4kit.testing.fixtures import write_fp8_block_source

    return write_fp8_block_source(tiny("deepseek_v3"), tmp_path_factory.mktemp("fp8src") / "src")


@pytest.fixture(scope="module")
def kept(fp8_source, tmp_path_factory):
    built: dict[str, Path] = {}

    def get(dialect: str) -> Path:
        if dialect not in built:
            dst = tmp_path_factory.mktemp(f"fp8-source-{dialect}") / "out"
            quantize_checkpoint(fp8_source, dst, QuantizeOptions(format=dialect, scheme_for=list(RULES)))
            built[dialect] = dst
        return built[dialect]

    return get


def _source_attention(source: dict[str, torch.Tensor]) -> list[str]:
    return sorted(n[: -len(".weight")] for n, t in source.items()
                  if ".self_attn." in n and n.endswith(".weight") and t.dtype == torch.float8_e4m3fn)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_kept_modules_are_the_source_bytes(fp8_source, kept, dialect):
    """Every FP8 attention Linear (decoder layers and MTP layer) is the source's weight bytes and scale values;
    compressed-tensors holds the scale bytes as the source does, ModelOpt the same fp32 bytes in its block shape."""
    source, ours = load_all(fp8_source), load_all(kept(dialect))
    modules = _source_attention(source)
    assert any(m.startswith("model.layers.3.") for m in modules)  # the MTP layer's, which the ignores keep
    for module in modules:
        assert torch.equal(ours[f"{module}.weight"].view(torch.uint8), source[f"{module}.weight"].view(torch.uint8))
        scale, stored = ours[f"{module}.weight_scale"], source[f"{module}.weight_scale_inv"]
        assert scale.dtype == torch.float32 and scale.numel() == stored.numel(), module
        assert torch.equal(scale.reshape(stored.shape).view(torch.int32), stored.view(torch.int32)), module
        assert f"{module}.weight_scale_inv" not in ours and f"{module}.weight_packed" not in ours
    # the routed experts are NVFP4, the rest of the MTP layer dequantized as before
    assert any(n.endswith("experts.0.gate_proj.weight_scale_2") or n.endswith("experts.0.gate_proj.weight_packed")
               for n in ours)
    assert ours["model.layers.3.mlp.experts.0.gate_proj.weight"].dtype == torch.bfloat16


def test_compressed_tensors_config_resolves_in_vllm(kept):
    from compressed_tensors.quantization import QuantizationConfig
    from helpers import vllm_module

    ct_config = vllm_module("model_executor.layers.quantization.compressed_tensors.compressed_tensors")
    root = kept("compressed-tensors")
    config = json.loads((root / "config.json").read_text())["quantization_config"]
    assert config["format"] == "mixed-precision"
    QuantizationConfig.model_validate(config)
    parsed = ct_config.CompressedTensorsConfig.from_config(config)
    parsed.packed_modules_mapping = dict(PACKED)

    class RowParallelLinear(torch.nn.Module):
        pass

    modules = _source_attention(load_all(root))
    for name in [*modules, *{f"{m.rsplit('.', 1)[0]}.fused_qkv_a_proj" for m in modules}]:
        scheme = parsed.get_scheme_dict(RowParallelLinear(), name)
        assert scheme is not None and scheme["weights"].num_bits == 8, name
        assert scheme["weights"].block_structure == [128, 128] and scheme["input_activations"].dynamic, name
    experts = parsed.get_scheme_dict(RowParallelLinear(), "model.layers.1.mlp.experts.0.gate_proj")
    assert experts["weights"].num_bits == 4
    assert "model.layers.3.self_attn.q_a_proj" not in config["ignore"]


def test_modelopt_config_resolves_in_vllm(kept):
    from helpers import vllm_module

    modelopt_config = vllm_module("model_executor.layers.quantization.modelopt")
    root = kept("modelopt")
    hf_quant = json.loads((root / "hf_quant_config.json").read_text())
    parsed = modelopt_config.ModelOptMixedPrecisionConfig.from_config(hf_quant)
    parsed.packed_modules_mapping = dict(PACKED)
    modules = _source_attention(load_all(root))
    for module in modules:
        assert not parsed.is_layer_excluded(module), module
        assert parsed._resolve_quant_algo(module) == "FP8_PB_WO", module
    assert parsed._resolve_quant_algo("model.layers.3.self_attn.fused_qkv_a_proj") == "FP8_PB_WO"
    assert parsed._resolve_quant_algo("model.layers.1.mlp.experts") == "W4A16_NVFP4"


@pytest.mark.parametrize("dialect", DIALECTS)
def test_open_checkpoint_reads_the_source_values(fp8_source, kept, dialect):
    """The kept modules read back as fp8-block modules whose dequantization is the source's, bit for bit."""
    from fp4kit.io.checkpoint import CheckpointReader, read_config
    from fp4kit.io.sources import read_source
    from fp4kit.quantize.plan import read_linear_weight

    with open_checkpoint(kept(dialect), mixed=True) as ckpt, CheckpointReader(fp8_source) as reader:
        source = read_source(reader, read_config(fp8_source))
        modules = {m.name: m for m in ckpt.fp8_modules}
        assert sorted(modules) == _source_attention(load_all(fp8_source))
        for name, module in modules.items():
            assert module.scheme == "fp8-block"
            weight, input_div = ckpt.read_fp8(module)
            assert input_div is None
            assert torch.equal(weight.dequantize(), read_linear_weight(reader, source, name)), name


def test_eval_reads_it(fp8_source, kept):
    """`fp4kit eval SRC DST` against the FP8 source: the kept attention read as FP8 blocks, the experts NVFP4."""
    from fp4kit.tools.evaluate import evaluate

    token_ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    result = evaluate(fp8_source, kept("compressed-tensors"), token_ids, batch_size=2)
    assert result.scheme == "mixed (nvfp4a16 + fp8-block)"
    assert 0 < result.kl < 0.1 and math.isfinite(result.ce_quantized)


def test_refusals_are_one_line(tiny, fp8_source, tmp_path):
    """fp8-source of a module the source does not store as FP8, of E8M0 scales (DeepSeek-V4's) in a dialect whose
    FP8 scales are floats, and a fused sibling left out: one line, exit 2, no DST."""
    from fp4kit.testing.fixtures import write_deepseek_v4_release_source

    release = write_deepseek_v4_release_source(tiny("deepseek_v4"), tmp_path / "release")
    cases = [
        (tiny("deepseek_v3"), [r"self_attn\.=fp8-source"], "is not quantized in the source"),
        (release, [r"attn\.w(q_a|kv)$=fp8-source"], "E8M0"),
        (fp8_source, [r"self_attn\.q_a_proj=fp8-source"], "must share one scheme"),
    ]
    for i, (src, rules, message) in enumerate(cases):
        dst = tmp_path / f"out{i}"
        run = cli_result("quantize", str(src), str(dst), *[a for r in rules for a in ("--scheme-for", r)])
        assert run.returncode == 2 and run.stderr.count("\n") == 1 and message in run.stderr, run.stderr
        assert not dst.exists()


def test_a_rule_that_keeps_nothing_is_refused(fp8_source, tmp_path):
    with pytest.raises(Fp4kitError, match="matches no module"):
        quantize_checkpoint(fp8_source, tmp_path / "x", QuantizeOptions(scheme_for=[r"no_such_module=fp8-source"]))


def _ue8m0_source(bf16: Path, dst: Path) -> Path:
    """bf16 checkpoint ``bf16`` written as DeepSeek-V3.1 stores FP8 (``scale_fmt: ue8m0``): F32 ``weight_scale_inv``
    per 128x128 block holding powers of two (the block amax / 448 rounded up to one), E4M3 codes under them."""
    from fp4kit.io.sources import FP8_SCALE_SUFFIX
    from fp4kit.testing.fixtures import write_fp8_block_source

    write_fp8_block_source(bf16, dst)
    source = load_all(bf16)
    tensors = load_all(dst)
    for name in [n for n in tensors if n.endswith(FP8_SCALE_SUFFIX)]:
        weight = source[name.removesuffix(FP8_SCALE_SUFFIX) + ".weight"].float()
        n, k = weight.shape
        padded = torch.nn.functional.pad(weight, (0, -k % 128, 0, -n % 128))
        amax = padded.unflatten(0, (-1, 128)).unflatten(2, (-1, 128)).abs().amax(dim=(1, 3))
        scale = torch.exp2(torch.ceil(torch.log2(torch.clamp(amax / 448, min=2.0**-126))))
        expanded = torch.kron(scale, torch.ones(128, 128))[:n, :k]
        tensors[name] = scale
        tensors[name.removesuffix(FP8_SCALE_SUFFIX) + ".weight"] = (weight / expanded).to(torch.float8_e4m3fn)
    for shard in dst.glob("*.safetensors"):
        shard.unlink()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"]["scale_fmt"] = "ue8m0"
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def test_ue8m0_block_scales_read_as_transformers_reads_them_and_kept_as_powers_of_two(tiny, tmp_path):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from fp4kit.io.checkpoint import CheckpointReader, read_config
    from fp4kit.io.sources import read_source
    from fp4kit.quantize.plan import read_linear_weight

    src = _ue8m0_source(tiny("deepseek_v3"), tmp_path / "v31")
    stored = load_all(src)
    op = Fp8Dequantize(None)
    with CheckpointReader(src) as reader:
        source = read_source(reader, read_config(src))
        assert source.name == "fp8-block 128x128 ue8m0"
        assert source.linears
        for module in source.linears:
            weight, scale = stored[f"{module}.weight"], stored[f"{module}.weight_scale_inv"]
            assert torch.equal(torch.frexp(scale).mantissa.abs(), torch.full_like(scale, 0.5))  # powers of two
            # transformers' Fp8Dequantize takes whole blocks only: a partial edge block is its elements of the
            # zero-padded weight's block
            n, k = weight.shape
            padded = torch.zeros(scale.shape[0] * 128, scale.shape[1] * 128, dtype=weight.dtype)
            padded[:n, :k] = weight
            expected = op._dequantize_one(padded, scale, torch.float32)[:n, :k]
            assert torch.equal(read_linear_weight(reader, source, module), expected), module
    dst = tmp_path / "out"
    quantize_checkpoint(src, dst, QuantizeOptions(scheme_for=[r"self_attn\.=fp8-source"]))
    ours = load_all(dst)
    attention = _source_attention(stored)
    assert attention
    for module in attention:
        assert torch.equal(ours[f"{module}.weight_scale"].view(torch.int32),
                           stored[f"{module}.weight_scale_inv"].view(torch.int32)), module


def test_source_config_refusals_are_one_line(tiny, fp8_source, tmp_path):
    """--source-config of a family no engine reads so, in a dialect whose expert names the engine does not read, or
    leaving MXFP4 experts (the MTP block's) unquantized: one line, exit 2, no DST."""
    from fp4kit.testing.fixtures import write_deepseek_v4_release_source

    release = write_deepseek_v4_release_source(tiny("deepseek_v4"), tmp_path / "release")
    cases = [
        (fp8_source, ["--format", "modelopt"], "no engine reads"),
        (release, ["--mtp", "quantize"], "add --format modelopt"),
        (release, ["--format", "modelopt"], "mtp.0.ffn.experts.0.w1"),
        (release, ["--format", "modelopt", "--mtp", "quantize", "--scheme-for", r"attn\.=fp8-source"],
         "--scheme-for does not apply"),
    ]
    for i, (src, args, message) in enumerate(cases):
        dst = tmp_path / f"out{i}"
        run = cli_result("quantize", str(src), str(dst), "--source-config", *args)
        assert run.returncode == 2 and run.stderr.count("\n") == 1 and message in run.stderr, run.stderr
        assert not dst.exists()


def test_compressed_tensors_fp8_sources_keep_their_bytes(tiny, tmp_path):
    """llm-compressor's FP8_DYNAMIC (per channel, bf16 scales) kept as stored: the same bytes in compressed-tensors,
    the same values in ModelOpt's fp32; a per-tensor FP8 source has no dynamic per-tensor scheme to be kept as."""
    pytest.importorskip("llmcompressor")
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import model_free_ptq

    ignore = ["lm_head", "re:.*mlp.gate$"]
    channel, tensor = tmp_path / "channel", tmp_path / "tensor"
    model_free_ptq(tiny("qwen3_moe"), channel, scheme="FP8_DYNAMIC", ignore=ignore)
    fp8 = dict(num_bits=8, type="float", strategy="tensor", symmetric=True)
    model_free_ptq(tiny("qwen3_moe"), tensor, ignore=ignore, scheme=QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(**fp8, dynamic=False),
        input_activations=QuantizationArgs(**fp8, dynamic=True)))
    source = load_all(channel)
    modules = _source_attention(source)
    assert modules and source[f"{modules[0]}.weight_scale"].dtype == torch.bfloat16
    for dialect in DIALECTS:
        dst = tmp_path / dialect
        quantize_checkpoint(channel, dst, QuantizeOptions(format=dialect, scheme_for=list(RULES)))
        ours = load_all(dst)
        with open_checkpoint(dst, mixed=True) as ckpt:
            assert {m.name: m.scheme for m in ckpt.fp8_modules} == dict.fromkeys(modules, "fp8-dynamic")
        for module in modules:
            assert torch.equal(ours[f"{module}.weight"].view(torch.uint8), source[f"{module}.weight"].view(torch.uint8))
            scale, stored = ours[f"{module}.weight_scale"], source[f"{module}.weight_scale"]
            if dialect == "compressed-tensors":
                assert scale.dtype == stored.dtype and torch.equal(scale.view(torch.int16), stored.view(torch.int16))
            else:
                assert scale.dtype == torch.float32 and torch.equal(scale, stored.float().flatten())
    with pytest.raises(Fp4kitError, match="128x128 blocks or one scale per output channel"):
        quantize_checkpoint(tensor, tmp_path / "refused", QuantizeOptions(scheme_for=list(RULES)))
    assert not (tmp_path / "refused").exists()


def test_source_config_output_is_the_release_but_its_experts(tiny, tmp_path):
    """--source-config on DeepSeek-V4's release: the release's config with moe_quant_algo, its non-expert tensors
    byte for byte, a warning about the missing input scales; fp4kit's readers refuse the form in one line."""
    from fp4kit.testing.fixtures import write_deepseek_v4_release_source

    release = write_deepseek_v4_release_source(tiny("deepseek_v4"), tmp_path / "release")
    dst = tmp_path / "out"
    run = cli_result("quantize", str(release), str(dst), "--source-config", "--format", "modelopt", "--mtp", "quantize")
    assert run.returncode == 0 and "no input scales" in run.stderr, run.stderr
    config, source_config = (json.loads((p / "config.json").read_text()) for p in (dst, release))
    assert config["quantization_config"] == {**source_config["quantization_config"], "moe_quant_algo": "NVFP4"}
    ours, stored = load_all(dst), load_all(release)
    kept = [n for n in stored if ".ffn.experts." not in n]
    assert kept and all(torch.equal(ours[n].view(torch.uint8), stored[n].view(torch.uint8)) for n in kept)
    assert not any(n.endswith(".scale") for n in ours if ".ffn.experts." in n)
    assert "vllm serve DST --quantization-config" in (dst / "README.md").read_text()
    inspect = cli_result("inspect", str(dst))
    assert inspect.returncode == 2 and inspect.stderr.count("\n") == 1 and "moe_quant_algo" in inspect.stderr


@pytest.mark.parametrize("dialect", DIALECTS)
def test_kept_tensors_have_the_shapes_vllm_registers(kept, monkeypatch, dialect):
    """Each kept module's tensors by name, shape and dtype as vLLM 0.33's FP8 block methods create their parameters
    (ModelOpt's ``KFp8Block128`` refuses an input size that is not a multiple of 128, as for fp8-block)."""
    from helpers import vllm_module

    param = vllm_module("model_executor.parameter")
    monkeypatch.setattr(param, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(param, "get_tensor_model_parallel_world_size", lambda: 1)
    tensors = load_all(kept(dialect))
    checked = 0
    for module in _source_attention(tensors):
        n, k = tensors[f"{module}.weight"].shape
        layer = torch.nn.Module()
        if dialect == "modelopt":
            mo = vllm_module("model_executor.layers.quantization.modelopt")
            shapes = mo.Shapes([n], k, torch.bfloat16)
            if k % 128:
                with pytest.raises(ValueError, match="divisible by 128"):
                    mo.KFp8Block128().create_weights(layer, mo.WEIGHT, mo.CkptCtx(), shapes, lambda *a, **kw: None)
                continue
            mo.KFp8Block128().create_weights(layer, mo.WEIGHT, mo.CkptCtx(), shapes, lambda *a, **kw: None)
        else:
            from compressed_tensors.quantization import QuantizationStrategy

            fp8_utils = vllm_module("model_executor.layers.quantization.utils.fp8_utils")
            ct_utils = vllm_module("model_executor.layers.quantization.compressed_tensors.utils")
            layer.register_parameter("weight", fp8_utils.create_fp8_weight_parameter(n, k, lambda *a, **kw: None))
            layer.register_parameter("weight_scale", fp8_utils.create_fp8_scale_parameter(
                ct_utils.STRATEGY_TO_PARAMETER_TYPE[QuantizationStrategy.BLOCK], [n], k, [128, 128],
                lambda *a, **kw: None))
        ours = {name.removeprefix(module + "."): (tuple(t.shape), t.dtype) for name, t in tensors.items()
                if name.rsplit(".", 1)[0] == module}
        theirs = {name: (tuple(p.shape), p.dtype) for name, p in layer.named_parameters()}
        assert ours == theirs, module
        checked += 1
    assert checked


def test_calibrated_runs_keep_the_bytes_too(tiny, tmp_path):
    """W4A4 with gptq (the layer pass writes kept tensors itself): the kept modules are still the source's bytes and
    the experts carry input scales."""
    from fp4kit.testing.fixtures import write_fp8_block_source

    src = write_fp8_block_source(tiny("qwen3_moe"), tmp_path / "src")
    dst = tmp_path / "out"
    quantize_checkpoint(src, dst, QuantizeOptions(scheme="nvfp4", method="gptq", samples=4, seq_len=16,
                                                  scheme_for=list(RULES)))
    source, ours = load_all(src), load_all(dst)
    modules = _source_attention(source)
    assert modules and any(n.endswith(".input_global_scale") for n in ours)
    for module in modules:
        assert torch.equal(ours[f"{module}.weight"].view(torch.uint8), source[f"{module}.weight"].view(torch.uint8))
        assert torch.equal(ours[f"{module}.weight_scale"], source[f"{module}.weight_scale_inv"])
