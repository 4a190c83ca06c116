"""The `fp4kit` command as users install it: usage errors, OS errors and internal errors are one line on stderr and
exit 2, Ctrl-C is one line and exit 130, `--version` prints the installed version; the help lists every choice.

The subprocess cases run the console script installed beside this interpreter (and `python -m fp4kit`) with
PYTHONPATH set to this checkout, so they run this checkout's code through the real entry point."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest
from helpers import choices, cli_commands, ignored_in_parent, reaching_children, run_cli

from fp4kit import cli
from fp4kit.errors import Fp4kitError

ROOT = Path(__file__).parents[1]
ENV = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
SCRIPT = Path(sys.executable).with_name("fp4kit")  # what `pip install` put on PATH for this interpreter
ENTRY_POINTS = {"script": [str(SCRIPT)], "python -m": [sys.executable, "-m", "fp4kit"]}

# argv -> what the one line must contain; none of these gets as far as importing torch
USAGE_ERRORS = {
    "no command": ([], "fp4kit: missing command: one of convert, demo, eval, inspect, layout, quantize, recipe, run, "
                       "shard, verify"),
    "unknown command": (["quantise", "A", "B"], "fp4kit: no such command 'quantise'"),
    "missing option": (["convert", "A", "B"], "fp4kit convert: missing option '--to'"),
    "missing argument": (["shard", "A", "--ep", "2"], "fp4kit shard: missing argument 'dst'"),
    "bad type": (["shard", "A", "B", "--ep", "two"], "fp4kit shard: invalid value for '--ep'"),
    "bad choice": (["quantize", "A", "B", "--scheme", "nvfp4x"],
                   "fp4kit quantize: invalid value for '--scheme': 'nvfp4x' is not one of 'nvfp4a16', 'nvfp4'"),
    "unknown option": (["inspect", "A", "--jsn"], "fp4kit inspect: no such option: --jsn"),
    "extra argument": (["layout", "A", "B", "C", "--backend", "marlin"], "fp4kit layout: got unexpected extra"),
}
RUNS = {**{(name, "script"): argv for name, (argv, _) in USAGE_ERRORS.items()},
        ("no command", "python -m"): [], ("bad choice", "python -m"): USAGE_ERRORS["bad choice"][0],
        ("version", "script"): ["--version"], ("version", "python -m"): ["--version"]}


def launch(entry: str, argv: list[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen([*ENTRY_POINTS[entry], *argv], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kwargs)


def finish(process: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, str], tuple[int, str, str]]:
    """Every usage case at once: each process is mostly interpreter start-up, which overlaps well."""
    assert SCRIPT.is_file(), f"no fp4kit console script beside {sys.executable}: pip install -e ."
    started = {key: launch(key[1], argv) for key, argv in RUNS.items()}
    return {key: finish(process) for key, process in started.items()}


def one_error_line(stderr: str) -> str:
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


@pytest.mark.parametrize("key", [k for k in RUNS if k[0] != "version"], ids="-".join)
def test_usage_error_is_one_line_exit_2(runs, key) -> None:
    code, out, err = runs[key]
    line = one_error_line(err)
    assert code == 2 and out == ""
    assert line.startswith(f"error: {USAGE_ERRORS[key[0]][1]}"), line
    command = re.match(r"error: (fp4kit(?: \w+)?):", line).group(1)
    assert line.endswith(f"(see {command} --help)")


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_version(runs, entry) -> None:
    assert runs[("version", entry)] == (0, f"fp4kit {version('fp4kit')}\n", "")


def test_os_error_through_the_entry_point(tiny, tmp_path) -> None:
    """DST below a regular file, a directory as the recipe: the OSError is one line naming the file, exit 2, nothing
    written."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    quantize = launch("script", ["quantize", str(tiny("qwen3_moe")), str(blocker / "out"), "-q"])
    directory = launch("script", ["run", str(tmp_path)])  # a directory where the recipe file is expected
    assert finish(directory) == (2, "", f"error: {tmp_path}: Is a directory\n")
    code, out, err = finish(quantize)
    assert code == 2 and out == "" and str(blocker) in one_error_line(err), err
    assert blocker.read_text() == "" and sorted(tmp_path.iterdir()) == [blocker]


