"""Parsing the durations operators type: ``90s``, ``15m``, ``12h``, ``7d``, ``1w``."""

from __future__ import annotations

import re
from datetime import timedelta

_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_duration(text: str) -> timedelta:
    """``"7d"`` -> ``timedelta(days=7)``; raises ValueError naming the accepted forms."""
    match = _DURATION.fullmatch(text)
    if not match:
        raise ValueError(f"{text!r} is not a duration like 90s, 15m, 12h, 7d or 1w")
    amount, unit = match.groups()
    return timedelta(**{_UNITS[unit]: float(amount)})
