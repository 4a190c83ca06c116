"""`fp4kit quantize` on tiny fixtures of every family: roles, fused scales, config, compressed-tensors reading it."""

import json

import pytest
import torch

from fp4kit.io.checkpoint import CheckpointReader
from fp4kit.testing.fixtures import FIXTURES

FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def global_scales(reader: CheckpointReader) -> dict[str, torch.Tensor]:
    suffix = ".weight_global_scale"
    return {n[: -len(suffix)]: reader.read(n) for n in reader.names() if n.endswith(suffix)}


@pytest.mark.parametrize("family", FIXTURES)
def test_fused_groups_share_global_scale(family, tiny_nvfp4a16):
    from fp4kit.families import detect

    grammar = detect(json.loads((tiny_nvfp4a16(family) / "config.json").read_text())).grammar
    scales = global_scales(CheckpointReader(tiny_nvfp4a16(family)))
    groups_seen = 0
    for module, scale in scales.items():
        parent, leaf = module.rsplit(".", 1)
        for group in (*FUSED, grammar.w13):  # MiniMax's experts: w1 / w3
            if leaf == group[0]:
                members = [scales[f"{parent}.{m}"] for m in group]
                assert all(torch.equal(m, scale) for m in members), module
                groups_seen += 1
    assert groups_seen >= 4


@pytest.mark.parametrize("family", FIXTURES)
def test_compressed_tensors_decompresses_within_error_band(family, tiny, tiny_nvfp4a16):
    """compressed-tensors' own ModelCompressor config + NVFP4 compressor read fp4kit's output back."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig

    out = tiny_nvfp4a16(family)
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    compressor = ModelCompressor(quantization_config=QuantizationConfig.model_validate(qconfig))
    scheme = compressor.quantization_config.config_groups["group_0"]
    source, quantized = CheckpointReader(tiny(family)), CheckpointReader(out)
    from fp4kit.quantize.plan import build_plan, read_group_weights

    plan = build_plan(source, json.loads((tiny(family) / "config.json").read_text()))
    worst = 0.0
    for group in plan.groups:
        for cand, ref in zip(group.members, read_group_weights(source, group), strict=True):
            m = cand.linear.module
            local = {k: quantized.read(f"{m}.{k}") for k in ("weight_packed", "weight_scale", "weight_global_scale")}
            dense = NVFP4PackedCompressor.decompress(local, scheme)["weight"].float()
            rel = ((dense - ref.float()).norm() / ref.float().norm()).item()
            worst = max(worst, rel)
    print(f"{family}: worst relative weight error {worst:.4f}")
    assert compressor.quantization_config.format == "nvfp4-pack-quantized"
    assert 0.03 < worst < 0.15


def test_default_roles(tiny, tiny_nvfp4a16):
    glm = CheckpointReader(tiny_nvfp4a16("glm4_moe"))
    assert glm.info("model.layers.1.mlp.gate.weight").dtype == torch.float32
    assert glm.info("model.layers.1.mlp.gate.e_score_correction_bias").dtype == torch.float32
    assert "model.layers.0.mlp.gate_proj.weight_packed" in glm  # dense layer quantized
    assert "model.layers.1.mlp.shared_experts.up_proj.weight_packed" in glm
    assert glm.info("model.layers.3.mlp.experts.0.up_proj.weight").dtype == torch.bfloat16  # MTP layer kept
    assert glm.info("model.layers.3.eh_proj.weight").dtype == torch.bfloat16
    assert glm.info("lm_head.weight").dtype == torch.bfloat16

    llama = CheckpointReader(tiny_nvfp4a16("llama4"))
    assert "language_model.model.layers.0.feed_forward.experts.3.down_proj.weight_packed" in llama
    assert "language_model.model.layers.0.feed_forward.experts.gate_up_proj" not in llama
    assert llama.info("language_model.model.layers.0.feed_forward.router.weight").dtype == torch.bfloat16
    assert not [n for n in llama.names() if n.startswith(("vision_model", "multi_modal")) and "packed" in n]

    vl = CheckpointReader(tiny_nvfp4a16("qwen3_vl_moe"))
    assert "model.language_model.layers.1.mlp.experts.7.gate_proj.weight_packed" in vl
    assert not [n for n in vl.names() if n.startswith("model.visual") and "packed" in n]
    config = json.loads((tiny_nvfp4a16("qwen3_vl_moe") / "config.json").read_text())
    assert "model.language_model.layers.0.mlp.gate" in config["quantization_config"]["ignore"]


def test_fused_expert_split_matches_source(tiny, tiny_nvfp4a16):
    """Per-expert gate/up/down written for Qwen3-VL's [E, H, 2I] tensor are the right slices, transposed."""
    from fp4kit.formats import compressed_tensors as ct

    src, out = CheckpointReader(tiny("qwen3_vl_moe")), CheckpointReader(tiny_nvfp4a16("qwen3_vl_moe"))
    prefix = "model.language_model.layers.1.mlp.experts"
    # transformers 5.17 saves this model's experts as [E, 2I, H] and [E, H, I] (HF's own checkpoints: transposed).
    gate_up = src.read(f"{prefix}.gate_up_proj").float()
    down = src.read(f"{prefix}.down_proj").float()
    inter = gate_up.shape[1] // 2
    for e, proj, ref in ((2, "gate_proj", gate_up[2, :inter]), (5, "up_proj", gate_up[5, inter:]),
                         (7, "down_proj", down[7])):
        m = f"{prefix}.{e}.{proj}"
        names = [f"{m}.{s}" for s in ("weight_packed", "weight_scale", "weight_global_scale")]
        weight, _ = ct.decode(m, {n: out.read(n) for n in names})
        assert ((weight.dequantize() - ref).norm() / ref.norm()).item() < 0.15


