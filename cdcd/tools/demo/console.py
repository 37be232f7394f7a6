"""How ``cdcd demo`` prints: colors on a terminal only, lines cut to the width, flushed."""


from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

#: Width of the output when stdout is not a terminal (logs, CI).
PIPE_WIDTH = 160

_ANSI = re.compile(r"\x1b\[[0-9;]*m")

class Stopping(Exception):
    """Raised inside the startup sequence when Ctrl-C/SIGTERM arrived meanwhile."""


class Console:
    """Everything the demo prints goes through here: colors, widths, flushing.

    Colors only on a terminal (and not with ``NO_COLOR`` or ``TERM=dumb``), so
    logs and CI output stay plain. Every line is flushed, because a pipe is
    block-buffered and a reader (or test) must see progress as it happens.
    """

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.color = (
            self.tty and "NO_COLOR" not in os.environ and os.environ.get("TERM", "") != "dumb"
        )

    @property
    def width(self) -> int:
        """Columns available for one line (the terminal's, or a fixed width on a pipe)."""
        if not self.tty:
            return PIPE_WIDTH
        return max(60, shutil.get_terminal_size((100, 24)).columns - 1)

    def paint(self, text: str, *codes: str) -> str:
        """Wrap ``text`` in SGR codes (``"1"`` bold, ``"2"`` dim, ``"32"`` green...)."""
        if not self.color or not codes:
            return text
        return f"\x1b[{';'.join(codes)}m{text}\x1b[0m"

    def line(self, text: str = "") -> None:
        """Print one line and flush it."""
        self.stream.write(text + "\n")
        self.stream.flush()

    def fit(self, text: str) -> str:
        """Cut ``text`` (which may contain SGR codes) to the line width, marking the cut."""
        width = self.width
        if len(_ANSI.sub("", text)) <= width:
            return text
        out: list[str] = []
        visible = 0
        pos = 0
        while pos < len(text) and visible < width - 1:
            match = _ANSI.match(text, pos)
            if match is not None:
                out.append(match.group(0))
                pos = match.end()
                continue
            out.append(text[pos])
            visible += 1
            pos += 1
        out.append("…")
        if self.color:
            out.append("\x1b[0m")
        return "".join(out)

    @contextmanager
    def step(self, what: str) -> Iterator[list[str]]:
        """Show ``what ...`` before slow work and ``ok (1.2 s) <details>`` after it.

        The caller appends details to the yielded list. On a terminal the
        result completes the same line; on a pipe too, since the line is
        flushed before the work starts and finished after it.
        """
        started = time.monotonic()
        self.stream.write(f"  {what:<38} ")
        self.stream.flush()
        details: list[str] = []
        try:
            yield details
        except Stopping:
            self.line(self.paint("interrupted", "1", "33"))
            raise
        except BaseException:
            self.line(self.paint("failed", "1", "31"))
            raise
        elapsed = time.monotonic() - started
        extra = "  ".join(details)
        self.line(f"{self.paint('ok', '1', '32')} {self.paint(f'({elapsed:.1f} s)', '2')}  {extra}")


# ------------------------------------------------------------------------ formatting


def format_bytes(value: float) -> str:
    """``1234`` -> ``1.2 kB``; small values stay exact so that "0 B" reads as zero."""
    if value < 1000:
        return f"{value:.0f} B"
    for unit in ("kB", "MB", "GB"):
        value /= 1000
        if value < 1000:
            return f"{value:.1f} {unit}"
    return f"{value:.1f} TB"
