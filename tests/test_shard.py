"""`fp4kit shard` on tiny fixtures of every family: every expert on exactly one rank with its source bytes, shared
tensors stored once and hard-linked, manifests that check out, and per-rank MoE outputs that sum to the unsharded
output (fp4kit.verify.reference.moe_reference, fp32) for N in {1, 2, 4, 8} and every placement.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from fp4kit.ep.shard import (
    EXPERT_MAP,
    MANIFEST,
    SHARED_DIR,
    ShardOptions,
    rank_dir_name,
    scan_experts,
    shard_checkpoint,
)
from fp4kit.errors import Fp4kitError
from fp4kit.families import detect
from fp4kit.families.routing import route
from fp4kit.formats import compressed_tensors as ct
from fp4kit.io.checkpoint import CheckpointReader, read_config
from fp4kit.verify.reference import moe_reference

FAMILIES = ("qwen3_moe", "qwen3_vl_moe", "glm4_moe", "glm4v_moe", "llama4", "llama4_text")
PLACEMENTS = ("linear", "round-robin", "balanced")
TOKENS = 48


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="session")
def quantized(tiny_nvfp4a16):
    """quantized(family) -> the fixture quantized by fp4kit; a quantize failure fails the tests that need it."""
    return tiny_nvfp4a16


def _model(src: Path) -> tuple[dict, object, int]:
    config = read_config(src)
    family = detect(config)
    return config, family, family.num_experts(family.text_config(config))


def skewed_stats(src: Path, path: Path) -> Path:
    """Routing statistics with the hot experts at the low ids (linear's worst case), different per layer."""
    config, _, num_experts = _model(src)
    with CheckpointReader(src) as reader:
        layers = scan_experts(reader.names(), num_experts).layers
    counts = {str(layer): [round(1000 / (1 + ((e + layer) % num_experts)) ** 1.5) for e in range(num_experts)]
              for layer in layers}
    path.write_text(json.dumps({"model_type": config["model_type"], "num_experts": num_experts, "layers": counts}))
    return path


def run_shard(src: Path, out: Path, ep: int, placement: str) -> Path:
    stats = skewed_stats(src, out.parent / f"{out.name}-stats.json") if placement == "balanced" else None
    shard_checkpoint(src, out, ShardOptions(ep=ep, placement=placement, stats=stats))
    return out


def _cases() -> list[tuple[str, int, str]]:
    experts = {"llama4": 4, "llama4_text": 4}
    return [(f, n, p) for f in FAMILIES for n in (1, 2, 4, 8) if n <= experts.get(f, 8) for p in PLACEMENTS]


@pytest.fixture(scope="session")
def sharded(quantized, tmp_path_factory):
    built: dict[tuple[str, int, str], Path] = {}

    def get(family: str, ep: int, placement: str) -> tuple[Path, Path]:
        src = quantized(family)
        key = (family, ep, placement)
        if key not in built:
            built[key] = run_shard(src, tmp_path_factory.mktemp("ep") / "out", ep, placement)
        return src, built[key]

    return get


@functools.lru_cache(maxsize=8)
def tensor_bytes(root: Path) -> dict[str, bytes]:
    """name -> raw bytes of every tensor of a checkpoint directory, read with safetensors itself; where there is an
    index, checks that it names exactly the tensors of each file."""
    from safetensors.torch import load_file

    index_path = root / "model.safetensors.index.json"
    weight_map = json.loads(index_path.read_text())["weight_map"] if index_path.exists() else None
    files = sorted(set(weight_map.values())) if weight_map else [p.name for p in root.glob("*.safetensors")]
    out = {}
    for file in files:
        for name, tensor in load_file(root / file).items():
            assert weight_map is None or weight_map[name] == file, name
            out[name] = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
    assert weight_map is None or set(weight_map) == set(out)
    return out


@pytest.mark.parametrize(("family", "ep", "placement"), _cases())
def test_ranks_partition_the_experts_and_share_the_rest(sharded, family: str, ep: int, placement: str) -> None:
    src, dst = sharded(family, ep, placement)
    _, _, num_experts = _model(src)
    source = tensor_bytes(src)
    inventory = scan_experts(list(source), num_experts)
    holders: dict[str, list[int]] = {name: [] for name in inventory.experts}
    for rank in range(ep):
        rank_dir = dst / rank_dir_name(rank)
        expert_map = json.loads((rank_dir / EXPERT_MAP).read_text())["layers"]
        tensors = tensor_bytes(rank_dir)
        for name, data in tensors.items():
            assert data == source[name], name
            if name in inventory.experts:
                holders[name].append(rank)
                t = inventory.experts[name]
                assert expert_map[str(t.layer)][t.expert] >= 0
        assert set(source) - set(inventory.experts) <= set(tensors)  # every non-expert tensor on every rank
        for path in rank_dir.glob("shared-*.safetensors"):
            assert path.stat().st_ino == (dst / SHARED_DIR / path.name).stat().st_ino, path  # a hard link
        for layer_map in expert_map.values():
            local = [lid for lid in layer_map if lid >= 0]
            assert local == list(range(len(local)))  # local ids follow global order
    assert all(len(ranks) == 1 for ranks in holders.values()), "an expert on no rank or on two"
    source_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    stored = {p.stat().st_ino: p.stat().st_size for p in dst.rglob("*.safetensors")}
    assert sum(stored.values()) < 1.02 * source_bytes + 2048 * (ep + 1)  # ~1x: headers are all that is added


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_manifests_checksum_every_file(sharded, placement: str) -> None:
    src, dst = sharded("glm4_moe", 4, placement)
    summary = json.loads((dst / MANIFEST).read_text())
    assert summary["ranks"] == [rank_dir_name(r) for r in range(4)] and summary["placement"] == placement
    if placement == "balanced":
        for load in summary["load"].values():
            assert load["max_over_mean"] <= load["max_over_mean_linear"]
    for rank in range(4):
        rank_dir = dst / rank_dir_name(rank)
        files = json.loads((rank_dir / MANIFEST).read_text())["files"]
        on_disk = {str(p.relative_to(rank_dir)) for p in rank_dir.rglob("*") if p.is_file()} - {MANIFEST}
        assert set(files) == on_disk
        for rel, entry in files.items():
            data = (rank_dir / rel).read_bytes()
            assert hashlib.sha256(data).hexdigest() == entry["sha256"] and len(data) == entry["bytes"], rel
        assert (rank_dir / "config.json").read_bytes() == (src / "config.json").read_bytes()  # quantization_config kept


# ---- numerics: per-rank MoE outputs sum to the unsharded output -------------------------------------------------


def _projection(reader: CheckpointReader, module: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 weight [N, K] of one Linear and its activation divisor (None for W4A16), from whatever dialect it is in."""
    names = [n for n in reader.names() if n.startswith(module + ".")]
    tensors = {n: reader.read(n, check_finite=False) for n in names}
    if f"{module}.weight" in tensors:  # left in bf16 (GLM's MTP layer)
        return tensors[f"{module}.weight"].float(), None
    weight, input_div = ct.decode(module, tensors)
    return weight.dequantize(), input_div


def _layer_experts(reader: CheckpointReader, module: str, experts: list[int], num_experts: int):
    """Stacked w13 [E, 2I, H], w2 [E, H, I] (zeros for experts not listed) and per-expert input multipliers."""
    w13: list[torch.Tensor | None] = [None] * num_experts
    w2: list[torch.Tensor | None] = [None] * num_experts
    muls = {}
    for e in experts:
        gate, gate_div = _projection(reader, f"{module}.{e}.gate_proj")
        up, up_div = _projection(reader, f"{module}.{e}.up_proj")
        w2[e], down_div = _projection(reader, f"{module}.{e}.down_proj")
        w13[e] = torch.cat([gate, up])
        if gate_div is not None:
            muls[e] = (1 / gate_div, 1 / up_div, 1 / down_div)
    shape13, shape2 = next(w.shape for w in w13 if w is not None), next(w.shape for w in w2 if w is not None)
    w13_t = torch.stack([torch.zeros(shape13) if w is None else w for w in w13])
    w2_t = torch.stack([torch.zeros(shape2) if w is None else w for w in w2])
    return w13_t, w2_t, muls


def _router(reader: CheckpointReader, module: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    parent = module.removesuffix(".experts")
    for name in (f"{parent}.gate.weight", f"{parent}.router.weight"):
        if name in reader:
            bias = f"{parent}.gate.e_score_correction_bias"
            return reader.read(name).float(), reader.read(bias).float() if bias in reader else None
    raise AssertionError(f"no router for {module}")


def moe_output(root: Path, module: str, layer: int, hidden: torch.Tensor, experts: list[int] | None) -> torch.Tensor:
    """Routed-expert output of one layer computed from checkpoint ``root`` alone, with only ``experts`` (all if None).

    W4A4 as an engine runs it on one EP rank: the activation global scale of w13 / w2 is reduced over the experts the
    rank holds (the smallest multiplier), which is what FlashInfer backends do without EPLB."""
    config, family, num_experts = _model(root)
    spec = family.routing(family.text_config(config))
    experts = list(range(num_experts)) if experts is None else experts
    with CheckpointReader(root) as reader:
        router, bias = _router(reader, module)
        w13, w2, muls = _layer_experts(reader, module, experts, num_experts)
    weights, ids = route(hidden @ router.T, spec, bias)
    mask = torch.zeros(num_experts, dtype=torch.bool)
    mask[experts] = True
    act = None
    if muls:
        mul13 = min(min(float(m[0]), float(m[1])) for m in muls.values())
        mul2 = min(float(m[2]) for m in muls.values())
        act = (torch.full((num_experts,), 1 / mul13, dtype=torch.float64),
               torch.full((num_experts,), 1 / mul2, dtype=torch.float64))
    return moe_reference(hidden, weights, ids, w13, w2, spec, mask, activation_global_div=act)


def hidden_states(src: Path, layer: int) -> torch.Tensor:
    config, family, _ = _model(src)
    hidden_size = int(family.text_config(config)["hidden_size"])
    return torch.randn(TOKENS, hidden_size, generator=torch.Generator().manual_seed(layer))


@functools.lru_cache(maxsize=64)
def unsharded_output(src: Path, module: str, layer: int) -> torch.Tensor:
    return moe_output(src, module, layer, hidden_states(src, layer), None)


def assert_ranks_sum_to_unsharded(src: Path, dst: Path, ep: int) -> None:
    _, _, num_experts = _model(src)
    with CheckpointReader(src) as reader:
        inventory = scan_experts(reader.names(), num_experts)
    for layer, module in inventory.modules.items():
        full = unsharded_output(src, module, layer)
        total = torch.zeros_like(full)
        for rank in range(ep):
            rank_dir = dst / rank_dir_name(rank)
            local = json.loads((rank_dir / EXPERT_MAP).read_text())["layers"][str(layer)]
            experts = [g for g, lid in enumerate(local) if lid >= 0]
            total += moe_output(rank_dir, module, layer, hidden_states(src, layer), experts)
        torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("family", "ep", "placement"), _cases())
def test_rank_outputs_sum_to_unsharded(sharded, family: str, ep: int, placement: str) -> None:
    src, dst = sharded(family, ep, placement)
    assert_ranks_sum_to_unsharded(src, dst, ep)


# ---- EP-invariant activation scales (W4A4) --------------------------------------------------------------------


def with_input_scales(src: Path, dst: Path) -> Path:
    """A copy of ``src`` whose every Linear carries a compressed-tensors input_global_scale, different per expert
    and per projection, and one uncalibrated expert (multiplier inf, from amax 0) per layer."""
    from safetensors.torch import save_file

    dst.mkdir()
    with CheckpointReader(src) as reader:
        tensors = {n: reader.read(n).clone() for n in reader.names()}
    generator = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        module = name.removesuffix(".weight_packed")
        amax = 1.0 + 9.0 * torch.rand(1, generator=generator)
        if ".experts.3." in module:
            amax = torch.zeros(1)
        tensors[f"{module}.input_global_scale"] = (448 * 6 / amax).to(torch.float32)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_bytes((src / "config.json").read_bytes())
    return dst


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_activation_scales_are_ep_invariant(quantized, tmp_path, family: str) -> None:
    src = with_input_scales(quantized(family), tmp_path / "w4a4")
    _, _, num_experts = _model(src)
    with CheckpointReader(src) as reader:
        inventory = scan_experts(reader.names(), num_experts)
        source_scales = {n: float(reader.read(n, check_finite=False)) for n in inventory.experts
                         if n.endswith(".input_global_scale")}
    for ep in (2, 4):
        dst = run_shard(src, tmp_path / f"ep{ep}", ep, "round-robin")
        summary = json.loads((dst / MANIFEST).read_text())["input_scales"]
        for layer, module in inventory.modules.items():
            for proj, projs in (("w13", ("gate_proj", "up_proj")), ("w2", ("down_proj",))):
                finite = [v for n, v in source_scales.items() if n.startswith(module + ".")
                          and n.split(".")[-2] in projs and v != float("inf")]
                if not finite:  # GLM's MTP layer stays bf16: no activation scales
                    assert str(layer) not in summary
                    continue
                expected = min(finite)
                assert summary[str(layer)][proj] == {"input_global_scale": expected}
                for rank in range(ep):
                    with CheckpointReader(dst / rank_dir_name(rank)) as reader:
                        for n in reader.names():
                            if n.startswith(module + ".") and n.split(".")[-2] in projs and "input_global" in n:
                                assert float(reader.read(n)) == expected
        assert_ranks_sum_to_unsharded(src, dst, ep)  # every rank computes what EP=1 computes
    # The source itself is not EP-invariant: a rank reducing over its local experts uses another scale.
    with pytest.raises(AssertionError):
        assert_ranks_sum_to_unsharded(src, run_shard_unified_off(src, tmp_path / "raw"), 2)


def run_shard_unified_off(src: Path, out: Path) -> Path:
    """Shard with the source's per-expert scales kept (what engines see without fp4kit): for the test's teeth."""
    import fp4kit.ep.shard as shard_module

    original = shard_module.unify_input_scales
    shard_module.unify_input_scales = lambda reader, inventory: ({}, {}, 0)
    try:
        return run_shard(src, out, 2, "linear")
    finally:
        shard_module.unify_input_scales = original


# ---- bad input, atomicity, CLI ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ep", "placement", "stats", "message"),
    [
        (0, "linear", None, "at least 1"),
        (9, "linear", None, "exceeds the model's 8 experts"),
        (2, "balanced", None, "needs routing statistics: --stats ROUTING_STATS.json, or the fp4kit_routing_stats"),
        (2, "balanced", "other", "model_type"),
        (2, "zigzag", None, "unknown placement"),
    ],
)
def test_bad_input_is_refused(quantized, tmp_path, ep: int, placement: str, stats: str | None, message: str) -> None:
    stats_path = None
    if stats:
        stats_path = tmp_path / "stats.json"
        stats_path.write_text(json.dumps({"model_type": "llama4", "num_experts": 8, "layers": {}}))
    with pytest.raises(Fp4kitError, match=message):
        shard_checkpoint(quantized("qwen3_moe"), tmp_path / "out",
                         ShardOptions(ep=ep, placement=placement, stats=stats_path))
    assert not (tmp_path / "out").exists()


def _fake_layout(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for path in src.iterdir():
        os.link(path, dst / path.name)
    (dst / "fp4kit_layout.json").write_text(json.dumps({"backend": "trtllm"}))
    return dst


def test_layout_input_needs_equal_local_counts(quantized, tmp_path) -> None:
    layout = _fake_layout(quantized("qwen3_moe"), tmp_path / "layout")
    with pytest.raises(Fp4kitError, match="E = 8 must be divisible by ep = 3"):
        shard_checkpoint(layout, tmp_path / "out", ShardOptions(ep=3))
    with pytest.raises(Fp4kitError, match="not supported yet"):
        shard_checkpoint(layout, tmp_path / "out", ShardOptions(ep=4))


def test_interrupted_run_leaves_nothing_and_rerun_finishes(quantized, tmp_path, monkeypatch) -> None:
    import fp4kit.ep.copy as shard_copy
    from fp4kit.io.output import leftovers, partial_prefix

    src, dst = quantized("glm4_moe"), tmp_path / "out"
    original, calls = shard_copy.ShardCopier.fill, []

    def dying_fill(self, job):
        calls.append(job.path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        original(self, job)

    monkeypatch.setattr(shard_copy.ShardCopier, "fill", dying_fill)
    with pytest.raises(KeyboardInterrupt):
        shard_checkpoint(src, dst, ShardOptions(ep=2))
    assert not dst.exists() and not leftovers(dst)
    monkeypatch.undo()
    (dst.parent / f"{partial_prefix(dst)}-4242-dead" / rank_dir_name(0)).mkdir(parents=True)  # a killed run's
    shard_checkpoint(src, dst, ShardOptions(ep=2))
    assert not leftovers(dst)
    assert sorted(p.name for p in dst.iterdir()) == [SHARED_DIR, MANIFEST, rank_dir_name(0), rank_dir_name(1)]


@pytest.mark.parametrize(
    ("case", "args", "message"),
    [
        ("model", ["--ep", "16"], "--ep 16 exceeds the model's 8 experts"),
        ("model", ["--ep", "0"], "at least 1"),
        ("model", ["--ep", "2", "--placement", "balanced", "--stats", "{stats}"], "model_type"),
        ("layout", ["--ep", "3"], "E = 8 must be divisible by ep = 3"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(quantized, tmp_path, monkeypatch, capsys, case: str, args: list[str],
                                          message: str) -> None:
    from fp4kit.cli import main

    src = quantized("qwen3_moe")
    if case == "layout":
        src = _fake_layout(src, tmp_path / "layout")
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"model_type": "llama4", "num_experts": 8, "layers": {}}))
    argv = [a.format(stats=stats) for a in args]
    monkeypatch.setattr("sys.argv", ["fp4kit", "shard", str(src), str(tmp_path / "o"), *argv])
    with pytest.raises(SystemExit) as exit_info:
        main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("direct", [True, False])
def test_many_blocks_direct_or_buffered(quantized, tmp_path, monkeypatch, direct: bool) -> None:
    """Files written in many small blocks (the real block is larger than the tiny fixtures' files), with more
    blocks than buffers, through O_DIRECT and through the page cache: same bytes and checksums."""
    import fp4kit.ep.copy as shard_copy

    monkeypatch.setattr(shard_copy, "_BLOCK", 4096)
    monkeypatch.setattr(shard_copy, "_IN_FLIGHT", 2)
    if not direct:
        monkeypatch.setattr(shard_copy, "_DIRECT", 0)
    src = quantized("glm4_moe")
    dst = run_shard(src, tmp_path / "out", 2, "linear")
    source = tensor_bytes(src)
    for rank in range(2):
        rank_dir = dst / rank_dir_name(rank)
        assert all(source[name] == data for name, data in tensor_bytes(rank_dir).items())
        files = json.loads((rank_dir / MANIFEST).read_text())["files"]
        for rel, entry in files.items():
            data = (rank_dir / rel).read_bytes()
            assert hashlib.sha256(data).hexdigest() == entry["sha256"] and len(data) == entry["bytes"], rel
        assert max(e["bytes"] for e in files.values()) > 10 * 4096


def test_cli_shards(quantized, tmp_path, monkeypatch, capsys) -> None:
    from fp4kit.cli import main

    src = quantized("glm4_moe")
    stats = skewed_stats(src, tmp_path / "stats.json")
    argv = ["fp4kit", "shard", str(src), str(tmp_path / "o"), "--ep", "4", "--placement", "balanced", "--stats",
            str(stats)]
    monkeypatch.setattr("sys.argv", argv)
    main()
    out = capsys.readouterr().out
    assert "over 4 ranks (balanced" in out and "max/mean tokens per rank: linear" in out
    assert (tmp_path / "o" / rank_dir_name(3) / EXPERT_MAP).is_file()


def test_balanced_placement_from_glm_calibration_stats(tiny, tmp_path, monkeypatch, capsys) -> None:
    """A calibrated GLM-4.5 checkpoint's own routing statistics cover its decoder layers, not its MTP layer (which
    has experts but no forward reaches it); balanced placement with them must still shard every MoE layer."""
    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint
    from fp4kit.quantize.input_scales import ROUTING_STATS_NAME

    src = tmp_path / "w4a4"
    quantize_checkpoint(tiny("glm4_moe"), src, QuantizeOptions(scheme="nvfp4", samples=4, seq_len=16))
    stats = json.loads((src / ROUTING_STATS_NAME).read_text())
    config, family, num_experts = _model(src)
    mtp_layer = str(family.text_config(config)["num_hidden_layers"])
    assert mtp_layer not in stats["layers"]
    report = shard_checkpoint(src, tmp_path / "ep2", ShardOptions(ep=2, placement="balanced",
                                                                   stats=src / ROUTING_STATS_NAME))
    expert_map = json.loads((tmp_path / "ep2" / rank_dir_name(0) / EXPERT_MAP).read_text())
    assert mtp_layer in expert_map["layers"], "the MTP layer's experts were placed"
    assert report.moe_layers == len(stats["layers"]) + 1

    # without --stats, balanced placement uses the statistics in SRC, and says so
    from fp4kit.cli import main

    monkeypatch.setattr("sys.argv", ["fp4kit", "shard", str(src), str(tmp_path / "found"), "--ep", "2",
                                     "--placement", "balanced"])
    main()
    captured = capsys.readouterr()
    assert f"routing statistics: {src / ROUTING_STATS_NAME} (found in SRC" in captured.out
    assert "warning" not in captured.err
    found = json.loads((tmp_path / "found" / rank_dir_name(0) / EXPERT_MAP).read_text())
    assert found == expert_map


def test_uneven_split_warns_and_succeeds(quantized, tmp_path, monkeypatch, capsys) -> None:
    """8 experts over 3 ranks (3/3/2) shards and loads in vLLM's Triton and Marlin MoE, not in the kernels that
    hold E / ep experts per rank: one warning line on stderr (also with -q), exit 0."""
    from fp4kit.cli import main

    for extra in ([], ["-q"]):
        out = tmp_path / f"ep3{''.join(extra)}"
        monkeypatch.setattr("sys.argv", ["fp4kit", "shard", str(quantized("qwen3_moe")), str(out), "--ep", "3",
                                         *extra])
        main()  # no SystemExit: exit 0
        err = capsys.readouterr().err
        assert [line for line in err.splitlines() if not line.startswith("shard: sharding (")] == [
            "warning: 8 experts over 3 ranks is uneven (3/3/2 per rank): vLLM's Triton and Marlin MoE run it, "
            "TRT-LLM-gen and FlashInfer CUTLASS MoE need E % ep == 0 (an EP size dividing 8)"], err
        assert [json.loads((out / rank_dir_name(r) / EXPERT_MAP).read_text())["layers"]["0"].count(-1)
                for r in range(3)] == [5, 5, 6]
    assert shard_checkpoint(quantized("qwen3_moe"), tmp_path / "ep2", ShardOptions(ep=2)).warnings == []
