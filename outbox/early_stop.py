"""A stop asked for while an ``outbox`` command starts up: a clean stop, not a crash.

Loading a daemon's libraries (SQLAlchemy, psycopg, librdkafka) takes a second or more, more
on a busy machine, and the daemon installs its own SIGTERM/SIGINT handlers only once they
are loaded. Until then the default action would kill the process with status 143 (128 +
SIGTERM), which a supervisor reads as a crash. :func:`install` puts a handler in place
before anything slow loads: the process logs one line and exits 0, since nothing has
started yet. A daemon's own handlers replace it; the other commands give the signals their
default action back (:func:`release`) before they run. Only the standard library is used
here, so that installing it costs nothing.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from types import FrameType

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def is_the_outbox_command(argv: list[str]) -> bool:
    """Whether this process is the ``outbox`` console script (not a program importing it)."""
    return bool(argv) and os.path.basename(argv[0]) in ("outbox", "outbox.exe")


def install() -> None:
    """Until a daemon installs its own handlers: SIGTERM or SIGINT ends the process with 0."""
    for sig in _SIGNALS:
        signal.signal(sig, _stop_before_start)


def release() -> None:
    """Give SIGTERM and SIGINT their default action back, where :func:`install` set them."""
    for sig in _SIGNALS:
        if signal.getsignal(sig) is _stop_before_start:
            default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            signal.signal(sig, default)


def _stop_before_start(signum: int, _frame: FrameType | None) -> None:
    # Logging is not configured yet (and importing it here could meet a half-loaded
    # module): one line in the daemons' format, OUTBOX_LOG_FORMAT's or by default JSON
    # unless stderr is a terminal (--log-format is not parsed yet).
    message = f"{signal.Signals(signum).name} received while starting up: stopped before start"
    now = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"
    try:
        text = os.environ.get("OUTBOX_LOG_FORMAT", "").lower()
        if text == "text" or (text != "json" and sys.stderr.isatty()):
            line = f"{stamp} INFO    outbox: {message}"
        else:
            line = json.dumps({"ts": stamp, "level": "info", "logger": "outbox", "msg": message})
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # no stderr to write to: the exit status still says it
        pass
    raise SystemExit(0)
