"""The compressed-tensors dialect's config (fp4kit/formats/compressed_tensors.py): the packaged snapshot is what
compressed-tensors' own classes build, and it is used only under the version it was taken with."""

from __future__ import annotations

import json

import pytest

from fp4kit.formats import compressed_tensors as ct

IGNORES = [[], ["lm_head"], ["lm_head", "model.layers.0.mlp.gate", "re:.*mlp.gate$"]]


@pytest.mark.pinned
def test_snapshot_is_what_the_installed_classes_build(tmp_path):
    packaged = json.loads(ct.write_config_snapshot(tmp_path / "fresh.json").read_text())
    assert ct._config_snapshot() == packaged, (
        "fp4kit/data/compressed_tensors_config.json is stale: run "
        "python -c 'from fp4kit.formats.compressed_tensors import write_config_snapshot; write_config_snapshot()'")


@pytest.mark.pinned
@pytest.mark.parametrize("scheme", sorted(ct.SCHEMES))
@pytest.mark.parametrize("ignore", IGNORES)
def test_config_is_byte_for_byte_the_classes_config(scheme, ignore):
    assert ct._config_snapshot()["compressed_tensors"] == ct._installed_version()  # the snapshot is in use
    fast = ct.quantization_config(scheme, ignore)
    assert json.dumps(fast, indent=2) == json.dumps(ct.build_quantization_config(scheme, ignore), indent=2)
    fast["ignore"].append("x")
    assert "x" not in ct.quantization_config(scheme, ignore)["ignore"]  # callers get their own copy


def test_another_installed_version_builds_with_the_classes(monkeypatch):
    built = []
    monkeypatch.setattr(ct, "_installed_version", lambda: "0.0.1")
    monkeypatch.setattr(ct, "build_quantization_config", lambda scheme, ignore: built.append(scheme) or {})
    ct.quantization_config("nvfp4", ["lm_head"])
    assert built == ["nvfp4"]
