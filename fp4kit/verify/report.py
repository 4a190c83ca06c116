"""What `fp4kit verify` found: a rich table for the terminal, a JSON document, and an optional per-layer error plot.

JSON (format ``fp4kit-verify``, version 2)::

    {"format", "version", "checkpoint", "kind", "family", "mode", "device", "passed", "seconds",
     "counts": {"passed", "failed", "skipped"},
     "tolerances": {"kernel", "source"}, "notes": [...],
     "backends": [{"name", "ran", "reason"}],
     "results": [{"layer", "check", "target", "status", "passed", "error", "tolerance", "tokens", "detail"}]}

A result's ``status`` is ``passed``, ``failed`` or ``skipped`` (the check could not run here; ``detail`` says why).
Its ``passed`` (kept for readers of version 1) is true for ``status: passed`` only: a skipped check is not a pass.
The top-level ``passed`` is true when no check failed (the exit code: 1 only on failures). ``error`` is a relative
Frobenius error ||got - expected|| / ||expected|| (null for pass/fail checks).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fp4kit.errors import Fp4kitError
from fp4kit.verify.checks import FAILED, PASSED, SKIPPED, CheckResult

FORMAT, VERSION = "fp4kit-verify", 2


@dataclass
class BackendStatus:
    name: str
    ran: bool
    reason: str


@dataclass
class VerifyReport:
    checkpoint: str
    kind: str
    family: str
    mode: str
    device: str
    backends: list[BackendStatus]
    tol_kernel: float
    tol_source: float
    results: list[CheckResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        """No check failed (skipped ones neither pass nor fail)."""
        return not any(r.failed for r in self.results)

    def counts(self) -> dict[str, int]:
        return {status: sum(r.status == status for r in self.results) for status in (PASSED, FAILED, SKIPPED)}

    def summary(self) -> str:
        """"N passed, M skipped, K failed" (the parts that are not zero; "0 checks" when there are none)."""
        parts = [f"{n} {status}" for status, n in self.counts().items() if n]
        return ", ".join(parts) or "0 checks"

    def add_failure(self, layer: int, check: str, target: str, detail: str) -> None:
        self.results.append(CheckResult(layer, check, target, FAILED, detail=detail))

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "checkpoint": self.checkpoint,
            "kind": self.kind,
            "family": self.family,
            "mode": self.mode,
            "device": self.device,
            "passed": self.passed,
            "seconds": round(self.seconds, 3),
            "counts": self.counts(),
            "tolerances": {"kernel": self.tol_kernel, "source": self.tol_source},
            "notes": self.notes,
            "backends": [asdict(b) for b in self.backends],
            "results": [_result_json(r) for r in self.results],
        }

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")


def _result_json(result: CheckResult) -> dict:
    return asdict(result) | {"passed": result.passed}


def result_from_json(result: dict) -> CheckResult:
    """A result of the JSON report back as a CheckResult; version 1 results have ``passed`` but no ``status``."""
    status = result.get("status") or (PASSED if result.get("passed") else FAILED)
    names = ("layer", "check", "target", "error", "tolerance", "tokens", "detail")
    return CheckResult(status=status, **{name: result[name] for name in names if name in result})


def summary_rows(results: list[CheckResult]) -> list[tuple[str, str, str, str, str, str]]:
    """One row per (check, target): layers, worst error against its tolerance (and the layer and batch it was on),
    result, and the first failure's detail."""
    groups: dict[tuple[str, str], list[CheckResult]] = {}
    for result in results:
        groups.setdefault((result.check, result.target), []).append(result)
    rows = []
    for (check, target), results in groups.items():
        errors = [r for r in results if r.error is not None]
        worst = max(errors, key=lambda r: r.error or 0.0) if errors else None
        failed = [r for r in results if r.failed]
        skipped = [r for r in results if r.skipped]
        shown = failed[0] if failed else (worst or results[0])
        error = "" if worst is None else f"{worst.error:.3g} (≤ {worst.tolerance:.3g})"
        if failed:
            where = f"layer {shown.layer}" + (f", {shown.tokens} tokens" if shown.tokens else "")
            detail = f"{len(failed)} failed; first: {where}" + (f": {shown.detail}" if shown.detail else "")
        else:
            detail = f"worst: layer {worst.layer}, {worst.tokens} tokens" if worst else shown.detail
        if worst is not None and worst.detail and not failed:
            detail += f", {worst.detail}"
        if skipped and not failed:
            why = skipped[0].detail
            detail = f"all {len(skipped)} skipped: {why}" if len(skipped) == len(results) else \
                f"{detail}; {len(skipped)} skipped ({why})"
        layers = sorted({r.layer for r in results})
        status = "FAIL" if failed else ("skip" if len(skipped) == len(results) else "pass")
        rows.append((check, target, ",".join(map(str, layers)), error, status, detail))
    return rows


