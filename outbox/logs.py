"""The daemons' logs (the relay, the inbox consumer, the check-back runner): one format for
all of them, secrets masked, repeated errors folded.

On stderr, as JSON lines (one object a line, for a log collector) or as readable text (for a
person at a terminal): ``--log-format``, by default text on a terminal and JSON otherwise.
librdkafka's own lines come through the same logger (``outbox.kafka``, see
:data:`KAFKA_LOGGER`), so they share the format and the folding.

A broker that is down makes librdkafka report the same failure hundreds of times a minute,
in bursts, and a daemon retrying a step logs its retries. :class:`FoldingHandler` writes a
warning or error (and any line of librdkafka's) once per cause per :data:`FOLD_SECONDS`: the
first at once, the repeats within that time counted, not written, and written as one line
with their count (``repeated``) when the time ends.

A command that ends on an error says so last (:func:`log_fatal`): what is still folded is
written first, and in JSON the error itself is a log line too, so that every line a daemon
writes is JSON.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any

from outbox.redaction import mask_secrets

LOG_FORMATS = ("json", "text")

#: The logger librdkafka's lines go to (confluent-kafka's ``logger`` setting).
KAFKA_LOGGER = logging.getLogger("outbox.kafka")

#: How long repeats of one warning or error are folded into one line (seconds).
FOLD_SECONDS = 10.0

_STANDARD_FIELDS = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


def _utc_time(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + (
        f".{int(record.msecs):03d}Z"
    )


def _extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    """A record's ``extra=`` fields (those not every record has)."""
    return {
        key: value
        for key, value in record.__dict__.items()
        if key not in _STANDARD_FIELDS and not key.startswith("_")
    }


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and any ``extra=`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": _utc_time(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": mask_secrets(record.getMessage()),
        }
        for key, value in _extra_fields(record).items():
            entry[key] = mask_secrets(value) if isinstance(value, str) else value
        if record.exc_info:
            entry["error"] = mask_secrets(self.formatException(record.exc_info))
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """A readable line: time (UTC), level, logger, message, then the ``extra=`` fields as
    ``key=value``; a traceback below it."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_utc_time(record)} {record.levelname:<7} {record.name}: {record.getMessage()}"
        extras = " ".join(f"{key}={value!r}" for key, value in _extra_fields(record).items())
        if extras:
            line += f"  {extras}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return mask_secrets(line)


@dataclass
class _Fold:
    """One cause's current interval: when it began, the repeats not written, the last one."""

    started: float
    repeats: int = 0
    last: logging.LogRecord | None = field(default=None, repr=False)


_NUMBERS = re.compile(r"\d+")


def cause(record: logging.LogRecord) -> tuple[str, int, str]:
    """What makes two records repeats of each other: logger, level, and the message (and its
    ``error`` field) with every number taken out (times, counts, ports, thread names)."""
    text = record.getMessage() + " " + str(record.__dict__.get("error", ""))
    return record.name, record.levelno, _NUMBERS.sub("#", text)


class FoldingHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A stream handler that writes a warning or error once per cause per ``interval``
    seconds; the repeats are written as one line an interval later, with ``repeated`` (how
    many it stands for) and ``repeated_within_s``."""

    def __init__(self, stream: IO[str] | None = None, interval: float = FOLD_SECONDS) -> None:
        super().__init__(stream)
        self.interval = interval
        self._folds: dict[tuple[str, int, str], _Fold] = {}
        self._sweeper_stop = threading.Event()
        self._sweeper: threading.Thread | None = None
        self._finished = False

    def emit(self, record: logging.LogRecord) -> None:
        # Called with the handler's lock held (Handler.handle).
        if self._finished:
            return
        if getattr(record, "_folded", False) or not self.folds(record):
            super().emit(record)
            return
        key = cause(record)
        now = time.monotonic()
        fold = self._folds.get(key)
        if fold is not None and now - fold.started < self.interval:
            fold.repeats += 1
            fold.last = record
            self._sweep_later()
            return
        if fold is not None and fold.repeats:
            record = _repeated(record, fold.repeats + 1, now - fold.started)
        self._folds[key] = _Fold(now)
        super().emit(record)

    def folds(self, record: logging.LogRecord) -> bool:
        """Whether repeats of ``record`` are folded: warnings and errors, and every line of
        librdkafka (which reports each broker disconnection as information)."""
        return record.levelno >= logging.WARNING or record.name == KAFKA_LOGGER.name

    def flush_folds(self, everything: bool = False) -> None:
        """Write the repeats of every interval that ended (of all with ``everything``)."""
        with self.lock:  # type: ignore[union-attr]
            now = time.monotonic()
            for key, fold in list(self._folds.items()):
                if not everything and now - fold.started < self.interval:
                    continue
                if fold.repeats and fold.last is not None:
                    super().emit(_repeated(fold.last, fold.repeats, now - fold.started))
                    # A cause still repeating gets its next line an interval later.
                    self._folds[key] = _Fold(now)
                else:
                    del self._folds[key]

    def finish(self, last: logging.LogRecord | None = None) -> None:
        """Write the repeats still folded, then ``last`` (if given), then nothing more: the
        process is ending, and what it says last must be the last line."""
        with self.lock:  # type: ignore[union-attr]
            self._sweeper_stop.set()
            self.flush_folds(everything=True)
            if last is not None:
                super().emit(last)
            self.flush()
            self._finished = True

    def close(self) -> None:
        self._sweeper_stop.set()
        self.flush_folds(everything=True)
        super().close()

    def _sweep_later(self) -> None:
        # Repeats left when their cause stops are written when the interval ends, by a
        # thread started with the first fold.
        if self._sweeper is None:
            self._sweeper = threading.Thread(target=self._sweep, name="log-folds", daemon=True)
            self._sweeper.start()

    def _sweep(self) -> None:
        while not self._sweeper_stop.wait(min(1.0, self.interval / 4)):
            self.flush_folds()


def _repeated(record: logging.LogRecord, count: int, seconds: float) -> logging.LogRecord:
    """``record`` standing for ``count`` lines of its cause over ``seconds``."""
    folded = logging.makeLogRecord(record.__dict__)
    folded.repeated = count
    folded.repeated_within_s = round(seconds, 1)
    folded._folded = True
    return folded


def configured_handler() -> FoldingHandler | None:
    """The handler :func:`configure_logging` put in place, if any."""
    return next((h for h in logging.getLogger().handlers if isinstance(h, FoldingHandler)), None)


def log_fatal(
    handler: FoldingHandler | None, message: str, exit_code: int, exc_info: Any = None
) -> bool:
    """A command's last words, when it configured logging (``handler``, from
    :func:`configured_handler`; None when it did not): the repeats still folded are written
    first, then nothing after. In JSON the line itself is written here, as a ``critical``
    entry with ``exit_code`` (and the traceback of ``exc_info``, if given), and True is
    returned; in text (or with no handler) False: the caller prints it, as the last line."""
    if handler is None:
        return False
    if not isinstance(handler.formatter, JsonFormatter):
        handler.finish()
        return False
    fields = {"name": "outbox", "levelno": logging.CRITICAL, "levelname": "CRITICAL"}
    record = logging.makeLogRecord(
        {**fields, "msg": message, "exc_info": exc_info, "exit_code": exit_code}
    )
    handler.finish(record)
    return True


def configure_logging(
    level: str = "INFO",
    log_format: str | None = None,
    *,
    stream: IO[str] | None = None,
    fold_seconds: float = FOLD_SECONDS,
) -> None:
    """Every logger to ``stream`` (stderr) at ``level``, as ``log_format`` says ("json" or
    "text"; None: text on a terminal, JSON otherwise), repeated warnings and errors folded."""
    stream = stream or sys.stderr
    if log_format is None:
        log_format = "text" if stream.isatty() else "json"
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r} is not one of {', '.join(LOG_FORMATS)}")
    handler = FoldingHandler(stream, fold_seconds)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in root.handlers:
        if isinstance(old, FoldingHandler):  # an earlier set-up's: write what it folded
            old.close()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
