"""`fp4kit eval` (fp4kit/tools/evaluate.py): the layer-streaming comparison equals a whole-model transformers forward of
the same dequantized weights, with the same activation quantization for W4A4, on every family and both dialects."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_cli, text_forward

from fp4kit.testing.fixtures import FIXTURES, fixture_spec, streams_layers

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SAMPLES, SEQ_LEN, BATCH = 4, 24, 2
REL = 1e-5


@pytest.fixture(scope="module")
def token_ids():
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (SAMPLES, SEQ_LEN), generator=generator)


@pytest.fixture(scope="module")
def quantized(tiny, tmp_path_factory):
    """quantized(family, scheme, dialect) -> an fp4kit checkpoint of that tiny fixture (W4A4 on a little text)."""
    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint

    built = {}

    def get(family: str, scheme: str, dialect: str):
        key = (family, scheme, dialect)
        if key not in built:
            built[key] = tmp_path_factory.mktemp(f"{family}-{scheme}") / dialect
            options = QuantizeOptions(scheme=scheme, format=dialect, samples=4, seq_len=32)
            quantize_checkpoint(tiny(family), built[key], options)
        return built[key]

    return get


def _hf_model(path, family: str):
    import transformers

    model = getattr(transformers, fixture_spec(family)["model_class"]).from_pretrained(path, dtype=torch.float32)
    return model.eval()


def whole_model_scores(src, ckpt, family: str, token_ids: torch.Tensor, tmp_path, source_weights: bool = False
                       ) -> torch.Tensor:
    """[KL, CE source, CE quantized, top-1] from transformers' whole models: the source as transformers loads it,
    the checkpoint dequantized to a dense float32 checkpoint loaded the same way (``source_weights``: the source
    again), W4A4 activations emulated with the checkpoint's input scales."""
    from fp4kit.families import detect
    from fp4kit.formats.detect import open_checkpoint
    from fp4kit.tools.dense import dequantize_checkpoint
    from fp4kit.tools.evaluate import _scores, emulate_w4a4, input_divisors

    if source_weights:
        dense = src
    else:
        dense = tmp_path / "dense-fp32"
        dequantize_checkpoint(ckpt, dense, dtype=torch.float32)
    source, quantized = _hf_model(src, family), _hf_model(dense, family)
    with open_checkpoint(ckpt) as opened:
        divisors = input_divisors(opened)
        family_of = detect(opened.config)
    covered = emulate_w4a4(quantized, "", divisors, family_of) if divisors else set()
    assert covered == set(divisors)  # every input scale of the checkpoint is emulated
    totals = torch.zeros(4, dtype=torch.float64)
    with torch.inference_mode():
        for start in range(0, SAMPLES, BATCH):
            ids = token_ids[start : start + BATCH]
            logits = [text_forward(m)(input_ids=ids, use_cache=False).logits[:, :-1].reshape(-1, 256).float()
                      for m in (source, quantized)]
            totals += _scores(*logits, ids[:, 1:].reshape(-1))
    return totals / (SAMPLES * (SEQ_LEN - 1))


def _streamed(src, ckpt, token_ids, activations_only: bool = False):
    from fp4kit.tools.evaluate import evaluate

    result = evaluate(src, ckpt, token_ids, batch_size=BATCH, activations_only=activations_only)
    return result, torch.tensor([result.kl, result.ce_source, result.ce_quantized, result.top1], dtype=torch.float64)


CASES = [(f, "nvfp4a16", "compressed-tensors") for f in FIXTURES if streams_layers(f)] + [
    (f, "nvfp4", "compressed-tensors") for f in ("qwen3_moe", "qwen3_vl_moe", "glm4_moe", "glm4v_moe", "llama4")
] + [(f, "nvfp4", "compressed-tensors") for f in ("glm4_moe_lite", "deepseek_v32", "glm_moe_dsa")
      ] + [("llama4", "nvfp4", "modelopt"), ("qwen3_moe", "nvfp4a16", "modelopt")]


