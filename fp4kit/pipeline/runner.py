"""`fp4kit run`: the steps of a recipe in order, each skipped when it already finished with the same config and inputs.

Work directory, for a recipe with every step::

    WORKDIR/
      quantize/  repair/  layout/  shard/  verify/     each step's output, created atomically by its library function
      quantize.done.json ...                            completion marker, written after the output is in place
      summary.md  summary.json                          every step's timing and status, and the verify results

A marker holds the step's key: sha256 over the step's name and options, the keys of the steps it reads (or a
fingerprint of the model directory) and of any file its options name (calibration set, routing statistics). A step
is skipped when its marker's key equals the key computed now and its output exists; otherwise it runs again,
replacing its output. Since keys chain, a changed step also reruns every step that reads it. A run killed at any
point leaves either no marker or a marker for a complete output (the libraries' outputs appear with one rename),
so rerunning finishes with the same bytes as an uninterrupted run.

Under torchrun (fp4kit.quantize.distributed) every rank runs this loop: the quantize step is split across ranks, the
other steps run on rank 0 while the others wait; rank 0 alone decides what to skip and writes markers and the summary.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console

from fp4kit import __version__
from fp4kit.pipeline.recipe import LoadedRecipe, check_against_model, load_recipe
from fp4kit.pipeline.steps import SOURCE, STEP_FUNCTIONS, StepContext, input_files, prepare, upstream
from fp4kit.progress import BYTES, Reporter
from fp4kit.quantize import distributed

MARKER_SUFFIX = ".done.json"
STEP_WORK = {"quantize": "quantizing", "repair": "converting", "layout": "laying out", "shard": "sharding",
             "verify": "verifying"}
SMALL_FILE = 1 << 20  # files up to this size are fingerprinted by content, larger ones by size and mtime


@dataclass
class StepRecord:
    name: str
    status: str  # "ran" or "skipped" (complete from an earlier run)
    seconds: float  # time the step took when it ran (for a skipped step: in the run that produced it)
    output: str
    key: str
    report: dict = field(default_factory=dict)


@dataclass
class Summary:
    recipe: str
    name: str
    model: str
    family: str
    workdir: str
    steps: list[StepRecord]
    seconds: float  # wall time of this run
    verify: dict | None = None

    @property
    def passed(self) -> bool | None:
        return None if self.verify is None else bool(self.verify.get("passed"))

    def quantized(self) -> str | None:
        """The quantize step's scheme, dialect, method and calibration data (None: no quantize step, or a marker
        from an fp4kit that did not record them)."""
        from fp4kit.quantize.checkpoint import describe

        report = next((s.report for s in self.steps if s.name == "quantize"), None)
        return describe(report) if report and "scheme" in report else None

    def to_json(self) -> dict:
        return asdict(self) | {"passed": self.passed}

    def markdown(self) -> str:
        lines = [f"# fp4kit run: {self.name}", "", f"- recipe: `{self.recipe}`", f"- model: `{self.model}` "
                 f"({self.family})", f"- workdir: `{self.workdir}`", f"- this run: {self.seconds:.1f} s", "",
                 "| step | status | seconds | output |", "|---|---|---:|---|"]
        lines += [f"| {s.name} | {s.status} | {s.seconds:.2f} | `{s.output}` |" for s in self.steps]
        if quantized := self.quantized():
            lines += ["", f"quantize: {quantized}"]
        if self.verify is not None:
            lines += ["", f"## verify: {'PASS' if self.passed else 'FAIL'}", ""]
            lines += [f"- note: {note}" for note in self.verify.get("notes", [])]
            lines += [f"- backend {b['name']}: {'ran' if b['ran'] else 'skipped'} ({b['reason']})"
                      for b in self.verify.get("backends", [])]
            lines += ["", "| check | target | layers | worst error (tolerance) | result | detail |",
                      "|---|---|---|---|---|---|"]
            lines += [_verify_row(row) for row in _verify_rows(self.verify.get("results", []))]
        return "\n".join(lines) + "\n"


def _verify_rows(results: list[dict]) -> list[tuple[str, ...]]:
    """One row per check and target with its worst layer, as `fp4kit verify` prints them."""
    from fp4kit.verify.report import result_from_json, summary_rows

    return summary_rows([result_from_json(r) for r in results])


_STATUS_CELL = {"FAIL": "**FAIL**"}


def _verify_row(row: tuple[str, ...]) -> str:
    check, target, layers, error, status, detail = row
    cells = [check, target, layers, error, _STATUS_CELL.get(status, status), detail]
    return "| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |"


def fingerprint(path: Path) -> str:
    """Identity of a model directory or input file without reading hundreds of GB: small files by content,
    large ones by name, size and modification time."""
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(
        p for p in path.rglob("*") if p.is_file() and not any(s.startswith(".") for s in p.relative_to(path).parts)
    )
    for file in files:
        stat = file.stat()
        digest.update(f"{file.relative_to(path) if file != path else file.name}\0{stat.st_size}\0".encode())
        digest.update(file.read_bytes() if stat.st_size <= SMALL_FILE else str(stat.st_mtime_ns).encode())
    return digest.hexdigest()


def step_key(step: str, options: dict, inputs: dict[str, str]) -> str:
    document = {"fp4kit": __version__, "step": step, "options": options, "inputs": inputs}
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()


def marker_path(workdir: Path, step: str) -> Path:
    return workdir / f"{step}{MARKER_SUFFIX}"


def read_marker(workdir: Path, step: str) -> dict | None:
    try:
        return json.loads(marker_path(workdir, step).read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def write_marker(workdir: Path, step: str, marker: dict) -> None:
    """Atomically: a marker is either absent or complete."""
    path = marker_path(workdir, step)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(marker, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(partial, path)


def _notify(reporter: Reporter, text: str) -> None:
    """A warning is printed (above the bar on a terminal); other lines only name the bar's current phase."""
    if text.startswith("warning: "):
        reporter.warn(text[len("warning: "):])
    else:
        reporter.describe(text)


