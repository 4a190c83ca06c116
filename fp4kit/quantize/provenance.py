"""How a checkpoint was made, in the checkpoint: ``fp4kit_provenance.json`` (fp4kit's version, the options, the
calibration data and its hashes, the command) and a model card ``README.md`` (Hugging Face front matter with
``base_model``, the precision of each module group, the method and data, the command, how to serve it).

Both are written by `fp4kit quantize`; layout and shard carry the record along (same weights), convert leaves it
out (another dialect: the record would no longer describe the directory). No timestamps or host names: the same
command on the same input writes the same bytes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections import Counter
from pathlib import Path

import torch

from fp4kit.quantize.plan import ModelPlan

PROVENANCE_NAME = "fp4kit_provenance.json"
CARD_NAME = "README.md"
FORMAT = "fp4kit.provenance/1"
SCHEME_TITLES = {"nvfp4": "NVFP4 W4A4 (weights and activations FP4)", "nvfp4a16": "NVFP4A16 (FP4 weights, BF16 "
                 "activations)"}
# options that change where and how fast the work runs, not the bytes; and --dtype, whose choice (auto) the
# calibration record replaces by the dtype the forward ran in
NOT_RECORDED = ("device", "native_cpu", "overwrite", "command", "dtype")
# options recorded only when given, so that a run without them records what it did before they existed
RECORDED_WHEN_SET = ("scheme_for", "source_config", "kv_cache")
# a module group's precision in the model card, by its --scheme-for scheme (NVFP4 otherwise)
PRECISIONS = {"fp8-dynamic": "FP8 (per-channel weights, dynamic per-token activations)",
              "fp8-block": "FP8 (128x128 weight blocks, dynamic activations)",
              "fp8-static": "FP8 (per-tensor weights, static input scale)"}
SERVE = ["vllm serve DST", "python -m sglang.launch_server --model-path DST"]  # docs/serving.md
# quantize --source-config (docs/serving.md, DeepSeek-V4): vLLM picks its DeepSeek-V4 FP8 config from config.json; the
# experts have no calibrated input scales, so they take per-token dynamic ones
SOURCE_CONFIG_SERVE = ["vllm serve DST --quantization-config '{\"moe\": {\"activation\": \"nvfp4_per_token\"}}'"]


def base_model(src: Path, config: dict) -> str:
    """The Hub id SRC came from: a Hugging Face cache path (``models--org--name/snapshots/<rev>``), config.json's
    ``_name_or_path`` when it is an id (``org/name``), else SRC's directory name."""
    for part in Path(src).resolve().parts:
        if part.startswith("models--"):
            return part.removeprefix("models--").replace("--", "/", 1)
    name = str(config.get("_name_or_path") or "")
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        return name
    return Path(src).resolve().name


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def calibration_record(calibration: dict, calib: Path | None, token_ids: torch.Tensor | None,
                       dtype: str | None = None) -> dict:
    """The calibration record of the report, with what pins it: the compute dtype of its forward (``dtype``), the
    file's bytes and the token ids used."""
    if not calibration:
        return {}
    record = dict(calibration)
    if dtype is not None:
        record["dtype"] = dtype
    if calib is not None:
        record["file_sha256"] = sha256_file(Path(calib))
    if token_ids is not None:
        ids = token_ids.to(torch.int64).contiguous().numpy().tobytes()
        record["token_ids_sha256"] = hashlib.sha256(ids).hexdigest()
    return record


def module_groups(plan: ModelPlan) -> list[tuple[str, int, str]]:
    """(module name pattern with layer and expert numbers as ``*``, count, precision), quantized groups first."""
    def pattern(module: str) -> str:
        return re.sub(r"\.\d+(?=\.|$)", ".*", module)

    quantized = Counter((pattern(m.linear.module), PRECISIONS.get(plan.schemes.get(m.linear.module), "NVFP4"))
                        for group in plan.groups for m in group.members)
    quantized.update((pattern(job.linear.module), "FP8 as stored in the source") for job in plan.stored_fp8)
    kept = Counter(pattern(module) for module in plan.ignored_modules)
    return ([(p, n, precision) for (p, precision), n in sorted(quantized.items())]
            + [(p, n, "kept (source precision)") for p, n in sorted(kept.items())])