def test_targets_and_ignore(tiny, tmp_path):
    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint

    out = tmp_path / "experts-only"
    quantize_checkpoint(tiny("qwen3_moe"), out, QuantizeOptions(targets=[r"experts\."], ignore=[r"layers\.1\."]))
    reader = CheckpointReader(out)
    packed = [n for n in reader.names() if n.endswith("weight_packed")]
    assert packed and all(".experts." in n and ".layers.0." in n for n in packed)
    assert reader.info("model.layers.0.self_attn.q_proj.weight").dtype == torch.bfloat16


def test_side_files_and_sharding(tiny, tmp_path):
    import shutil

    from fp4kit.quantize import QuantizeOptions, quantize_checkpoint

    src = tmp_path / "src"  # a copy: the session fixture is shared with other tests
    shutil.copytree(tiny("qwen3_moe"), src)
    (src / "tokenizer.json").write_text("{}")
    (src / "chat_template.jinja").write_text("{{ messages }}")
    out = tmp_path / "sharded"
    report = quantize_checkpoint(src, out, QuantizeOptions(max_shard_bytes=40_000))
    assert len(report.output_files) > 3
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(report.output_files)
    assert (out / "tokenizer.json").exists() and (out / "chat_template.jinja").exists()
    assert (out / "generation_config.json").exists()
    reread = CheckpointReader(out)
    assert len(reread.names()) == len(index["weight_map"])


# what a Hub model repository holds besides its weights: the files engines and the Hub use, and a model author's
# own files that are not the model's (the trained reference model's directory holds the last three)
MODEL_FILES = {"tokenizer.json": "{}", "tokenizer_config.json": "{}", "special_tokens_map.json": "{}",
               "tiktoken.model": "x", "chat_template.jinja": "{{ messages }}",
               "additional_chat_templates/tool_use.jinja": "{{ tools }}", "preprocessor_config.json": "{}",
               "configuration_moe.py": "# remote code", "modeling_moe.py": "# remote code", "LICENSE": "terms",
               "USE_POLICY.md": "policy"}
NOT_THE_MODELS = {"calib.jsonl": "{}", "eval.jsonl": "{}", "TRAINING.json": "{}", "notes/run.log": "x",
                  "figure.png": "x", "original/params.json": "{}", ".gitattributes": "x"}


def test_outputs_copy_the_model_files_of_src_and_nothing_else(tmp_path, capsys):
    """quantize, layout and shard (every EP rank) carry SRC's tokenizer, templates, processor config, remote code
    and licence, not the data, logs and notes beside them."""
    from fp4kit import cli
    from fp4kit.testing.fixtures import build_fixture

    marlin_sizes = {"hidden_size": 128, "moe_intermediate_size": 64}  # H % 128, I % 64
    src = build_fixture("qwen3_moe", tmp_path / "src", overrides=marlin_sizes)
    for rel, text in {**MODEL_FILES, **NOT_THE_MODELS}.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    cli._register_commands()
    assert cli.run(["quantize", str(src), str(tmp_path / "q"), "-q"]) == 0
    assert cli.run(["layout", str(tmp_path / "q"), str(tmp_path / "l"), "--backend", "marlin", "-q"]) == 0
    assert cli.run(["shard", str(tmp_path / "q"), str(tmp_path / "s"), "--ep", "2", "-q"]) == 0
    assert capsys.readouterr().err == ""
    for out in [tmp_path / "q", tmp_path / "l", tmp_path / "s" / "rank-00000", tmp_path / "s" / "rank-00001"]:
        files = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
        assert {rel: (out / rel).read_text() for rel in MODEL_FILES} == MODEL_FILES, out
        assert not files & set(NOT_THE_MODELS) and "generation_config.json" in files, (out, sorted(files))
        assert not any(rel.startswith(("notes", "original")) for rel in files), sorted(files)


@pytest.mark.parametrize("family", ["qwen3_moe", "llama4"])
def test_stacked_quantization_writes_the_same_bytes(family, tiny, tiny_nvfp4a16, tmp_path, monkeypatch):
    """The GPU path stacks consecutive same-shape groups into one quantize call; forced on the CPU it must write
    exactly what group-by-group quantization writes."""
    from fp4kit.quantize import checkpoint as q

    monkeypatch.setitem(q.STACK_BYTES, "cpu", 1 << 30)
    stacked_sizes: list[int] = []
    real_stacked = q.quantize_stacked

    def record(stack, *args):
        stacked_sizes.append(stack.shape[0])
        return real_stacked(stack, *args)

    monkeypatch.setattr(q, "quantize_stacked", record)
    out = tmp_path / "stacked"
    q.quantize_checkpoint(tiny(family), out)
    assert max(stacked_sizes) > 2  # experts were stacked, not quantized one by one
    reference = tiny_nvfp4a16(family)
    files = sorted(p.name for p in reference.iterdir())
    assert files == sorted(p.name for p in out.iterdir())
    for name in files:
        assert (reference / name).read_bytes() == (out / name).read_bytes(), name