# steps whose library function splits its work across torchrun's ranks; the others run on rank 0
DISTRIBUTED_STEPS = ("quantize",)


def _run_step(step: str, ctx: StepContext, workdir: Path, key: str, console: Console,
              ranks: distributed.Ranks) -> StepRecord:
    output = workdir / step
    marker = read_marker(workdir, step)
    if ranks.agree(marker is not None and marker.get("key") == key and output.is_dir()):
        console.print(f"{step}: complete from an earlier run, skipped")
        seconds = float(marker.get("seconds", 0.0)) if marker else 0.0
        return StepRecord(step, "skipped", seconds, str(output), key, marker.get("report", {}) if marker else {})
    if ranks.main:
        marker_path(workdir, step).unlink(missing_ok=True)
    start = time.perf_counter()
    report: dict = {}
    # verify reports checks done (layers x checks); the other steps report bytes, or phases of their own
    unit = "checks" if step == "verify" else BYTES
    with Reporter(step, console=console, default_phase=STEP_WORK[step], default_unit=unit) as reporter:
        ctx.progress = reporter
        ctx.notify = lambda text: _notify(reporter, text)
        if step in DISTRIBUTED_STEPS:
            report = STEP_FUNCTIONS[step](ctx, output)
        else:
            with ranks.together():
                if ranks.main:
                    report = STEP_FUNCTIONS[step](ctx, output)
    seconds = time.perf_counter() - start
    if ranks.main:
        write_marker(workdir, step, {"step": step, "key": key, "seconds": seconds, "report": report})
    console.print(f"{step}: done in {seconds:.2f} s -> {output}")
    return StepRecord(step, "ran", seconds, str(output), key, report)


def default_workdir(loaded: LoadedRecipe) -> Path:
    return Path(loaded.recipe.workdir) if loaded.recipe.workdir else Path("fp4kit-runs") / loaded.recipe.name


def run_loaded(loaded: LoadedRecipe, workdir: Path | None = None, console: Console | None = None) -> Summary:
    """Run a loaded recipe's steps in order in ``workdir``; write and return the summary."""
    recipe = loaded.recipe
    ranks = distributed.ranks(recipe.quantize.device if recipe.quantize else "cpu")
    console = console or Console(stderr=True)
    if not ranks.main:
        console = Console(stderr=True, quiet=True)
    check_against_model(loaded)
    prepare(recipe)
    workdir = Path(workdir) if workdir else default_workdir(loaded)
    workdir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    model = Path(recipe.model)
    keys = {SOURCE: fingerprint(model)}
    ctx = StepContext(recipe, {SOURCE: model})
    records: list[StepRecord] = []
    with ranks.exclusive(workdir):  # a second run of the same workdir is refused, not interleaved
        for step in recipe.steps():
            inputs = {name: keys[name] for name in upstream(step, recipe)}
            inputs |= {str(path): fingerprint(path) for path in input_files(step, recipe)}
            keys[step] = step_key(step, recipe.step_options(step), inputs)
            records.append(_run_step(step, ctx, workdir, keys[step], console, ranks))
            ctx.outputs[step] = workdir / step
    # only rank 0 ran verify: the others report no result rather than a failed one
    verify = next((r.report for r in records if r.name == "verify"), None) if ranks.main else None
    summary = Summary(str(loaded.path), recipe.name, recipe.model, recipe.family, str(workdir), records,
                      time.perf_counter() - start, verify)
    if ranks.main:
        (workdir / "summary.json").write_text(json.dumps(summary.to_json(), indent=2, default=str) + "\n")
        (workdir / "summary.md").write_text(summary.markdown())
    return summary


def run_recipe(path: str | Path, overrides: Sequence[str] = (), workdir: str | Path | None = None,
               console: Console | None = None) -> Summary:
    """Load ``path`` with ``--set``-style ``overrides`` ("key.sub=value") and run it (see run_loaded)."""
    return run_loaded(load_recipe(path, overrides), Path(workdir) if workdir else None, console)
