"""Turning the outbox's SQLAlchemy database URL into Spark JDBC options."""

from __future__ import annotations

from sqlalchemy.engine import make_url


def jdbc_options(database_url: str) -> dict[str, str]:
    """``url``, ``user``, ``password`` and ``driver`` options for ``spark.read.format("jdbc")``.

    >>> jdbc_options("postgresql+psycopg://app:s3cret@db.local:5433/shop")["url"]
    'jdbc:postgresql://db.local:5433/shop'
    """
    url = make_url(database_url)
    if not url.drivername.startswith("postgresql"):
        raise ValueError(f"only PostgreSQL URLs are supported, got {url.drivername!r}")
    host = url.host or "localhost"
    port = url.port or 5432
    options = {
        "url": f"jdbc:postgresql://{host}:{port}/{url.database or ''}",
        "driver": "org.postgresql.Driver",
    }
    if url.username:
        options["user"] = url.username
    if url.password is not None:
        options["password"] = str(url.password)
    return options
