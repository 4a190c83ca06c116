"""Which quantized sources fp4kit reads and which it refuses (fp4kit.io.sources), on checkpoints the real producers
write: llm-compressor 0.14's `model_free_ptq` (MXFP4A16, FP8_DYNAMIC, FP8 per tensor, NVFP4A16) of the tiny
Qwen3-MoE, and fp4kit's own NVFP4 output in both dialects.

Oracles: compressed-tensors 0.19 `entrypoints/convert/converters/ct_dequantizer.py` (CompressedTensorsDequantizer
over `compressors/mxfp4/base.py` MXFP4PackedCompressor and `compressors/naive_quantized`), transformers 5.17
`integrations/mxfp4.py` (convert_moe_packed_tensors, gpt-oss's `*_blocks` / `*_scales`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import cli_result
from safetensors.torch import load_file, save_file

from fp4kit.errors import Fp4kitError
from fp4kit.io.checkpoint import CheckpointReader
from fp4kit.io.sources import dequantize, dequantize_mxfp4, detect_source, read_source

pytestmark = pytest.mark.usefixtures("one_torch_thread")
IGNORE = ["lm_head", "re:.*mlp.gate$"]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


@pytest.fixture(scope="module")
def produced(tiny, tmp_path_factory):
    """produced(kind) -> a checkpoint of the tiny Qwen3-MoE: llm-compressor's model_free_ptq for MXFP4A16,
    FP8_DYNAMIC (per channel), FP8_TENSOR (per tensor), NVFP4A16; fp4kit's own NVFP4 for fp4kit-ct / fp4kit-modelopt."""
    pytest.importorskip("llmcompressor")
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import model_free_ptq

    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint

    root = tmp_path_factory.mktemp("produced")
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind in built:
            return built[kind]
        dst = root / kind
        if kind == "bf16":
            return tiny("qwen3_moe")
        if kind.startswith("fp4kit-"):
            quantize_checkpoint(tiny("qwen3_moe"), dst, QuantizeOptions(format=kind.removeprefix("fp4kit-")))
        else:
            scheme: object = kind
            if kind == "FP8_TENSOR":  # FP8 with a static activation scale cannot be made without calibration
                fp8 = dict(num_bits=8, type="float", strategy="tensor", symmetric=True)
                scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**fp8, dynamic=False),
                                            input_activations=QuantizationArgs(**fp8, dynamic=True))
            model_free_ptq(tiny("qwen3_moe"), dst, scheme=scheme, ignore=IGNORE)
        built[kind] = dst
        return dst

    return get


def assert_refused(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ") or "Traceback" in line]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def dequantized_by_compressed_tensors(src: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    return CompressedTensorsDequantizer(src, dtype=dtype).process(load_file(src / "model.safetensors"))


# --- read: values against compressed-tensors' decompressors ---------------------------------------------------


@pytest.mark.pinned
@pytest.mark.parametrize("kind, name", [("MXFP4A16", "mxfp4"), ("FP8_DYNAMIC", "fp8-channel"),
                                        ("FP8_TENSOR", "fp8-tensor")])
def test_values_equal_compressed_tensors_decompression(kind, name, produced):
    """Every quantized Linear (all but lm_head and the routers: 57) dequantized: MXFP4 bit for bit in fp32 and bf16
    (its values are exact in both); FP8 in bf16, the dtype compressed-tensors multiplies in (the e4m3 x bf16 scale
    product is exact in fp32, so fp4kit's fp32 value rounds to exactly theirs)."""
    src = produced(kind)
    config = json.loads((src / "config.json").read_text())
    with CheckpointReader(src) as reader:
        source = read_source(reader, config)
        assert source.name == name and len(source.linears) == 57
        for dtype in (torch.float32, torch.bfloat16) if kind == "MXFP4A16" else (torch.bfloat16,):
            expected = dequantized_by_compressed_tensors(src, dtype)
            for module, linear in source.linears.items():
                ours = dequantize(reader, linear, torch.float32)
                if kind != "MXFP4A16":  # the exact product: e4m3 value times the fp32-widened scale
                    weight = reader.read(linear.encoding.weight).to(torch.float32)
                    scale = reader.read(linear.encoding.scale).to(torch.float32)
                    assert torch.equal(ours, weight * scale.reshape(-1, 1) if scale.numel() > 1 else weight * scale)
                assert torch.equal(bits(ours.to(dtype)), bits(expected[f"{module}.weight"])), module


def test_mxfp4_every_code_and_exponent_against_compressed_tensors():
    """All 16 codes under every E8M0 exponent but 255 (NaN in OCP MX; compressed-tensors gives inf), through
    MXFP4PackedCompressor.decompress itself (which refuses a partial last group)."""
    from compressed_tensors.compressors.mxfp4 import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    rows, cols = 255, 64
    generator = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=generator)
    packed[:, :8] = torch.arange(8 * rows, dtype=torch.int32).remainder(256).to(torch.uint8).view(rows, 8)  # all codes
    exponents = torch.stack([torch.arange(rows, dtype=torch.int32).to(torch.uint8),
                             torch.arange(rows - 1, -1, -1, dtype=torch.int32).to(torch.uint8)], 1)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="float", strategy="group", group_size=32, symmetric=True, scale_dtype=torch.uint8))
    expected = MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": exponents}, scheme)["weight"]
    ours = dequantize_mxfp4(packed, exponents, torch.bfloat16)
    assert expected.dtype == torch.bfloat16 and torch.equal(bits(ours), bits(expected))
    assert torch.equal(dequantize_mxfp4(packed, exponents).to(torch.bfloat16), ours)  # fp32 exact: the same values


