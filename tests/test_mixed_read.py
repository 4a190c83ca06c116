"""Reading mixed-precision checkpoints (quantize --scheme-for): open_checkpoint exposes the FP8 modules with their
scheme and an exact dequantization, the NVFP4 modules as a single-scheme run's, kept ones as kept; inspect reports
each module group's scheme; eval emulates the FP8 modules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import cli_result, load_all

from fp4kit.errors import Fp4kitError
from fp4kit.formats.detect import open_checkpoint
from fp4kit.fp8 import quantize_fp8
from fp4kit.quantize.checkpoint import QuantizeOptions, quantize_checkpoint

# attention FP8 per channel, DeepSeek's dense and shared MLPs in FP8 blocks, some routed experts kept, the rest NVFP4
RULES = {
    "qwen3_moe": [r"self_attn\.=fp8-dynamic", r"layers\.1\.mlp\.experts\.[0-3]\.=bf16"],
    "deepseek_v3": [r"self_attn\.=fp8-dynamic", r"mlp\.(shared_experts|gate_proj|up_proj|down_proj)=fp8-block",
                    r"layers\.2\.mlp\.experts\.[0-3]\.=bf16"],
}
DIALECTS = ("compressed-tensors", "modelopt")


@pytest.fixture(scope="module")
def mixed(tiny, tmp_path_factory):
    built: dict[tuple, Path] = {}

    def get(family: str, dialect: str, rules: tuple[str, ...] | None = None, scheme: str = "nvfp4a16") -> Path:
        rules = tuple(RULES[family]) if rules is None else rules
        key = (family, dialect, rules, scheme)
        if key not in built:
            dst = tmp_path_factory.mktemp(f"mixed-{family}-{dialect}") / "out"
            extra = {"samples": 4, "seq_len": 16} if scheme == "nvfp4" else {}
            quantize_checkpoint(tiny(family), dst, QuantizeOptions(format=dialect, scheme=scheme,
                                                                   scheme_for=list(rules), **extra))
            built[key] = dst
        return built[key]

    return get




@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("family", sorted(RULES))
def test_mixed_checkpoint_opens_with_fp8_modules_exact(mixed, tiny, tmp_path, family, dialect):
    root = mixed(family, dialect)
    source = load_all(tiny(family))
    plain = tmp_path / "plain"
    quantize_checkpoint(tiny(family), plain, QuantizeOptions(format=dialect))
    with open_checkpoint(root, mixed=True) as ckpt, open_checkpoint(plain) as single:
        assert ckpt.mixed and not single.mixed and not single.fp8_modules
        assert ckpt.scheme == "nvfp4a16"
        schemes = {m.name: m.scheme for m in ckpt.fp8_modules}
        mtp = ".layers.3." if family == "deepseek_v3" else None  # the MTP layer, kept
        expected_fp8 = {n.removesuffix(".weight") for n in source if ".self_attn." in n and n.endswith(".weight")
                        and source[n].dim() == 2 and not (mtp and mtp in n)}
        assert {n for n, s in schemes.items() if s == "fp8-dynamic"} == expected_fp8
        if family == "deepseek_v3":
            assert {n for n, s in schemes.items() if s == "fp8-block"} == {
                n.removesuffix(".weight") for n in source if n.endswith("_proj.weight") and ".mlp." in n
                and ".experts." not in n and mtp not in n}
        for m in ckpt.fp8_modules:
            weight, input_div = ckpt.read_fp8(m)
            reference = quantize_fp8(source[f"{m.name}.weight"], m.scheme)
            assert input_div is None
            assert torch.equal(weight.codes.view(torch.uint8), reference.codes.view(torch.uint8)), m.name
            assert torch.equal(weight.dequantize(), reference.dequantize()), m.name
        # NVFP4 modules: those of a single-scheme run that the rules left NVFP4, read the same
        plain_modules = {m.name: m for m in single.modules}
        assert ckpt.modules and all(m.name in plain_modules for m in ckpt.modules)
        for m in ckpt.modules[:8]:
            a, b = ckpt.read_weight(m), single.read_weight(plain_modules[m.name])
            assert torch.equal(a.packed, b.packed) and torch.equal(a.global_scale_div, b.global_scale_div)
        kept = f"model.layers.{1 if family == 'qwen3_moe' else 2}.mlp.experts.0.gate_proj.weight"
        assert kept in ckpt.passthrough
        assert torch.equal(ckpt.reader.read(kept), source[kept])
        assert not any(n.startswith(m.name + ".") for m in ckpt.fp8_modules for n in ckpt.passthrough)
        assert set(ckpt.module_schemes().values()) == set(schemes.values()) | {"nvfp4a16"}


def test_calibrated_fp8_static_input_scale_is_read(mixed):
    root = mixed("qwen3_moe", "compressed-tensors", (r"self_attn\.o_proj=fp8-static",), scheme="nvfp4")
    with open_checkpoint(root, mixed=True) as ckpt:
        assert ckpt.scheme == "nvfp4" and all(m.input_scale for m in ckpt.modules)
        static = [m for m in ckpt.fp8_modules if m.scheme == "fp8-static"]
        assert [m.name for m in static] == ["model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"]
        weight, input_div = ckpt.read_fp8(static[0])
        assert weight.scale.shape == (1,) and input_div is not None and float(input_div) > 0


@pytest.mark.parametrize("dialect", DIALECTS)
def test_single_scheme_readers_refuse_a_mixed_checkpoint_in_one_line(mixed, dialect):
    with pytest.raises(Fp4kitError, match="single-scheme") as info:
        open_checkpoint(mixed("qwen3_moe", dialect))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("family", sorted(RULES))
def test_inspect_reports_schemes_per_module_group_and_is_clean(mixed, family, dialect):
    root = mixed(family, dialect)
    run = cli_result("inspect", "--json", str(root))
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["clean"] and report["scheme"] == "nvfp4a16"
    groups = {(g["modules"], g["scheme"]): g["count"] for g in report["module_schemes"]}
    assert groups[("model.layers.*.self_attn.o_proj", "fp8-dynamic")] == (2 if family == "qwen3_moe" else 3)
    assert groups[("model.layers.*.mlp.experts.*.gate_proj", "nvfp4a16")] == 12
    assert groups[("model.layers.*.mlp.experts.*.gate_proj", "kept")] == (4 if family == "qwen3_moe" else 12)
    if family == "deepseek_v3":
        assert groups[("model.layers.*.mlp.shared_experts.up_proj", "fp8-block")] == 2
    text = cli_result("inspect", str(root))
    assert text.returncode == 0 and "mixed precision (nvfp4a16 + fp8-" in text.stdout, text.stdout + text.stderr


def test_inspect_json_of_a_single_scheme_checkpoint_has_no_module_schemes(tiny_nvfp4a16):
    run = cli_result("inspect", "--json", str(tiny_nvfp4a16("qwen3_moe")))
    assert run.returncode == 0 and "module_schemes" not in json.loads(run.stdout), run.stderr


def test_inspect_finds_a_bad_fp8_scale(mixed, tmp_path):
    import shutil

    from safetensors.torch import save_file

    root = tmp_path / "bad"
    shutil.copytree(mixed("qwen3_moe", "compressed-tensors"), root)
    tensors = load_all(root)
    name = "model.layers.0.self_attn.q_proj.weight_scale"
    tensors[name] = tensors[name].clone()
    tensors[name][3] = 0
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    run = cli_result("inspect", "--json", str(root))
    problems = json.loads(run.stdout)["problems"]
    assert run.returncode == 1 and [(p["check"], p["module"]) for p in problems] == [
        ("bad_scale", "model.layers.0.self_attn.q_proj")], problems


@pytest.mark.parametrize("scheme", ["fp8-dynamic", "fp8-block", "fp8-static"])
def test_fp8_activation_emulation_is_vllms(scheme):
    """fake_quantize_fp8_activation against vLLM 0.33's QuantFP8.forward_native (the reference path of its input
    quantization), run on a stand-in for the CustomOp instance, which needs a device to build."""
    from types import SimpleNamespace

    import torch.nn.functional as F
    from helpers import vllm_module

    from fp4kit.fp8 import fake_quantize_fp8_activation

    input_quant = vllm_module("model_executor.layers.quantization.input_quant_fp8")
    shapes = vllm_module("model_executor.layers.quantization.utils.quant_utils").GroupShape
    group = {"fp8-dynamic": shapes.PER_TOKEN, "fp8-block": shapes(1, 128), "fp8-static": shapes.PER_TENSOR}[scheme]
    op = SimpleNamespace(static=scheme == "fp8-static", group_shape=group, is_group_quant=scheme == "fp8-block",
                         group_size=128, use_ue8m0=False, column_major_scales=False, num_token_padding=None)
    op._quantize_group_native = lambda x: input_quant.QuantFP8._quantize_group_native(op, x)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 300, generator=generator) * torch.logspace(-3, 2, 6).unsqueeze(1)
    x[2] = 0  # a token of zeros: the scale floor
    x[3, 7] = 1e4  # beyond the static scale's range: clamped
    divisor = torch.tensor(0.02, dtype=torch.float64)
    codes, scale = input_quant.QuantFP8.forward_native(op, x, divisor.float().reshape(1) if op.static else None)
    if scheme == "fp8-block":
        expected = (F.pad(codes.float(), (0, 84)).unflatten(-1, (3, 128)) * scale.unsqueeze(-1)).flatten(-2)[:, :300]
    else:
        expected = codes.float() * scale
    ours = fake_quantize_fp8_activation(x, scheme, divisor if op.static else None)
    assert torch.equal(ours, expected)
    assert not torch.equal(ours, x)


@pytest.fixture(scope="module")
def token_ids():
    return torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(0))


def _fp8_dense(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes x scale, each scale of a 2-D block grid spread over its 128x128 block (independent of Fp8Weight)."""
    scale = scale.float()
    if scale.dim() == 2 and scale.shape[1] != 1:
        scale = torch.kron(scale, torch.ones(128, 128))[: codes.shape[0], : codes.shape[1]]
    return codes.float() * scale