@pytest.mark.parametrize("workers", [1, 5])
def test_the_cpu_worker_pool_writes_the_same_bytes(workers, tiny, tiny_nvfp4a16, tmp_path, monkeypatch):
    """On the CPU whole jobs run on a pool of threads (one thread: the reader thread alone); any number of them
    writes exactly the reference output."""
    from fp4kit.quantize import checkpoint as q

    monkeypatch.setattr(q, "cpu_workers", lambda: workers)
    out = tmp_path / "pool"
    q.quantize_checkpoint(tiny("qwen3_moe"), out)
    reference = tiny_nvfp4a16("qwen3_moe")
    files = sorted(p.name for p in reference.iterdir())
    assert files == sorted(p.name for p in out.iterdir())
    for name in files:
        assert (reference / name).read_bytes() == (out / name).read_bytes(), name


def test_the_output_records_how_it_was_made(tiny, tmp_path, capsys, monkeypatch):
    """fp4kit_provenance.json and the model card, read back: version, scheme, method, the calibration file's hash
    and the windows used, the command; the card's front matter (base_model from config.json's _name_or_path) and
    its module groups; convert leaves the record out (another dialect), modelopt's files name fp4kit as producer."""
    import hashlib
    import shutil

    import yaml

    from fp4kit import __version__, cli

    src = tmp_path / "src"
    shutil.copytree(tiny("qwen3_moe"), src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "_name_or_path": "acme/Tiny-MoE"}))
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"input_ids": [(3 * i + s) % 256 for i in range(64)]}) + "\n"
                             for s in range(6)))
    dst = tmp_path / "Tiny-MoE-NVFP4"
    argv = ["quantize", str(src), str(dst), "--scheme", "nvfp4", "--format", "modelopt", "--calib", str(calib),
            "--samples", "4", "--seq-len", "64", "--method", "mse", "-q"]
    cli._register_commands()
    # the record is of the command line run() was given, not of the process's (a runner or a pipeline calling it)
    monkeypatch.setattr("sys.argv", ["runner.py", "--run", "plan.json"])
    assert cli.run(argv) == 0, capsys.readouterr().err

    record = json.loads((dst / "fp4kit_provenance.json").read_text())
    assert record["producer"] == {"name": "fp4kit", "version": __version__}
    assert (record["base_model"], record["scheme"], record["dialect"], record["method"]) == (
        "acme/Tiny-MoE", "nvfp4", "modelopt", "mse")
    assert record["calibration"] == {
        "data": str(calib), "samples": 4, "seq_len": 64, "tokens": 256,
        "file_sha256": hashlib.sha256(calib.read_bytes()).hexdigest(),
        "token_ids_sha256": record["calibration"]["token_ids_sha256"],
        "dtype": record["calibration"]["dtype"]}
    assert record["calibration"]["dtype"] in ("bfloat16", "float32")  # --dtype auto: the hardware's choice
    assert record["options"]["samples"] == 4 and "device" not in record["options"]
    assert record["command"] == " ".join(["fp4kit", "quantize", "SRC", "DST", *argv[3:]])

    card = (dst / "README.md").read_text()
    front, body = card.removeprefix("---\n").split("\n---\n", 1)
    meta = yaml.safe_load(front)
    assert meta["base_model"] == "acme/Tiny-MoE" and {"fp4kit", "nvfp4", "modelopt"} <= set(meta["tags"])
    assert "| `model.layers.*.mlp.experts.*.gate_proj` | 16 | NVFP4 |" in body
    assert "| `lm_head` | 1 | kept (source precision) |" in body
    assert "| method | `mse` |" in body and f"4 samples x 64 tokens = 256 tokens of `{calib}`" in body
    assert record["command"] in body and "vllm serve DST --quantization modelopt_fp4" in body
    for name in ("hf_quant_config.json", "config.json"):
        document = json.loads((dst / name).read_text())
        producer = document["producer"] if name != "config.json" else document["quantization_config"]["producer"]
        assert producer["name"] == "fp4kit"

    assert cli.run(["convert", str(dst), str(tmp_path / "ct"), "--to", "compressed-tensors", "-q"]) == 0
    assert not (tmp_path / "ct" / "fp4kit_provenance.json").exists()


def test_base_model_of_a_hub_cache_snapshot(tmp_path):
    from fp4kit.quantize.provenance import base_model

    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3-30B-A3B" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    assert base_model(snapshot, {"_name_or_path": "/data/ckpt"}) == "Qwen/Qwen3-30B-A3B"
    assert base_model(tmp_path, {"_name_or_path": "/data/ckpt"}) == tmp_path.name
