"""Children that signals reach as they reach a command started from a shell.

A suite started in the background (`pytest &` in a script, `nohup`) inherits SIGINT ignored, and a process started
with a signal ignored keeps ignoring it (Python then installs no KeyboardInterrupt handler, and fp4kit no SIGTERM
handler). A test that sends a child SIGINT or SIGTERM starts it inside ``reaching_children()``: an ignored signal
passes through exec as ignored, a caught one arrives as the default, so for the Popen call the test process catches
the signals it will send. (Not a ``preexec_fn``: Python code between fork and exec can deadlock in a process that
has threads, as torch's.)"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

SENT = (signal.SIGINT, signal.SIGTERM)


def _catch(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # this process's own Ctrl-C or SIGTERM during the Popen call


@contextlib.contextmanager
def reaching_children() -> Iterator[None]:
    """Processes started in the block see SIGINT and SIGTERM at their default disposition."""
    previous = {signum: signal.getsignal(signum) for signum in SENT}
    for signum, handler in previous.items():
        if handler in (signal.SIG_IGN, signal.SIG_DFL, None):
            signal.signal(signum, _catch)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def ignored_in_parent(signum: int) -> Iterator[None]:
    """The test process ignores ``signum`` for the block, as a backgrounded suite does SIGINT."""
    previous = signal.signal(signum, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signum, previous)