def test_gpt_oss_blocks_against_transformers():
    """gpt-oss's own form: ``*_blocks`` U8 [E, R, K/32, 16] and ``*_scales`` U8 [E, R, K/32] are per row the bytes
    of compressed-tensors' MXFP4; transformers' convert_moe_packed_tensors returns [E, K, R] (its parameter
    layout), in bf16 and fp32."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(1)
    experts, rows, groups = 3, 40, 4
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(100, 140, (experts, rows, groups), dtype=torch.uint8, generator=generator)
    for dtype in (torch.bfloat16, torch.float32):
        expected = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        ours = dequantize_mxfp4(blocks.flatten(-2), scales, dtype)
        assert torch.equal(bits(ours.transpose(1, 2).contiguous()), bits(expected))


# --- refused: one line, exit 2, wherever a source is read --------------------------------------------------------


def headers(src: Path) -> dict:
    with CheckpointReader(src) as reader:
        return {n: (i.dtype, i.shape) for n, i in reader.tensors.items()}


@pytest.mark.pinned
@pytest.mark.parametrize("kind, needle", [
    ("NVFP4A16", "compressed-tensors nvfp4-pack-quantized"),
    ("fp4kit-compressed-tensors", "compressed-tensors nvfp4-pack-quantized"),
    ("fp4kit-modelopt", "ModelOpt NVFP4"),
])
def test_nvfp4_sources_refused_by_quantize_and_verify(kind, needle, produced, tmp_path):
    """Before, quantize copied an NVFP4 source through: 0 Linears quantized, every tensor kept, exit 0."""
    src = produced(kind)
    dst = tmp_path / "out"
    assert_refused(cli_result("quantize", str(src), str(dst)), "an NVFP4 checkpoint", needle)
    assert not dst.exists()
    assert_refused(cli_result("verify", str(produced("fp4kit-compressed-tensors")), "--source", str(src)),
                   "an NVFP4 checkpoint", needle)


def with_config(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def unknown_sources(produced, tmp_path) -> dict[str, tuple[Path, str]]:
    """Sources of a quantization fp4kit does not read -> (directory, what the one line names)."""
    mx = produced("MXFP4A16")

    def set_format(fmt):
        def edit(config):
            config["quantization_config"]["format"] = fmt
            config["quantization_config"]["config_groups"]["MXFP4A16"]["format"] = fmt
        return edit

    no_config = with_config(mx, tmp_path / "no-config", lambda c: c.pop("quantization_config"))
    gptq = with_config(produced("bf16"), tmp_path / "gptq",
                       lambda c: c.update(quantization_config={"quant_method": "gptq", "bits": 4}))
    modelopt_fp8 = shutil.copytree(produced("FP8_TENSOR"), tmp_path / "modelopt-fp8")
    (modelopt_fp8 / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    return {
        "mxfp8": (with_config(mx, tmp_path / "mxfp8", set_format("mxfp8-quantized")),
                  "config_groups.MXFP4A16.format: 'mxfp8-quantized'"),
        "no-config": (no_config, "weight_packed: a quantization tensor"),
        "gptq": (gptq, "quant_method: 'gptq'"),
        "modelopt-fp8": (modelopt_fp8, "hf_quant_config.json: quantization.quant_algo: 'FP8'"),
    }


@pytest.mark.pinned
def test_unknown_quantization_refused_everywhere(produced, tmp_path):
    """Another compressed-tensors format, packed tensors without a config, another quant_method, a ModelOpt FP8
    side config: refused by quantize, verify --source and eval's SRC, each with its field or tensor."""
    ckpt = produced("fp4kit-compressed-tensors")
    for name, (src, needle) in unknown_sources(produced, tmp_path).items():
        dst = tmp_path / f"out-{name}"
        assert_refused(cli_result("quantize", str(src), str(dst)), needle)
        assert not dst.exists()
        assert_refused(cli_result("verify", str(ckpt), "--source", str(src)), needle)
        if name != "modelopt-fp8":  # eval reads config.json (and takes a ModelOpt NVFP4 side as the quantized one)
            assert_refused(cli_result("eval", str(src), str(ckpt), "--samples", "1", "--seq-len", "8"), needle)


