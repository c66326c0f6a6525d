"""A streaming standby of the local PostgreSQL, its promotion, and URLs that follow the primary.

The standby is made with ``pg_basebackup`` from the running primary (WAL streamed during the
copy, a physical replication slot of its own so the primary keeps the WAL it has not read),
listens on its own loopback port and replays the primary's WAL as it comes. Replication is

- **synchronous**: ``synchronous_standby_names = '*'`` on the primary, so a commit returns
  only once the standby has flushed it (``synchronous_commit = on``, the server's default);
  a promotion then forgets no commit that anyone saw;
- **asynchronous**: the primary does not wait; a promotion forgets what the standby had not
  received yet (the replication lag).

A promoted standby has no standby of its own: it stops waiting for one (as Patroni's
non-strict synchronous mode does), and a standby built from it again brings the wait back.
Clients find the primary with one URL listing both servers and
``target_session_attrs=read-write`` (libpq tries each host in turn and keeps the one that
accepts writes); the stack rebuilds a standby on the old primary's port, so that URL stays
right through any number of failovers.
"""

from __future__ import annotations

import os
import shutil
import time
from urllib.parse import quote

import psycopg

from outbox.devstack.postgres import SUPERUSER, PostgresServer, server_bindir
from outbox.devstack.procs import StackError, postgres_user_ids, run_as_postgres, running_as_root

SYNCHRONOUS = "sync"
ASYNCHRONOUS = "async"
REPLICATION_MODES = (SYNCHRONOUS, ASYNCHRONOUS)
#: The standby's name as the primary sees it (``application_name``): one at a time.
STANDBY_NAME = "outbox_standby"
#: How long a standby gets to catch up with its primary after it starts streaming.
CATCH_UP_TIMEOUT = 60.0


def multi_host_url(servers: list[PostgresServer], database: str) -> str:
    """SQLAlchemy's form: a ``host=`` parameter per server, and ``read-write`` sessions only.

    ``postgresql+psycopg://postgres:pw@/db?host=127.0.0.1:5433&host=127.0.0.1:5434&...``
    """
    password = quote(servers[0].password, safe="")
    hosts = "&".join(f"host=127.0.0.1:{server.port}" for server in servers)
    return (
        f"postgresql+psycopg://{SUPERUSER}:{password}@/{database}?{hosts}"
        "&target_session_attrs=read-write"
    )


def libpq_multi_host_url(servers: list[PostgresServer], database: str) -> str:
    """libpq's form, which psql and every libpq client read too (outbox takes it as well):
    ``postgresql://postgres:pw@/db?host=127.0.0.1,127.0.0.1&port=5433,5434&...``."""
    password = quote(servers[0].password, safe="")
    hosts = ",".join("127.0.0.1" for _ in servers)
    ports = ",".join(str(server.port) for server in servers)
    return (
        f"postgresql://{SUPERUSER}:{password}@/{database}?host={hosts}&port={ports}"
        "&target_session_attrs=read-write"
    )


def in_recovery(server: PostgresServer) -> bool:
    """True for a standby (replaying WAL), False for a primary."""
    with psycopg.connect(server.conninfo(), autocommit=True, connect_timeout=5) as conn:
        row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
    return bool(row and row[0])


def build_standby(
    primary: PostgresServer, standby: PostgresServer, mode: str, stream_port: int | None = None
) -> None:
    """Copy ``primary`` into ``standby`` (whose folder is emptied first), start it streaming,
    and set the primary's replication to ``mode`` once it has caught up; returns once the
    primary counts it as its synchronous standby (or, asynchronous, as caught up).

    The primary is asynchronous while the standby is built: commits meanwhile are on one
    server only, as they were since the promotion that left it without a standby.

    ``stream_port``: where the standby streams the WAL from (a proxy in front of the primary,
    say); the primary's own port by default. The copy itself comes straight from the
    primary."""
    if mode not in REPLICATION_MODES:
        raise StackError(f"replication is {' or '.join(REPLICATION_MODES)}, not {mode!r}")
    standby.password = primary.password
    set_replication(primary, None)
    slot = _slot_name(standby.port)
    with psycopg.connect(primary.conninfo(), autocommit=True, connect_timeout=10) as conn:
        # A slot left by an earlier standby on this port would keep WAL for ever.
        conn.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            "WHERE slot_name = %s AND NOT active",
            (slot,),
        )
        conn.execute("SELECT pg_create_physical_replication_slot(%s, true)", (slot,))
    _base_backup(primary, standby)
    _write_standby_settings(stream_port or primary.port, primary.password, standby, slot)
    standby.start()
    # Synchronous only once it has caught up: a standby still catching up is no synchronous
    # standby, and every commit would wait for it until then.
    wait_caught_up(primary, standby, ASYNCHRONOUS)
    if mode == SYNCHRONOUS:
        set_replication(primary, mode)
        wait_caught_up(primary, standby, mode)


