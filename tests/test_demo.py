"""`fp4kit demo --family NAME --keep DIR`: every family's demo model is accepted by every layout backend (the tiny
test fixtures are not: their I is 16 or 32), and a demo run keeps what it made."""

from __future__ import annotations

import json

import pytest

from fp4kit.layouts.directory import LayoutOptions, layout_checkpoint
from fp4kit.pipeline.demo import DEMO_FAMILIES, build_demo_model
from fp4kit.quantize import QuantizeOptions, quantize_checkpoint
from fp4kit.testing.fixtures import FIXTURES, fixture_spec, streams_layers


def test_every_family_but_the_text_only_variants_has_a_demo() -> None:
    """The demo calibrates W4A4: every family whose decoder layers fp4kit streams."""
    streamed = {f for f in FIXTURES if streams_layers(f)}
    assert set(DEMO_FAMILIES) == streamed - {"llama4_text", "qwen3_5_moe_text"}


@pytest.mark.parametrize("family", DEMO_FAMILIES)
def test_demo_model_meets_every_backend_and_the_fixture_is_unchanged(family: str, tmp_path) -> None:
    src = build_demo_model(family, tmp_path / "bf16")
    config = json.loads((src / "config.json").read_text())
    if "vision_config" in config and "out_hidden_size" in config["vision_config"]:  # projects into the text stream
        assert config["vision_config"]["out_hidden_size"] == config["text_config"]["hidden_size"]
    quantized = tmp_path / "nvfp4"  # W4A4: TRT-LLM-gen and CUTLASS run it, Marlin its weights
    quantize_checkpoint(src, quantized, QuantizeOptions(scheme="nvfp4", samples=2, seq_len=16))
    for backend in ("trtllm", "cutlass", "marlin"):  # each checks its kernel's shape rules first
        layout_checkpoint(quantized, tmp_path / backend, LayoutOptions(backend=backend))
    spec = fixture_spec(family)["config"]
    assert spec.get("text_config", spec)["hidden_size"] == 64  # the test fixtures keep their own sizes


def test_demo_keeps_every_output(monkeypatch, capsys, tmp_path) -> None:
    from fp4kit import cli

    keep = tmp_path / "kept"
    monkeypatch.setattr("sys.argv", ["fp4kit", "demo", "--family", "glm4_moe", "--keep", str(keep)])
    cli.main()  # exit 0: no SystemExit
    out = capsys.readouterr().out
    assert "## verify: PASS" in out and f"outputs: {keep / 'run'}" in out
    assert (keep / "demo-glm4_moe-bf16" / "config.json").is_file()
    for step in ("quantize", "layout", "shard", "verify"):
        assert (keep / "run" / step).is_dir(), step
    summary = json.loads((keep / "run" / "summary.json").read_text())
    assert summary["family"] == "glm4_moe" and summary["passed"] is True


def test_unknown_family_is_a_usage_error(monkeypatch, capsys) -> None:
    from fp4kit import cli

    cli._register_commands()
    assert cli.run(["demo", "--family", "mixtral"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: fp4kit demo: ") and "mixtral" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("family", DEMO_FAMILIES)
def test_the_cli_offers_every_family_the_demo_builds(family, monkeypatch, capsys) -> None:
    """`fp4kit demo --family` takes exactly the families pipeline.demo has a model of (its choices derive from them)."""
    from fp4kit import cli

    called = []
    monkeypatch.setattr("fp4kit.pipeline.demo.run_demo", lambda keep, device, name: called.append(name) or ["ok"])
    cli._register_commands()
    assert cli.run(["demo", "--family", family]) == 0, capsys.readouterr().err
    assert called == [family]
