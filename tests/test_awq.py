"""`fp4kit quantize --method awq|awq+gptq` (fp4kit/quantize/awq.py): the fold leaves the float model and the router
logits unchanged, the output is a plain checkpoint that compressed-tensors decompresses and vLLM's compressed-tensors
config resolves, and families without a defined mapping are refused."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import token_calibration_file

from fp4kit.errors import Fp4kitError
from fp4kit.io.checkpoint import CheckpointReader
from fp4kit.quantize import QuantizeOptions, awq, quantize_checkpoint
from fp4kit.quantize.calibrate import calibrate_quantized

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _vocab(src) -> int:
    config = json.loads((src / "config.json").read_text())
    return (config.get("text_config") or config)["vocab_size"]


def test_the_fold_keeps_the_float_layers_and_the_router_logits(tiny, monkeypatch):
    """Every decoder layer of the streamed fixture, in fp32, before and after its fold (the search replaced by random
    powers of two from 1/4 to 4, so every mapping scales): the layer's output within fp32 rounding, the router's
    logits bit for bit, and the fold did scale the norms, the router, v_proj, o_proj and the experts."""
    src = tiny("qwen3_moe")
    ids = torch.randint(0, _vocab(src), (4, 32), generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(2)
    monkeypatch.setattr(awq.AwqFolder, "_search", lambda self, x_mean, loss, keys: torch.exp2(
        torch.randint(-2, 3, x_mean.shape, generator=gen).float()))
    folder = awq.AwqFolder(act=False, quantized=lambda name: True, stored_dtype=lambda name: torch.bfloat16)
    checked = []

    def outputs(layer, hidden_batches, layer_args, index):
        logits = []
        handle = layer.mlp.gate.register_forward_hook(lambda m, a, out: logits.append(out[0].clone()))
        try:
            hidden = [layer(h, *layer_args[tuple(h.shape)][index][0], **layer_args[tuple(h.shape)][index][1]).clone()
                      for h in hidden_batches]
        finally:
            handle.remove()
        return hidden, logits

    def prepare(index, layer, text, hidden_batches, layer_args):
        before = {k: v.clone() for k, v in layer.state_dict().items()}
        reference, reference_logits = outputs(layer, hidden_batches, layer_args, index)
        folder(index, layer, text, hidden_batches, layer_args)
        after = layer.state_dict()
        changed = {k for k in before if not torch.equal(before[k], after[k])}
        assert {"input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate.weight",
                "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.experts.gate_up_proj",
                "mlp.experts.down_proj"} <= changed, changed
        folded, folded_logits = outputs(layer, hidden_batches, layer_args, index)
        for ours, theirs in zip(folded, reference, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        assert all(torch.equal(a, b) for a, b in zip(folded_logits, reference_logits, strict=True))
        checked.append(index)

    calibrate_quantized(src, ids, lambda index, layer, stats: {}, dtype=torch.float32, prepare_layer=prepare,
                        input_amax=False)
    config = json.loads((src / "config.json").read_text())
    assert checked == list(range(config["num_hidden_layers"]))
    assert set(folder.folded) >= {"model.layers.0.input_layernorm.weight", "model.layers.0.mlp.gate.weight"}


def _decompressed_model(src, out):
    """transformers' model with the output's tensors: NVFP4 ones decompressed by compressed-tensors, the rest
    (folded norms and router) as stored."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from transformers import Qwen3MoeForCausalLM

    qconfig = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    scheme = qconfig.config_groups["group_0"]
    model = Qwen3MoeForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    reader = CheckpointReader(out)
    modules = {n[: -len(".weight_packed")] for n in reader.names() if n.endswith(".weight_packed")}
    parameters = dict(model.named_parameters())

    def dense(module: str) -> torch.Tensor:
        local = {k: reader.read(f"{module}.{k}") for k in ("weight_packed", "weight_scale", "weight_global_scale")}
        return NVFP4PackedCompressor.decompress(local, scheme)["weight"].float()

    with torch.no_grad():
        for name in reader.names():
            if name in parameters:
                parameters[name].copy_(reader.read(name).float())
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name in modules:
                module.weight.copy_(dense(name))
            if isinstance(getattr(module, "gate_up_proj", None), torch.Tensor):
                for e in range(module.gate_up_proj.shape[0]):
                    module.gate_up_proj[e].copy_(torch.cat([dense(f"{name}.{e}.gate_proj"),
                                                            dense(f"{name}.{e}.up_proj")]))
                    module.down_proj[e].copy_(dense(f"{name}.{e}.down_proj"))
    return model


