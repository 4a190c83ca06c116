from __future__ import annotations

import os
from pathlib import Path

import pytest


def pytest_configure(config):
    """Under pytest-xdist (`-n auto`) each worker gets its share of the cores for torch's thread pool: a worker per
    core with torch's default of one thread per core would oversubscribe every core."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        import torch

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // workers))


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """tiny(name) -> path of a bf16 fixture checkpoint of that family, built once per session."""
    from fp4kit.testing.fixtures import build_fixture

    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_fixture(name, tmp_path_factory.mktemp(f"bf16-{name}"))
        return built[name]

    return get


@pytest.fixture(scope="session")
def tiny_nvfp4a16(tiny, tmp_path_factory):
    """tiny_nvfp4a16(name) -> path of that fixture quantized by fp4kit (compressed-tensors, NVFP4A16)."""
    from fp4kit.quantize.checkpoint import quantize_checkpoint

    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:  # cached only once quantized: a failure fails every test that asks again
            out = tmp_path_factory.mktemp(f"nvfp4a16-{name}") / "out"
            quantize_checkpoint(tiny(name), out)
            built[name] = out
        return built[name]

    return get


@pytest.fixture(scope="session")
def square_moe(tmp_path_factory) -> dict[str, Path]:
    """A Qwen3-MoE with H = I = 128: bf16, NVFP4A16, W4A4, and the layouts and EP split of the W4A4 one."""
    from helpers import SQUARE, add_input_scales

    from fp4kit.ep.shard import ShardOptions, shard_checkpoint
    from fp4kit.layouts.directory import LayoutOptions, layout_checkpoint
    from fp4kit.quantize.checkpoint import quantize_checkpoint
    from fp4kit.testing.fixtures import build_fixture

    root = tmp_path_factory.mktemp("verify-square")
    paths = {"bf16": build_fixture("qwen3_moe", root / "bf16", overrides=SQUARE)}
    quantize_checkpoint(paths["bf16"], root / "nvfp4a16")
    paths["nvfp4a16"] = root / "nvfp4a16"
    paths["nvfp4"] = add_input_scales(paths["nvfp4a16"], root / "nvfp4")
    for backend in ("trtllm", "cutlass"):
        layout_checkpoint(paths["nvfp4"], root / backend, LayoutOptions(backend=backend))
        paths[backend] = root / backend
    layout_checkpoint(paths["nvfp4a16"], root / "marlin", LayoutOptions(backend="marlin"))
    paths["marlin"] = root / "marlin"
    shard_checkpoint(paths["nvfp4"], root / "ep4", ShardOptions(ep=4))
    paths["ep4"] = root / "ep4"
    return paths


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors: torch's thread pool costs more than it saves, badly so on a busy 2-core runner. Modules opt in
    with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With FP4KIT_REQUIRE_ORACLES=1 (CI) an oracle library that fails to import fails its tests instead of skipping
    them: a green run must not hide a comparison that never ran. (Without it they skip with the reason.)"""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("FP4KIT_REQUIRE_ORACLES") and report.skipped and "could not import" in str(report.longrepr):
        report.outcome = "failed"
        report.longrepr = f"CI: an oracle did not import, so its test did not run: {report.longrepr}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("FP4KIT_REQUIRE_ORACLES") and report.skipped and "could not import" in str(report.longrepr):
        report.outcome = "failed"
        report.longrepr = f"CI: an oracle did not import, so this module did not run: {report.longrepr}"
