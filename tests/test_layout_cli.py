"""`fp4kit layout`: kernel tensors replace the experts, everything else is copied byte for byte, the manifest names
every tensor; bad input (not NVFP4, unknown backend, violated shape constraint) is one line and exit 2, and nothing is
left behind, also when a layer fails half-way through."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import random_moe_only_source, run_cli, shared_source
from safetensors.torch import load_file, save_file

from fp4kit.io.checkpoint import DTYPES, CheckpointReader
from fp4kit.io.output import leftovers
from fp4kit.layouts.manifest import MANIFEST


@pytest.fixture(scope="module")
def w4a4(tmp_path_factory) -> Path:
    return shared_source(tmp_path_factory, hidden=256, intermediate=64)


@pytest.fixture(scope="module")
def padded(tmp_path_factory) -> Path:
    return shared_source(tmp_path_factory, hidden=96, intermediate=48)


def raw(reader: CheckpointReader, name: str) -> bytes:
    return bytes(reader.read(name).reshape(-1).view(torch.uint8).numpy())


@pytest.mark.parametrize("backend", ["trtllm", "cutlass", "marlin"])
def test_layout_replaces_experts_and_copies_everything_else(monkeypatch, capsys, w4a4, tmp_path, backend):
    out = tmp_path / "out"
    code, _, err = run_cli(monkeypatch, capsys, "layout", w4a4, out, "--backend", backend, "--quiet")
    manifest = json.loads((out / MANIFEST).read_text())
    # the source's experts have their own gate/up input scales: the W4A4 kernels get the layer's largest, said once
    collapsed = [layer["options"].get("collapsed_input_scales13", 0) for layer in manifest["layers"].values()]
    if backend == "marlin":
        assert (code, err) == (0, "") and collapsed == [0, 0]
    else:
        assert code == 0 and all(collapsed)
        assert err.startswith("note: 2 MoE layers have per-expert gate/up input scales")
    assert manifest["backend"] == backend and sorted(manifest["layers"]) == ["0", "1"]
    assert manifest["kernel"]["version"] in ("0.7.2.post1", "0.33")
    assert (out / "config.json").read_bytes() == (w4a4 / "config.json").read_bytes()
    with CheckpointReader(w4a4) as source, CheckpointReader(out) as written:
        kernel_names = set()
        for layer in manifest["layers"].values():
            assert (layer["num_experts"], layer["hidden_size"], layer["intermediate_size"]) == (8, 256, 64)
            for spec in layer["tensors"].values():
                info = written.info(spec["name"])
                assert (info.dtype, list(info.shape)) == (DTYPES[spec["dtype"]], spec["shape"])
                assert spec["name"].startswith(layer["module"] + ".")
                kernel_names.add(spec["name"])
        copied = [n for n in source.names() if ".experts." not in n]
        assert set(written.names()) == kernel_names | set(copied)
        for name in copied:
            assert raw(source, name) == raw(written, name), name


def test_overwrite_replaces_a_non_empty_destination(monkeypatch, capsys, w4a4, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    code, _, err = run_cli(monkeypatch, capsys, "layout", w4a4, out, "--backend", "cutlass")
    assert code == 2 and "--overwrite" in err
    code, _, _ = run_cli(monkeypatch, capsys, "layout", w4a4, out, "--backend", "cutlass", "--overwrite", "-q")
    assert code == 0 and not (out / "stale.txt").exists() and (out / MANIFEST).exists()


BAD = {  # name -> (source, extra arguments, words the one-line error must contain)
    "unknown backend": ("w4a4", ["--backend", "cuda"], ["'cuda' is not one of", "'trtllm'"]),
    "not nvfp4": ("bf16", ["--backend", "marlin"], ["no NVFP4 quantization config"]),
    "weight-only for W4A4": ("a16", ["--backend", "trtllm"], ["weight-only", "--backend marlin"]),
    "cutlass I % 64": ("padded", ["--backend", "cutlass"], ["I = 48", "multiple of 64"]),
    "marlin H % 128": ("padded", ["--backend", "marlin"], ["H = 96", "multiple of 128"]),
    "trtllm fp16": ("w4a4", ["--backend", "trtllm", "--act-dtype", "fp16"], ["bfloat16"]),
    "unknown flavor": ("w4a4", ["--backend", "cutlass", "--cutlass-flavor", "sglang"], ["'sglang' is not one of"]),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(monkeypatch, capsys, w4a4, padded, tmp_path, case):
    which, extra, needles = BAD[case]
    source = {"w4a4": w4a4, "padded": padded, "a16": w4a4.parent / "nvfp4a16", "bf16": w4a4.parent / "bf16"}[which]
    out = tmp_path / "out"
    code, _, err = run_cli(monkeypatch, capsys, "layout", source, out, *extra)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err
    assert not out.exists() and not leftovers(out)


def test_a_layer_failing_mid_stream_leaves_no_output(monkeypatch, capsys, w4a4, tmp_path):
    """Gate and up of one expert of the last layer carry different global scales: found only when that layer is read,
    after earlier layers were written; the atomic output directory must vanish."""
    source = tmp_path / "src"
    source.mkdir()
    tensors = load_file(w4a4 / "model.safetensors")
    name = "model.layers.1.mlp.experts.5.up_proj.weight_global_scale"
    tensors[name] = tensors[name] * 2
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    (source / "config.json").write_bytes((w4a4 / "config.json").read_bytes())
    out = tmp_path / "out"
    code, _, err = run_cli(monkeypatch, capsys, "layout", source, out, "--backend", "trtllm")
    assert code == 2 and "experts.5: gate and up have different weight global scales" in err
    assert not out.exists() and not leftovers(out)


RSS_CHILD = r"""
import json, resource, sys
from fp4kit.layouts.directory import LayoutOptions, layout_checkpoint
peaks = []
for src, dst in zip(sys.argv[1::2], sys.argv[2::2]):
    layout_checkpoint(src, dst, LayoutOptions(backend="cutlass", max_shard_bytes=32 * 10**6))
    peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