@pytest.fixture(scope="module")
def awq_outputs(tiny, tmp_path_factory):
    """The qwen3_moe fixture with a few outlier channels in every norm's output (their norm weights x8, as trained
    models have), quantized by rtn, awq+gptq and awq."""
    from helpers import copy_with, load_all

    tmp = tmp_path_factory.mktemp("awq")
    tensors = load_all(tiny("qwen3_moe"))
    for name, tensor in tensors.items():
        if name.endswith("layernorm.weight"):
            tensor[:4] *= 8
    src = copy_with(tiny("qwen3_moe"), tmp / "outliers", tensors)
    calib, ids = token_calibration_file(tmp, _vocab(src))
    outs = {}
    for method in ("rtn", "awq+gptq", "awq"):
        outs[method] = tmp / method.replace("+", "-")
        quantize_checkpoint(src, outs[method], QuantizeOptions(
            method=method, calib=calib if method != "rtn" else None, samples=12, seq_len=48, gptq_min_tokens=8))
    return src, ids, outs


def test_awq_outputs_are_plain_checkpoints_that_decompress_and_serve(awq_outputs):
    """The same tensor names, shapes and dtypes and the same config as rtn's (norms and router folded, not added
    to); vLLM 0.33's compressed-tensors config gives every quantized module NVFP4A16 and leaves the router alone;
    compressed-tensors' decompression into transformers' model gives logits closer to the source's than rtn's
    (awq+gptq)."""
    from helpers import vllm_ct_scheme
    from transformers import Qwen3MoeForCausalLM

    src, ids, outs = awq_outputs
    rtn = CheckpointReader(outs["rtn"])
    source = CheckpointReader(src)
    for method in ("awq", "awq+gptq"):
        reader = CheckpointReader(outs[method])
        assert {n: (reader.info(n).shape, reader.info(n).dtype) for n in reader.names()} == {
            n: (rtn.info(n).shape, rtn.info(n).dtype) for n in rtn.names()}
        config = json.loads((outs[method] / "config.json").read_text())
        assert config["quantization_config"] == json.loads((outs["rtn"] / "config.json").read_text())[
            "quantization_config"]
        for norm in ("input_layernorm", "post_attention_layernorm"):  # folded, by powers of two
            ratio = source.read(f"model.layers.0.{norm}.weight").float() / reader.read(
                f"model.layers.0.{norm}.weight").float()
            assert torch.equal(torch.exp2(torch.log2(ratio).round()), ratio) and (ratio != 1).any(), (norm, ratio)
        resolved = vllm_ct_scheme(config["quantization_config"])
        quantized = {n[: -len(".weight_packed")] for n in reader.names() if n.endswith(".weight_packed")}
        assert quantized and all(resolved(m) == "nvfp4a16" for m in quantized)
        assert resolved("model.layers.0.mlp.gate") is None
    with torch.no_grad():
        reference = Qwen3MoeForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(input_ids=ids).logits
        errors = {m: (_decompressed_model(src, outs[m])(input_ids=ids).logits - reference).square().mean().item()
                  for m in outs}
    assert errors["awq+gptq"] < errors["rtn"], errors


def test_awq_w4a4_input_scales_come_from_the_folded_layers(tiny, tmp_path):
    """W4A4: input scales exist for every quantized module, and taking them from the source model's pass (which
    has not seen the fold) is refused in one line."""
    src = tiny("qwen3_moe")
    calib, _ = token_calibration_file(tmp_path, _vocab(src), samples=4, seq_len=32)
    out = tmp_path / "w4a4"
    quantize_checkpoint(src, out, QuantizeOptions(method="awq", scheme="nvfp4", calib=calib, samples=4, seq_len=32))
    names = set(CheckpointReader(out).names())
    packed = {n[: -len(".weight_packed")] for n in names if n.endswith(".weight_packed")}
    assert packed and all(f"{m}.input_global_scale" in names for m in packed)
    with pytest.raises(Fp4kitError, match="input-scales-from"):
        quantize_checkpoint(src, tmp_path / "source", QuantizeOptions(
            method="awq", scheme="nvfp4", calib=calib, samples=4, seq_len=32, input_scales_from="source"))
    assert not (tmp_path / "source").exists()


@pytest.mark.parametrize("family", ["llama4", "gpt_oss"])
def test_a_family_without_a_mapping_is_refused_in_one_line(tiny, tmp_path, monkeypatch, capsys, family):
    from helpers import run_cli

    src = tiny(family)
    calib, _ = token_calibration_file(tmp_path, _vocab(src), samples=2, seq_len=16)
    code, out, err = run_cli(monkeypatch, capsys, "quantize", src, tmp_path / "out", "--method", "awq", "--calib",
                             calib, "--samples", 2, "--seq-len", 16)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and family in lines[0], err
    assert not (tmp_path / "out").exists()
