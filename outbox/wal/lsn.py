"""WAL positions (LSNs): PostgreSQL writes them as two hex halves, ``16/B374D848``."""

from __future__ import annotations


def parse_lsn(text: str) -> int:
    """``'16/B374D848'`` as the 64-bit position it names."""
    high, _, low = text.partition("/")
    if not low:
        raise ValueError(f"not an LSN: {text!r}")
    return (int(high, 16) << 32) | int(low, 16)


def format_lsn(position: int) -> str:
    """A 64-bit position as PostgreSQL writes it."""
    return f"{position >> 32:X}/{position & 0xFFFFFFFF:X}"
