"""The `fp4kit` command: parse, call the library, print.

Exit codes, for every command:
  0    done
  1    the checks ran and found problems (inspect, verify, run's verify step)
  2    failed: bad input (Fp4kitError), a usage error, an OS error (disk full, permission denied, read-only DST, ...)
       or an internal error; one line ``error: <file, tensor or command>: <what>`` on stderr per problem
  130  interrupted (Ctrl-C, SIGINT)
  143  terminated (SIGTERM: `kill`, a job scheduler's time limit, a container stopping), as a shell reports a
       process that SIGTERM ended; like Ctrl-C, the run's partial output is removed and one line says so
  141  stdout was closed early (`fp4kit inspect X | head -1`), as a shell reports a process ended by SIGPIPE
An internal error (a bug: any other exception) is a failure like the others, so a pipeline that tells 1 from 2 never
reads a crash as "problems found"; its traceback goes to a file that the one line names.

Each subcommand lives in its own module under fp4kit/commands and registers itself with ``register(app)``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import os
import pkgutil
import re
import signal
import sys
from collections.abc import Iterator, Sequence
from typing import Annotated

import typer

from fp4kit.commands._common import INVOKED_ARGS
from fp4kit.errors import Fp4kitError

try:  # typer 0.2x raises the exceptions of its own bundled copy of click, not the click package's
    from typer._click import exceptions as click_exceptions
except ImportError:  # older typer: click itself
    from click import exceptions as click_exceptions

PROG = "fp4kit"
EXIT_FAILED = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 128 + signal.SIGTERM
EXIT_BROKEN_PIPE = 128 + 13  # as a shell reports a writer that SIGPIPE ended
MAX_LINE = 1000  # an error line longer than this is cut: a message carrying a huge value stays readable
INTERRUPTED = "interrupted: no partial output was left behind"
TERMINATED = "terminated: no partial output was left behind"

# no_args_is_help would print the whole help before the error: `fp4kit` alone is a usage error of one line.
# rich_markup_mode None: click's plain help, which prints help texts as written (rich markup would eat
# `'fp4kit[plot]'`), wraps at the terminal without cutting option names, and shows no <bool> metavars
app = typer.Typer(add_completion=False, no_args_is_help=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Turn BF16 MoE checkpoints into NVFP4 checkpoints that serving engines load and run.",
                  epilog="Exit codes: 0 done, 1 checks found problems, 2 failed (one 'error:' line), 130 interrupted, "
                         "143 terminated.")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread: it unwinds as Ctrl-C does (every output's work directory is removed, and
    torchrun's ranks do not wait for one another), then the run exits 143."""


def _raise_terminated(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM during the clean-up ends the process at once
    raise Terminated


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """For the block, SIGTERM raises ``Terminated``, unless the parent made this process ignore it."""
    previous = signal.getsignal(signal.SIGTERM)
    if previous != signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed_version

    try:
        return installed_version("fp4kit")
    except PackageNotFoundError:  # a source checkout that was never installed
        from fp4kit import __version__

        return __version__


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"{PROG} {version()}")
        raise typer.Exit(0)


@app.callback()
def _options(
    show_version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                               help="print fp4kit's version and exit")] = False,
) -> None:
    pass


@functools.cache  # once per process: typer appends a command per call, and `run` builds every one it holds
def _register_commands() -> None:
    import fp4kit.commands as commands

    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        importlib.import_module(f"fp4kit.commands.{info.name}").register(app)


# commands that split their work across torchrun's ranks; any other would run whole on every rank, into one DST
DISTRIBUTED_COMMANDS = ("quantize", "run")


def _under_torchrun() -> bool:
    return os.environ.get("WORLD_SIZE", "1") != "1"


def _check_ranks() -> None:
    command = next((arg for arg in sys.argv[1:] if not arg.startswith("-")), None)
    if os.environ.get("WORLD_SIZE", "1") != "1" and command and command not in DISTRIBUTED_COMMANDS:
        raise Fp4kitError(f"fp4kit {command} does not split its work across ranks: run it without torchrun "
                          f"(under torchrun: {' and '.join(DISTRIBUTED_COMMANDS)})")


def one_line(text: str) -> str:
    """``text`` as one bounded line: line breaks become ' / ', the middle of an overlong message is cut."""
    line = " / ".join(part.strip() for part in str(text).splitlines() if part.strip())
    if len(line) > MAX_LINE:
        cut = len(line) - MAX_LINE
        line = f"{line[: MAX_LINE // 2]} ...({cut} characters cut)... {line[-MAX_LINE // 2 :]}"
    return line


