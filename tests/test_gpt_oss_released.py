"""gpt-oss as released (openai/gpt-oss-20b / -120b): experts stored MXFP4 as fused ``mlp.experts.gate_up_proj_blocks``
U8 [E, 2I, H/32, 16] / ``_scales`` U8 [E, 2I, H/32] and ``down_proj_blocks`` [E, H, I/32, 16] / ``_scales``, gate and
up rows interleaved, the expert biases BF16, ``quantization_config: {quant_method: mxfp4, modules_to_not_convert:
[...]}`` (the published config.json; vLLM 0.33's ``gpt_oss.py`` ``_load_weights_mxfp4`` reads the same tensors).

The fixture is the tiny gpt_oss model with its experts rounded to MXFP4 by this file's packer, checked against
transformers' own dequantizer (``integrations/mxfp4.py`` ``convert_moe_packed_tensors``). Oracles: that dequantizer
for the source's values, compressed-tensors' NVFP4 decompressor for the output's.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import cli_result
from safetensors.torch import load_file, save_file

from fp4kit.nvfp4 import E2M1_MAGNITUDES, e2m1_codes, pack_codes

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# config.json's quantization_config of openai/gpt-oss-20b and -120b
RELEASED_QUANTIZATION_CONFIG = {
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                               "lm_head"],
    "quant_method": "mxfp4",
}
EXPERTS, LAYERS, HIDDEN, INTER = 8, 2, 64, 64  # the tiny gpt_oss fixture at its recipe stand-in sizes


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def mxfp4_rtn(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., N, K] -> (blocks U8 [..., N, K/32, 16], scales U8 [..., N, K/32], the values they hold in fp32): per
    32-block the smallest power of two 2^k with amax / 2^k <= 6, codes rounded to nearest E2M1."""
    blocks = weight.to(torch.float32).unflatten(-1, (-1, 32))
    amax = blocks.abs().amax(-1)
    k = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6)), torch.full_like(amax, -127)).clamp(-127, 127)
    scale = torch.ldexp(torch.ones_like(amax), k.to(torch.int32))
    codes = e2m1_codes(blocks / scale.unsqueeze(-1))
    magnitudes = torch.tensor(E2M1_MAGNITUDES)[(codes & 7).long()]
    values = torch.where(codes >= 8, -magnitudes, magnitudes) * scale.unsqueeze(-1)
    return pack_codes(codes), (k + 127).to(torch.uint8), values.flatten(-2)


def write_released(bf16: Path, dst: Path) -> dict[str, torch.Tensor]:
    """The tiny BF16 gpt_oss as gpt-oss's release stores it; returns each fused expert tensor's exact values as the
    model holds them ([E, K, N], fp32)."""
    dst.mkdir(parents=True)
    tensors = load_file(bf16 / "model.safetensors")
    values: dict[str, torch.Tensor] = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weight = tensors.pop(name).transpose(1, 2).contiguous()  # [E, K, N] -> the release's [E, N, K]
        weight = weight * torch.logspace(-3, 3, EXPERTS, base=2.0)[:, None, None]  # exponents over 6+ binades
        blocks, scales, exact = mxfp4_rtn(weight)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        values[name] = exact.transpose(1, 2).contiguous()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    for side in bf16.iterdir():
        if side.is_file() and side.suffix != ".safetensors" and side.name != "config.json":
            (dst / side.name).write_bytes(side.read_bytes())
    config = json.loads((bf16 / "config.json").read_text())
    config["quantization_config"] = RELEASED_QUANTIZATION_CONFIG
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return values


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    from fp4kit.testing.fixtures import RECIPE_STAND_INS, build_fixture

    root = tmp_path_factory.mktemp("gpt-oss-released")
    bf16 = build_fixture("gpt_oss", root / "bf16", overrides=RECIPE_STAND_INS["gpt_oss"])  # I a multiple of 32
    return root / "src", write_released(bf16, root / "src")


def test_the_fixture_is_what_transformers_reads(released):
    """The packer's blocks and scales decode, in transformers' convert_moe_packed_tensors, to the values it meant,
    bit for bit (fp32 and bf16); shapes and dtypes are the release's."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src, values = released
    stored = load_file(src / "model.safetensors")
    for name, exact in values.items():
        blocks, scales = stored[f"{name}_blocks"], stored[f"{name}_scales"]
        rows = 2 * INTER if name.endswith("gate_up_proj") else HIDDEN
        cols = HIDDEN if name.endswith("gate_up_proj") else INTER
        assert blocks.dtype == scales.dtype == torch.uint8
        assert blocks.shape == (EXPERTS, rows, cols // 32, 16) and scales.shape == (EXPERTS, rows, cols // 32)
        assert len(set(scales.flatten().tolist())) > 6
        for dtype in (torch.float32, torch.bfloat16):
            decoded = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
            assert torch.equal(bits(decoded), bits(exact.to(dtype))), name
    assert stored["model.layers.0.mlp.experts.gate_up_proj_bias"].dtype == torch.bfloat16


def ct_dequantized(path: Path) -> dict[str, torch.Tensor]:
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    return CompressedTensorsDequantizer(path, dtype=torch.float32).process(load_file(path / "model.safetensors"))


def quantize_cli(src: Path, dst: Path, *args: str) -> subprocess.CompletedProcess:
    run = cli_result("quantize", str(src), str(dst), *args)
    assert run.returncode == 0, run.stderr
    return run


@pytest.fixture(scope="module")
def cast(released, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`fp4kit quantize SRC DST` of the release: compressed-tensors NVFP4A16, the default cast."""
    dst = tmp_path_factory.mktemp("gpt-oss-cast") / "nvfp4"
    return dst, quantize_cli(released[0], dst)


