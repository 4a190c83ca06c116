"""MXFP4 sources to NVFP4 without rounding (fp4kit.nvfp4.cast_mxfp4_group, the default of `fp4kit quantize`).

The source: llm-compressor 0.14's `model_free_ptq(scheme="MXFP4A16")` of the tiny Qwen3-MoE (compressed-tensors
`mxfp4-pack-quantized`). Oracles: compressed-tensors 0.19's CompressedTensorsDequantizer
(`entrypoints/convert/converters/ct_dequantizer.py`) of both the MXFP4 source and the NVFP4 output, and fp4kit eval.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import cli_result
from safetensors.torch import load_file

from fp4kit.native import nvfp4_cpu
from fp4kit.nvfp4 import Mxfp4Weight, NonFiniteError, cast_mxfp4_group, quantize_group

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def mxfp4(rows: int, cols: int, low: int, high: int, seed: int) -> Mxfp4Weight:
    generator = torch.Generator().manual_seed(seed)
    return Mxfp4Weight(torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=generator),
                       torch.randint(low, high + 1, (rows, -(-cols // 32)), dtype=torch.uint8, generator=generator))


@pytest.mark.parametrize("low, high", [(127, 127), (110, 127), (0, 17), (237, 254)])
def test_within_18_binades_every_value_is_exact_and_the_codes_are_the_bytes(low, high):
    """A fused pair whose exponents span at most 18 binades (E4M3's powers of two 2^-9 .. 2^8): the same code bytes,
    scales 2^(k + m), a power-of-two global scale shared by both, and bit-identical values, at both ends of E8M0."""
    pair = [mxfp4(64, 256, low, high, seed) for seed in (0, 1)]
    cast = cast_mxfp4_group(pair)
    assert (cast.exact_blocks, cast.requantized_blocks) == (2 * 64 * 16, 0)
    divisor = cast.tensors[0].global_scale_div
    assert float(divisor) == 2.0 ** round(torch.log2(divisor).item()) and torch.equal(divisor,
                                                                                       cast.tensors[1].global_scale_div)
    for source, out in zip(pair, cast.tensors, strict=True):
        assert torch.equal(out.packed, source.packed)
        assert torch.equal(bits(out.dequantize()), bits(source.dequantize()))
    assert float(cast.tensors[0].block_scale.to(torch.float32).max()) == 256.0  # the largest block at 2^8


def test_wider_ranges_requantize_only_the_smallest_blocks():
    """40 binades: the largest blocks exact (nothing clips), those more than 17 binades below re-quantized by RTN from
    their exact values under the same global scale, counted; far less error than RTN of the whole group."""
    pair = [mxfp4(64, 256, 100, 140, seed) for seed in (2, 3)]
    cast = cast_mxfp4_group(pair)
    assert cast.requantized_blocks > 0 and cast.exact_blocks + cast.requantized_blocks == 2 * 64 * 16
    redone = 0
    for source, out in zip(pair, cast.tensors, strict=True):
        k = (source.exponents.to(torch.int32) - 127).repeat_interleave(2, dim=1)
        nonzero = (source.packed.view(64, 16, 8) & 0x77).ne(0).any(-1)
        small = nonzero & (k < 140 - 127 - 17)
        redone += int(small.sum())
        same = (out.dequantize().view(64, 16, 16) == source.dequantize().view(64, 16, 16)).all(-1)
        assert same[~small].all()
        assert torch.equal(out.packed.view(64, 16, 8)[~small], source.packed.view(64, 16, 8)[~small])
    assert redone == cast.requantized_blocks
    rtn = quantize_group([w.dequantize() for w in pair], exact_fp32=True)

    def error(tensors):
        return sum(float(((t.dequantize().double() - w.dequantize().double()) ** 2).sum())
                   for t, w in zip(tensors, pair, strict=True))

    assert error(cast.tensors) < 1e-6 * error(rtn)


def test_all_zero_blocks_and_nan_exponent():
    weight = Mxfp4Weight(torch.zeros(4, 32, dtype=torch.uint8), torch.full((4, 2), 200, dtype=torch.uint8))
    weight.packed[0, :8] = 0x88  # -0.0 codes keep their sign
    cast = cast_mxfp4_group([weight])
    assert cast.requantized_blocks == 0 and torch.equal(bits(cast.tensors[0].dequantize()), bits(weight.dequantize()))
    weight.exponents[1, 1] = 255
    with pytest.raises(NonFiniteError):
        cast_mxfp4_group([weight])


def assert_native_casts_alike(weights: list[Mxfp4Weight]) -> None:
    """fp4kit's C loop (nvfp4_cpu.mxfp4_top / mxfp4_cast_scales) gives the torch path's bytes and counts."""
    assert all(nvfp4_cpu.handles_mxfp4(w.packed, w.exponents) for w in weights)
    torch_cast, native_cast = cast_mxfp4_group(weights), cast_mxfp4_group(weights, native=True)
    assert (native_cast.exact_blocks, native_cast.requantized_blocks) == (torch_cast.exact_blocks,
                                                                          torch_cast.requantized_blocks)
    for a, b in zip(torch_cast.tensors, native_cast.tensors, strict=True):
        assert torch.equal(a.packed, b.packed)
        assert torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8))
        assert torch.equal(a.global_scale_div, b.global_scale_div)


def every_code_under_every_exponent(cols: int = 512) -> Mxfp4Weight:
    """Row e: exponent byte e (0 .. 254) on every block, and every code byte (so every code in both nibbles) along
    the row, rotated by e."""
    codes = torch.arange(256, dtype=torch.int32)
    packed = torch.stack([codes.roll(e) for e in range(255)]).to(torch.uint8)[:, : cols // 2]
    exponents = torch.arange(255, dtype=torch.uint8).unsqueeze(1).expand(255, -(-cols // 32)).contiguous()
    return Mxfp4Weight(packed, exponents)


def test_the_c_loop_builds_here():
    """CI machines have a C compiler: the native cast must really run there, not fall back silently."""
    assert nvfp4_cpu.available()


def test_the_c_loop_gives_the_same_bytes_on_every_code_and_exponent():
    """Every code under every finite E8M0 exponent (0 .. 254, spanning 255 binades: most blocks re-quantized, each
    one's exponent the largest in turn as rows are dropped), alone and fused, K a multiple of 32 or not."""
    weight = every_code_under_every_exponent()
    assert_native_casts_alike([weight])
    for top in (0, 8, 17, 18, 127, 200, 254):
        assert_native_casts_alike([Mxfp4Weight(weight.packed[: top + 1], weight.exponents[: top + 1])])
    half = every_code_under_every_exponent(48)
    assert_native_casts_alike([half])
    assert_native_casts_alike([weight, Mxfp4Weight(weight.packed[100:], weight.exponents[100:])])


@pytest.mark.parametrize("seed", range(6))
def test_the_c_loop_gives_the_same_bytes_on_random_weights(seed):
    """Random spans at both ends of E8M0, zero blocks (-0 included) at the largest exponent and below, strided rows (a
    fused tensor's interleaved gate / up rows, read in place), a last half block, an all-zero weight."""
    generator = torch.Generator().manual_seed(seed)
    low = int(torch.randint(0, 240, (), generator=generator))
    span = int(torch.randint(0, 40, (), generator=generator))
    cols = 32 * int(torch.randint(1, 6, (), generator=generator)) + 16 * (seed % 2)
    pair = [mxfp4(24, cols, low, min(254, low + span), seed * 2 + i) for i in range(2)]
    zero = torch.rand(pair[0].packed.shape[0], pair[0].packed.shape[1] // 8, generator=generator) < 0.3
    for w in pair:
        w.packed.view(w.packed.shape[0], -1, 8)[zero] = torch.tensor([0x00, 0x08, 0x80, 0x88], dtype=torch.uint8)[
            torch.randint(0, 4, (8,), generator=generator)]
    for row, group in (pair[0].exponents == pair[0].exponents.max()).nonzero().tolist():
        pair[0].packed[row, group * 16: group * 16 + 16] = 0  # zero blocks at the largest exponent
    assert_native_casts_alike(pair)
    fused = mxfp4(48, cols, low, min(254, low + span), seed + 100)
    gate, up = (Mxfp4Weight(fused.packed[i::2], fused.exponents[i::2]) for i in (0, 1))
    assert gate.packed.stride(0) == 2 * gate.packed.shape[1]
    assert_native_casts_alike([gate, up])
    zeros = Mxfp4Weight(torch.zeros_like(pair[0].packed), pair[0].exponents)
    assert_native_casts_alike([zeros])
    assert cast_mxfp4_group([zeros], native=True).tensors[0].global_scale_div == 1.0


def test_the_c_loop_refuses_a_nan_exponent_and_bad_shapes():
    weight = every_code_under_every_exponent()
    nan = Mxfp4Weight(weight.packed.clone(), weight.exponents.clone())
    nan.exponents[3, 5] = 255
    for native in (False, True):
        with pytest.raises(NonFiniteError):
            cast_mxfp4_group([weight, nan], native=native)
        with pytest.raises(ValueError, match="exponents"):
            cast_mxfp4_group([Mxfp4Weight(weight.packed, weight.exponents[:, :-1])], native=native)
    empty = Mxfp4Weight(torch.zeros(0, 16, dtype=torch.uint8), torch.zeros(0, 1, dtype=torch.uint8))
    assert_native_casts_alike([empty])


@pytest.fixture(scope="module")
def mxfp4_source(tiny, tmp_path_factory):
    pytest.importorskip("llmcompressor")
    from llmcompressor import model_free_ptq

    dst = tmp_path_factory.mktemp("mxfp4") / "src"
    model_free_ptq(tiny("qwen3_moe"), dst, scheme="MXFP4A16", ignore=["lm_head", "re:.*mlp.gate$"])
    return dst


def dequantized(path, dtype=torch.float32) -> dict[str, torch.Tensor]:
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    return CompressedTensorsDequantizer(path, dtype=dtype).process(load_file(path / "model.safetensors"))


@pytest.mark.pinned
def test_quantize_casts_an_mxfp4_source_exactly(mxfp4_source, tmp_path):
    """`fp4kit quantize` of the MXFP4A16 source: every Linear the source quantized (experts, attention) dequantizes
    in compressed-tensors' own NVFP4 decompressor to its MXFP4 decompressor's values bit for bit, kept tensors are
    the source's bytes, the summary line counts the blocks, inspect is clean, fp4kit eval's KL is 0 and verify
    --source (the MXFP4 source as the reference) passes."""
    dst = tmp_path / "nvfp4"
    run = cli_result("quantize", str(mxfp4_source), str(dst))
    assert run.returncode == 0, run.stderr
    assert "MXFP4 source: 7680 NVFP4 blocks cast exactly, 0 re-quantized" in run.stdout
    assert "56 Linears quantized" in run.stdout
    source, out = dequantized(mxfp4_source), dequantized(dst)
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["format"] == "nvfp4-pack-quantized"
    quantized = [n for n in load_file(mxfp4_source / "model.safetensors") if n.endswith(".weight_packed")]
    assert len(quantized) == 57  # the 56 Linears and the embedding, which fp4kit keeps (dequantized, exact in bf16)
    for name in quantized:
        weight = name.removesuffix("_packed")
        expected = source[weight] if "embed_tokens" not in name else source[weight].to(torch.bfloat16)
        assert torch.equal(out[weight].view(torch.uint8), expected.view(torch.uint8)), weight
    stored, written = load_file(mxfp4_source / "model.safetensors"), load_file(dst / "model.safetensors")
    kept = [n for n in stored if not n.endswith(("weight_packed", "weight_scale"))]
    assert len(kept) == 12  # norms, routers, lm_head (the 13th tensor kept: the embedding, dequantized)
    for name in kept:
        assert torch.equal(written[name].view(torch.uint8), stored[name].view(torch.uint8)), name
    for name in quantized:  # the codes are the source's bytes
        if "embed_tokens" not in name:
            assert torch.equal(written[name], stored[name]), name

    from fp4kit.tools.evaluate import evaluate
    from fp4kit.tools.inspect_artifacts import inspect_path

    report = inspect_path(dst)
    assert report.clean and report.kind == "checkpoint"
    assert "cast from an MXFP4 source: 7680 NVFP4 blocks hold its values exactly, 0 re-quantized" in report.notes[-1]
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    assert evaluate(mxfp4_source, dst, tokens).kl <= 1e-6
    verify = cli_result("verify", str(dst), "--source", str(mxfp4_source))
    assert verify.returncode == 0 and "PASS" in verify.stdout, verify.stdout + verify.stderr


@pytest.mark.parametrize("scheme", ["nvfp4a16", "nvfp4"])
def test_modelopt_output_and_w4a4_cast_too(scheme, mxfp4_source, tmp_path):
    """ModelOpt's divisor form holds 2^-m exactly as well; W4A4 calibrates as usual and casts the weights."""
    from fp4kit.formats.detect import open_checkpoint
    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint

    report = quantize_checkpoint(mxfp4_source, tmp_path / "mo", QuantizeOptions(format="modelopt", scheme=scheme,
                                                                                 samples=2, seq_len=16))
    assert report.mxfp4_cast == {"exact": 7680, "requantized": 0}
    source = dequantized(mxfp4_source)
    with open_checkpoint(tmp_path / "mo") as ckpt:
        assert ckpt.scheme == scheme
        for module in ckpt.modules:
            weight = ckpt.read_weight(module).dequantize()
            assert torch.equal(bits(weight), bits(source[f"{module.name}.weight"])), module.name


def test_an_explicit_method_requantizes(mxfp4_source, tmp_path):
    """--method rtn (the API's cast_mxfp4=False) re-quantizes from the exact values: no blocks counted, other bytes."""
    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint

    cast = quantize_checkpoint(mxfp4_source, tmp_path / "cast", QuantizeOptions())
    rtn = quantize_checkpoint(mxfp4_source, tmp_path / "rtn", QuantizeOptions(cast_mxfp4=False))
    assert cast.mxfp4_cast["exact"] == 7680 and rtn.mxfp4_cast == {}
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("cast", "rtn"))
    assert any(not torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a if n.endswith("packed"))


def test_the_codes_are_copied_file_to_file(mxfp4_source, tmp_path, monkeypatch):
    """The cast's code bytes go from the source file to the output with copy_file_range (one copy per cast Linear,
    none of anything else); where the kernel cannot copy them, they are written from memory: the same files."""
    import errno
    import os

    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint

    copied = []
    real = os.copy_file_range
    monkeypatch.setattr(os, "copy_file_range", lambda *a: copied.append(a[2]) or real(*a))
    quantize_checkpoint(mxfp4_source, tmp_path / "copied", QuantizeOptions())
    stored = load_file(mxfp4_source / "model.safetensors")
    codes = [n for n in stored if n.endswith(".weight_packed") and "embed_tokens" not in n]
    assert sorted(copied) == sorted(stored[n].numel() for n in codes)
    monkeypatch.setattr(os, "copy_file_range", lambda *a: (_ for _ in ()).throw(OSError(errno.EXDEV, "")))
    quantize_checkpoint(mxfp4_source, tmp_path / "written", QuantizeOptions())
    for name in ("model.safetensors", "config.json", "fp4kit_mxfp4_cast.json"):
        assert (tmp_path / "copied" / name).read_bytes() == (tmp_path / "written" / name).read_bytes(), name


@pytest.mark.parametrize("low, high", [(120, 130), (60, 140)])
def test_a_last_half_block(low, high):
    """K = 48: the last 32-block holds 16 inputs (one NVFP4 block); exact where in range, on the fast and the
    re-quantizing path."""
    weight = mxfp4(32, 48, low, high, seed=4)
    cast = cast_mxfp4_group([weight])
    out = cast.tensors[0]
    assert out.block_scale.shape == (32, 3) and cast.exact_blocks + cast.requantized_blocks == 96
    assert (cast.requantized_blocks > 0) == (high - low > 17)
    same = (out.dequantize().view(32, 3, 16) == weight.dequantize().view(32, 3, 16)).all(-1)
    assert int(same.sum()) >= cast.exact_blocks
