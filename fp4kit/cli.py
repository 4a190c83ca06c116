"""The `fp4kit` command: parse, call the library, print. Bad input exits 2 with one line.

Each subcommand lives in its own module under fp4kit/commands and registers itself with ``register(app)``.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys

import typer

from fp4kit.errors import Fp4kitError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Turn BF16 MoE checkpoints into NVFP4 checkpoints that serving engines load and run.")


def _register_commands() -> None:
    import fp4kit.commands as commands

    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        importlib.import_module(f"fp4kit.commands.{info.name}").register(app)


# commands that split their work across torchrun's ranks; any other would run whole on every rank, into one DST
DISTRIBUTED_COMMANDS = ("quantize", "run")


def _check_ranks() -> None:
    command = next((arg for arg in sys.argv[1:] if not arg.startswith("-")), None)
    if os.environ.get("WORLD_SIZE", "1") != "1" and command and command not in DISTRIBUTED_COMMANDS:
        raise Fp4kitError(f"fp4kit {command} does not split its work across ranks: run it without torchrun "
                          f"(under torchrun: {' and '.join(DISTRIBUTED_COMMANDS)})")


def main() -> None:
    _register_commands()
    try:
        _check_ranks()
        # without standalone mode click returns a command's exit code (typer.Exit(1)) instead of exiting
        code = app(standalone_mode=False)
    except Fp4kitError as exc:
        ranks = os.environ.get("WORLD_SIZE", "1") != "1"  # under torchrun, one rank prints what failed
        if ranks:
            from fp4kit import distributed

            exc = distributed.shared_failure(exc)
        if not getattr(exc, "silent", False):
            typer.echo(f"error: {exc}", err=True)
        if ranks:
            distributed.settle()
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted: no output was left behind", err=True)
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except Exception as exc:  # click usage errors and the like
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            sys.exit(2)
        if isinstance(exc, click.exceptions.Abort):
            sys.exit(130)
        raise
    if isinstance(code, int) and code:
        sys.exit(code)