@pytest.mark.pinned
def test_quantize_casts_every_expert_value_exactly(released, cast):
    """`fp4kit quantize` of the release (compressed-tensors NVFP4A16, the default cast): every expert Linear
    dequantized by compressed-tensors' NVFP4 decompressor equals transformers' decoding of the source's rows bit for
    bit (gate the even rows, up the odd ones), the codes are the source's bytes, every other tensor (expert biases,
    router, attention, sinks, norms, embeddings) is carried byte for byte or quantized as from BF16, inspect is
    clean."""
    from fp4kit.tools.inspect_artifacts import inspect_path

    src, values = released
    dst, run = cast
    blocks_per_layer = EXPERTS * (2 * INTER * HIDDEN + HIDDEN * INTER) // 16
    assert f"MXFP4 source: {LAYERS * blocks_per_layer} NVFP4 blocks cast exactly, 0 re-quantized" in run.stdout
    out = ct_dequantized(dst)
    stored, written = load_file(src / "model.safetensors"), load_file(dst / "model.safetensors")
    for layer in range(LAYERS):
        experts = f"model.layers.{layer}.mlp.experts"
        gate_up, down = values[f"{experts}.gate_up_proj"], values[f"{experts}.down_proj"]
        packed_gate_up = stored[f"{experts}.gate_up_proj_blocks"].flatten(-2)
        for e in range(EXPERTS):
            expected = {"gate_proj": gate_up[e, :, 0::2].t(), "up_proj": gate_up[e, :, 1::2].t(),
                        "down_proj": down[e].t()}
            for proj, weight in expected.items():
                assert torch.equal(bits(out[f"{experts}.{e}.{proj}.weight"]), bits(weight.contiguous())), (e, proj)
            assert torch.equal(written[f"{experts}.{e}.gate_proj.weight_packed"], packed_gate_up[e, 0::2])
    for name, tensor in stored.items():
        if name.endswith(("_blocks", "_scales")):
            continue
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")):
            assert name.removesuffix(".weight") + ".weight_packed" in written
            continue
        assert torch.equal(written[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert not any(n.endswith(("_blocks", "_scales")) for n in written)
    config = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "nvfp4-pack-quantized"
    report = inspect_path(dst)
    assert report.clean and report.kind == "checkpoint", report.problems


def test_modelopt_output_casts_too(released, tmp_path):
    """The ModelOpt dialect holds the cast's power-of-two global scales exactly: the same values."""
    from fp4kit.formats.detect import open_checkpoint
    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint

    src, values = released
    report = quantize_checkpoint(src, tmp_path / "mo", QuantizeOptions(format="modelopt"))
    assert report.mxfp4_cast["requantized"] == 0 and report.mxfp4_cast["exact"] > 0
    checked = 0
    with open_checkpoint(tmp_path / "mo") as ckpt:
        for module in ckpt.modules:
            if ".experts." not in module.name:
                continue
            experts, e, proj = module.name.rsplit(".", 2)
            fused = values[f"{experts}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"][int(e)]
            expected = {"gate_proj": fused[:, 0::2], "up_proj": fused[:, 1::2], "down_proj": fused}[proj].t()
            assert torch.equal(bits(ckpt.read_weight(module).dequantize()), bits(expected.contiguous())), module.name
            checked += 1
    assert checked == LAYERS * EXPERTS * 3


def test_partly_kept_experts_are_refused(released, tmp_path):
    src, _ = released
    run = cli_result("quantize", str(src), str(tmp_path / "out"), "--ignore", r"experts\.3\.up_proj")
    assert run.returncode == 2 and run.stderr.count("error:") == 1 and "Traceback" not in run.stderr
    assert "gate_up_proj_blocks" in run.stderr and not (tmp_path / "out").exists()


def test_eval_reads_the_release_as_the_source(released, tmp_path):
    """With only the experts quantized, `fp4kit eval` against the release finds KL 0: the cast keeps their values
    (and eval streams the release's experts dequantized, as transformers' layers hold them)."""
    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint
    from fp4kit.tools.evaluate import evaluate

    src, _ = released
    experts_only = tmp_path / "experts"
    quantize_checkpoint(src, experts_only, QuantizeOptions(targets=[r"experts\."]))
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    result = evaluate(src, experts_only, tokens)
    assert result.kl <= 1e-6 and result.top1 == 1.0
    assert evaluate(src.parent / "bf16", experts_only, tokens).kl > 1e-6  # the BF16 model it was rounded from


@pytest.mark.slow
def test_verify_reads_the_release_as_the_source(released, cast, tmp_path):
    """`verify --source` with the release finds error 0 where the BF16 model the fixture was rounded from differs
    (so the source's experts are really read from their MXFP4 blocks)."""
    src, _ = released
    errors = {}
    for reference in (src, src.parent / "bf16"):
        report = tmp_path / f"{reference.name}.json"
        run = cli_result("verify", str(cast[0]), "--source", str(reference), "--json", str(report))
        assert run.returncode in (0, 1), run.stderr
        results = json.loads(report.read_text())["results"]
        errors[reference.name] = max(r["error"] for r in results if r["check"] in ("source", "source-expert"))
        assert {r["check"] for r in results} >= {"source", "source-expert"}
    assert errors["src"] == 0 < errors["bf16"]


def test_w4a4_calibrates_on_the_release(released, tmp_path):
    """W4A4: the layer-streaming calibration runs transformers' decoder layers on the release's dequantized experts
    (read as [E, K, N], the BF16 form's) and the weights are still cast exactly."""
    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint
    from fp4kit.tools.inspect_artifacts import inspect_path

    src, _ = released
    report = quantize_checkpoint(src, tmp_path / "w4a4", QuantizeOptions(scheme="nvfp4", samples=2, seq_len=16))
    assert report.mxfp4_cast["requantized"] == 0 and report.mxfp4_cast["exact"] > 0
    assert inspect_path(tmp_path / "w4a4").clean


def test_vllm_dequantizes_the_experts_to_the_release_s_values(released, cast, tiny, tmp_path):
    """vLLM 0.33's own NVFP4 dequantization (nvfp4_emulation_utils.dequantize_to_dtype) of every expert Linear gives
    the release's values, and the output holds exactly the tensors (names, dtypes, shapes) that quantizing the BF16
    form writes, which is what vLLM 0.33's gpt-oss loader is run on in tests/test_vllm_gpt_oss.py (and what
    docs/serving.md says it cannot load yet)."""
    from helpers import vllm_module

    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint

    emulation = vllm_module("model_executor.layers.quantization.utils.nvfp4_emulation_utils")
    src, values = released
    out = load_file(cast[0] / "model.safetensors")
    checked = 0
    for name in [n for n in out if ".experts." in n and n.endswith(".weight_packed")]:
        module = name.removesuffix(".weight_packed")
        experts, e, proj = module.rsplit(".", 2)
        fused = values[f"{experts}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"][int(e)]
        expected = {"gate_proj": fused[:, 0::2], "up_proj": fused[:, 1::2], "down_proj": fused}[proj].t()
        got = emulation.dequantize_to_dtype(out[name], out[f"{module}.weight_scale"],
                                            1.0 / out[f"{module}.weight_global_scale"], torch.float32, swizzle=False)
        assert torch.equal(bits(got), bits(expected.contiguous())), module
        checked += 1
    assert checked == LAYERS * EXPERTS * 3
    quantize_checkpoint(src.parent / "bf16", tmp_path / "from-bf16", QuantizeOptions())
    from_bf16 = load_file(tmp_path / "from-bf16" / "model.safetensors")
    assert {n: (t.dtype, t.shape) for n, t in out.items()} == {n: (t.dtype, t.shape) for n, t in from_bf16.items()}


@pytest.mark.parametrize("change, needle", [
    (lambda h: h.pop("model.layers.0.mlp.experts.down_proj_scales"), "down_proj_scales is missing"),
    (lambda h: h.update({"model.layers.1.mlp.experts.gate_up_proj_scales": (torch.uint8, (8, 128, 3))}),
     "gate_up_proj_scales: torch.uint8[8, 128, 3]"),
    (lambda h: h.update({"model.layers.1.mlp.experts.down_proj_blocks": (torch.uint8, (8, 64, 2, 8))}),
     "MXFP4 blocks are uint8 [E, N, K/32, 16]"),
    (lambda h: h.update({"model.layers.0.mlp.experts.down_proj": (torch.bfloat16, (8, 64, 64))}),
     "stored beside its MXFP4 blocks"),
    (lambda h: [h.pop(n) for n in list(h) if n.endswith(("_blocks", "_scales"))], "without any *_blocks"),
])
def test_release_headers_that_disagree_are_refused(released, change, needle):
    from fp4kit.errors import Fp4kitError
    from fp4kit.io.checkpoint import CheckpointReader
    from fp4kit.io.sources import detect_source

    src, _ = released
    with CheckpointReader(src) as reader:
        headers = {n: (i.dtype, tuple(i.shape)) for n, i in reader.tensors.items()}
    config = json.loads((src / "config.json").read_text())
    assert detect_source(config, dict(headers)).name == "mxfp4 (gpt-oss)"
    change(headers)
    with pytest.raises(Fp4kitError, match=re.escape(needle)):
        detect_source(config, headers)