@pytest.mark.parametrize(("family", "scheme", "dialect"), CASES)
def test_streaming_equals_whole_model_forward(family, scheme, dialect, tiny, quantized, token_ids, tmp_path):
    src, ckpt = tiny(family), quantized(family, scheme, dialect)
    result, streamed = _streamed(src, ckpt, token_ids)
    reference = whole_model_scores(src, ckpt, family, token_ids, tmp_path)
    assert result.scheme == scheme and result.tokens == SAMPLES * (SEQ_LEN - 1)
    assert torch.allclose(streamed, reference, rtol=REL, atol=0), (streamed, reference)
    assert result.kl > 1e-4 and len(result.layers) == fixture_spec(family)["config"].get(
        "text_config", fixture_spec(family)["config"])["num_hidden_layers"]
    assert all(0 < e < 1 for e in result.layers)


def test_quantized_lm_head(tiny, token_ids, tmp_path):
    """A W4A4 lm_head (default ignores dropped): dequantized, and its input quantized, in both computations."""
    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint

    ckpt = tmp_path / "ckpt"
    options = QuantizeOptions(scheme="nvfp4", default_ignore=False, ignore=[r"mlp\.gate$"], samples=4, seq_len=32)
    quantize_checkpoint(tiny("qwen3_moe"), ckpt, options)
    from fp4kit.io.checkpoint import CheckpointReader

    assert "lm_head.input_global_scale" in CheckpointReader(ckpt)
    _, streamed = _streamed(tiny("qwen3_moe"), ckpt, token_ids)
    reference = whole_model_scores(tiny("qwen3_moe"), ckpt, "qwen3_moe", token_ids, tmp_path)
    assert torch.allclose(streamed, reference, rtol=REL, atol=0), (streamed, reference)


def test_w4a4_emulation_moves_the_result(tiny, quantized, token_ids):
    """The activation quantization is on: W4A4 and W4A16 of the same weights differ, W4A4 errs more."""
    a16, _ = _streamed(tiny("qwen3_moe"), quantized("qwen3_moe", "nvfp4a16", "compressed-tensors"), token_ids)
    a4, _ = _streamed(tiny("qwen3_moe"), quantized("qwen3_moe", "nvfp4", "compressed-tensors"), token_ids)
    assert a4.kl > a16.kl and a4.layers[-1] > a16.layers[-1]


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe_lite"])
def test_activations_only_runs_the_source_weights_with_the_input_scales(family, tiny, quantized, token_ids,
                                                                         tmp_path):
    """--activations-only: the source's weights, the W4A4 checkpoint's activation quantization; it equals the
    whole-model forward of the source with those input scales, and lies below the full W4A4 error here."""
    src, ckpt = tiny(family), quantized(family, "nvfp4", "compressed-tensors")
    result, streamed = _streamed(src, ckpt, token_ids, activations_only=True)
    reference = whole_model_scores(src, ckpt, family, token_ids, tmp_path, source_weights=True)
    assert torch.allclose(streamed, reference, rtol=REL, atol=0), (streamed, reference)
    full, _ = _streamed(src, ckpt, token_ids)
    assert result.scheme == "nvfp4, activations only (the source's weights)"
    assert 0 < result.kl < full.kl
    weight_only, _ = _streamed(src, quantized(family, "nvfp4a16", "compressed-tensors"), token_ids,
                               activations_only=True)
    assert weight_only.kl == 0 and weight_only.layers == [0.0] * len(weight_only.layers)


def test_w4a4_experts_match_the_verify_reference():
    """The routed-experts emulation (transformers' eager loop with two quantization points) equals
    fp4kit/verify/reference.py's moe_reference, an independent loop over the same math."""
    from fp4kit.families.moe_modules import FUSED_EXPERTS
    from fp4kit.families.routing import RoutingSpec
    from fp4kit.tools.evaluate import _fake_quantized
    from fp4kit.verify.reference import moe_reference

    generator = torch.Generator().manual_seed(1)
    experts, hidden, inter, tokens, k = 4, 32, 16, 20, 2
    w13 = torch.randn(experts, 2 * inter, hidden, generator=generator)
    w2 = torch.randn(experts, hidden, inter, generator=generator)
    x = torch.randn(tokens, hidden, generator=generator)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=generator)
    div13 = torch.rand(experts, generator=generator, dtype=torch.float64) * 0.01 + 1e-3
    div2 = torch.rand(experts, generator=generator, dtype=torch.float64) * 0.01 + 1e-3
    module = torch.nn.Module()  # transformers' experts module: the W4A4 forward refers to it weakly
    module.gate_up_proj, module.down_proj, module.act_fn = w13, w2, torch.nn.functional.silu
    ours = FUSED_EXPERTS.w4a4_forward(module, list(div13), list(div2), _fake_quantized)(x, ids, weights)
    spec = RoutingSpec("softmax_topk", experts, k)
    reference = moe_reference(x, weights, ids, w13, w2, spec, activation_global_div=(div13, div2))
    assert torch.allclose(ours, reference, rtol=1e-5, atol=1e-5)