def _slot_name(port: int) -> str:
    return f"outbox_standby_{port}"


def _base_backup(primary: PostgresServer, standby: PostgresServer) -> None:
    if standby.running():
        standby.stop(mode="immediate")
    shutil.rmtree(standby.root, ignore_errors=True)
    standby.root.mkdir(parents=True)
    standby.root.chmod(0o755)
    if running_as_root():
        os.chown(standby.root, *postgres_user_ids())
    command = [
        str(server_bindir() / "pg_basebackup"),
        f"--dbname=host=127.0.0.1 port={primary.port} user={SUPERUSER}",
        "-D",
        str(standby.data_dir),
        "--wal-method=stream",
        "--checkpoint=fast",
        # The copy's files are not flushed to disk one by one (seconds on a busy disk): the
        # standby lives on this machine, whose kernel keeps the writes through any kill of
        # a server; only a crash of the machine itself could lose them.
        "--no-sync",
    ]
    # The password in the environment, not on a command line that ps shows.
    result = run_as_postgres(command, env={**os.environ, "PGPASSWORD": primary.password})
    if result.returncode != 0:
        raise StackError(f"pg_basebackup failed: {result.stdout}{result.stderr}")


def _write_standby_settings(port: int, password: str, standby: PostgresServer, slot: str) -> None:
    """``standby.signal`` and where to stream from; the primary's own settings (copied with
    its data) otherwise hold."""
    (standby.data_dir / "standby.signal").write_text("")
    conninfo = (
        f"host=127.0.0.1 port={port} user={SUPERUSER} password={password} "
        f"application_name={STANDBY_NAME}"
    )
    with (standby.data_dir / "postgresql.auto.conf").open("a") as conf:
        conf.write(f"primary_conninfo = '{conninfo}'\nprimary_slot_name = '{slot}'\n")
    for path in (standby.data_dir / "standby.signal", standby.data_dir / "postgresql.auto.conf"):
        if running_as_root():
            os.chown(path, *postgres_user_ids())


def set_replication(primary: PostgresServer, mode: str | None) -> None:
    """``sync``: commits wait for a standby's flush; ``async`` or None: they do not."""
    names = "*" if mode == SYNCHRONOUS else ""
    with psycopg.connect(primary.conninfo(), autocommit=True, connect_timeout=10) as conn:
        conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{names}'")
        conn.execute("SELECT pg_reload_conf()")


def wait_caught_up(
    primary: PostgresServer, standby: PostgresServer, mode: str, timeout: float = CATCH_UP_TIMEOUT
) -> None:
    """Until the primary streams to the standby, the standby has replayed what the primary
    had written when this was called, and (synchronous) the standby is the synchronous one."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(primary.conninfo(), autocommit=True, connect_timeout=10) as conn:
        row = conn.execute("SELECT pg_current_wal_lsn()").fetchone()
        assert row is not None
        target = row[0]
        while True:
            state = conn.execute(
                "SELECT sync_state, replay_lsn >= %s::pg_lsn FROM pg_stat_replication "
                "WHERE application_name = %s AND state = 'streaming'",
                (target, STANDBY_NAME),
            ).fetchone()
            wanted_state = "sync" if mode == SYNCHRONOUS else "async"
            if state is not None and state[0] == wanted_state and state[1]:
                return
            if time.monotonic() > deadline:
                raise StackError(
                    f"the standby on port {standby.port} did not catch up in {timeout:.0f}s "
                    f"(replication: {state}; see {standby.log_file})"
                )
            time.sleep(0.1)


def promote(standby: PostgresServer) -> None:
    """Make ``standby`` the primary, and stop it waiting for a standby it no longer has."""
    result = run_as_postgres(
        [str(server_bindir() / "pg_ctl"), "-D", str(standby.data_dir), "-w", "-t", "60", "promote"]
    )
    if result.returncode != 0:
        raise StackError(f"promotion failed (see {standby.log_file}): {result.stderr}")
    set_replication(standby, None)