def describe_os_error(exc: OSError) -> str:
    """``<file>: <what>`` for an OSError, from its filename(s) and strerror (``[Errno N]`` left out)."""
    what = exc.strerror or str(exc) or type(exc).__name__
    if exc.filename is None:
        return what
    where = os.fsdecode(exc.filename)
    if exc.filename2 is not None:
        where = f"{where} -> {os.fsdecode(exc.filename2)}"
    return f"{where}: {what}"


def describe_usage_error(exc: click_exceptions.ClickException) -> str:
    """``fp4kit <command>: <what> (see ... --help)`` for a usage error click raised while parsing."""
    ctx = getattr(exc, "ctx", None)
    command = ctx.command_path if ctx is not None else PROG
    # typer validates through pydantic, whose messages start "Value error, " for a value outside the choices
    what = re.sub(r"\bvalue error, ", "", exc.format_message(), flags=re.IGNORECASE).rstrip(".")
    what = what[:1].lower() + what[1:]
    names = sorted(getattr(ctx.command, "commands", None) or {}) if ctx is not None else []
    if what == "missing command" and names:
        what = f"missing command: one of {', '.join(names)}"
    return f"{command}: {what} (see {command} --help)"


def _internal_error(exc: BaseException) -> str:
    """The line for a bug, and its traceback saved to a file the line names (the line stays one line)."""
    import tempfile
    import traceback

    where = ""
    try:
        fd, path = tempfile.mkstemp(prefix="fp4kit-traceback-", suffix=".txt")
        with os.fdopen(fd, "w") as out:
            out.write("".join(traceback.format_exception(exc)))
        where = f", with the traceback in {path}"
    except OSError:
        pass
    return f"internal error: {type(exc).__name__}: {exc} (please report it{where})"


def _fail(exc: BaseException, *lines: str) -> int:
    """Print ``error: line`` for each line (one per problem; under torchrun only on the rank that failed first) and
    return exit code 2."""
    ranks = os.environ.get("WORLD_SIZE", "1") != "1"
    if ranks:
        from fp4kit.quantize import distributed

        exc = distributed.shared_failure(exc)  # a silent RankFailed where another rank failed first
    if not getattr(exc, "silent", False):
        for line in lines:
            typer.echo(f"error: {one_line(line)}", err=True)
    if ranks:
        from fp4kit.quantize import distributed

        distributed.settle()
    return EXIT_FAILED


def run(args: Sequence[str]) -> int:
    """Run the command line ``args`` (without the program name) and return its exit code."""
    command = typer.main.get_command(app)
    try:
        _check_ranks()
        # click's own main() would turn Ctrl-C into a silent exit 130 and print usage errors over several lines
        invoked = INVOKED_ARGS.set(list(args))
        try:
            with command.make_context(PROG, list(args)) as ctx:
                command.invoke(ctx)
        finally:
            INVOKED_ARGS.reset(invoked)
        return 0
    except typer.Exit as exc:  # --help, --version
        return exc.exit_code
    except SystemExit as exc:  # a command's own exit code: inspect and verify exit 1 when they find problems
        if isinstance(exc.__context__, BrokenPipeError):  # rich exits 1 when its stdout's reader went away
            return EXIT_BROKEN_PIPE
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except Terminated:
        if not _under_torchrun():  # torchrun ends the other ranks when one fails: its report says so
            typer.echo(TERMINATED, err=True)
        return EXIT_TERMINATED
    except (KeyboardInterrupt, typer.Abort):
        typer.echo(INTERRUPTED, err=True)
        return EXIT_INTERRUPTED
    except click_exceptions.ClickException as exc:  # usage errors: parsing happens before any work
        typer.echo(f"error: {one_line(describe_usage_error(exc))}", err=True)
        return EXIT_FAILED
    except Fp4kitError as exc:  # a recipe's validation reports all its problems at once, one line each
        return _fail(exc, *(getattr(exc, "problems", None) or [str(exc)]))
    except BrokenPipeError:  # stdout's reader went away (`fp4kit inspect X | head -1`): nothing left to say
        with contextlib.suppress(OSError, ValueError):  # no flush at exit may complain about it again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except OSError as exc:
        return _fail(exc, describe_os_error(exc))
    except MemoryError as exc:  # not a bug: the machine has less memory than this input needs
        return _fail(exc, f"out of memory{': ' + str(exc) if str(exc) else ''}")
    except Exception as exc:
        return _fail(exc, _internal_error(exc))


def main() -> None:
    with sigterm_unwinds():
        _register_commands()
        code = run(sys.argv[1:])
    # the garbage collection at interpreter exit would walk every object torch's import made (about 0.4 CPU s);
    # frozen, they are left to the process's end like the rest. Not once triton is loaded: its nanobind bindings
    # print every object left uncollected at exit as a leak.
    if "triton" not in sys.modules:
        gc.freeze()
    if code == EXIT_TERMINATED and _under_torchrun():  # end by the signal itself, as torchrun expects its ranks to
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    if code:
        sys.exit(code)
