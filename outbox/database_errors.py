"""What a database error means for a daemon that starts, and the one line that names it.

A daemon that starts while its database is starting, restarting or refusing connections
should wait for it; one given a wrong password, a missing database or a role that may not log
in should stop at once: waiting will not fix those. psycopg reports a failed connection
without a SQLSTATE (libpq hands over only the message text, ``... failed: FATAL:  password
authentication failed ...``), so the difference is read from that text: an error the server
sent (``FATAL:``) is permanent unless it says the server is not accepting connections *yet*;
an error without one (refused, timed out, the host not resolved) is a server not reachable
yet. A server whose messages are translated (``lc_messages``) is waited for up to the start
timeout, then reported in the same one line.

Lives low in the library: the command line, the inbox consumer and the check-back runner
ask it.
"""

from __future__ import annotations

import re

from outbox.redaction import mask_secrets

#: SQLSTATEs of a server that is there but not accepting connections yet (or now): shutting
#: down, crashed, starting up, too many connections.
NOT_YET_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "53300", "08001", "08006"})

#: What the server says, as ``FATAL:``, when it will accept connections later.
_NOT_YET_MESSAGES = (
    "the database system is starting up",
    "the database system is shutting down",
    "the database system is in recovery mode",
    "the database system is not yet accepting connections",
    "the database system is not accepting connections",
    "sorry, too many clients already",
    "remaining connection slots are reserved",
    "terminating connection due to administrator command",
)

#: Failures libpq finds itself that no wait will change.
_CLIENT_SIDE_PERMANENT = (
    "fe_sendauth: no password supplied",
    "server does not support SSL",
)

_SERVER_SAYS = re.compile(r"\b(?:FATAL|ERROR|PANIC):\s+(.*)")
_CONNECTION_PREFIX = re.compile(r"^connection failed:\s*")


def driver_error(error: BaseException) -> BaseException:
    """The driver's own error inside a SQLAlchemy one (``error.orig``), or ``error`` itself."""
    return getattr(error, "orig", None) or error


def sqlstate_of(error: BaseException) -> str | None:
    """The SQLSTATE of a (SQLAlchemy or driver) error, whichever PostgreSQL driver raised it:
    psycopg 3 and SQLAlchemy's asyncpg adapter name it ``sqlstate``, psycopg2 ``pgcode``."""
    orig = driver_error(error)
    code = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    return str(code) if code else None


def constraint_of(error: BaseException) -> str | None:
    """The constraint (or unique index) an integrity error names, whichever driver raised it:
    psycopg 3 and psycopg2 give it in ``diag``, asyncpg on its own exception, which
    SQLAlchemy's adapter keeps as its cause."""
    orig = driver_error(error)
    name = getattr(getattr(orig, "diag", None), "constraint_name", None)
    if name is None:
        for inner in (getattr(orig, "orig", None), orig.__cause__):
            name = getattr(inner, "constraint_name", None)
            if name is not None:
                break
    return str(name) if name else None


def database_not_ready(error: BaseException) -> bool:
    """Whether ``error`` says the database is not reachable *yet* (worth waiting for), as
    opposed to a wrong password, a missing database or table, or missing privileges."""
    import psycopg

    orig = driver_error(error)
    if not isinstance(orig, psycopg.OperationalError):
        return False
    sqlstate = getattr(orig, "sqlstate", None)
    if sqlstate is not None:
        return sqlstate in NOT_YET_SQLSTATES
    text = str(orig)
    if any(marker in text for marker in _CLIENT_SIDE_PERMANENT):
        return False
    said = _SERVER_SAYS.search(text)
    if said is None:
        return True  # refused, timed out, host not resolved: the server may come
    return said.group(1).strip().startswith(_NOT_YET_MESSAGES)


def first_line(error: BaseException) -> str:
    """The first line of a (driver) error, secrets masked: what an operator is shown.

    A failed connection reads ``connection to server at "db", port 5432 failed: password
    authentication failed for user "app"``: psycopg's ``connection failed:`` prefix and the
    server's ``FATAL:`` tag are dropped, the cause is kept whole.
    """
    text = str(driver_error(error)).strip()
    line = text.splitlines()[0] if text else type(error).__name__
    line = _CONNECTION_PREFIX.sub("", line)
    line = re.sub(r"\bFATAL:\s+", "", line)
    return mask_secrets(line)
