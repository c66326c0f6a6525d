"""Reading an error as it was written down, with its traceback after its summary: by the
inbox (a parked row, a dead letter) and by the commands that list failures by cause. Only the
standard library: :mod:`outbox.fingerprints` and the commands load it without the inbox."""

from __future__ import annotations

#: What separates an error's summary from its traceback in a recorded error's text.
TRACEBACK_HEADER = "\nTraceback (most recent call last):\n"


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