def _dense_fp32_copy_by_transformers(fp8_src, dst):
    """The FP8-block source as a dense float32 checkpoint, each weight dequantized by transformers' own
    Fp8Dequantize (integrations/finegrained_fp8.py), not by fp4kit."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    tensors = load_file(fp8_src / "model.safetensors")
    dense = {}
    for name, tensor in tensors.items():
        if name.endswith(".weight_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv")
        dense[name] = (Fp8Dequantize(None)._dequantize_one(tensor, scale, output_dtype=torch.float32)
                       if scale is not None else tensor.float())
    dst.mkdir()
    save_file(dense, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((fp8_src / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))
    return dst


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_fp8_block_source_equals_its_dequantization_by_transformers(family, tiny, token_ids, tmp_path):
    """SRC may be an FP8-block source: eval dequantizes it in fp32, the same scores as the whole-model forward of
    transformers' own dequantization of it."""
    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint
    from fp4kit.testing.fixtures import write_fp8_block_source

    fp8 = write_fp8_block_source(tiny(family), tmp_path / "fp8", block=(16, 16))
    ckpt = tmp_path / "ckpt"
    quantize_checkpoint(fp8, ckpt, QuantizeOptions(scheme="nvfp4a16"))
    result, streamed = _streamed(fp8, ckpt, token_ids)
    reference = whole_model_scores(_dense_fp32_copy_by_transformers(fp8, tmp_path / "dense-src"), ckpt, family,
                                   token_ids, tmp_path)
    assert result.scheme == "nvfp4a16"
    assert torch.allclose(streamed, reference, rtol=REL, atol=0), (streamed, reference)
    against_itself, _ = _streamed(fp8, fp8, token_ids)
    assert against_itself.scheme == "fp8-block 16x16" and against_itself.kl == 0


def test_source_against_itself(tiny, token_ids):
    result, _ = _streamed(tiny("glm4_moe"), tiny("glm4_moe"), token_ids)
    assert result.scheme == "dense"
    assert result.kl == 0 and result.top1 == 1 and result.ce_source == result.ce_quantized
    assert result.layers == [0.0] * len(result.layers)


def test_cli_json(monkeypatch, capsys, tiny, quantized, tmp_path):
    out = tmp_path / "eval.json"
    code, stdout, _ = run_cli(monkeypatch, capsys, "eval", tiny("llama4_text"),
                              quantized("llama4_text", "nvfp4a16", "compressed-tensors"), "--samples", 2,
                              "--seq-len", 16, "--json", out)
    assert code == 0 and "KL(source || quantized)" in stdout
    report = json.loads(out.read_text())
    assert {"kl", "ce_source", "ce_quantized", "top1", "layers", "samples", "tokens"} <= set(report)
    assert report["samples"] == 2 and report["tokens"] == 2 * 15
    code, stdout, _ = run_cli(monkeypatch, capsys, "eval", tiny("llama4_text"),
                              quantized("llama4_text", "nvfp4a16", "compressed-tensors"), "--samples", 2,
                              "--seq-len", 16, "--json", "-")
    assert code == 0 and json.loads(stdout)["kl"] == report["kl"]  # the JSON alone on stdout
    code, stdout, _ = run_cli(monkeypatch, capsys, "eval", tiny("llama4_text"),
                              quantized("llama4_text", "nvfp4", "compressed-tensors"), "--samples", 2,
                              "--seq-len", 16, "--activations-only")
    assert code == 0 and "(nvfp4, activations only (the source's weights))" in stdout