def _dense_reference(root: Path, tmp_path: Path) -> tuple[Path, dict[str, tuple[str, torch.Tensor | None]]]:
    """The mixed checkpoint's weights dequantized into a dense fp32 checkpoint with the source's config, for a
    whole-model forward; and each FP8 module's (scheme, input divisor)."""
    from safetensors.torch import save_file

    dense = tmp_path / "dense"
    dense.mkdir()
    with open_checkpoint(root, mixed=True) as ckpt:
        tensors = {n: ckpt.reader.read(n) for n in ckpt.passthrough}
        tensors = {n: t.float() if t.dtype.is_floating_point else t for n, t in tensors.items()}
        tensors |= {f"{m.name}.weight": ckpt.read_weight(m).dequantize(torch.float32) for m in ckpt.modules}
        fp8 = {}
        for m in ckpt.fp8_modules:
            weight, input_div = ckpt.read_fp8(m)
            tensors[f"{m.name}.weight"] = _fp8_dense(weight.codes, weight.scale)
            fp8[m.name] = (m.scheme, input_div)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dense / "model.safetensors"))
    config = json.loads((root / "config.json").read_text())
    config.pop("quantization_config")
    (dense / "config.json").write_text(json.dumps(config))
    return dense, fp8


@pytest.mark.parametrize(("family", "dialect", "scheme"), [("qwen3_moe", "compressed-tensors", "nvfp4a16"),
                                                           ("deepseek_v3", "modelopt", "nvfp4a16"),
                                                           ("qwen3_moe", "modelopt", "nvfp4")])
