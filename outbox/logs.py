"""Structured logs for the daemons (the relay, the check-back runner): one JSON object per
line on stderr, secrets masked."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from outbox.redaction import mask_secrets


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and any ``extra=`` fields."""

    _standard = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": mask_secrets(record.getMessage()),
        }
        for key, value in record.__dict__.items():
            if key not in self._standard and not key.startswith("_"):
                entry[key] = mask_secrets(value) if isinstance(value, str) else value
        if record.exc_info:
            entry["error"] = mask_secrets(self.formatException(record.exc_info))
        return json.dumps(entry, default=str)


def configure_logging(level: str = "INFO") -> None:
    """JSON lines (UTC times) on stderr for every logger, at ``level``."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    handler.formatter.converter = time.gmtime  # type: ignore[union-attr]
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
