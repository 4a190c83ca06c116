"""Streaming: quantize's peak resident memory does not grow with the number of layers (DESIGN.md §10).

Each run is its own process; it reports its peak RSS (ru_maxrss, which counts mapped file pages too) minus its RSS
after imports, so the number is what the quantization itself added.
"""

import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys
import torch, fp4kit.quantize as q, fp4kit.checkpoint, fp4kit.plan
from compressed_tensors.quantization import QuantizationConfig  # imported by the config writer; count it as baseline
def rss_kb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS"))
base = rss_kb()
q.quantize_checkpoint(sys.argv[1], sys.argv[2], q.QuantizeOptions(max_shard_bytes=64 * 10**6))
print(json.dumps({"added_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base}))
"""


def added_peak_rss_kb(src, dst) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, str(src), str(dst)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["added_kb"]


def test_peak_rss_independent_of_layer_count(tmp_path):
    from fp4kit.synthetic import write_synthetic_qwen3_moe

    dims = dict(hidden=512, moe_intermediate=256, num_experts=16, num_heads=8, num_kv_heads=2, head_dim=64,
                vocab_size=1024, max_shard_bytes=40 * 10**6)
    peaks = {}
    for layers in (2, 8):
        src = write_synthetic_qwen3_moe(tmp_path / f"src{layers}", num_layers=layers, **dims)
        size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        peaks[layers] = added_peak_rss_kb(src, tmp_path / f"out{layers}")
        print(f"{layers} layers: {size / 1e6:.0f} MB checkpoint, peak RSS added {peaks[layers] / 1e3:.1f} MB")
    largest_group_kb = 2 * 256 * 512 * 2 / 1024  # gate + up of one expert, bf16
    assert peaks[8] <= 1.3 * peaks[2] + 8 * 1024  # 8 MB of allocator slack
    # No absolute bound: run alone the work adds ~20 MB, but inside the full suite a lazily imported library
    # (not yet identified) sometimes adds a constant ~0.55 GB to both runs.
    assert largest_group_kb < peaks[8]  # the measurement sees real work