def test_eval_of_a_mixed_checkpoint_equals_a_whole_model_forward(mixed, tiny, token_ids, tmp_path, family, dialect,
                                                                  scheme):
    """eval streams a mixed checkpoint as transformers' whole model runs it: dequantized weights, FP8 Linears'
    inputs quantized by vLLM's rule (and W4A4 NVFP4 ones as a single-scheme run's)."""
    from helpers import text_forward

    from fp4kit.families import detect
    from fp4kit.tools.evaluate import _fp8_input_hook, _scores, emulate_w4a4, evaluate, input_divisors

    rules = tuple(RULES[family]) if scheme == "nvfp4a16" else (r"self_attn\.(q|k|v)_proj=fp8-dynamic",
                                                               r"self_attn\.o_proj=fp8-static")
    root = mixed(family, dialect, rules, scheme)
    result = evaluate(tiny(family), root, token_ids, batch_size=2)
    assert result.scheme.startswith(f"mixed ({scheme} + fp8-"), result.scheme
    dense, fp8 = _dense_reference(root, tmp_path)

    import transformers

    from fp4kit.testing.fixtures import fixture_spec

    model_class = getattr(transformers, fixture_spec(family)["model_class"])
    source, quantized = (model_class.from_pretrained(p, dtype=torch.float32).eval() for p in (tiny(family), dense))
    with open_checkpoint(root, mixed=True) as ckpt:
        divisors = input_divisors(ckpt)
        family_of = detect(ckpt.config)
    assert emulate_w4a4(quantized, "", divisors, family_of) == set(divisors)
    hooked = set()
    for name, module in quantized.named_modules():
        if name in fp8:
            module.register_forward_pre_hook(_fp8_input_hook(*fp8[name]))
            hooked.add(name)
    assert hooked == set(fp8)
    totals = torch.zeros(4, dtype=torch.float64)
    with torch.inference_mode():
        for start in range(0, 4, 2):
            ids = token_ids[start : start + 2]
            logits = [text_forward(m)(input_ids=ids, use_cache=False).logits[:, :-1].reshape(-1, 256).float()
                      for m in (source, quantized)]
            totals += _scores(*logits, ids[:, 1:].reshape(-1))
    reference = totals / (4 * 23)
    streamed = torch.tensor([result.kl, result.ce_source, result.ce_quantized, result.top1], dtype=torch.float64)
    assert torch.allclose(streamed, reference, rtol=1e-5, atol=0), (streamed, reference)


