"""The SQLAlchemy binds that write in the caller's transaction (publish, cancel): a Session,
or a Connection inside a transaction, never an autocommit one."""

from __future__ import annotations

from sqlalchemy import exc
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from outbox.errors import NotInTransaction


def session_connection(session: Session) -> Connection:
    """The Connection of ``session``'s transaction (begun now if it has not yet)."""
    try:
        conn = session.connection()  # begins the session's transaction if it has not yet
    except exc.InvalidRequestError as error:
        raise NotInTransaction(f"publish needs a session inside a transaction: {error}") from error
    return checked_connection(conn, session_owned=True)


def checked_connection(conn: Connection, session_owned: bool = False) -> Connection:
    """``conn``, after checking that it is inside a transaction and not autocommit."""
    if not session_owned and not conn.in_transaction():
        raise NotInTransaction(
            "publish needs a connection inside a transaction: use `with conn.begin():`"
        )
    dbapi_connection = conn.connection.dbapi_connection
    if getattr(dbapi_connection, "autocommit", False):
        raise NotInTransaction(
            "publish refuses an AUTOCOMMIT connection: each statement would commit on its own"
        )
    return conn