print(json.dumps(peaks))
"""


def test_memory_follows_the_layer_not_the_checkpoint(tmp_path):
    """In one process, laying out a 12-layer checkpoint after a 3-layer one raises the peak RSS by less than 4 layers:
    a few layers are in flight (read ahead, transformed, queued for writing), never the whole checkpoint."""
    experts, hidden, inter = 8, 1024, 512
    layer_kb = experts * 3 * hidden * inter * (1 / 2 + 1 / 16) / 1024
    runs = []
    for layers in (3, 12):
        src = random_moe_only_source(tmp_path / f"src{layers}", layers, experts, hidden, inter)
        runs += [str(src), str(tmp_path / f"out{layers}")]
    out = subprocess.run([sys.executable, "-c", RSS_CHILD, *runs], capture_output=True, text=True, check=True)
    peak_small, peak_large = json.loads(out.stdout.strip().splitlines()[-1])
    assert peak_large - peak_small < 4 * layer_kb, (peak_small, peak_large, layer_kb)


def test_read_layer_stacks_what_each_module_reads(w4a4):
    from fp4kit.errors import Fp4kitError
    from fp4kit.formats.detect import open_checkpoint
    from fp4kit.layouts.directory import find_moe_layers, read_layer

    with open_checkpoint(w4a4) as ckpt:
        layer = find_moe_layers(ckpt)[1]
        stacked = read_layer(ckpt, layer)
        w13, w2, input13, input2 = stacked.w13, stacked.w2, stacked.input_scale_div13, stacked.input_scale_div2
        inter = layer.intermediate
        for e, (gate, up, down) in enumerate(layer.members):
            (g, g_in), (u, _), (d, d_in) = (ckpt.read(m) for m in (gate, up, down))
            assert torch.equal(w13.packed[e], torch.cat([g.packed, u.packed]))
            assert torch.equal(w13.block_scale[e].view(torch.uint8),
                               torch.cat([g.block_scale, u.block_scale]).view(torch.uint8))
            assert torch.equal(w2.packed[e], d.packed)
            assert torch.equal(w2.block_scale[e].view(torch.uint8), d.block_scale.view(torch.uint8))
            assert (w13.global_scale_div[e], w2.global_scale_div[e]) == (g.global_scale_div, d.global_scale_div)
            assert (input13[e], input2[e]) == (g_in, d_in)
        with pytest.raises(Fp4kitError, match="cannot be read into"):
            ckpt.reader.read_into(layer.members[0][0].packed, torch.empty(inter + 1, layer.hidden // 2,
                                                                         dtype=torch.uint8))


@pytest.mark.parametrize("backend", ["trtllm", "cutlass", "marlin"])
def test_every_layer_equals_the_pure_transform_with_recycled_buffers(tmp_path, backend):
    """Kernel tensors computed in place in the output file, from source buffers recycled across layers, are the
    bytes the backend's transform gives for each layer read on its own."""
    import queue

    from fp4kit.formats.detect import open_checkpoint
    from fp4kit.layouts.directory import BACKENDS, LayoutOptions, find_moe_layers, layout_checkpoint, read_layer

    src = random_moe_only_source(tmp_path / "src", 6, 4, 256, 128)
    layout_checkpoint(src, tmp_path / "out", LayoutOptions(backend=backend))
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    with open_checkpoint(src) as ckpt, CheckpointReader(tmp_path / "out") as written:
        recycled: queue.SimpleQueue = queue.SimpleQueue()
        previous = None
        for layer in find_moe_layers(ckpt):
            canonical = read_layer(ckpt, layer, recycled)
            if previous is not None:  # the previous layer's buffers were reused, not new ones
                assert canonical.w13.packed.data_ptr() == previous
            expected = BACKENDS[backend].transform(*canonical.arguments())
            for arg, spec in manifest["layers"][str(layer.layer)]["tensors"].items():
                stored = written.read(spec["name"])
                assert torch.equal(stored.view(torch.uint8), expected[arg].contiguous().view(torch.uint8)), arg
            previous = canonical.w13.packed.data_ptr()
            recycled.put((canonical.w13.packed, canonical.w13.block_scale, canonical.w2.packed,
                          canonical.w2.block_scale))