def test_eval_of_fp8_attention_differs_sensibly_from_all_nvfp4(mixed, tiny, token_ids, tmp_path):
    """FP8 attention beside NVFP4 experts errs less than NVFP4 everywhere, and more than nothing; an all-NVFP4 run
    reads as its single scheme."""
    from fp4kit.tools.evaluate import evaluate

    plain = tmp_path / "plain"
    quantize_checkpoint(tiny("qwen3_moe"), plain, QuantizeOptions())
    nvfp4 = evaluate(tiny("qwen3_moe"), plain, token_ids, batch_size=2)
    fp8_attention = evaluate(tiny("qwen3_moe"), mixed("qwen3_moe", "compressed-tensors",
                                                      (r"self_attn\.=fp8-dynamic",)), token_ids, batch_size=2)
    assert nvfp4.scheme == "nvfp4a16" and fp8_attention.scheme == "mixed (nvfp4a16 + fp8-dynamic)"
    assert 0 < fp8_attention.kl < nvfp4.kl and fp8_attention.layers[0] < nvfp4.layers[0]


def test_eval_refuses_fp8_routed_experts_in_one_line(mixed, tiny, token_ids):
    from fp4kit.tools.evaluate import evaluate

    root = mixed("qwen3_moe", "compressed-tensors", (r"experts\.=fp8-dynamic",))
    with pytest.raises(Fp4kitError, match="not FP8 routed experts") as info:
        evaluate(tiny("qwen3_moe"), root, token_ids, batch_size=2)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("family", "dialect"), [("qwen3_moe", "compressed-tensors"), ("deepseek_v3", "modelopt")])
def test_shard_carries_fp8_tensors_to_every_rank(mixed, family, dialect, tmp_path):
    """An EP split of a mixed checkpoint: every rank holds each FP8 module's tensors byte for byte and reads as the
    same mixed checkpoint with its share of the experts; inspect finds the root and the ranks clean."""
    rules = (r"self_attn\.=fp8-dynamic",) + ((r"mlp\.(shared_experts|gate_proj|up_proj|down_proj)=fp8-block",)
                                             if family == "deepseek_v3" else ())
    root = mixed(family, dialect, rules)
    dst = tmp_path / "ep"
    run = cli_result("shard", str(root), str(dst), "--ep", "2", "-q")
    assert run.returncode == 0, run.stderr
    source = load_all(root)
    ranks = sorted(p for p in dst.iterdir() if p.name.startswith("rank-"))
    assert len(ranks) == 2
    with open_checkpoint(root, mixed=True) as whole:
        fp8 = {m.name: m.scheme for m in whole.fp8_modules}
        names = [n for m in whole.fp8_modules for n in (m.weight, m.scale)]
    assert "fp8-dynamic" in fp8.values() and (family == "qwen3_moe" or "fp8-block" in fp8.values())
    for rank in ranks:
        with open_checkpoint(rank, mixed=True) as ckpt:
            assert {m.name: m.scheme for m in ckpt.fp8_modules} == fp8
            assert all(torch.equal(ckpt.reader.read(n).view(torch.uint8), source[n].view(torch.uint8))
                       for n in names)
    for path in (dst, ranks[1]):
        run = cli_result("inspect", "--json", str(path))
        assert run.returncode == 0 and json.loads(run.stdout)["module_schemes"], run.stdout + run.stderr


def test_a_mixed_checkpoint_is_no_quantize_source(mixed, tmp_path):
    for dialect in DIALECTS:
        with pytest.raises(Fp4kitError, match="an NVFP4 checkpoint") as info:
            quantize_checkpoint(mixed("qwen3_moe", dialect), tmp_path / dialect, QuantizeOptions())
        assert "\n" not in str(info.value) and not (tmp_path / dialect).exists()
