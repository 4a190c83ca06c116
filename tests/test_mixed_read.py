"""Reading mixed-precision checkpoints (quantize --scheme-for): open_checkpoint exposes the FP8 modules with their
scheme and an exact dequantization, the NVFP4 modules as a single-scheme run's, kept ones as kept; inspect reports
each module group's scheme; eval emulates the FP8 modules."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

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


def _source(root: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(root.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return out


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("family", sorted(RULES))
def test_mixed_checkpoint_opens_with_fp8_modules_exact(mixed, tiny, tmp_path, family, dialect):
    root = mixed(family, dialect)
    source = _source(tiny(family))
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
    run = subprocess.run([sys.executable, "-m", "fp4kit", "inspect", "--json", str(root)], capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["clean"] and report["scheme"] == "nvfp4a16"
    groups = {(g["modules"], g["scheme"]): g["count"] for g in report["module_schemes"]}
    assert groups[("model.layers.*.self_attn.o_proj", "fp8-dynamic")] == (2 if family == "qwen3_moe" else 3)
    assert groups[("model.layers.*.mlp.experts.*.gate_proj", "nvfp4a16")] == 12
    assert groups[("model.layers.*.mlp.experts.*.gate_proj", "kept")] == (4 if family == "qwen3_moe" else 12)
    if family == "deepseek_v3":
        assert groups[("model.layers.*.mlp.shared_experts.up_proj", "fp8-block")] == 2
    text = subprocess.run([sys.executable, "-m", "fp4kit", "inspect", str(root)], capture_output=True, text=True)
    assert text.returncode == 0 and "mixed precision (nvfp4a16 + fp8-" in text.stdout, text.stdout + text.stderr


def test_inspect_json_of_a_single_scheme_checkpoint_has_no_module_schemes(tiny_nvfp4a16):
    run = subprocess.run([sys.executable, "-m", "fp4kit", "inspect", "--json", str(tiny_nvfp4a16("qwen3_moe"))],
                         capture_output=True, text=True)
    assert run.returncode == 0 and "module_schemes" not in json.loads(run.stdout), run.stderr


def test_inspect_finds_a_bad_fp8_scale(mixed, tmp_path):
    import shutil

    from safetensors.torch import save_file

    root = tmp_path / "bad"
    shutil.copytree(mixed("qwen3_moe", "compressed-tensors"), root)
    tensors = _source(root)
    name = "model.layers.0.self_attn.q_proj.weight_scale"
    tensors[name] = tensors[name].clone()
    tensors[name][3] = 0
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    run = subprocess.run([sys.executable, "-m", "fp4kit", "inspect", "--json", str(root)], capture_output=True,
                         text=True)
    problems = json.loads(run.stdout)["problems"]
    assert run.returncode == 1 and [(p["check"], p["module"]) for p in problems] == [
        ("bad_scale", "model.layers.0.self_attn.q_proj")], problems
