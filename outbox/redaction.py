"""Hiding secrets in text that leaves the process (log lines, one-line errors).

Lives here, low in the library, because the relay, the reconciliation job, the chaos runs and
the CLI all print driver errors that may repeat a connection URL with its password.
"""

from __future__ import annotations

import re

_URL_PASSWORD = re.compile(r"(://[^:/@\s]+:)[^@\s]+@")
_KEYWORD_SECRET = re.compile(
    r"((?:password|passwd|secret|sasl\.password|token)\s*[=:]\s*)(\S+)", re.IGNORECASE
)


def mask_secrets(text: str) -> str:
    """Hide passwords in URLs (``user:***@host``) and ``password=...`` pairs."""
    return _KEYWORD_SECRET.sub(r"\1***", _URL_PASSWORD.sub(r"\1***@", text))
