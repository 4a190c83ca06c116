"""Run fp4kit as a user at a terminal does: a real subprocess whose stderr is a pseudo-terminal."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def under_terminal(*args: object, columns: int = 100) -> tuple[int, str, str]:
    """Run `python -m fp4kit ARGS` with stderr on a pseudo-terminal ``columns`` wide: (exit code, stdout, the
    terminal's text with colours and cursor moves removed)."""
    leader, follower = pty.openpty()
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": str(columns), "TERM": "xterm"}
    process = subprocess.Popen([sys.executable, "-m", "fp4kit", *map(str, args)], stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=follower, env=env)
    os.close(follower)
    terminal = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the follower side closed: the process exited
            break
        if not chunk:
            break
        terminal += chunk
    os.close(leader)
    stdout = process.stdout.read().decode()  # type: ignore[union-attr]
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", terminal.decode(errors="replace"))
    return process.wait(timeout=300), stdout, text
