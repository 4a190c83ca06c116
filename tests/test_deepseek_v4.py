"""DeepSeek-V4 (fp4kit.families.deepseek_v4): its release format read exactly, data-free quantize with the exact
MXFP4 -> NVFP4 cast, its routing and clamped SwiGLU.

The source: the tiny fixture written as the release stores it (fp4kit.testing.fixtures
write_deepseek_v4_release_source: FP4 experts with E8M0 scales per 32, FP8 with E8M0 128x128 scales). Oracles:
transformers 5.17's ``Fp8Dequantize`` (the DeepSeek-V4 loading path with ``dequantize=True``, both scale grids),
compressed-tensors' NVFP4 decompressor of the output, transformers' ``DeepseekV4TopKRouter`` and
``DeepseekV4Experts._apply_gate``.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import cli_result
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def release(tiny, tmp_path_factory):
    from fp4kit.testing.fixtures import write_deepseek_v4_release_source

    return write_deepseek_v4_release_source(tiny("deepseek_v4"), tmp_path_factory.mktemp("dsv4") / "release")


@pytest.fixture(scope="module")
def quantized(release, tmp_path_factory):
    """`fp4kit quantize RELEASE DST` (data-free, compressed-tensors): its stdout and DST."""
    dst = tmp_path_factory.mktemp("dsv4") / "nvfp4"
    run = cli_result("quantize", str(release), str(dst))
    assert run.returncode == 0, run.stderr
    return run.stdout, dst


def transformers_dequantized(path) -> dict[str, torch.Tensor]:
    """Every quantized Linear of the release as transformers' Fp8Dequantize reads it, in fp32."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    stored = load_file(path / "model.safetensors")
    op = Fp8Dequantize(None)
    return {name: op._dequantize_one(stored[name], stored[name.removesuffix("weight") + "scale"], torch.float32)
            for name in stored if name.endswith(".weight") and name.removesuffix("weight") + "scale" in stored}


def test_release_read_exactly_as_transformers_reads_it(release):
    """Every FP4 expert and FP8 Linear of the release dequantizes in fp4kit to transformers' values bit for bit."""
    from fp4kit.io.checkpoint import CheckpointReader, read_config
    from fp4kit.io.sources import Fp8Block, Mxfp4, dequantize, read_source

    expected = transformers_dequantized(release)
    with CheckpointReader(release) as reader:
        source = read_source(reader, read_config(release))
        assert source.name == "fp8-block 128x128 ue8m0 + mxfp4"
        kinds = {type(linear.encoding) for linear in source.linears.values()}
        assert kinds == {Fp8Block, Mxfp4}
        assert {f"{m}.weight" for m in source.linears} == set(expected)
        assert sum(isinstance(lin.encoding, Mxfp4) for lin in source.linears.values()) == 4 * 8 * 3  # with mtp.0
        for module, linear in source.linears.items():
            got = dequantize(reader, linear)
            assert torch.equal(got, expected[f"{module}.weight"]), module


def test_quantize_casts_the_release_exactly(release, quantized):
    """`fp4kit quantize` of the release: the routed experts of the decoder layers dequantize (compressed-tensors'
    decompressor) to the source's MXFP4 values bit for bit, every 16-block cast exactly; the FP8 Linears kept are
    transformers' dequantized values in bf16 (exact); every other tensor is the source's bytes; inspect is clean."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    from fp4kit.tools.inspect_artifacts import inspect_path

    stdout, dst = quantized
    assert "MXFP4 source: 73728 NVFP4 blocks cast exactly, 0 re-quantized" in stdout
    assert "deepseek_v4" in stdout and "72 Linears quantized" in stdout
    source = transformers_dequantized(release)
    written = load_file(dst / "model.safetensors")
    out = CompressedTensorsDequantizer(dst, dtype=torch.float32).process(dict(written))
    experts = [n for n in source if ".experts." in n and not n.startswith("mtp.")]
    assert len(experts) == 72
    for name in experts:
        assert torch.equal(out[name], source[name]), name
    stored = load_file(release / "model.safetensors")
    for name, tensor in stored.items():
        if name.endswith(".scale") or name in experts:
            continue
        if name in source:  # an FP8 Linear kept, or an MTP expert: dequantized, exact in bf16
            assert written[name].dtype == torch.bfloat16 and torch.equal(written[name].float(), source[name]), name
        else:
            assert torch.equal(written[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert not any(name.endswith(".scale") for name in written)
    report = inspect_path(dst)
    assert report.clean and report.family == "deepseek_v4"
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["format"] == "nvfp4-pack-quantized"


def test_the_output_is_the_release_in_transformers(release, quantized, tmp_path):
    """fp4kit eval does not stream DeepSeek-V4 yet; the whole model says the same: transformers' DeepSeek-V4 loaded
    from the release (FP8 dequantized on load) and from the NVFP4 output (`fp4kit convert --to bf16`, exact) holds
    the same weights and computes the same logits (KL 0)."""
    from transformers import DeepseekV4ForCausalLM, FineGrainedFP8Config

    from fp4kit.tools.dense import dequantize_checkpoint

    dequantize_checkpoint(quantized[1], tmp_path / "dense")
    # fp32 throughout: transformers keeps the hyper-connections fp32, which its bf16 Linears refuse
    source = DeepseekV4ForCausalLM.from_pretrained(release, dtype=torch.float32,
                                                   quantization_config=FineGrainedFP8Config(dequantize=True)).float()
    output = DeepseekV4ForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.float32).float()
    expected, got = source.state_dict(), output.state_dict()
    assert expected.keys() == got.keys()
    assert not [k for k in expected if not torch.equal(expected[k], got[k])]
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(source(input_ids=ids).logits, output(input_ids=ids).logits)


def test_a_malformed_e8m0_scale_is_one_line(release, tmp_path):
    """An E8M0 scale whose grid does not fit its weight: one error line naming it, exit 2, no output."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(release, broken)
    tensors = load_file(broken / "model.safetensors")
    name = "layers.1.ffn.experts.3.w2.scale"
    tensors[name] = tensors[name][:, :2].contiguous()
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    run = cli_result("quantize", str(broken), str(tmp_path / "out"))
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and name in lines[0], run.stderr
    assert not (tmp_path / "out").exists()