def _bad(monkeypatch, capsys, *args, needle: str) -> None:
    code, _, err = run_cli(monkeypatch, capsys, "eval", *args)
    # the phase that started before the error, if one did
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("eval: evaluating (")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err


def test_bad_input(monkeypatch, capsys, tiny, quantized, tmp_path):
    src, ckpt = tiny("qwen3_moe"), quantized("qwen3_moe", "nvfp4a16", "compressed-tensors")
    _bad(monkeypatch, capsys, src, tmp_path / "nowhere", needle="nowhere")
    _bad(monkeypatch, capsys, src, quantized("glm4_moe", "nvfp4a16", "compressed-tensors"), needle="model_type")
    text = tmp_path / "broken.jsonl"
    text.write_text("{not json\n")
    _bad(monkeypatch, capsys, src, ckpt, "--text", text, needle="broken.jsonl")
    _bad(monkeypatch, capsys, src, ckpt, "--dtype", "float8", needle="--dtype")
    _bad(monkeypatch, capsys, src, ckpt, "--seq-len", 1, needle="--seq-len must be at least 2")


def _added_peak_bytes(work) -> int:
    """What ``work()`` adds to this process's peak RSS (VmHWM reset to the current RSS first)."""
    import ctypes

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key)) * 1024

    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what earlier work freed must not hide this one's growth
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = status("VmRSS:")
    work()
    return status("VmHWM:") - start


def test_peak_memory_does_not_grow_with_layer_count(tmp_path):
    """Six more layers add far less than a layer's dequantized weights to eval's peak; holding them would add 6 x 2
    sides x that."""
    from fp4kit.quantize.checkpoint import quantize_checkpoint
    from fp4kit.testing.synthetic import write_synthetic_qwen3_moe
    from fp4kit.tools.evaluate import evaluate

    dims = dict(hidden=256, moe_intermediate=256, num_experts=16, num_heads=4, num_kv_heads=2, head_dim=64,
                vocab_size=1024)
    pairs = {}
    for layers in (2, 8):
        src = write_synthetic_qwen3_moe(tmp_path / f"src{layers}", num_layers=layers, **dims)
        quantize_checkpoint(src, tmp_path / f"q{layers}")
        pairs[layers] = (src, tmp_path / f"q{layers}")
    ids = torch.randint(0, 1024, (4, 32), generator=torch.Generator().manual_seed(0))
    evaluate(*pairs[2], ids, batch_size=2)  # imports and first-call set-up
    added = {n: _added_peak_bytes(lambda p=pair: evaluate(*p, ids, batch_size=2)) for n, pair in pairs.items()}
    layer_fp32 = 16 * 3 * 256 * 256 * 4  # one layer's routed experts, dequantized
    print(f"peak RSS added: 2 layers {added[2] / 1e6:.1f} MB, 8 layers {added[8] / 1e6:.1f} MB")
    assert added[8] - added[2] < 2 * layer_fp32
    assert added[2] > layer_fp32  # the measurement sees real work


def test_an_emulated_layer_is_freed_without_the_garbage_collector():
    """The W4A4 expert forward lives on the module: it must not hold the module strongly, or every layer's weights
    would wait for a GC run (on a GPU, which the collector does not see filling, until memory runs out)."""
    import gc
    import weakref

    from torch import nn

    from fp4kit.families import qwen3_moe
    from fp4kit.tools.evaluate import emulate_w4a4

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.zeros(2, 4, 16))
            self.down_proj = nn.Parameter(torch.zeros(2, 16, 2))
            self.act_fn = nn.functional.silu

    layer = nn.Module()
    layer.experts = Experts()
    divisors = {f"x.experts.{e}.{p}": torch.tensor(1.0, dtype=torch.float64)
                for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")}
    emulate_w4a4(layer, "x.", divisors, qwen3_moe.FAMILY)
    experts = weakref.ref(layer.experts)
    gc.disable()
    try:
        del layer
        assert experts() is None
    finally:
        gc.enable()
