"""Turning the outbox's SQLAlchemy database URL into Spark JDBC options."""

from __future__ import annotations

from sqlalchemy.engine import URL, make_url

#: libpq's ``target_session_attrs`` as the JDBC driver's ``targetServerType``.
_TARGET_SERVER_TYPES = {
    "any": "any",
    "read-write": "primary",
    "primary": "primary",
    "read-only": "secondary",
    "standby": "secondary",
    "prefer-standby": "preferSecondary",
}


def jdbc_options(database_url: str) -> dict[str, str]:
    """``url``, ``user``, ``password`` and ``driver`` options for ``spark.read.format("jdbc")``.

    >>> jdbc_options("postgresql+psycopg://app:s3cret@db.local:5433/shop")["url"]
    'jdbc:postgresql://db.local:5433/shop'

    A URL that lists several servers, in SQLAlchemy's form (``?host=a:5432&host=b:5432``) or
    libpq's (``?host=a,b&port=5432,5432``), lists them for the driver too, which then looks
    for the primary as ``target_session_attrs`` asks::

    >>> jdbc_options("postgresql://app@/shop?host=a,b&port=5432,5433"
    ...              "&target_session_attrs=read-write")["url"]
    'jdbc:postgresql://a:5432,b:5433/shop?targetServerType=primary'
    """
    url = make_url(database_url)
    if not url.drivername.startswith("postgresql"):
        raise ValueError(f"only PostgreSQL URLs are supported, got {url.drivername!r}")
    servers = ",".join(f"{host}:{port}" for host, port in _servers(url))
    address = f"jdbc:postgresql://{servers}/{url.database or ''}"
    attrs = url.query.get("target_session_attrs")
    if isinstance(attrs, str):
        if attrs not in _TARGET_SERVER_TYPES:
            raise ValueError(f"target_session_attrs={attrs!r} has no JDBC equivalent")
        address += f"?targetServerType={_TARGET_SERVER_TYPES[attrs]}"
    options = {"url": address, "driver": "org.postgresql.Driver"}
    if url.username:
        options["user"] = url.username
    if url.password is not None:
        options["password"] = str(url.password)
    return options


def _servers(url: URL) -> list[tuple[str, int]]:
    """(host, port) of each server the URL names, defaults filled in as libpq does."""
    hosts = url.query.get("host")
    if hosts is None:
        return [(url.host or "localhost", url.port or 5432)]
    if isinstance(hosts, str):  # libpq's form: host=a,b and port=x,y (or one port for all)
        names = hosts.split(",")
        raw_ports = url.query.get("port")
        ports = str(raw_ports).split(",") if isinstance(raw_ports, str) else []
        if len(ports) == 1:
            ports *= len(names)
        if ports and len(ports) != len(names):
            raise ValueError(f"{len(names)} hosts but {len(ports)} ports in the URL")
        return [(name, int(ports[at]) if ports else 5432) for at, name in enumerate(names)]
    servers = []
    for entry in hosts:  # SQLAlchemy's form: one host=name:port per server
        name, _, port = entry.rpartition(":") if ":" in entry else (entry, "", "")
        servers.append((name, int(port) if port else 5432))
    return servers
