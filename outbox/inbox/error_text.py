"""A failure as the inbox writes it down: in the log, in a parked row, in a dead letter."""

from __future__ import annotations

import traceback

#: Longest error text kept for a record (a parked row's ``error``, a log line's).
MAX_ERROR_TEXT = 4000

#: What separates an error's summary from its traceback in :func:`handler_error`'s text.
TRACEBACK_HEADER = "\nTraceback (most recent call last):\n"


def short_error(exc: BaseException) -> str:
    """The exception's type and text, as ``traceback.format_exception_only`` writes them."""
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return text[:2000]


def handler_error(exc: BaseException) -> str:
    """A handler's exception as it is logged and parked: its type and text first (what a
    list shows), then the traceback that says where it came from, at most
    ``MAX_ERROR_TEXT`` characters (the innermost frames are kept when it is cut)."""
    summary = short_error(exc)
    frames = "".join(traceback.format_tb(exc.__traceback__))
    cut = "  ...\n"
    room = MAX_ERROR_TEXT - len(summary) - len(TRACEBACK_HEADER) - len(cut)
    if room <= 0 or not frames:
        return summary[:MAX_ERROR_TEXT]
    if len(frames) > room:
        frames = cut + frames[-room:]
    return f"{summary}{TRACEBACK_HEADER}{frames}".rstrip()


def split_error(error: str) -> tuple[str, str | None]:
    """``error`` as (summary, traceback): the traceback is None when there is none."""
    summary, found, frames = error.partition(TRACEBACK_HEADER)
    if not found:
        return error, None
    return summary, TRACEBACK_HEADER.lstrip("\n") + frames
