"""A failure as the inbox writes it down: in the log, in a parked row, in a dead letter."""

from __future__ import annotations

import traceback

from outbox.traceback_text import TRACEBACK_HEADER, error_line, split_error

__all__ = [
    "MAX_ERROR_TEXT",
    "TRACEBACK_HEADER",
    "error_line",
    "handler_error",
    "short_error",
    "split_error",
]

#: Longest error text kept for a record (a parked row's ``error``, a log line's).
MAX_ERROR_TEXT = 4000


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