def test_stdout_closed_early_is_not_problems_found() -> None:
    """`fp4kit ... | head -1`: the reader leaves; exit as a shell reports SIGPIPE (141), never 1, and no traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:  # --version prints through click, --help through rich, which exits 1 on a broken pipe by itself
        started = [subprocess.Popen([*ENTRY_POINTS["script"], argv], env=ENV, stdout=write_end,
                                    stderr=subprocess.PIPE, text=True) for argv in ("--version", "--help")]
    finally:
        os.close(write_end)
    assert [(p.wait(timeout=120), p.communicate()[1]) for p in started] == [(cli.EXIT_BROKEN_PIPE, "")] * 2


@pytest.mark.parametrize("parent", ["default", "ignores SIGINT"])
def test_sigint_prints_one_line_and_exits_130(tmp_path, parent) -> None:
    """A real SIGINT while `fp4kit run` waits on its recipe (a FIFO nobody writes): one line, exit 130. Also when
    the suite itself runs with SIGINT ignored (started in the background), which the child would inherit."""
    fifo = tmp_path / "recipe.yaml"
    os.mkfifo(fifo)
    with ignored_in_parent(signal.SIGINT) if parent != "default" else contextlib.nullcontext(), reaching_children():
        process = launch("script", ["run", str(fifo)])
    writer = None
    try:
        deadline = time.monotonic() + 120
        while writer is None:  # opening a FIFO's write end without blocking works once its reader has it open
            try:
                writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                assert exc.errno == errno.ENXIO and process.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
        process.send_signal(signal.SIGINT)  # the reader now waits in read(): the writer never writes
        code, out, err = finish(process, timeout=60)
    finally:
        if writer is not None:
            os.close(writer)
        process.kill()
    assert (code, out, err) == (130, "", cli.INTERRUPTED + "\n")


# ---- in process: the error line of each kind of failure, through a command whose library call fails -------------

def fail_with(monkeypatch, capsys, exc: BaseException) -> tuple[int, str]:
    """Run `fp4kit demo` with its library call raising ``exc``: (exit code, stderr)."""
    def raise_it(*args, **kwargs):
        raise exc

    monkeypatch.setattr("fp4kit.pipeline.demo.run_demo", raise_it)
    cli._register_commands()
    code = cli.run(["demo"])
    captured = capsys.readouterr()
    assert captured.out == ""
    return code, captured.err


@pytest.mark.parametrize(("exc", "line"), [
    (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/out/model.safetensors"),
     "error: /out/model.safetensors: No space left on device"),
    (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "error: No space left on device"),
    (PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/ro/.out.fp4kit-partial", None, "/ro/out"),
     "error: /ro/.out.fp4kit-partial -> /ro/out: Permission denied"),
    (IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), "/src/model.safetensors"),
     "error: /src/model.safetensors: Is a directory"),
    (Fp4kitError("a.safetensors: header\nis cut short"), "error: a.safetensors: header / is cut short"),
    (MemoryError(), "error: out of memory"),
])
def test_failure_is_one_line_exit_2(monkeypatch, capsys, exc, line) -> None:
    assert fail_with(monkeypatch, capsys, exc) == (2, line + "\n")


def test_long_message_is_cut_to_one_bounded_line(monkeypatch, capsys) -> None:
    code, err = fail_with(monkeypatch, capsys, Fp4kitError("x.json: " + "v" * 100_000 + " end"))
    assert code == 2 and err.count("\n") == 1 and len(err) < cli.MAX_LINE + 100
    assert err.startswith("error: x.json: vvv") and err.endswith(" end\n") and "characters cut" in err


def test_internal_error_is_exit_2_with_the_traceback_in_a_file(monkeypatch, capsys) -> None:
    """A bug is a failure (2), never "problems found" (1); the line names the file holding the traceback."""
    code, err = fail_with(monkeypatch, capsys, KeyError("layers.0.mlp"))
    match = re.fullmatch(r"error: internal error: KeyError: 'layers.0.mlp' \(please report it, with the traceback "
                         r"in (\S+)\)\n", err)
    assert code == 2 and match, err
    traceback_file = Path(match.group(1))
    try:
        assert "raise_it" in traceback_file.read_text() and "KeyError" in traceback_file.read_text()
    finally:
        traceback_file.unlink()


def test_interrupt_and_command_exit_codes(monkeypatch, capsys) -> None:
    assert fail_with(monkeypatch, capsys, KeyboardInterrupt()) == (130, cli.INTERRUPTED + "\n")
    assert fail_with(monkeypatch, capsys, SystemExit(1)) == (1, "")  # inspect and verify: problems found


def test_runs_in_one_process_register_each_command_once(monkeypatch, capsys) -> None:
    """The entry point called again in one process (the in-process tests, a library user) finds each command once,
    not once per earlier call: every call builds each command registered."""
    def registered() -> list[str]:
        return [c.callback.__name__ for c in cli.app.registered_commands] + [g.name for g in cli.app.registered_groups]

    assert run_cli(monkeypatch, capsys, "--version")[0] == 0
    once = registered()
    for _ in range(2):
        assert run_cli(monkeypatch, capsys, "--version")[0] == 0
    assert registered() == once and len(once) == len(set(once)) == len(cli_commands())


# ---- help ----------------------------------------------------------------------------------------------------------

def test_every_option_has_help_and_no_doubled_negation() -> None:
    for name, command in cli_commands().items():
        for param in command.params:
            if param.param_type_name == "option":
                assert param.help, f"fp4kit {name} {param.opts[0]}: no help text"
                assert not any(opt.startswith("--no-no-") for opt in param.opts + param.secondary_opts), param.opts


def test_choices_are_the_librarys() -> None:
    """Choices the CLI lists (and checks while parsing) are exactly those the library accepts."""
    from fp4kit import registry
    from fp4kit.ep import placement
    from fp4kit.layouts import cutlass
    from fp4kit.layouts import directory as layout
    from fp4kit.quantize import checkpoint as quantize
    from fp4kit.quantize import input_scales
    from fp4kit.tools import dense, evaluate
    from fp4kit.verify import backends, runner

    expected = {
        ("quantize", "scheme"): quantize.SCHEMES, ("quantize", "format"): quantize.FORMATS,
        ("quantize", "moe_input_scales"): input_scales.POLICIES,
        ("convert", "to"): (*registry.DIALECT_NAMES, dense.TARGET),
        ("layout", "backend"): layout.BACKENDS, ("layout", "act_dtype"): layout.ACT_DTYPES,
        ("layout", "cutlass_flavor"): cutlass.KERNEL, ("shard", "placement"): placement.PLACEMENTS,
        ("verify", "backend"): ("auto", *backends.BACKENDS), ("verify", "mode"): runner.MODES,
        ("eval", "dtype"): evaluate.DTYPES,
    }
    for (command, option), library in expected.items():
        assert choices(command, option) == set(library), (command, option)


def test_help_lists_choices(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    cli._register_commands()
    assert cli.run(["quantize", "--help"]) == 0
    text = capsys.readouterr().out
    assert "nvfp4a16|nvfp4" in text and "shared|per-expert" in text and "--no-no-" not in text


def normalized(text: str) -> str:
    """Words with the help's line wrapping undone (a line may also break after a hyphen)."""
    return re.sub(r"-\s+", "-", re.sub(r"\s+", " ", text))


