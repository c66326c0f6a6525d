"""A private PostgreSQL cluster (Debian's packages, initdb) on a loopback port."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import shutil
import signal
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import psycopg
from psycopg import sql

from outbox.devstack.procs import (
    StackError,
    apt_install,
    pid_alive,
    postgres_user_ids,
    run_as_postgres,
    running_as_root,
    terminate,
    wait_until,
)

SUPERUSER = "postgres"

#: The local stack decodes its WAL (the relay's WAL source reads the outbox through a logical
#: replication slot), so every cluster it starts runs with ``wal_level = logical``; a test of
#: the refusal of another level starts one with ``wal_level="replica"``.
DEFAULT_WAL_LEVEL = "logical"


def server_bindir() -> Path:
    """The newest PostgreSQL server's bin folder; installs Debian's package when there is none."""
    override = os.environ.get("OUTBOX_PG_BINDIR")
    if override:
        return Path(override)
    found = _find_bindir()
    if found is None:
        apt_install("postgresql")
        found = _find_bindir()
    if found is None:
        raise StackError("PostgreSQL server binaries not found under /usr/lib/postgresql/*/bin")
    return found


def _find_bindir() -> Path | None:
    candidates = sorted(
        (Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/initdb")),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    return candidates[-1] if candidates else None


def _processes_in(folder: Path) -> list[int]:
    """Live processes whose working directory is ``folder`` (every postgres backend's is)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if Path(os.readlink(proc / "cwd")) == folder.resolve() and pid_alive(int(proc.name)):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def data_root_for(run_dir: Path) -> Path:
    """Where the cluster lives: inside ``run_dir`` when the postgres user can reach it.

    As root the server runs as ``postgres``, which cannot traverse a private folder such as
    /root; then the cluster goes to a folder under /tmp named after ``run_dir``.
    """
    if not running_as_root() or _traversable_by_others(run_dir):
        return run_dir / "postgres"
    digest = hashlib.sha1(str(run_dir).encode()).hexdigest()[:12]
    return Path("/tmp") / f"outbox-postgres-{digest}"


def _traversable_by_others(path: Path) -> bool:
    path = path.resolve()
    for folder in [path, *path.parents]:
        if folder.exists() and not folder.stat().st_mode & stat.S_IXOTH:
            return False
    return True


@dataclass
class PostgresServer:
    """One initdb cluster; ``root`` holds its data folder and log."""

    root: Path
    port: int
    password: str
    durable: bool = True
    #: Given at each start (not written into postgresql.conf), so that a cluster made before
    #: the setting existed runs with it too.
    wal_level: str = DEFAULT_WAL_LEVEL

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def log_file(self) -> Path:
        return self.root / "server.log"

    def url(self, database: str = "postgres") -> str:
        """SQLAlchemy URL (psycopg 3 driver) for ``database`` as the superuser."""
        return f"postgresql+psycopg://{SUPERUSER}:{self.password}@127.0.0.1:{self.port}/{database}"

    def conninfo(self, database: str = "postgres") -> str:
        return (
            f"host=127.0.0.1 port={self.port} user={SUPERUSER} "
            f"password={self.password} dbname={database}"
        )

    def running(self) -> bool:
        pid_file = self.data_dir / "postmaster.pid"
        try:
            pid = int(pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return False
        return pid_alive(pid)

    def start(self) -> None:
        """Create the cluster on first use, then start it and wait until it accepts logins."""
        bindir = server_bindir()
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb(bindir)
        if self.running():
            return
        self._clear_stale_lock()
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories='' "
            f"-c wal_level={self.wal_level}"
        )
        result = run_as_postgres(
            [
                str(bindir / "pg_ctl"),
                "-D",
                str(self.data_dir),
                "-l",
                str(self.log_file),
                "-w",
                "-t",
                "60",
                "-o",
                options,
                "start",
            ],
            start_new_session=True,
        )
        if result.returncode != 0:
            raise StackError(
                f"PostgreSQL did not start (see {self.log_file}): {result.stdout}{result.stderr}"
            )

    def _clear_stale_lock(self) -> None:
        """After a kill -9 of the postmaster, wait for its children and drop its lock file.

        Postgres itself ignores a lock file whose PID is gone, but a killed postmaster can linger
        as a zombie for a while and its children still hold the shared memory.
        """
        pid_file = self.data_dir / "postmaster.pid"
        if not pid_file.exists():
            return
        wait_until(
            lambda: not _processes_in(self.data_dir), 30, "the killed server's processes to exit"
        )
        pid_file.unlink(missing_ok=True)

    def stop(self, mode: str = "fast") -> None:
        """``fast`` rolls back open transactions and checkpoints; ``immediate`` is a crash
        (no checkpoint: the next start replays the WAL)."""
        if not self.running():
            return
        result = run_as_postgres(
            [str(server_bindir() / "pg_ctl"), "-D", str(self.data_dir), "-m", mode, "-w", "stop"]
        )
        if result.returncode != 0 and self.running():
            pid = int((self.data_dir / "postmaster.pid").read_text().split()[0])
            terminate(pid)

    def kill(self, at_once: Callable[[], None] | None = None) -> float:
        """``kill -9`` of the postmaster and every backend at once, as when the server's
        machine dies: nothing is flushed or shut down, and clients see their connections
        reset. ``at_once`` is called just before the signals go (what else the machine's death
        takes with it). Returns the wall-clock time of the kill (finding the processes takes
        a while on a busy machine; the kill itself does not)."""
        found = _processes_in(self.data_dir)
        if at_once is not None:
            at_once()
        killed, deadline = time.time(), time.monotonic() + 30
        while found:
            if time.monotonic() > deadline:
                raise StackError(f"the killed server's processes {found} did not exit in 30s")
            for pid in found:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)  # a backend forked meanwhile is killed by the next round
            found = _processes_in(self.data_dir)
        return killed

    def create_database(self, name: str, template: str | None = None) -> str:
        """Create ``name`` (from ``template`` if given) and return its SQLAlchemy URL."""
        statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template:
            statement += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
        with psycopg.connect(self.conninfo(), autocommit=True) as conn:
            conn.execute(statement)
        return self.url(name)

    def drop_database(self, name: str) -> None:
        """Drop ``name``, with its logical replication slots (they would refuse the drop), and
        the connections still open to it."""
        with psycopg.connect(self.conninfo(), autocommit=True) as conn:
            _drop_slots(conn, name)
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )

    def _initdb(self, bindir: Path) -> None:
        if self.data_dir.exists():
            shutil.rmtree(self.data_dir)  # a half-made cluster from an interrupted run
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)
        self.data_dir.mkdir(mode=0o700)
        password_file = self.root / "initdb.pw"
        password_file.write_text(self.password + "\n")
        if running_as_root():
            uid, gid = postgres_user_ids()
            for path in (self.root, self.data_dir, password_file):
                os.chown(path, uid, gid)
        try:
            result = run_as_postgres(
                [
                    str(bindir / "initdb"),
                    "-D",
                    str(self.data_dir),
                    "-U",
                    SUPERUSER,
                    "--auth-host=scram-sha-256",
                    "--auth-local=peer",
                    f"--pwfile={password_file}",
                    "-E",
                    "UTF8",
                    "--locale=C.UTF-8",
                    "--no-sync",
                ]
            )
        finally:
            password_file.unlink(missing_ok=True)
        if result.returncode != 0:
            raise StackError(f"initdb failed: {result.stdout}{result.stderr}")
        with (self.data_dir / "postgresql.conf").open("a") as conf:
            conf.write(self._settings())

    def _settings(self) -> str:
        lines = [
            "# Local stack settings",
            "max_connections = 200",
            "shared_buffers = 256MB",
            "log_min_messages = warning",
        ]
        if not self.durable:
            # Throwaway test clusters skip fsync: safe when a server process is killed (the OS
            # still holds the writes), unsafe only when the machine itself crashes.
            lines += ["fsync = off", "full_page_writes = off"]
        return "\n" + "\n".join(lines) + "\n"


def _drop_slots(conn: psycopg.Connection[tuple[object, ...]], database: str) -> None:
    """Drop the replication slots of ``database``; a slot in use is let go first (its reader's
    session is ended, and its slot is free once that session has exited)."""
    slots = "SELECT slot_name, active_pid FROM pg_replication_slots WHERE database = %s"
    for slot, pid in conn.execute(slots, (database,)).fetchall():
        if pid is not None:
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
            wait_until(partial(_released, conn, str(slot)), 30, f"slot {slot} to be let go")
        conn.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots"
            " WHERE slot_name = %s",
            (slot,),
        )


def _released(conn: psycopg.Connection[tuple[object, ...]], slot: str) -> bool:
    query = "SELECT active_pid IS NULL FROM pg_replication_slots WHERE slot_name = %s"
    row = conn.execute(query, (slot,)).fetchone()
    return row is None or bool(row[0])