def test_detect_refuses_leftover_quantization_tensors():
    """A read format's config with tensors it does not consume: an MXFP4 weight in an FP8 config, a packed weight
    no group targets."""
    fp8 = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    tensors = {"a.weight": (torch.bfloat16, (32, 32)), "b.weight_packed": (torch.uint8, (32, 16)),
               "b.weight_scale": (torch.uint8, (32, 1))}
    with pytest.raises(Fp4kitError, match=r"^b\.weight_packed: a quantization tensor"):
        detect_source(fp8, tensors)
    with pytest.raises(Fp4kitError, match=r"^c\.weight: torch\.uint8\[32, 32\], a quantized tensor"):
        detect_source({}, {"c.weight": (torch.uint8, (32, 32))})
    ct = {"quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                                  "config_groups": {"g": {"targets": ["re:.*experts.*"], "weights": {
                                      "type": "float", "num_bits": 4, "group_size": 32, "strategy": "group"}}}}}
    with pytest.raises(Fp4kitError, match=r"^b\.weight_packed: no mxfp4-pack-quantized entry .* targets b$"):
        detect_source(ct, tensors)
    good = detect_source(ct, {"x.experts.0.w.weight_packed": (torch.uint8, (32, 16)),
                              "x.experts.0.w.weight_scale": (torch.uint8, (32, 1))})
    assert good.name == "mxfp4" and good.linears["x.experts.0.w"].in_features == 32


def exact_fp32_copy(src: Path, dst: Path) -> Path:
    """SRC as an unquantized checkpoint holding fp4kit's fp32 dequantization of its quantized Linears."""
    config = json.loads((src / "config.json").read_text())
    dst.mkdir()
    with CheckpointReader(src) as reader:
        source = read_source(reader, config)
        tensors = {n: reader.read(n) for n in reader.names() if n not in source.consumed()}
        tensors.update({f"{m}.weight": dequantize(reader, q, torch.float32) for m, q in source.linears.items()})
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("kind", ["FP8_DYNAMIC", "FP8_TENSOR"])
def test_fp8_channel_and_tensor_sources_quantize_from_their_exact_values(kind, produced, tmp_path):
    """FP8_DYNAMIC (per channel) and per-tensor sources quantize as FP8-block ones do: every Linear the bf16 fixture
    quantizes, and the bytes of quantizing an unquantized copy holding their exact fp32 values."""
    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint

    src = produced(kind)
    copy = exact_fp32_copy(src, tmp_path / "fp32")
    reports = [quantize_checkpoint(d, tmp_path / f"out-{i}", QuantizeOptions()) for i, d in enumerate((src, copy))]
    assert reports[0].quantized_linears == reports[1].quantized_linears == 56  # all but lm_head and the routers
    ours, theirs = (load_file(tmp_path / f"out-{i}" / "model.safetensors") for i in (0, 1))
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        expected = tensor if "weight_" in name or tensor.dtype != torch.float32 else tensor.to(torch.bfloat16)
        assert torch.equal(ours[name].view(torch.uint8), expected.view(torch.uint8)), name


@pytest.mark.pinned
def test_mxfp4_source_as_eval_src(produced, tmp_path):
    """eval reads an MXFP4 SRC dequantized exactly: against its exact values as a dense checkpoint, KL 0."""
    from fp4kit.tools.evaluate import evaluate

    src = produced("MXFP4A16")
    dense = exact_fp32_copy(src, tmp_path / "dense")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    assert evaluate(src, dense, tokens).kl == 0