def provenance(src: Path, plan: ModelPlan, options: object, calibration: dict, command: str | None) -> dict:
    from fp4kit import __version__

    settings = {key: (str(value) if isinstance(value, Path) else value)
                for key, value in dataclasses.asdict(options).items()
                if key not in NOT_RECORDED and not (key in RECORDED_WHEN_SET and not value)}
    if "mse_range" in settings:  # the search it ran, not "auto"
        settings["mse_range"] = options.mse_span  # type: ignore[attr-defined]
    return {
        "format": FORMAT,
        "producer": {"name": "fp4kit", "version": __version__},
        "base_model": base_model(src, plan.config),
        "family": plan.family.name,
        "scheme": settings["scheme"],
        "dialect": settings["format"],
        "method": settings["method"],
        "calibration": calibration or None,
        "options": settings,
        "command": command,
    }


def _source_config_serving(scheme: str) -> list[str]:
    return SOURCE_CONFIG_SERVE if scheme == "nvfp4a16" else SERVE[:1]


def serving_lines(dialect: str, mixed: bool = False) -> list[str]:
    """``mixed``: the checkpoint has per-module schemes (``--scheme-for``), which some dialects serve under another
    method name."""
    from fp4kit.registry import dialect as registered_dialect

    fmt = registered_dialect(dialect)
    flag = fmt.serve_quantization_mixed if mixed else fmt.serve_quantization
    return [f"{line} --quantization {flag}" if flag else line for line in SERVE]


def model_card(record: dict, plan: ModelPlan) -> str:
    from fp4kit.quantize.schemes import single_nvfp4

    """The card's text; like the record, it does not depend on DST's name (the same input, the same bytes)."""
    scheme, dialect, method = record["scheme"], record["dialect"], record["method"]
    calibration = record["calibration"]
    tags = ["fp4kit", "nvfp4", dialect, "moe", "quantized", "fp4"]
    lines = ["---", f"base_model: {record['base_model']}", "tags:", *[f"- {tag}" for tag in tags], "---", "",
             f"# {record['base_model']}, {scheme} ({dialect})", "",
             f"{record['base_model']} ({record['family']}) quantized to {SCHEME_TITLES.get(scheme, scheme)} by "
             f"fp4kit {record['producer']['version']}, in the {dialect} format.", "",
             "| | |", "|---|---|", f"| scheme | `{scheme}` |", f"| format | {dialect} |", f"| method | `{method}` |"]
    if calibration:
        data = (f"{calibration['samples']} samples x {calibration['seq_len']} tokens = {calibration['tokens']} tokens "
                f"of `{calibration['data']}`")
        lines.append(f"| calibration | {data} |")
    else:
        lines.append("| calibration | none (the weights alone) |")
    kv_cache = record["options"].get("kv_cache")
    if kv_cache:
        lines.append(f"| KV cache | {kv_cache.upper()}, per-layer calibrated `k_scale` / `v_scale` (serve with "
                     f"`--kv-cache-dtype {kv_cache}`) |")
    lines += ["", "## Precision by module group", "", "| modules | count | precision |", "|---|---|---|"]
    lines += [f"| `{pattern}` | {count} | {precision} |" for pattern, count, precision in module_groups(plan)]
    lines += ["", "## How it was made", ""]
    if record["command"]:
        lines += ["```bash", record["command"], "```", ""]
    lines += [f"Every option and the calibration data's hashes: `{PROVENANCE_NAME}`.", "", "## Serving", "",
              "DST is this directory, or its Hub id once uploaded.", "",
              "```bash", *(_source_config_serving(scheme) if record["options"].get("source_config") else
                           serving_lines(dialect, bool(plan.stored_fp8) or not single_nvfp4(plan.schemes.values()))),
              "```", ""]
    return "\n".join(lines)


def write_provenance(work: Path, src: Path, plan: ModelPlan, options: object, calibration: dict,
                     command: str | None) -> None:
    record = provenance(src, plan, options, calibration, command)
    (work / PROVENANCE_NAME).write_text(json.dumps(record, indent=2) + "\n")
    (work / CARD_NAME).write_text(model_card(record, plan))