def test_routing_is_transformers_topk_router():
    """sqrtsoftplus_topk routes as transformers' DeepseekV4TopKRouter: the same experts and weights."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter

    from fp4kit.families import deepseek_v4
    from fp4kit.families.routing import route

    config = DeepseekV4Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, num_hidden_layers=1,
                              routed_scaling_factor=1.5)
    router = DeepseekV4TopKRouter(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=generator))
        router.e_score_correction_bias.copy_(0.3 * torch.randn(16, generator=generator))
    hidden = torch.randn(64, 32, generator=generator)
    logits, weights, ids = router(hidden)
    spec = deepseek_v4.FAMILY.routing(config.to_dict())
    assert spec.kind == "sqrtsoftplus_topk" and spec.routed_scaling_factor == 1.5
    got_weights, got_ids = route(logits.detach(), spec, router.e_score_correction_bias)
    order = ids.argsort(dim=-1)  # transformers' top-k is unsorted
    got_order = got_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), got_ids.gather(1, got_order))
    # the same terms, summed in another order (transformers' top-k order): equal within fp32 rounding
    torch.testing.assert_close(weights.detach().gather(1, order), got_weights.gather(1, got_order), rtol=1e-6,
                               atol=0)


def test_activation_is_transformers_clamped_swiglu():
    """silu_clamped is DeepseekV4Experts._apply_gate (gate and up halves), with the config's swiglu_limit."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

    from fp4kit.families import deepseek_v4

    config = DeepseekV4Config(hidden_size=32, moe_intermediate_size=16, n_routed_experts=4, num_hidden_layers=1,
                              swiglu_limit=3.0)
    experts = DeepseekV4Experts(config)
    gate_up = 8 * torch.randn(50, 32, generator=torch.Generator().manual_seed(1))
    activation = deepseek_v4.FAMILY.activation(config.to_dict())
    assert activation.kind == "silu_clamped" and activation.limit == 3.0
    expected = experts._apply_gate(gate_up)
    torch.testing.assert_close(activation(*gate_up.chunk(2, dim=-1)), expected, rtol=0, atol=0)
    assert bool((gate_up.abs() > 3.0).any())  # the clamp is exercised


def test_mtp_block_layers_follow_the_decoder_layers():
    """The MTP block `mtp.0.*` is numbered after the decoder layers, kept whole by default, and `--mtp quantize`
    leaves only its routed experts to quantize."""
    import re

    from fp4kit.families import deepseek_v4

    tc = {"num_hidden_layers": 3}
    assert deepseek_v4.FAMILY.layer_index("mtp.0.ffn.experts.5.w1", tc) == 3
    assert deepseek_v4.FAMILY.layer_index("layers.2.ffn.experts.5.w1", tc) == 2

    def kept(module: str, mtp: str) -> bool:
        return any(re.search(p, module) for p in deepseek_v4.FAMILY.default_ignore(tc, mtp))

    assert kept("mtp.0.ffn.experts.5.w1", "keep") and kept("mtp.0.e_proj", "keep")
    assert not kept("mtp.0.ffn.experts.5.w1", "quantize") and kept("mtp.0.attn.wq_a", "quantize")
    assert not kept("layers.1.ffn.experts.5.w2", "keep") and kept("layers.1.ffn.gate", "keep")
