"""Reading an error as it was written down, with its traceback after its summary: by the
inbox (a parked row, a dead letter) and by the commands that list failures by cause. Only the
standard library: :mod:`outbox.fingerprints` and the commands load it without the inbox."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

#: What separates an error's summary from its traceback in a recorded error's text.
TRACEBACK_HEADER = "\nTraceback (most recent call last):\n"

#: The first line of a traceback frame: ``  File "path", line 12, in name``.
_FRAME_START = re.compile(r'^  File "(?P<path>[^"\n]*)", line \d+', re.MULTILINE)
#: The outbox package's own directory, to tell its frames from the application's.
_PACKAGE_DIR = Path(__file__).resolve().parent


def split_error(error: str) -> tuple[str, str | None]:
    """``error`` as (summary, traceback): the traceback is None when there is none."""
    summary, found, frames = error.partition(TRACEBACK_HEADER)
    if not found:
        return error, None
    return summary, TRACEBACK_HEADER.lstrip("\n") + frames


def error_line(error: str | None) -> str:
    """The one line that says what failed: the first line of ``error``'s summary (the
    exception's type and text, ``KeyError: 'customer_email'``), never a line of its
    traceback."""
    summary, _ = split_error((error or "").strip())
    return next((line for line in summary.splitlines() if line.strip()), "").strip()


def without_library_frames(error: str) -> str:
    """``error`` with the traceback frames of the outbox package itself left out: they say
    which of the library's ways (a first delivery, a retry) ran the handler, not where the
    application failed."""
    summary, found, frames = error.partition(TRACEBACK_HEADER)
    if not found:
        return error
    starts = [match.start() for match in _FRAME_START.finditer(frames)]
    if not starts:
        return error
    kept = [frames[: starts[0]]]  # a cut's "  ...", if any
    for start, end in zip(starts, [*starts[1:], len(frames)], strict=True):
        frame = frames[start:end]
        match = _FRAME_START.match(frame)
        if match is None or not _library_file(match.group("path")):
            kept.append(frame)
    return f"{summary}{TRACEBACK_HEADER}{''.join(kept)}"


@cache
def _library_file(path: str) -> bool:
    """Whether ``path`` is a module of the outbox package: by the part after its last
    ``outbox/``, which also names the library's frames of a consumer installed elsewhere
    (another machine, another virtualenv) than the command that reads them."""
    normalized = path.replace("\\", "/")
    _, found, inside = normalized.rpartition("/outbox/")
    return bool(found and inside.endswith(".py") and (_PACKAGE_DIR / inside).is_file())