@pytest.mark.parametrize("name", sorted(cli_commands()))
def test_help_at_80_columns_shows_every_text_whole(name, capsys, monkeypatch) -> None:
    """At 80 columns: no line wider, every option name unbroken, every help text as written (brackets included:
    `pip install 'fp4kit[plot]'` is not markup), no `<bool>` metavar or "Choose from" list."""
    monkeypatch.setenv("COLUMNS", "80")
    assert cli.run([name, "--help"]) == 0
    text = capsys.readouterr().out
    assert max(len(line) for line in text.splitlines()) <= 80, text
    assert "<bool>" not in text and "Choose from" not in text and "…" not in text
    words = set(re.findall(r"--?[\w-]+", text))
    for param in cli_commands()[name].params:
        for opt in (*param.opts, *param.secondary_opts) if param.param_type_name == "option" else ():
            assert opt in words, f"fp4kit {name}: {opt} not shown whole"
        if param.help:
            assert normalized(param.help) in normalized(text), f"fp4kit {name} {param.name}: {param.help!r}"
    if name == "verify":
        assert "pip install 'fp4kit[plot]'" in text


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "recipes").glob("*.yaml"))]


def test_docs_name_only_commands_that_exist() -> None:
    """Every `fp4kit WORD` the docs and recipe headers show, and every command the exit-code lists name, is a
    command (an `fp4kit audit` the docs listed never existed: the audit is `inspect --source`)."""
    names = set(cli_commands())
    for path in DOCS:
        text = path.read_text()
        code = "\n".join(re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.DOTALL))
        shown = {*re.findall(r"`fp4kit ([a-z][\w-]*)", text), *re.findall(r"^fp4kit ([a-z][\w-]*)", code, re.MULTILINE),
                 *re.findall(r"^#\s+fp4kit ([a-z][\w-]*)", text, re.MULTILINE) * (path.suffix == ".yaml")}
        assert shown <= names, (path.name, sorted(shown - names))
        for listed in re.findall(r'"the checks found problems" \(([^)]*)\)', text.replace("\n", " ")):
            words = {w for w in re.findall(r"`([^`]+)`", listed) if not w.startswith("-")}
            assert words <= names, (path.name, sorted(words - names))