def print_report(report: VerifyReport) -> None:
    """The report on stdout: rich tables on a terminal; in a log or a pipe, markdown tables whose rows are never
    wrapped, so that names and paths stay whole and grep finds them."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        print(markdown_report(report), flush=True)
        return
    from rich.table import Table

    console.print(
        f"[bold]{report.checkpoint}[/]: {report.family}, {report.kind}, mode {report.mode}, device {report.device}",
        markup=True, highlight=False,
    )
    for note in report.notes:
        console.print(f"  {note}", markup=False, highlight=False)
    backends = Table(title="backends", show_edge=False)
    for column in ("backend", "status", "why"):
        backends.add_column(column)
    for status in report.backends:
        backends.add_row(status.name, "[green]ran[/]" if status.ran else "[yellow]skipped[/]", status.reason)
    console.print(backends)
    table = Table(title="checks", show_edge=False)
    for column in CHECK_COLUMNS:
        table.add_column(column, overflow="fold")
    for check, target, layers, error, status, detail in summary_rows(report.results):
        shown_status = {"FAIL": "[red]FAIL[/]", "skip": "[yellow]skip[/]"}.get(status, "[green]pass[/]")
        table.add_row(check, target, layers, error, shown_status, detail)
    console.print(table)
    verdict = "[green]PASS[/]" if report.passed else "[red]FAIL[/]"
    console.print(f"{verdict}: {report.summary()} in {report.seconds:.1f} s")


CHECK_COLUMNS = ("check", "target", "layers", "worst error (tolerance)", "result", "detail")


def markdown_report(report: VerifyReport) -> str:
    """The report as plain text with markdown tables (what `fp4kit run`'s summary prints too)."""

    def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
        cells = [[str(cell).replace("|", "\\|") for cell in row] for row in rows]
        return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                *("| " + " | ".join(row) + " |" for row in cells)]

    lines = [f"{report.checkpoint}: {report.family}, {report.kind}, mode {report.mode}, device {report.device}",
             *(f"  {note}" for note in report.notes), "", "backends:", ""]
    lines += table(("backend", "status", "why"),
                   [(b.name, "ran" if b.ran else "skipped", b.reason) for b in report.backends])
    lines += ["", "checks:", ""]
    lines += table(CHECK_COLUMNS, summary_rows(report.results))
    lines += ["", f"{'PASS' if report.passed else 'FAIL'}: {report.summary()} in {report.seconds:.1f} s"]
    return "\n".join(lines)


PLOT_EXTRA = "pip install 'fp4kit[plot]'"


def check_plot_available() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise Fp4kitError(f"--plot needs matplotlib: {PLOT_EXTRA} (or pip install matplotlib)") from None


def plot_series(report: VerifyReport) -> tuple[dict[str, dict[int, float]], dict[float, list[str]]]:
    """Per (check, target) with an error value: layer -> worst error over token counts; and each tolerance with the
    checks it bounds."""
    series: dict[str, dict[int, float]] = {}
    tolerances: dict[float, list[str]] = {}
    for r in report.results:
        if r.error is None:
            continue
        points = series.setdefault(f"{r.check}: {r.target}", {})
        points[r.layer] = max(points.get(r.layer, 0.0), r.error)
        if r.tolerance is not None and r.check not in tolerances.setdefault(r.tolerance, []):
            tolerances[r.tolerance].append(r.check)
    return series, tolerances


def plot_floor(series: dict[str, dict[int, float]]) -> float:
    """Where an error of exactly 0 is drawn on the log scale: a decade below the smallest non-zero error."""
    nonzero = [e for points in series.values() for e in points.values() if e > 0]
    return min(nonzero) / 10 if nonzero else 1e-12


def plot_report(report: VerifyReport, path: str | Path) -> None:
    """Write `plot_figure` as a PNG."""
    import matplotlib.pyplot as plt

    figure = plot_figure(report)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_figure(report: VerifyReport):  # -> matplotlib.figure.Figure (matplotlib is optional)
    """Per-layer worst relative error of each (check, target) with an error value, on a log scale, with a labelled
    line per tolerance; errors of exactly 0 (bit-exact outputs) are drawn at a floor that a legend entry names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    series, tolerances = plot_series(report)
    floor = plot_floor(series)
    figure, axes = plt.subplots(figsize=(9, 4.5))
    zeros = False
    for label, points in series.items():
        layers = sorted(points)
        nonzero = [i for i, layer in enumerate(layers) if points[layer] > 0]
        line, = axes.plot(layers, [points[layer] or floor for layer in layers], marker="o", markevery=nonzero,
                          label=label)
        exact = [layer for layer in layers if points[layer] == 0]
        if exact:
            zeros = True
            axes.plot(exact, [floor] * len(exact), linestyle="none", marker="v", markersize=8,
                      color=line.get_color())
    for style, (tolerance, checks) in zip(["--", ":", "-.", (0, (1, 3))] * 4, sorted(tolerances.items()),
                                          strict=False):
        axes.axhline(tolerance, linestyle=style, color="grey", linewidth=0.9,
                     label=f"tolerance {tolerance:g} ({', '.join(checks)})")
    if zeros:  # a legend entry, so that the note never covers a point
        axes.plot([], [], linestyle="none", marker="v", color="dimgrey",
                  label=f"error exactly 0 (bit exact), drawn at {floor:.1g}")
    axes.set_yscale("log")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("MoE layer")
    axes.set_ylabel("relative error (worst over token counts)")
    axes.set_title(f"fp4kit verify: {Path(report.checkpoint).name} ({report.mode})")
    if series:
        axes.legend(fontsize="small")
    else:
        axes.annotate("no check with an error value ran (e.g. the reference alone, without --source)",
                      xy=(0.5, 0.5), xycoords="axes fraction", ha="center")
    figure.tight_layout()
    return figure
